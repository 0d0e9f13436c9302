"""dsclient.ray without a Ray cluster: rows <-> requests and results, and the callable class on a
scripted server (httpx.MockTransport). The run on a real Ray and a real vLLM is in
tests/integration/test_ray_integration.py."""

from __future__ import annotations

import importlib
import inspect
import json
import pickle
import subprocess
import sys

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest

import dsclient
from dsclient import ChatResult, CompletionResult, ContextOverflow, Failure, Usage
from dsclient._http import httpx
from dsclient.ray import (
    OUTPUT_COLUMNS,
    Generate,
    error_text,
    map_dataset,
    outcome_table,
    to_item,
)
from tests.fakes import FakeServer, chat_body, completion_body

URL = "http://vllm.test:8000"

TOO_LONG = "too long " * 50


def _answer(request: httpx.Request) -> httpx.Response:
    """Echo the prompt (or the last message) back; refuse TOO_LONG as vLLM does."""
    body = json.loads(request.content)
    if "messages" in body:
        return httpx.Response(200, json=chat_body(text="re: " + body["messages"][-1]["content"]))
    if body["prompt"] == TOO_LONG:
        message = (
            "This model's maximum context length is 2048 tokens. However, your prompt contains "
            "at least 2049 input tokens, which exceeds this limit even without any output "
            "tokens. Please reduce the length of the input prompt. "
            "(parameter=input_tokens, value=2049)"
        )
        return httpx.Response(
            400,
            json={
                "error": {
                    "message": message,
                    "type": "BadRequestError",
                    "param": "input_tokens",
                    "code": 400,
                }
            },
        )
    return httpx.Response(200, json=completion_body(text="re: " + body["prompt"]))


def _generate(server: FakeServer, **kwargs: object) -> Generate:
    options = dict(kwargs.pop("client_options", {}) or {})  # type: ignore[call-overload]
    options.setdefault("transport", server.transport)
    return Generate(URL, client_options=options, **kwargs)  # type: ignore[arg-type]


async def _one(udf: Generate, batch: object) -> pa.Table:
    tables = [t async for t in udf(batch)]
    assert len(tables) == 1
    return tables[0]


# -- the pure parts --------------------------------------------------------------------------
def test_to_item_turns_what_ray_hands_over_into_plain_python() -> None:
    messages = np.array([{"role": "user", "content": "Hi"}], dtype=object)
    assert to_item(messages) == [{"role": "user", "content": "Hi"}]
    assert isinstance(to_item(messages), list)
    assert to_item("Hello") == "Hello"
    assert to_item(np.int64(3)) == 3 and type(to_item(np.int64(3))) is int
    nested = {"prompt": "p", "stop": np.array(["a", "b"]), "n": np.int32(2)}
    assert to_item(nested) == {"prompt": "p", "stop": ["a", "b"], "n": 2}
    assert to_item(None) is None  # map() reports it as the row's error
    # A struct column gives each row every field, null where the row had none.
    assert to_item({"role": "user", "content": "Hi", "name": None}) == {"role": "user", "content": "Hi"}
    assert to_item(("a", np.float64(0.5))) == ["a", 0.5]


def test_error_text_is_type_and_message() -> None:
    assert error_text(ValueError("bad")) == "ValueError: bad"
    assert error_text(RuntimeError()) == "RuntimeError"
    overflow = ContextOverflow("prompt too long", prompt_tokens=3000, context_length=2048)
    assert error_text(overflow) == "ContextOverflow: prompt too long"


def _results() -> list[CompletionResult | Failure]:
    ok = CompletionResult(
        text="yes",
        finish_reason="length",
        usage=Usage(prompt_tokens=4, completion_tokens=2),
        latency_s=0.5,
        queued_s=0.1,
        attempts=2,
    )
    bad = Failure(index=1, error=ContextOverflow("too long"), attempts=1)
    return [ok, bad]


def test_outcome_table_types_and_nulls() -> None:
    table = outcome_table(_results())
    assert table.schema == pa.schema(list(OUTPUT_COLUMNS.items()))
    assert table.to_pylist() == [
        {
            "answer": "yes",
            "error": None,
            "finish_reason": "length",
            "prompt_tokens": 4,
            "completion_tokens": 2,
            "latency_s": 0.5,
            "queued_s": 0.1,
            "attempts": 2,
        },
        {
            "answer": None,
            "error": "ContextOverflow: too long",
            "finish_reason": None,
            "prompt_tokens": None,
            "completion_tokens": None,
            "latency_s": None,
            "queued_s": None,
            "attempts": 1,
        },
    ]


def test_outcome_table_of_only_successes_keeps_the_error_column_a_string() -> None:
    # An all-null column typed 'null' cannot be merged with a later block's strings.
    table = outcome_table(_results()[:1])
    assert table.schema.field("error").type == pa.string()
    assert outcome_table([]).num_rows == 0
    assert outcome_table([]).schema.field("answer").type == pa.string()


