"""Hostile server input, fuzzed: whatever a server (or a file it wrote) sends, dsclient answers with
a result or one of its documented errors, never an untyped exception, and never hangs.

Every input is bounded (a few KiB, a handful of events), so each example runs in microseconds;
the counts are modest so the file runs in seconds. ``DSCLIENT_FUZZ_EXAMPLES=1500`` fuzzes longer
(about three minutes). The bugs these tests found each have an example-based regression test that
says what was found: in ``test_exceptions.py``, ``test_retry.py``, ``test_load.py``,
``test_discovery.py`` and ``test_pipeline.py`` (answers and streams), and at the end of this file
for the results file.
"""

from __future__ import annotations

import email.utils
import io
import itertools
import json
import math
import os
import random
import re
from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dsclient import AsyncClient, DSClientError, MalformedResponse, Retry
from dsclient._exceptions import (
    ContextOverflow,
    Overloaded,
    RequestRefused,
    context_overflow_from_response,
    error_from_response,
)
from dsclient._http import httpx
from dsclient._models import CompletionResult, Failure, Result, Usage
from dsclient._streaming import delta_of, iter_sse_data
from dsclient.batch._jsonl import MAP_RECORDS, JsonlStore, explicit_id, item_id, scan_records
from dsclient.client._discovery import (
    ServerInfo,
    discover,
    parse_llamacpp_props,
    parse_models,
    parse_ollama_ps,
    parse_ollama_version,
    parse_sglang_loads,
    parse_sglang_server_info,
    parse_tgi_info,
    parse_version,
    parse_vllm_server_info,
)
from dsclient.client._retry import compute_backoff, parse_retry_after
from dsclient.governor._endpoint import ControlOptions, Endpoint
from dsclient.governor._load import Load, parse_load, parse_prometheus

from .fakes import FakeServer

EXAMPLES = int(os.environ.get("DSCLIENT_FUZZ_EXAMPLES", "150"))
# No deadline: a timing assertion would make the suite flaky on a loaded machine; the inputs are
# bounded instead. No example database: the tests write nothing into the working tree.
fuzz = settings(
    max_examples=EXAMPLES,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def run(fn: Callable[[], Any]) -> Any:
    return anyio.run(fn, backend="asyncio")


# -- strategies ----------------------------------------------------------------------------------
#: Hand-picked hostile values that random generation rarely reaches.
HOSTILE_TEXT = [
    "[" * 50_000,  # nesting deeper than the JSON decoder's recursion limit
    '{"a":' * 50_000,
    "9" * 5_000,  # more digits than int() converts
    "NaN",
    "-Infinity",
    "1e999",
    "-0",
    "\x00",
    "\ufeff{}",
    "\ud800",  # a lone surrogate
    "null",
    "",
]

scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.integers(min_value=-(10**400), max_value=10**400)
    | st.floats()
    | st.text(max_size=20)
    | st.sampled_from([0, -1, 1, 2**63, 10**400, 1e308, -1e308, math.inf, math.nan])
)
json_values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4)
    ),
    max_leaves=16,
)


def dumps(value: Any) -> str:
    # Python's json writes NaN / Infinity, which its reader takes back (servers do send them).
    return json.dumps(value)