def test_outcome_table_renames_and_drops() -> None:
    table = outcome_table(_results(), {"answer": "summary", "queued_s": None, "attempts": None})
    assert table.column_names == [
        "summary",
        "error",
        "finish_reason",
        "prompt_tokens",
        "completion_tokens",
        "latency_s",
    ]
    assert table.column("summary").to_pylist() == ["yes", None]


@pytest.mark.parametrize(
    ("columns", "match"),
    [
        ({"text": "x"}, "unknown output column 'text'"),
        ({"answer": "error"}, "share a name"),
        ({"answer": ""}, "non-empty str or None"),
    ],
)
def test_bad_column_names_are_refused_by_name(columns: dict[str, str], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        outcome_table([], columns)
    with pytest.raises(ValueError, match=match):
        Generate(URL, columns=columns)


def test_generate_refuses_bad_arguments() -> None:
    with pytest.raises(TypeError, match="url must be"):
        Generate(None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="column must be"):
        Generate(URL, column="")


def test_every_dsclient_exception_pickles() -> None:
    """Anything that crosses a Ray process boundary is pickled: the error types must survive."""
    examples = [
        dsclient.ContextOverflow("too long", prompt_tokens=3000, context_length=2048),
        dsclient.MalformedResponse("not JSON", body="<html>"),
        dsclient.Overloaded(503, "busy", retry_after=1.5),
        dsclient.RequestRefused(400, "{}", "bad request"),
        dsclient.ServerFault(500, '{"error": {"message": "boom"}}'),
        dsclient.ResponseTooLarge("answer", limit=10),
        dsclient.ConnectionError("refused"),
        dsclient.TimeoutError("late"),
        dsclient.ServerError("500"),
        dsclient.TransportError("reset"),
        dsclient.DSClientError("root"),
        dsclient.NoServerError("no server of this client serves model 'big'"),
    ]
    exported = {
        name
        for name in dsclient.__all__
        if inspect.isclass(getattr(dsclient, name))
        and issubclass(getattr(dsclient, name), BaseException)
    }
    assert {type(e).__name__ for e in examples} == exported
    for error in examples:
        back = pickle.loads(pickle.dumps(error))
        assert type(back) is type(error)
        assert str(back) == str(error)
    failure = Failure(index=3, error=examples[0])
    assert error_text(pickle.loads(pickle.dumps(failure)).error) == error_text(examples[0])


def test_import_without_ray_names_the_extra() -> None:
    code = (
        "import sys; sys.modules['ray'] = None\n"
        "try:\n    import dsclient.ray\n"
        "except ImportError as exc:\n    print(exc)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "pip install 'dsclient[ray]'" in done.stdout
    assert importlib.import_module("dsclient.ray").Generate is Generate


# -- the callable class on a scripted server ---------------------------------------------------
@pytest.mark.anyio
async def test_a_batch_comes_back_with_every_row_and_failures_as_rows() -> None:
    server = FakeServer(script=[_answer])
    udf = _generate(server, max_tokens=8, temperature=0.0)
    prompts = ["one", TOO_LONG, "three", None]
    batch = pa.table({"id": [0, 1, 2, 3], "prompt": prompts})
    out = await _one(udf, batch)
    rows = out.to_pylist()
    assert [r["id"] for r in rows] == [0, 1, 2, 3]
    assert [r["prompt"] for r in rows] == prompts
    assert [r["answer"] for r in rows] == ["re: one", None, "re: three", None]
    assert rows[0]["error"] is None and rows[2]["error"] is None
    assert rows[1]["error"].startswith("ContextOverflow: HTTP 400: This model's maximum context")
    assert rows[3]["error"].startswith("TypeError")  # a null prompt is that row's error
    assert rows[0]["prompt_tokens"] == 3 and rows[0]["completion_tokens"] == 2
    assert rows[0]["finish_reason"] == "length" and rows[0]["latency_s"] > 0
    assert out.schema.field("latency_s").type == pa.float64()
    # Generation parameters reach the server; the refused prompt is not retried.
    sent = [b["prompt"] for b in server.bodies]
    assert sorted(sent) == sorted(["one", TOO_LONG, "three"])
    assert all(b["max_tokens"] == 8 and b["temperature"] == 0.0 for b in server.bodies)
    await udf.aclose()
    assert udf.client is None


@pytest.mark.anyio
async def test_numpy_and_pandas_batches_and_chat_messages() -> None:
    server = FakeServer(script=[_answer])
    udf = _generate(server, column="messages", columns={"answer": "reply", "queued_s": None})
    messages = np.empty(2, dtype=object)
    messages[0] = np.array([{"role": "user", "content": "Hi"}], dtype=object)
    messages[1] = np.array([{"role": "user", "content": "Yo"}], dtype=object)
    out = await _one(udf, {"id": np.array([7, 8]), "messages": messages})
    assert out.column("reply").to_pylist() == ["re: Hi", "re: Yo"]
    assert out.column("id").to_pylist() == [7, 8]
    assert "queued_s" not in out.column_names
    assert server.bodies[0]["messages"] == [{"role": "user", "content": "Hi"}]

    frame = pd.DataFrame({"messages": [[{"role": "user", "content": "Pandas"}]]})
    out = await _one(udf, frame)
    assert out.column("reply").to_pylist() == ["re: Pandas"]
    assert isinstance(out, pa.Table)
    # One client for the actor, whatever the number of batches.
    first = udf.client
    await _one(udf, pa.table({"messages": [[{"role": "user", "content": "again"}]]}))
    assert udf.client is first
    await udf.aclose()


@pytest.mark.anyio
async def test_job_mistakes_raise_with_the_column_names() -> None:
    udf = _generate(FakeServer(script=[_answer]))
    with pytest.raises(ValueError, match=r"no column 'prompt' in the batch \(columns: text\)"):
        await _one(udf, pa.table({"text": ["a"]}))
    with pytest.raises(ValueError, match=r"output column\(s\) \['answer'\] already exist"):
        await _one(udf, pa.table({"prompt": ["a"], "answer": ["b"]}))


@pytest.mark.anyio
async def test_a_batch_that_fails_whole_comes_back_as_error_rows(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    udf = _generate(FakeServer(script=[_answer]))

    async def broken(self: object, items: object, **kwargs: object) -> object:
        raise dsclient.ConnectionError("nothing answers at http://vllm.test:8000")

    monkeypatch.setattr(dsclient.AsyncClient, "map", broken)
    out = await _one(udf, pa.table({"prompt": ["a", "b", "c"]}))
    assert out.column("error").to_pylist() == [
        "ConnectionError: nothing answers at http://vllm.test:8000"
    ] * 3
    assert out.column("answer").null_count == 3


@pytest.mark.anyio
async def test_bad_client_options_raise_instead_of_becoming_rows() -> None:
    udf = Generate(URL, client_options={"limit": 0})
    with pytest.raises(ValueError, match="limit must be an int >= 1"):
        await _one(udf, pa.table({"prompt": ["a"]}))


def test_shared_options_reach_the_client_only_when_set() -> None:
    assert "shared" not in Generate(URL)._options
    udf = Generate(URL, shared="redis://127.0.0.1:6379/0", shared_key="job", client_options={})
    assert udf._options == {"shared": "redis://127.0.0.1:6379/0", "shared_key": "job"}


def test_map_dataset_checks_its_arguments_before_ray_runs() -> None:
    with pytest.raises(ValueError, match="actors must be an int >= 1"):
        map_dataset(object(), URL, actors=0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown output column"):
        map_dataset(object(), URL, columns={"nope": "x"})  # type: ignore[arg-type]


def test_chat_result_rows() -> None:
    result = ChatResult(
        text="hi", finish_reason="stop", usage=Usage(prompt_tokens=5), latency_s=1.0
    )
    assert outcome_table([result]).column("answer").to_pylist() == ["hi"]


@pytest.mark.anyio
async def test_batches_at_once_share_one_client_opened_once() -> None:
    import anyio

    server = FakeServer(script=[_answer])
    udf = _generate(server)
    clients = []

    async def one(i: int) -> None:
        out = await _one(udf, pa.table({"prompt": [f"p{i}-{k}" for k in range(5)]}))
        assert out.column("answer").to_pylist() == [f"re: p{i}-{k}" for k in range(5)]
        clients.append(udf.client)

    async with anyio.create_task_group() as group:
        for i in range(4):
            group.start_soon(one, i)
    assert len(clients) == 4 and len({id(c) for c in clients}) == 1
    await udf.aclose()
    assert udf.client is None
    # After closing, a later batch opens a new client rather than failing.
    await _one(udf, pa.table({"prompt": ["again"]}))
    assert udf.client is not None and udf.client is not clients[0]
    await udf.aclose()


@pytest.mark.anyio
async def test_request_dict_cells_send_only_the_fields_each_row_has() -> None:
    server = FakeServer(script=[_answer])
    udf = _generate(server, column="request", max_tokens=4)
    requests = [{"prompt": "a", "max_tokens": 2}, {"prompt": "b", "temperature": 0.5}]
    out = await _one(udf, pa.table({"request": requests}))  # one struct column: nulls filled in
    assert out.column("answer").to_pylist() == ["re: a", "re: b"]
    bodies = sorted(server.bodies, key=lambda b: b["prompt"])
    assert bodies[0]["max_tokens"] == 2 and "temperature" not in bodies[0]
    assert bodies[1]["max_tokens"] == 4 and bodies[1]["temperature"] == 0.5
    await udf.aclose()