def maybe(value: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """The expected value, or anything JSON can carry in its place."""
    return value | json_values


def shaped(fields: dict[str, st.SearchStrategy[Any]]) -> st.SearchStrategy[dict[str, Any]]:
    """Dicts with some of ``fields`` (each possibly of the wrong type) and maybe extra keys."""
    return st.fixed_dictionaries(
        {}, optional={k: maybe(v) for k, v in fields.items()}
    ) | st.dictionaries(
        st.sampled_from(sorted(fields)) | st.text(max_size=8), json_values, max_size=5
    )


def bodies(shapes: st.SearchStrategy[Any]) -> st.SearchStrategy[bytes]:
    """Response bodies: a shaped JSON value, any JSON, hostile text, or any bytes."""
    return st.one_of(
        shapes.map(dumps),
        json_values.map(dumps),
        st.sampled_from(HOSTILE_TEXT),
        st.text(max_size=200),
    ).map(lambda s: s.encode("utf-8", "surrogatepass")) | st.binary(max_size=200)


def split_anywhere(data: bytes, draw: Callable[..., Any]) -> list[bytes]:
    cuts = sorted(draw(st.lists(st.integers(0, len(data)), max_size=12)))
    edges = [0, *cuts, len(data)]
    return [data[a:b] for a, b in itertools.pairwise(edges)]


async def chunks_of(parts: list[bytes]) -> AsyncIterator[bytes]:
    for part in parts:
        yield part


async def lines_of(parts: list[bytes]) -> AsyncIterator[str]:
    """What the client feeds ``iter_sse_data`` today: httpx's own line splitter over the chunks."""
    response = httpx.Response(200, stream=httpx.ByteStream(b""))
    response.stream = _Chunks(parts)  # type: ignore[assignment]
    async for line in response.aiter_lines():
        yield line


class _Chunks(httpx.AsyncByteStream):
    def __init__(self, parts: list[bytes]) -> None:
        self.parts = parts

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for part in self.parts:
            yield part


async def collect_events(parts: list[bytes]) -> list[dict[str, Any]] | str:
    """The events of a body split into ``parts``, or the name of the dsclient error raised."""
    events = []
    try:
        async for event in iter_sse_data(lines_of(parts)):
            events.append(event)
    except DSClientError as exc:
        return type(exc).__name__
    return events


# -- server-sent events --------------------------------------------------------------------------
event_dicts = st.dictionaries(
    st.text(max_size=8).filter(lambda k: k != "error"), json_values, max_size=4
)


@st.composite
def sse_streams(draw: Callable[..., Any]) -> tuple[list[dict[str, Any]], list[bytes]]:
    events = draw(st.lists(event_dicts, max_size=5))
    eol = draw(st.sampled_from(["\n", "\r\n", "\r"]))
    out = []
    for event in events:
        if draw(st.booleans()):
            out.append(": keep-alive" + eol)
        if draw(st.booleans()):
            out.append("event: message" + eol)
        out.append(("data: " if draw(st.booleans()) else "data:") + dumps(event) + eol + eol)
    if draw(st.booleans()):
        out.append("data: [DONE]" + eol + eol)
    elif out and draw(st.booleans()):
        out[-1] = out[-1][: -len(eol)]  # a body that ends without its blank line
    raw = "".join(out).encode("utf-8", "surrogatepass")
    return events, split_anywhere(raw, draw)


@fuzz
@given(sse_streams())
def test_sse_events_survive_any_split(stream):
    events, parts = stream
    assert dumps(run(lambda: collect_events(parts))) == dumps(events)  # dumps: NaN != NaN


sse_lines = st.lists(
    st.tuples(
        st.sampled_from(["data: ", "data:", ": ", "event: ", "id: ", "retry: ", "", "data"]),
        st.one_of(
            json_values.map(dumps),
            st.sampled_from(
                [*HOSTILE_TEXT, "[DONE]", '{"error": {"message": "boom"}}', '{"error": 5}']
            ),
            st.text(max_size=30),
        ),
        st.sampled_from(["\n", "\r\n", "\r", "\n\n", ""]),
    ),
    max_size=8,
).map(lambda ls: "".join(a + b + c for a, b, c in ls).encode("utf-8", "surrogatepass"))


@fuzz
@given(st.data(), sse_lines | st.binary(max_size=300))
def test_any_stream_body_gives_events_or_a_typed_error(data, raw):
    parts = split_anywhere(raw, data.draw)
    outcome = run(lambda: collect_events(parts))
    if isinstance(outcome, str):
        assert outcome == "MalformedResponse"
    else:
        assert all(isinstance(e, dict) for e in outcome)
        # Where the body is cut does not change what it means.
        assert dumps(run(lambda: collect_events([raw]))) == dumps(outcome)


choice_shapes = shaped(
    {
        "text": st.text(max_size=10),
        "delta": shaped({"content": st.text(max_size=10), "role": st.just("assistant")}),
        "finish_reason": st.sampled_from(["stop", "length", None]),
        "index": st.integers(0, 3),
    }
)
chunk_shapes = shaped({"choices": st.lists(choice_shapes, max_size=2), "id": st.text(max_size=5)})


@fuzz
@given(chunk_shapes | st.dictionaries(st.text(max_size=5), json_values, max_size=3))
def test_delta_of_any_chunk_is_text_and_a_reason_or_a_typed_error(event):
    try:
        text, finish = delta_of(event)
    except MalformedResponse:
        return
    assert isinstance(text, str)
    assert finish is None or isinstance(finish, str)


# -- error bodies ----------------------------------------------------------------------------------
numbers = st.integers(0, 10**6).map(str) | st.sampled_from(["9" * 5_000, "1,048,576", "0", ",,,"])


@st.composite
def overflow_messages(draw: Callable[..., Any]) -> str:
    n = [draw(numbers) for _ in range(4)]
    return draw(
        st.sampled_from(
            [
                f"This model's maximum context length is {n[0]} tokens. However, your prompt "
                f"contains at least {n[1]} input tokens",
                f"This model's maximum context length is {n[0]} tokens. However, you requested "
                f"{n[1]} output tokens and your prompt contains at least {n[2]} input tokens",
                f"maximum context length is {n[0]} tokens. However, you requested {n[1]} tokens "
                f"({n[2]} in the messages, {n[3]} in the completion)",
                f"'max_tokens' is too large: {n[0]}. This model's maximum context length is {n[1]} "
                f"tokens and your request has {n[2]} input tokens",
                f"You passed {n[0]} input tokens and requested {n[1]} output tokens. However, the "
                f"model's context length is only {n[2]} tokens",
                f"The decoder prompt (length {n[0]}) is longer than the maximum model length of {n[1]}",
                f"`inputs` tokens + `max_new_tokens` must be <= {n[0]}. Given: {n[1]} `inputs` "
                f"tokens and {n[2]} `max_new_tokens`",
                f"`inputs` must have less than {n[0]} tokens. Given: {n[1]}",
                f"your prompt contains {n[0]} characters (more than {n[1]} characters, which is "
                f"the upper bound for {n[2]} input",
            ]
        )
    )


error_objects = shaped(
    {
        "message": overflow_messages() | st.text(max_size=30),
        "type": st.sampled_from(["BadRequestError", "exceed_context_size_error"]),
        "n_prompt_tokens": st.integers(),
        "n_ctx": st.integers(),
        "code": st.integers(400, 599),
        "error": st.text(max_size=10),
        "detail": st.text(max_size=10),
    }
)
error_shapes = shaped(
    {
        "error": error_objects | overflow_messages(),
        "detail": st.text(max_size=20) | overflow_messages(),
        "message": st.text(max_size=20) | overflow_messages(),
    }
)
header_values = st.one_of(
    st.text(alphabet=st.characters(min_codepoint=32, max_codepoint=126), max_size=40),
    st.floats().map(repr),
    st.integers(-(10**30), 10**30).map(str),
    # HTTP dates up to the year 9999
    st.floats(0, 2.5e11).map(lambda t: email.utils.formatdate(t, usegmt=True)),
    st.sampled_from(
        ["1e999", "nan", "-inf", "Mon, 32 Jan 2024 00:00:00 GMT", "Fri, 31 Dec 9999 23:59:59 +2359"]
    ),
    # Date-shaped garbage: every number field any size, any zone.
    st.builds(
        "{}, {} {} {} {}:{}:{} {}".format,
        st.sampled_from(["Mon", "Xyz", ""]),
        st.integers(-5, 10**25),
        st.sampled_from(["Jan", "Dec", "Foo"]),
        st.integers(-5, 10**25),
        st.integers(-1, 100),
        st.integers(-1, 100),
        st.integers(-1, 100),
        st.sampled_from(["GMT", "-0000", "+2359", "+9999", "EST"])
        | st.integers(-(10**25), 10**25).map(lambda n: f"{n:+05d}"),
    ),
)
charsets = st.sampled_from(
    ["utf-8", "latin-1", "utf-16", "idna", "rot13", "hex", "punycode", "no-such-codec"]
)
statuses = st.integers(400, 599) | st.sampled_from([400, 413, 422, 429, 503])


@fuzz
@given(
    statuses,
    bodies(error_shapes),
    st.none() | header_values,
    st.none() | header_values,
    st.none() | charsets,
)
def test_any_error_body_becomes_a_refusal(status, body, retry_after, retry_after_ms, charset):
    headers = {"content-type": f"application/json; charset={charset}"} if charset else {}
    if retry_after is not None:
        headers["retry-after"] = retry_after
    if retry_after_ms is not None:
        headers["retry-after-ms"] = retry_after_ms
    error = error_from_response(httpx.Response(status, content=body, headers=headers))
    assert isinstance(error, RequestRefused) and error.status == status
    assert isinstance(error.message, str) and len(error.body) <= 4000
    assert isinstance(str(error), str) and isinstance(repr(error), str)
    if isinstance(error, Overloaded):
        assert status in (429, 503)
    if error.retry_after is not None:
        assert math.isfinite(error.retry_after) and error.retry_after >= 0
    if isinstance(error, ContextOverflow):
        for n in (error.prompt_tokens, error.requested_tokens, error.context_length):
            assert n is None or isinstance(n, int)


@fuzz
@given(statuses | st.integers(100, 399), st.text(max_size=300) | error_shapes.map(dumps))
def test_context_overflow_recognition_never_raises(status, body):
    found = context_overflow_from_response(status, body)
    assert found is None or isinstance(found, ContextOverflow)


# -- Retry-After -----------------------------------------------------------------------------------
@fuzz
@given(st.none() | header_values, st.none() | header_values, st.floats(-1e12, 1e12))
def test_retry_after_is_none_or_a_finite_wait(ms, header, now):
    seconds = parse_retry_after(ms, header, now=now)
    assert seconds is None or (math.isfinite(seconds) and seconds >= 0)


@fuzz
@given(
    st.integers(1, 10**6),
    st.floats(0.001, 10),
    st.floats(0.001, 100),
    st.none() | st.floats(),
)
def test_backoff_is_always_within_zero_and_the_cap(attempt, base, cap_extra, retry_after):
    cap = base + cap_extra
    wait = compute_backoff(
        attempt, base=base, cap=cap, retry_after=retry_after, rng=random.Random(0)
    )
    assert 0.0 <= wait <= cap


# -- Prometheus text -------------------------------------------------------------------------------
metric_names = st.sampled_from(
    [
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:num_preemptions_total",
        "vllm:num_requests_waiting_by_reason",
        "vllm:cache_config_info",
        "sglang:num_running_reqs",
        "sglang:num_queue_reqs",
        "sglang:token_usage",
        "sglang:max_total_num_tokens",
        "sglang:page_size",
        "sglang:max_running_requests",
        "llamacpp:requests_processing",
        "llamacpp:requests_deferred",
        "tgi_batch_current_size",
        "tgi_queue_size",
        "tgi_batch_max_total_tokens",
    ]
) | st.from_regex(r"[a-zA-Z_:][a-zA-Z0-9_:]{0,12}", fullmatch=True)
label_values = st.text(max_size=12) | st.sampled_from(
    ["capacity", "tiny", "None", "1e400", "nan", "-5", "16", "1e308"]
)
sample_values = st.one_of(
    st.floats().map(repr),
    st.sampled_from(
        ["NaN", "+Inf", "-Inf", "1e308", "1.7e308", "-1e308", "1_0", "0x10", "", "3.0"]
    ),
    st.integers(-(10**30), 10**30).map(str),
    st.text(max_size=6),
)


@st.composite
def prometheus_lines(draw: Callable[..., Any]) -> str:
    kind = draw(st.integers(0, 9))
    if kind == 0:
        return draw(st.text(max_size=40))
    if kind == 1:
        return "# " + draw(st.sampled_from(["HELP", "TYPE", ""])) + " " + draw(st.text(max_size=20))
    name = draw(metric_names)
    labels = draw(
        st.dictionaries(
            st.sampled_from(
                [
                    "model_name",
                    "engine",
                    "reason",
                    "kv_cache_size_tokens",
                    "block_size",
                    "kv_cache_max_concurrency",
                ]
            )
            | st.text(max_size=5),
            label_values,
            max_size=4,
        )
    )

    def quoted(value: str) -> str:
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'

    body = ",".join(f"{k}={quoted(v)}" for k, v in labels.items())
    if draw(st.booleans()):
        body += draw(st.sampled_from([",", ' ,x="', "}", "{", '\\"', ""]))
    text = name + ("{" + body + "}" if labels or draw(st.booleans()) else "")
    text += draw(st.sampled_from([" ", "\t", "  ", ""])) + draw(sample_values)
    if draw(st.booleans()):
        text += " " + draw(st.sampled_from(["1700000000000", '# {a="b"} 1', "x"]))
    return text


HOSTILE_SAMPLES = [
    "1e308",
    "1.7976931348623157e308",
    "-1e308",
    "+Inf",
    "NaN",
    "1e300",
    "3",
    "0",
    "-2",
]


@st.composite
def vllm_scrapes(draw: Callable[..., Any]) -> str:
    """A vLLM scrape whose every gauge has a few series (data-parallel engines) of any value."""
    lines = []
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:num_preemptions_total",
    ):
        for engine in range(draw(st.integers(0, 3))):
            value = draw(st.sampled_from(HOSTILE_SAMPLES) | sample_values)
            lines.append(f'{name}{{model_name="tiny",engine="{engine}"}} {value}')
    for engine in range(draw(st.integers(0, 2))):
        size, block = draw(st.sampled_from(HOSTILE_SAMPLES)), draw(st.sampled_from(HOSTILE_SAMPLES))
        lines.append(
            f'vllm:cache_config_info{{engine="{engine}",kv_cache_size_tokens="{size}",block_size="{block}",'
            f'kv_cache_max_concurrency="{draw(st.sampled_from(HOSTILE_SAMPLES))}"}} 1'
        )
    return "\n".join(draw(st.permutations(lines)))


prometheus_texts = (
    st.lists(prometheus_lines(), max_size=12).map("\n".join)
    | st.text(max_size=300)
    | vllm_scrapes()
)


@fuzz
@given(prometheus_texts, st.none() | st.sampled_from(["tiny", "other"]) | st.text(max_size=5))
def test_any_metrics_text_parses_to_a_sane_load_or_none(text, model):
    samples = parse_prometheus(text)
    for name, series in samples.items():
        assert isinstance(name, str)
        assert all(isinstance(labels, dict) and isinstance(v, float) for labels, v in series)
    load = parse_load(text, model=model)
    if load is None:
        return
    assert isinstance(load, Load)
    for count in (
        load.running,
        load.waiting,
        load.waiting_capacity,
        load.kv_cache_size_tokens,
        load.block_size,
        load.max_num_seqs,
    ):
        assert count is None or (isinstance(count, int) and count >= 0)
    assert load.kv_usage is None or 0.0 <= load.kv_usage <= 1.0
    for number in (load.preemptions, load.kv_cache_max_concurrency):
        assert number is None or math.isfinite(number)


@fuzz
@given(st.lists(prometheus_texts, min_size=1, max_size=4), st.sampled_from([1, 8, 256]))
def test_the_endpoint_takes_any_scrape(texts, max_num_seqs):
    endpoint = Endpoint("http://x", ControlOptions(), {}, start=1, clock=lambda: 0.0)
    info = ServerInfo(url="http://x", kind="vllm", max_num_seqs=max_num_seqs)
    loads = [parse_load(text) for text in texts]
    endpoint.seed(info, loads[0])
    for i, load in enumerate(loads[1:], 1):
        if load is not None:
            endpoint.observe_load(load, float(i))
    assert endpoint.governor.limit >= 1


# -- discovery -------------------------------------------------------------------------------------
model_entries = shaped(
    {
        "id": st.sampled_from(["tiny", "big", ""]) | st.text(max_size=5),
        "owned_by": st.sampled_from(["vllm", "sglang", "llamacpp", "x"]),
        "max_model_len": st.integers(),
    }
)
models_shapes = shaped({"data": st.lists(model_entries, max_size=3), "object": st.just("list")})
vllm_info_shapes = shaped(
    {
        "vllm_config": shaped(
            {
                "scheduler_config": shaped({"max_num_seqs": st.integers()})
                | shaped({"max_num_seqs": st.integers()}).map(dumps),
                "model_config": shaped({"max_model_len": st.integers()}),
            }
        )
        | st.text(max_size=30)
        | st.sampled_from(
            ["max_num_seqs=0, max_model_len=0", "max_num_seqs=" + "9" * 5000, "max_seq_len=-3"]
        ),
    }
)
sglang_shapes = shaped(
    {
        "max_running_requests": st.integers(),
        "dp_size": st.integers() | st.just(10**30),
        "internal_states": st.lists(
            shaped({"effective_max_running_requests_per_dp": st.integers() | st.just(10**30)}),
            max_size=2,
        ),
        "context_length": st.integers(),
        "max_req_input_len": st.integers(),
        "served_model_name": st.text(max_size=5),
        "version": st.text(max_size=5),
    }
)
loads_shapes = shaped(
    {
        "loads": st.lists(
            shaped(
                {
                    "num_running_reqs": st.integers(),
                    "num_waiting_reqs": st.integers(),
                    "max_running_requests": st.integers() | st.just(10**30),
                }
            ),
            max_size=3,
        )
    }
)
tgi_shapes = shaped(
    {
        "max_concurrent_requests": st.integers(),
        "max_batch_size": st.integers(),
        "max_total_tokens": st.integers(),
        "max_input_tokens": st.integers(),
        "router": st.just("text-generation-router"),
        "model_id": st.text(max_size=5),
    }
)
props_shapes = shaped(
    {
        "total_slots": st.integers(),
        "default_generation_settings": shaped({"n_ctx": st.integers()}),
        "model_path": st.text(max_size=5),
    }
)
ps_shapes = shaped(
    {
        "models": st.lists(
            shaped({"name": st.text(max_size=5), "context_length": st.integers()}), max_size=2
        )
    }
)
version_shapes = shaped({"version": st.text(max_size=8)})

PARSERS: list[tuple[Callable[[Any], Any], st.SearchStrategy[Any]]] = [
    (parse_models, models_shapes),
    (parse_version, version_shapes),
    (parse_vllm_server_info, vllm_info_shapes),
    (parse_sglang_loads, loads_shapes),
    (parse_sglang_server_info, sglang_shapes),
    (parse_tgi_info, tgi_shapes),
    (parse_llamacpp_props, props_shapes),
    (parse_ollama_version, version_shapes),
    (parse_ollama_ps, ps_shapes),
]


@fuzz
@given(st.data())
def test_every_discovery_parser_takes_any_json(data):
    for parse, shapes in PARSERS:
        value = data.draw(shapes | json_values | st.sampled_from(HOSTILE_TEXT))
        facts = parse(value)
        if facts is None:
            continue
        for name in ("max_model_len", "max_num_seqs", "max_input_tokens"):
            n = getattr(facts, name)
            assert n is None or (isinstance(n, int) and n >= 1), (parse.__name__, name, n)
        for n in (facts.num_running, facts.num_waiting):
            assert n is None or (isinstance(n, int) and n >= 0)


PROBE_SHAPES = {
    "/v1/models": models_shapes,
    "/version": version_shapes,
    "/server_info": vllm_info_shapes | sglang_shapes,
    "/get_server_info": sglang_shapes,
    "/v1/loads": loads_shapes,
    "/info": tgi_shapes,
    "/props": props_shapes,
    "/api/version": version_shapes,
    "/api/ps": ps_shapes,
}


@st.composite
def probe_answers(draw: Callable[..., Any]) -> dict[str, tuple[int, bytes]]:
    answers = {}
    for path, shapes in PROBE_SHAPES.items():
        if draw(st.booleans()):
            answers[path] = (draw(st.sampled_from([200, 200, 200, 404, 500])), draw(bodies(shapes)))
    return answers


@fuzz
@given(probe_answers(), st.none() | st.sampled_from(["tiny", "big"]))
def test_discovery_of_any_server_gives_info_or_a_documented_error(answers, model):
    def handler(request: httpx.Request) -> httpx.Response:
        status, body = answers.get(request.url.path, (404, b""))
        return httpx.Response(status, content=body)

    async def main() -> ServerInfo | None:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as http:
            try:
                return await discover(http, "http://x", model=model, records=None)
            except ValueError as exc:  # documented: the model is not served, or not one
                assert "model" in str(exc)
                return None

    info = run(main)
    if info is None:
        return
    # What discovery found must be something the client can start from.
    endpoint = Endpoint(info.url, ControlOptions(), {}, start=1, clock=lambda: 0.0)
    endpoint.seed(info, None)
    assert endpoint.governor.limit >= 1
    assert isinstance(str(info), str) and isinstance(repr(info), str)


# -- a completion or chat answer -------------------------------------------------------------------
usage_shapes = shaped(
    {"prompt_tokens": st.integers(0, 100), "completion_tokens": st.integers(0, 100)}
)
completion_shapes = shaped(
    {
        "choices": st.lists(
            shaped(
                {
                    "text": st.text(max_size=10),
                    "message": shaped(
                        {"content": st.text(max_size=10), "role": st.just("assistant")}
                    ),
                    "finish_reason": st.sampled_from(["stop", "length", None]),
                }
            ),
            max_size=2,
        ),
        "usage": usage_shapes,
        "id": st.text(max_size=5),
        "model": st.just("tiny"),
    }
)
encodings = st.sampled_from([None, None, "gzip", "deflate", "identity", "br", "x-unknown"])


@fuzz
@given(
    bodies(completion_shapes),
    st.sampled_from(["generate", "chat"]),
    encodings,
    st.sampled_from([200, 200, 201, 204, 299, 400, 429, 503]),
    st.none() | charsets,
    st.none() | st.sampled_from([b"\xb2", b"-1", b"abc", b"9" * 30, b"0", b"10", b" 5"]),
)
def test_any_answer_is_a_result_or_a_typed_error(body, call, encoding, status, charset, length):
    headers = {"content-encoding": encoding} if encoding else {}
    if length is not None:
        headers["content-length"] = length
    if charset:
        headers["content-type"] = f"application/json; charset={charset}"
    # A stream, not content=: httpx would decode content= (gzip) when the test builds it.
    fake = FakeServer(
        script=[lambda _: httpx.Response(status, headers=headers, stream=httpx.ByteStream(body))]
    )

    async def main() -> Result | None:
        async with AsyncClient(
            "http://x", transport=fake.transport, retry=Retry(attempts=1)
        ) as client:
            try:
                if call == "generate":
                    return await client.generate("hi", max_tokens=4)
                return await client.chat([{"role": "user", "content": "hi"}], max_tokens=4)
            except DSClientError:
                return None

    result = run(main)
    if result is not None:
        assert isinstance(result.text, str)
        assert result.finish_reason is None or isinstance(result.finish_reason, str)
        assert isinstance(result.usage.prompt_tokens, int) and isinstance(
            result.usage.completion_tokens, int
        )


# -- JSONL: the batch runner's files ---------------------------------------------------------------
def completion(text: str, index: int) -> CompletionResult:
    return CompletionResult(
        text=text,
        finish_reason="length",
        usage=Usage(prompt_tokens=1, completion_tokens=2),
        latency_s=0.1,
        index=index,
    )


record_shapes = shaped(
    {
        "index": st.integers(0, 5),
        "id": st.sampled_from(["a", "b", "0-x"]),
        "ok": st.booleans(),
        "kind": st.sampled_from(["chat", "completion"]),
        "text": st.text(max_size=8),
        "finish_reason": st.sampled_from(["stop", None]),
        "usage": usage_shapes,
        "latency_s": st.floats(0, 10),
        "queued_s": st.floats(0, 10),
        "attempts": st.integers(1, 5),
        "max_tokens": st.integers(1, 10),
        "lane": st.sampled_from(["short", "long"]),
        "response_id": st.text(max_size=5),
        "model": st.text(max_size=5),
        "created": st.integers(0, 10**10),
        "error": shaped({"type": st.text(max_size=5), "message": st.text(max_size=5)}),
    }
)
jsonl_lines = st.lists(
    st.one_of(
        record_shapes.map(dumps).map(str.encode),
        st.sampled_from(HOSTILE_TEXT).map(lambda s: s.encode("utf-8", "surrogatepass")),
        st.binary(max_size=40).filter(lambda b: b"\n" not in b),
    ),
    max_size=6,
)


@fuzz
@given(jsonl_lines, st.booleans(), st.binary(max_size=20).filter(lambda b: b"\n" not in b))
def test_resuming_from_any_results_file_never_crashes(tmp_path_factory, lines, torn, tail):
    path = tmp_path_factory.mktemp("jsonl") / "out.jsonl"
    path.write_bytes(b"".join(line + b"\n" for line in lines) + (tail if torn else b""))
    store = JsonlStore(path, fsync_interval=None)
    done = store.open(resume=True)
    try:
        for index, offset in enumerate(done.values()):
            result = store.load(offset, index)
            assert isinstance(result, Result) and isinstance(result.text, str)
            assert isinstance(result._raw_data, dict)
        # After a resume the file is whole lines again, and appending works.
        store.append(99, "new", completion("x", 99))
        store.append(100, "bad", Failure(index=100, id="bad", error=RuntimeError("e")))
    finally:
        store.close()
    assert path.read_bytes().endswith(b"\n")
    again = JsonlStore(path, fsync_interval=None)
    assert "new" in again.open(resume=True)
    again.close()


@fuzz
@given(
    st.lists(
        st.tuples(
            st.integers(0, 10**6), st.binary(max_size=60) | record_shapes.map(dumps).map(str.encode)
        ),
        max_size=8,
    )
)
def test_scanning_any_lines_counts_them(lines):
    done, failed, bad = scan_records(lines, MAP_RECORDS)
    assert failed + bad + len(done) <= len(lines)


@fuzz
@given(json_values, st.integers(0, 10**6))
def test_any_item_gets_a_stable_id(item, index):
    got = item_id(item, index)
    own = explicit_id(item)
    if own is not None:
        assert got == own
        return
    assert re.fullmatch(rf"{index}-[0-9a-f]{{12}}", got), got
    # The same item read back from a file (a JSON round trip, its keys in another order) is the
    # same item: a resume finds it by this id.
    again = _reversed_keys(json.loads(json.dumps(item)))
    assert item_id(again, index) == got
    assert item_id(item, index + 1) != got


def _reversed_keys(value):
    if isinstance(value, dict):
        return {k: _reversed_keys(value[k]) for k in reversed(list(value))}
    if isinstance(value, list):
        return [_reversed_keys(v) for v in value]
    return value


@fuzz
@given(sse_lines | st.binary(max_size=300), st.data())
def test_any_stream_through_the_client_gives_text_or_a_typed_error(raw, data):
    parts = split_anywhere(raw, data.draw)
    fake = FakeServer(script=[lambda _: httpx.Response(200, stream=_Chunks(parts))])

    async def main() -> list[str] | None:
        async with AsyncClient(
            "http://x", transport=fake.transport, retry=Retry(attempts=1)
        ) as client:
            try:
                async with client.stream("hi", max_tokens=4) as s:
                    deltas = [d async for d in s]
                assert s.finish_reason is None or isinstance(s.finish_reason, str)
                return deltas
            except DSClientError:
                return None
            finally:
                assert client.in_flight == 0

    deltas = run(main)
    assert deltas is None or all(isinstance(d, str) and d for d in deltas)


# -- regressions: the results file (tests/test_batch.py is not this change's file) -----------------
def test_a_results_line_nested_past_the_recursion_limit_is_unreadable():
    # Found: scan_records caught ValueError only; json.loads raised RecursionError on a line of
    # 50 000 "[" and the resume failed.
    lines = [(0, b"[" * 50_000 + b"\n"), (50_001, b'{"id": "a", "ok": true, "text": "t"}\n')]
    assert scan_records(lines, MAP_RECORDS) == ({"a": 50_001}, 0, 1)


def test_a_success_line_with_odd_fields_still_rebuilds(tmp_path):
    # Found: a success line whose "usage" was 5 raised AttributeError, "latency_s": "x" a pydantic
    # ValidationError, when the resume loaded it. The text is there: the item is done.
    path = tmp_path / "out.jsonl"
    odd = {
        "id": "a",
        "ok": True,
        "text": "hello",
        "kind": ["chat"],
        "usage": 5,
        "latency_s": "x",
        "queued_s": math.inf,
        "attempts": True,
        "max_tokens": -3,
        "lane": 7,
        "finish_reason": {"r": 1},
        "response_id": 3,
        "created": "now",
        "model": None,
    }
    path.write_text(json.dumps(odd) + "\n")
    store = JsonlStore(path, fsync_interval=None)
    done = store.open(resume=True)
    try:
        result = store.load(done["a"], 0)
    finally:
        store.close()
    assert isinstance(result, CompletionResult) and result.text == "hello"
    assert (result.usage.prompt_tokens, result.latency_s, result.queued_s) == (0, 0.0, 0.0)
    assert (result.attempts, result.max_tokens, result.lane, result.finish_reason) == (
        1,
        None,
        "short",
        None,
    )
    raw = result._raw_data
    assert raw["choices"][0]["text"] == "hello"
    assert (raw["id"], raw["created"], raw["model"]) == ("resumed-a", 0, "")


# -- found in cli/map.py and _tokens.py by the fuzzing, fixed there ------------------------------
def test_an_input_line_nested_past_the_recursion_limit_is_an_invalid_item():
    from dsclient.batch._batch import InvalidItem
    from dsclient.cli.map import read_requests

    items = list(read_requests(io.StringIO("[" * 50_000 + "\n"), drop_model=False, report=print))
    assert len(items) == 1 and isinstance(items[0], InvalidItem)


@pytest.mark.parametrize(
    "body",
    [{"choices": [{}]}, {"choices": "x"}, {"choices": [{"text": 5}]}, {"usage": 5}],
    ids=["no-text", "choices-str", "text-int", "usage-int"],
)
def test_a_batch_output_line_of_an_odd_shape_is_redone_or_rebuilt(body):
    from dsclient.cli.map import BATCH_RECORDS

    record = {"custom_id": "a", "error": None, "response": {"status_code": 200, "body": body}}
    found = BATCH_RECORDS.identify(record)
    if found is not None and found[1]:
        assert isinstance(BATCH_RECORDS.rebuild(record, 0).text, str)


def test_a_refusal_body_nested_past_the_recursion_limit_is_written_as_text():
    from dsclient.cli.map import BATCH_RECORDS

    failure = Failure(index=0, id="a", error=RequestRefused(500, "[" * 4000))
    line = BATCH_RECORDS.encode(0, "a", failure)
    assert line["response"]["body"] == "[" * 4000


@pytest.mark.parametrize(
    "response",
    [
        lambda: httpx.Response(
            400, content=b"x", headers={"content-type": "text/x; charset=rot13"}
        ),
        lambda: httpx.Response(200, content=b"[" * 50_000),
    ],
    ids=["rot13-charset", "deep-json"],
)
def test_a_hostile_tokenize_answer_is_no_count(response):
    from dsclient.client._tokens import count_exact

    async def main() -> int | None:
        transport = httpx.MockTransport(lambda _: response())
        async with httpx.AsyncClient(transport=transport) as http:
            return await count_exact(http, "http://x", model=None, prompt="hi", timeout=5.0)

    assert run(main) is None
