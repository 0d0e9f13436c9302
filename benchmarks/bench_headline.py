"""The headline: dsclient against what a user would write instead, on one real tiny vLLM.

    .venv/bin/python -m benchmarks headline            # 2 rounds of every leg: 9-13 min
    .venv/bin/python -m benchmarks headline --quick    # 1 round, smaller workloads: ~3.5 min
    .venv/bin/python -m benchmarks headline --url http://127.0.0.1:8011   # a running server
    .venv/bin/python -m benchmarks headline --wait-for-others 120   # then run beside them

LiteLLM is in the ``bench`` extra (``pip install -e '.[bench]'``); a client whose library is
missing is skipped with a note.

The server's processes (API server and engine) start on their own CPUs and the client runs on
another (:func:`benchmarks._common.plan_placement`: on 2 cores, server on CPU 1, client on CPU 0;
``--shared-cpus`` for the old mix); where each ran is in the results file's ``placement`` fact,
and each row keeps the client's and the server's CPU (``own_cores``, ``server_cores``).

Starts ONE vLLM server through ``dsclient.launcher`` (the tiny random Llama, ``max_num_seqs`` 8,
``max_model_len`` 2048, served as ``"tiny"``) with ``--scheduling-policy priority``, so that a
client which sends vLLM's ``priority`` field (lower runs first) gets what it asks for; a request
without the field has priority 0, and ties run first come, first served. Legs, each named with
its settings:

* ``dsclient``: ``dsclient.AsyncClient(url)`` with its defaults: ``client.map()`` for the batch,
  ``client.generate()`` per request online;
* ``httpx``: the baseline, a plain unbounded ``asyncio.gather`` of ``httpx`` POSTs to
  ``/v1/completions`` (no pool limit, timeout 600 s, no retries);
* ``openai``: ``asyncio.gather`` over ``openai.AsyncOpenAI(base_url=url + "/v1")`` calls, its
  defaults (``max_retries`` 2, timeout 600 s);
* ``openai+priority``: the same, sending ``priority`` 0 with short requests and 1 with long ones
  (online only: in the batch every request is short, so it would be the ``openai`` leg again);
* ``openai+priority+semN``: the same behind ``asyncio.Semaphore(N)`` for N = 5, 8, 16 (0.7x,
  1x and 2x ``max_num_seqs``);
* ``litellm+retries``: ``litellm.Router`` with one ``hosted_vllm/`` deployment,
  ``num_retries=3`` and a ``RetryPolicy`` that retries timeouts, 429, 500 and 503 three times
  and never a 400, 401 or 404, through ``router.atext_completion``;
* ``litellm+retries+cap5``: the same with the deployment's ``max_parallel_requests=5``;
* ``litellm+scheduler+cap16``: the same at ``max_parallel_requests=16`` with LiteLLM's request
  prioritization scheduler as its docs set it up (``polling_interval=0.03``,
  ``routing_strategy="simple-shuffle"``), each call with ``priority`` 0 (short) or 1 (long).

Workloads, every request with ``ignore_eos`` so output lengths are exactly what was asked:

* **batch**: ``--batch`` (400) short completions (20 words, 16-32 tokens out) at once:
  makespan and failures.
* **online**: the governor benchmark's mixed traffic: short requests as a Poisson stream at
  ``--rate`` (8/s) for ``--online-seconds`` (16), and from t = 1 s ``--burst`` (40) long
  requests (~1000-token prompts, 256 out) arriving evenly over ``--burst-window`` (4 s; a burst
  all at t = 1 s, the old workload, with 0): short and long latency from submission (p50, p95,
  p99, max and the count), makespan.

* **serving**: streamed, Poisson arrivals at ``--serving-rate`` (4/s) for
  ``--serving-seconds`` (20) with seeded lognormal prompt and output lengths
  (:mod:`benchmarks._serving`; the drawn distribution goes into the results file): per lane TTFT
  and TPOT p50/p95/p99 and goodput at ``--goodput`` (``ttft:1000,tpot:50``), for dsclient
  (``client.stream``) and the openai legs (``stream=True``).

Legs run interleaved (every leg once per round, ``--runs`` rounds, 3 by default, each round
starting one leg later), each with fresh prompts of the same sizes. The conditions (commit,
versions, load) are recorded before the first leg; one summary row per leg and run goes to
``benchmarks/results/headline/<UTC start>.json`` (kept in git) through
:mod:`benchmarks._results`, and the per-request trace to ``benchmarks/results/headline.json``
(gitignored). ``python -m benchmarks report`` renders the page's tables from the kept files.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import _report as report
from benchmarks._common import (
    busiest_processes,
    client_facts,
    cpu_snapshot,
    cpu_split,
    default_placement,
    engine_sampler,
    machine,
    percentile,
    placement_facts,
    sample_every,
    say,
    server_group,
    spread,
    tiny_vllm,
    vllm_processes,
    words,
    write_results,
)
from benchmarks._results import Run
from benchmarks._serving import (
    Timed,
    distribution,
    distribution_text,
    lane_of,
    lognormal_lengths,
    serving_figures,
)
from benchmarks.bench_governor import (
    MODEL,
    WARM_UP,
    Outcome,
    Request,
    batch_workload,
    execute,
    online_workload,
    short_request,
    warm_up,
)
from dsclient.cli.bench.goodput import Slo, parse_goodput

MAX_NUM_SEQS = 8
MAX_MODEL_LEN = 2048
#: The cap people are told to use in front of vLLM: 0.7 x max_num_seqs, rounded down.
CAP = math.floor(0.7 * MAX_NUM_SEQS)
#: The semaphore peers: 0.7x, 1x and 2x max_num_seqs.
SEMAPHORES = (CAP, MAX_NUM_SEQS, 2 * MAX_NUM_SEQS)
#: The server's flags beyond the launcher's: vLLM honours the request field `priority` only so.
SERVER_ARGS = ("--scheduling-policy", "priority")
#: vLLM's `priority` per request kind: lower runs first.
PRIORITY = {"short": 0, "long": 1}
LITELLM_RETRIES = 3
STRATEGIES = (
    "dsclient",
    "httpx",
    "openai",
    "openai+priority",
    *(f"openai+priority+sem{n}" for n in SEMAPHORES),
    "litellm+retries",
    f"litellm+retries+cap{CAP}",
    f"litellm+scheduler+cap{2 * MAX_NUM_SEQS}",
)
#: Legs that only differ from another in the online workload (the batch is all short).
ONLINE_ONLY = ("openai+priority",)
#: The streamed legs of the serving workload: dsclient and every openai peer (httpx and LiteLLM
#: are not streamed here).
SERVING_LEGS = (
    "dsclient",
    "openai",
    "openai+priority",
    *(f"openai+priority+sem{n}" for n in SEMAPHORES),
)
BASELINE = "httpx"
WORKLOADS = ("batch", "online", "serving")
#: The serving workload's stated objective, as ``vllm bench serve --goodput`` takes it (ms).
GOODPUT = "ttft:1000,tpot:50"
TIMEOUT_S = 600.0
#: vLLM took over 300 s (the launcher's default) to start beside other engineers' servers.
STARTUP_TIMEOUT_S = 900.0
#: How each semaphore relates to max_num_seqs, for the tables.
SEMAPHORE_LABEL = {CAP: "0.7x", MAX_NUM_SEQS: "1x", 2 * MAX_NUM_SEQS: "2x"}
#: What each leg is, for the tables.
ABOUT = {
    "dsclient": "`AsyncClient(url)` defaults (`map` / `generate` / `stream`)",
    "httpx": "`asyncio.gather` of httpx POSTs, unbounded, no retries",
    "openai": "`AsyncOpenAI` defaults, `asyncio.gather`, unbounded",
    "openai+priority": "`AsyncOpenAI`, unbounded, `priority` 0 for shorts, 1 for longs",
    **{
        f"openai+priority+sem{n}": f"`AsyncOpenAI` + `priority` behind `asyncio.Semaphore({n})` "
        f"({SEMAPHORE_LABEL[n]} max_num_seqs)"
        for n in SEMAPHORES
    },
    "litellm+retries": f"LiteLLM `Router`, `num_retries={LITELLM_RETRIES}` + `RetryPolicy`, no cap",
    f"litellm+retries+cap{CAP}": f"LiteLLM `Router`, retries as above, "
    f"`max_parallel_requests={CAP}`",
    f"litellm+scheduler+cap{2 * MAX_NUM_SEQS}": "LiteLLM `Router` with its request "
    "prioritization scheduler as its docs set it (`polling_interval=0.03`, `simple-shuffle`), "
    f"`max_parallel_requests={2 * MAX_NUM_SEQS}` (2x max_num_seqs), retries as above, `priority` "
    "0 for shorts and 1 for longs",
}


# -- clients -------------------------------------------------------------------------------------
Call = Callable[[Request], Awaitable[Outcome | None]]


@dataclass
class Leg:
    """One client, ready: ``call`` sends one request (raises on failure); ``batch`` runs many."""

    call: Call
    info: Callable[[], dict[str, Any]] = dict
    batch: Callable[[list[Request]], Awaitable[tuple[list[Outcome], float]]] | None = None
    stream: Call | None = None  # the serving workload: streamed, TTFT timed


@contextlib.asynccontextmanager
async def dsclient_leg(url: str) -> AsyncIterator[Leg]:
    import dsclient

    async with (
        dsclient.AsyncClient(url) as client,
        sample_every(lambda: client.limit) as limits,
    ):

        async def call(request: Request) -> Outcome:
            result = await client.generate(
                request.prompt, max_tokens=request.max_tokens, ignore_eos=True
            )
            outcome = Outcome(request.kind, 0.0, 0.0)
            outcome.lane, outcome.queued_s = result.lane, result.queued_s
            return outcome

        async def batch(requests: list[Request]) -> tuple[list[Outcome], float]:
            items = [{"prompt": r.prompt, "max_tokens": r.max_tokens} for r in requests]
            begun = time.perf_counter()
            results = await client.map(items, ignore_eos=True, progress=False)
            makespan = time.perf_counter() - begun
            outcomes = []
            for request, result in zip(requests, results, strict=True):
                error = getattr(result, "error", None)
                outcomes.append(
                    Outcome(
                        request.kind,
                        0.0,
                        0.0,
                        latency=getattr(result, "latency_s", None),
                        error=None if error is None else f"{type(error).__name__}: {error}"[:300],
                        queued_s=getattr(result, "queued_s", None),
                    )
                )
            return outcomes, makespan

        async def stream(request: Request) -> Outcome:
            loop = asyncio.get_running_loop()
            begun, ttft = loop.time(), None
            async with client.stream(
                request.prompt, max_tokens=request.max_tokens, ignore_eos=True
            ) as answer:
                async for delta in answer:
                    if delta and ttft is None:
                        ttft = loop.time() - begun
            outcome = Outcome(request.kind, 0.0, 0.0, lane=answer.lane)
            outcome.ttft, outcome.tokens = ttft, request.max_tokens
            return outcome

        def info() -> dict[str, Any]:
            return {**client_facts(client), "limit_samples": spread(limits)}

        yield Leg(call, info, batch, stream)


@contextlib.asynccontextmanager
async def openai_leg(url: str, cap: int | None, priority: bool = False) -> AsyncIterator[Leg]:
    import openai

    gate = asyncio.Semaphore(cap) if cap else None
    async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="x") as client:

        async def send(request: Request) -> None:
            body: dict[str, Any] = {"ignore_eos": True}
            if priority:
                body["priority"] = PRIORITY[request.kind]
            await client.completions.create(
                model=MODEL,
                prompt=request.prompt,
                max_tokens=request.max_tokens,
                extra_body=body,
            )

        async def call(request: Request) -> None:
            if gate is None:
                await send(request)
            else:
                async with gate:
                    await send(request)

        async def streamed(request: Request) -> Outcome:
            loop = asyncio.get_running_loop()
            begun, ttft = loop.time(), None
            body: dict[str, Any] = {"ignore_eos": True}
            if priority:
                body["priority"] = PRIORITY[request.kind]
            async with contextlib.AsyncExitStack() as stack:
                if gate is not None:
                    await stack.enter_async_context(gate)
                chunks = await client.completions.create(
                    model=MODEL,
                    prompt=request.prompt,
                    max_tokens=request.max_tokens,
                    stream=True,
                    extra_body=body,
                )
                async for chunk in chunks:
                    if ttft is None and chunk.choices and chunk.choices[0].text:
                        ttft = loop.time() - begun
            outcome = Outcome(request.kind, 0.0, 0.0)
            outcome.ttft, outcome.tokens = ttft, request.max_tokens
            return outcome

        yield Leg(call, lambda: {"semaphore": cap, "priority": priority}, stream=streamed)


def litellm_model_list(url: str, cap: int | None) -> list[dict[str, Any]]:
    """One vLLM deployment, as LiteLLM's docs write it: ``hosted_vllm/`` plus ``api_base``."""
    params: dict[str, Any] = {
        "model": f"hosted_vllm/{MODEL}",
        "api_base": url + "/v1",
        "api_key": "x",
        "timeout": TIMEOUT_S,
    }
    if cap is not None:
        params["max_parallel_requests"] = cap
    return [{"model_name": MODEL, "litellm_params": params}]


def litellm_retry_policy(retries: int = LITELLM_RETRIES) -> dict[str, int]:
    """LiteLLM's ``RetryPolicy`` fields as its docs set them: retry what is transient, only.

    Timeouts, 429, 500 and 503 are retried ``retries`` times; a refused request (400, 401,
    404, content policy) never is, as it would fail again.
    """
    return {
        "TimeoutErrorRetries": retries,
        "RateLimitErrorRetries": retries,
        "InternalServerErrorRetries": retries,
        "ServiceUnavailableErrorRetries": retries,
        "BadRequestErrorRetries": 0,
        "AuthenticationErrorRetries": 0,
        "NotFoundErrorRetries": 0,
        "ContentPolicyViolationErrorRetries": 0,
    }


@contextlib.asynccontextmanager
async def litellm_leg(url: str, cap: int | None, scheduler: bool = False) -> AsyncIterator[Leg]:
    # The cost map is fetched from the network at import unless this is set (none here).
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    import litellm
    from litellm.types.router import RetryPolicy

    litellm.telemetry = False
    litellm.suppress_debug_info = True
    router = litellm.Router(
        model_list=litellm_model_list(url, cap),
        num_retries=LITELLM_RETRIES,
        retry_policy=RetryPolicy(**litellm_retry_policy()),
        timeout=TIMEOUT_S,
        **litellm_scheduler_settings(scheduler),
    )

    async def call(request: Request) -> None:
        extra = {"priority": PRIORITY[request.kind]} if scheduler else {}
        await router.atext_completion(
            model=MODEL,
            prompt=request.prompt,
            max_tokens=request.max_tokens,
            ignore_eos=True,
            **extra,
        )

    version = getattr(litellm, "version", None) or _version("litellm")
    yield Leg(
        call, lambda: {"max_parallel_requests": cap, "litellm": version, "scheduler": scheduler}
    )


def litellm_scheduler_settings(scheduler: bool) -> dict[str, Any]:
    """The Router settings LiteLLM's request-prioritization docs give (docs/scheduler): poll the
    queue every 30 ms, ``simple-shuffle`` routing (their recommendation for speed)."""
    if not scheduler:
        return {}
    return {"polling_interval": 0.03, "routing_strategy": "simple-shuffle"}


@contextlib.asynccontextmanager
async def httpx_leg(url: str) -> AsyncIterator[Leg]:
    import httpx

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT_S, limits=limits) as http:

        async def call(request: Request) -> None:
            response = await http.post(
                "/v1/completions",
                json={
                    "model": MODEL,
                    "prompt": request.prompt,
                    "max_tokens": request.max_tokens,
                    "ignore_eos": True,
                },
            )
            response.raise_for_status()
            json.loads(response.content)

        yield Leg(call, dict)


def _version(dist: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return None


def leg(name: str, url: str) -> contextlib.AbstractAsyncContextManager[Leg]:
    """The leg called ``name`` (see :data:`STRATEGIES`), pointed at ``url``."""
    if name == "dsclient":
        return dsclient_leg(url)
    if name == "httpx":
        return httpx_leg(url)
    if name == "openai":
        return openai_leg(url, None)
    if name == "openai+priority":
        return openai_leg(url, None, priority=True)
    if name.startswith("openai+priority+sem"):
        return openai_leg(url, int(name.removeprefix("openai+priority+sem")), priority=True)
    if name == "litellm+retries":
        return litellm_leg(url, None)
    if name.startswith("litellm+retries+cap"):
        return litellm_leg(url, int(name.removeprefix("litellm+retries+cap")))
    if name.startswith("litellm+scheduler+cap"):
        return litellm_leg(url, int(name.removeprefix("litellm+scheduler+cap")), scheduler=True)
    raise ValueError(f"unknown client {name!r}")


def missing(names: Sequence[str]) -> dict[str, str]:
    """Clients that cannot run here, with why: their library is not installed."""
    found = {}
    for name in names:
        module = name.split("+")[0] if name.startswith(("openai", "litellm")) else None
        if module and _version(module) is None:
            found[name] = f"{module} is not installed (pip install 'dsclient[bench]')"
    return found


# -- summaries (pure) ----------------------------------------------------------------------------
def batch_row(outcomes: Sequence[Outcome], makespan: float) -> dict[str, Any]:
    """Makespan, failures and throughput of a batch leg."""
    ok = [o for o in outcomes if o.error is None]
    return {
        "makespan_s": round(makespan, 2),
        "requests": len(outcomes),
        "failures": len(outcomes) - len(ok),
        "ok_per_s": round(len(ok) / makespan, 1) if makespan > 0 else None,
    }


def latency_figures(outcomes: Sequence[Outcome], kind: str) -> dict[str, Any]:
    """``<kind>_n`` (answered), p50, p95, p99 and max seconds from submission, of one kind.

    All four are kept; the page shows the p99 only where ``n`` >= 200 (else the p95, or the
    maximum under 20: :func:`benchmarks._report.tail_name`).
    """
    ok = [o.latency for o in outcomes if o.kind == kind and o.error is None and o.latency]
    row: dict[str, Any] = {f"{kind}_n": len(ok)}
    for name, value in (
        ("p50", percentile(ok, 50)),
        ("p95", percentile(ok, 95)),
        ("p99", percentile(ok, 99)),
        ("max", max(ok, default=None)),
    ):
        row[f"{kind}_{name}_s"] = None if value is None else round(value, 3)
    return row


def serving_row(outcomes: Sequence[Outcome], makespan: float, slo: Slo) -> dict[str, Any]:
    """Makespan, failures, and per lane TTFT and TPOT p50 / p95 / p99 and goodput at ``slo``
    over the makespan (the benchmark's duration, as ``vllm bench serve`` takes it)."""
    timed = [
        Timed(
            o.kind,
            o.error is None,
            o.ttft,
            o.latency if o.latency is not None else 0.0,
            o.tokens or 0,
        )
        for o in outcomes
    ]
    return {
        "makespan_s": round(makespan, 2),
        "requests": len(outcomes),
        "failures": sum(o.error is not None for o in outcomes),
        **serving_figures(timed, slo, makespan),
    }


def serving_requests(
    seed: int, args: argparse.Namespace, per_word: float
) -> tuple[list[Request], list[tuple[int, int]]]:
    """Poisson arrivals at ``--serving-rate`` for ``--serving-seconds`` (from ``--seed``: the
    same in every run), each with lognormal lengths (from ``--seed`` too: the same spread in
    every run and leg) and fresh words (from ``seed``). Prompts are sized with the server's
    tokens per word, so their token counts are near, not at, the drawn ones."""
    times = random.Random(args.seed)
    arrivals = []
    t = times.expovariate(args.serving_rate)
    while t < args.serving_seconds:
        arrivals.append(t)
        t += times.expovariate(args.serving_rate)
    lengths = lognormal_lengths(args.seed, len(arrivals))
    text = random.Random(seed)
    requests = [
        Request(lane_of(prompt, out), at, words(text, max(1, round(prompt / per_word))), out)
        for at, (prompt, out) in zip(arrivals, lengths, strict=True)
    ]
    return requests, lengths


def online_row(outcomes: list[Outcome], makespan: float) -> dict[str, Any]:
    """Makespan, failures, and short and long latency figures of an online leg."""
    return {
        "makespan_s": round(makespan, 2),
        "requests": len(outcomes),
        "failures": sum(o.error is not None for o in outcomes),
        **latency_figures(outcomes, "short"),
        **latency_figures(outcomes, "long"),
    }


TIMES = "\N{MULTIPLICATION SIGN}"


# -- the page (benchmarks/_report.py) ------------------------------------------------------------
BATCH_COLUMNS = (
    report.Column("makespan s", "makespan_s", 1),
    report.Column("ok/s", "ok_per_s", 1),
    report.Column("failures", "failures", 0),
)
ONLINE_COLUMNS = (
    report.Column("shorts", "short_n", 0),
    report.Column("short {tail} s", "short_{tail}_s", count="short_n"),
    report.Column("long {tail} s", "long_{tail}_s", count="long_n"),
    report.Column("short p50 s", "short_p50_s"),
    report.Column("makespan s", "makespan_s", 1),
    report.Column("failures", "failures", 0),
)


SERVING_COLUMNS = (
    report.Column("short TTFT p50 s", "short_ttft_p50_s", 3),
    report.Column("short TTFT p95 s", "short_ttft_p95_s", 3),
    report.Column("short TTFT p99 s", "short_ttft_p99_s", 3),
    report.Column("short TPOT p50 ms", "short_tpot_p50_ms", 1),
    report.Column("short TPOT p95 ms", "short_tpot_p95_ms", 1),
    report.Column("long TTFT p95 s", "long_ttft_p95_s", 3),
    report.Column("long TTFT p99 s", "long_ttft_p99_s", 3),
    report.Column("long TPOT p95 ms", "long_tpot_p95_ms", 1),
    report.Column("goodput req/s", "goodput_rps", 2),
    report.Column("good", "good", 0),
    report.Column("makespan s", "makespan_s", 1),
    report.Column("failures", "failures", 0),
)


def _in_ms(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """TPOT in milliseconds for the table (kept in seconds in the file)."""
    out = []
    for row in rows:
        extra = {
            key.replace("_s", "_ms"): None if row[key] is None else row[key] * 1000
            for key in row
            if "_tpot_" in key and key.endswith("_s")
        }
        out.append({**row, **extra})
    return out


def render(records: Sequence[dict[str, Any]]) -> str:
    """The section's tables: batch, online, then serving, one line per leg (median and range
    over runs), and the serving workload's drawn lengths."""
    record = report.latest(records)
    assert record is not None
    rows = record["rows"]
    facts = record.get("facts", {})
    about = facts.get("legs", ABOUT)
    parts = []
    for workload, columns in (
        ("batch", BATCH_COLUMNS),
        ("online", ONLINE_COLUMNS),
        ("serving", SERVING_COLUMNS),
    ):
        mine = report.select(rows, workload=workload)
        if not mine:
            continue
        if workload == "serving":
            slo = next((r.get("slo") for r in mine if r.get("slo")), GOODPUT)
            title = f"**serving** (streamed; goodput at `--goodput {slo}`)"
            parts.append(title + "\n\n" + report.leg_table(_in_ms(mine), columns, about=about))
            if facts.get("serving_lengths"):
                parts.append("Serving lengths drawn:\n\n"
                             + distribution_text(facts["serving_lengths"]))  # fmt: skip
        else:
            parts.append(f"**{workload}**\n\n" + report.leg_table(mine, columns, about=about))
    parts.append(report.conditions(record, records))
    return "\n\n".join(parts)


def headline(records: Sequence[dict[str, Any]]) -> list[report.Versus]:
    """dsclient over each peer, per run: batch makespan; online makespan, short and long tails."""
    record = report.latest(records)
    if record is None:
        return []
    rows = record["rows"]
    lines = []
    for workload in ("batch", "online"):
        mine = report.select(rows, workload=workload)
        for peer in report.legs(mine):
            if peer == "dsclient":
                continue
            pair = [r for r in mine if r["leg"] in ("dsclient", peer)]
            figures = [("makespan", "makespan_s", "")]
            if workload == "online":  # the tail both legs' answers support
                for column, kind in (
                    ("short-request tail", "short"),
                    ("long-request tail", "long"),
                ):
                    tail = report.Column("", f"{kind}_{{tail}}_s", count=f"{kind}_n")
                    key = report.resolve(tail, pair)[1]
                    figures.append((column, key, key.split("_")[1]))
            for column, key, label in figures:
                found = report.ratios(rows, key, peer, workload=workload)
                if found:
                    lines.append(report.Versus("headline", peer, column, found, label, workload))
    serving = report.select(rows, workload="serving")
    for peer in report.legs(serving):
        if peer == "dsclient":
            continue
        for column, key, label, higher in (
            ("short-request tail", "short_ttft_p95_s", "TTFT p95", False),
            ("long-request tail", "long_ttft_p95_s", "TTFT p95", False),
            ("other", "goodput_rps", "goodput (higher is better)", True),
        ):
            found = report.ratios(rows, key, peer, workload="serving")
            if found:
                lines.append(report.Versus("headline", peer, column, found, label, "serving",
                                           higher_better=higher))  # fmt: skip
    for workload in WORKLOADS:
        for peer in report.legs(report.select(rows, workload=workload)):
            if peer != "dsclient":
                lines += report.failures(rows, "failures", peer, "headline", workload=workload)
    return lines


def noise_summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """How busy the machine was over the legs: others' cores (mean, max), load average range."""
    others = [r["cpu"]["others_cores"] for r in rows if r.get("cpu")]
    loads = [
        r["cpu"][key]
        for r in rows
        if r.get("cpu")
        for key in ("loadavg_1min_before", "loadavg_1min_after")
    ]
    if not others:
        return {}
    return {
        "others_cores_mean": round(sum(others) / len(others), 2),
        "others_cores_max": max(others),
        "loadavg_1min_min": min(loads),
        "loadavg_1min_max": max(loads),
    }


# -- the run -------------------------------------------------------------------------------------
@dataclass
class Plan:
    workload: str
    run: int
    client: str
    requests: list[Request] = field(repr=False)


def leg_order(names: Sequence[str], run: int) -> list[str]:
    """The clients' order in round ``run`` (from 1): each round starts one client later, so none
    is always first or last while the machine's load drifts."""
    shift = (run - 1) % len(names) if names else 0
    return [*names[shift:], *names[:shift]]


def batch_requests(seed: int, n: int) -> list[Request]:
    rng = random.Random(seed)
    return [short_request(rng, 0.0) for _ in range(n)]


async def run_leg(
    url: str, plan: Plan, server_pgid: int | None, slo: Slo | None = None
) -> dict[str, Any]:
    async with leg(plan.client, url) as client, engine_sampler(url) as engine:
        before = cpu_snapshot(server_pgid)
        if plan.workload == "batch" and client.batch is not None:
            outcomes, makespan = await client.batch(plan.requests)
        elif plan.workload == "serving":
            assert client.stream is not None, f"{plan.client} has no streamed leg"
            outcomes, makespan = await execute(client.stream, plan.requests)
        else:
            outcomes, makespan = await execute(client.call, plan.requests)
        after = cpu_snapshot(server_pgid)
        details = client.info()
    if plan.workload == "serving":
        figures = serving_row(outcomes, makespan, slo or parse_goodput(GOODPUT))
    elif plan.workload == "batch":
        figures = batch_row(outcomes, makespan)
    else:
        figures = online_row(outcomes, makespan)
    errors = sorted({o.error for o in outcomes if o.error})
    return {
        "workload": plan.workload,
        "run": plan.run,
        "client": plan.client,
        **figures,
        **{f"engine_{key}": value for key, value in engine.items()},
        "cpu": cpu_split(before, after),
        "details": details,
        "error_samples": errors[:5],
        "outcomes": [asdict(o) for o in outcomes],
    }


#: What each kept row holds beside the leg's own figures: where the CPU went, the engine's batch.
KEPT_EXTRA = ("others_cores", "server_cores", "own_cores")


def kept_row(row: dict[str, Any]) -> dict[str, Any]:
    """The summary figures of a traced row, as :meth:`Run.add` keeps them (scalars only)."""
    figures = {
        key: value
        for key, value in row.items()
        if key not in ("client", "run", "cpu", "details", "error_samples", "outcomes")
        and (value is None or isinstance(value, int | float | str | bool))
    }
    cpu = row.get("cpu") or {}
    figures.update({key: cpu.get(key) for key in KEPT_EXTRA})
    if row.get("error_samples"):
        figures["first_error"] = str(row["error_samples"][0])[:200]
    limit = (row.get("details") or {}).get("limit_samples") or {}
    if limit:
        figures["dsclient_limit_min"] = limit.get("min")
        figures["dsclient_limit_max"] = limit.get("max")
    return figures


async def bench(url: str, args: argparse.Namespace, record: Run) -> dict[str, Any]:
    import dsclient

    names = [n for n in args.clients.split(",") if n]
    skipped = missing(names)
    for name, why in skipped.items():
        say(f"skipping {name}: {why}")
        record.note(f"{name} skipped: {why}")
    names = [n for n in names if n not in skipped]
    workloads = [w for w in WORKLOADS if w in args.workloads.split(",")]
    server_pgid = server_group(url)
    say(f"server process group: {server_pgid}")

    say("calibrating prompts with /tokenize ...")
    online_args = argparse.Namespace(
        seed=args.seed, online_seconds=args.online_seconds, burst=args.burst, burst_at=1.0,
        burst_window=args.burst_window, batch=WARM_UP,
    )  # fmt: skip
    async with dsclient.AsyncClient(url) as counter:

        async def count(text: str) -> int:
            return await counter.count_tokens(text)

        per_word = [1.5]
        plans: list[Plan] = []
        if "serving" in workloads:  # the server's tokens per word, before any prompt is sized
            sample = words(random.Random(args.seed), 400)
            per_word[0] = await count(sample) / 400
        for workload in workloads:
            if workload == "serving":
                here = [n for n in names if n in SERVING_LEGS]
            else:
                here = [n for n in names if workload == "online" or n not in ONLINE_ONLY]
            for run in range(1, args.runs + 1):
                for name in leg_order(here, run):
                    seed = args.seed + 7919 * (len(plans) + 1)
                    if workload == "batch":
                        requests = batch_requests(seed, args.batch)
                    elif workload == "serving":
                        requests, lengths = serving_requests(seed, args, per_word[0])
                        if "serving_lengths" not in record.facts:
                            drawn = distribution(lengths)
                            record.fact("serving_lengths", drawn)
                            say("serving lengths drawn:\n" + distribution_text(drawn))
                    else:
                        requests = await online_workload(
                            seed, online_args, count, per_word, args.rate
                        )
                    plans.append(Plan(workload, run, name, requests))
        warm = await batch_workload(args.seed - 1, online_args, count, per_word)
    say("warming the server up ...")
    await warm_up(url, warm)

    rows = []
    for plan in plans:
        kinds = {k: sum(r.kind == k for r in plan.requests) for k in ("short", "long")}
        say(f"{plan.workload} run {plan.run} {plan.client}: {kinds['short']} short, "
            f"{kinds['long']} long ...")  # fmt: skip
        row = await run_leg(url, plan, server_pgid, args.goodput)
        say("  " + json.dumps({k: v for k, v in row.items() if k not in ("details", "outcomes")}))
        rows.append(row)
        record.add(leg=plan.client, run=plan.run, **kept_row(row))
        await asyncio.sleep(args.pause)
    if any(n.startswith("litellm") for n in names):  # its cached aiohttp sessions
        import litellm

        await litellm.close_litellm_async_clients()
    return {
        "server": {"url": url, "max_num_seqs": MAX_NUM_SEQS, "max_model_len": MAX_MODEL_LEN},
        "cap": CAP,
        "baseline": BASELINE,
        "clients": {name: ABOUT[name] for name in names},
        "skipped": skipped,
        "noise": noise_summary(rows),
        "rows": rows,
    }


def server_version() -> dict[str, Any]:
    """The vLLM the launcher will start (its own venv), for the record."""
    from dsclient.launcher import resolve_server_python

    install = resolve_server_python()
    return {"dist": install.dist, "version": install.version}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks headline", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "--quick", action="store_true", help="1 run, a batch of 200, 8 s online, a burst of 20"
    )
    parser.add_argument("--runs", type=int, default=3, help="runs of every leg")
    parser.add_argument("--clients", default=",".join(STRATEGIES),
                        help=f"comma-separated, from {', '.join(STRATEGIES)}")  # fmt: skip
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--batch", type=int, default=400, help="short requests in the batch")
    parser.add_argument("--rate", type=float, default=8.0, help="online short arrivals per second")
    parser.add_argument("--online-seconds", type=float, default=16.0)
    parser.add_argument("--burst", type=int, default=40, help="long requests in the online burst")
    parser.add_argument(
        "--burst-window", type=float, default=4.0, metavar="SECONDS",
        help="the long requests arrive evenly over this window from t = 1 s (0: all at once)",
    )  # fmt: skip
    parser.add_argument("--serving-rate", type=float, default=4.0,
                        help="serving workload: arrivals per second")  # fmt: skip
    parser.add_argument("--serving-seconds", type=float, default=20.0)
    parser.add_argument(
        "--goodput", type=parse_goodput, default=parse_goodput(GOODPUT), metavar="ttft:MS,tpot:MS",
        help="the serving workload's objectives, as vllm bench serve --goodput (default "
        f"{GOODPUT})",
    )  # fmt: skip
    parser.add_argument("--pause", type=float, default=2.0, help="idle seconds between legs")
    parser.add_argument("--seed", type=int, default=20261203)
    parser.add_argument("--url", help="use this running server instead of launching one"
                        " (it must run with --scheduling-policy priority)")  # fmt: skip
    parser.add_argument("--no-save", action="store_true", help="keep no results file (a try-out)")
    parser.add_argument(
        "--shared-cpus", action="store_true",
        help="let the client share the server's CPUs (default: server on its own CPUs, client"
        " on the first)",
    )  # fmt: skip
    parser.add_argument(
        "--wait-for-others",
        type=float,
        metavar="SECONDS",
        help="wait at most this long for other vLLM servers to stop, then run beside them"
        " (default: wait for ever)",
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.runs, args.batch, args.online_seconds, args.burst = 1, 200, 8.0, 20
        args.serving_seconds = 8.0
    for name in args.clients.split(","):
        if name not in STRATEGIES:
            parser.error(f"unknown client {name!r}")

    # Everything the figures depend on is recorded before the first leg (and the server) starts.
    record = Run.begin(
        "headline",
        params={
            **{k: v for k, v in vars(args).items() if k not in ("no_save", "goodput")},
            "goodput": args.goodput.text(),
            "max_num_seqs": MAX_NUM_SEQS,
            "max_model_len": MAX_MODEL_LEN,
            "server_args": list(SERVER_ARGS),
        },
        peers=["openai", "litellm", "httpx"],
        versions={"vllm (server)": None if args.url else server_version()["version"]},
    )
    record.fact("legs", {name: ABOUT[name] for name in args.clients.split(",")})
    started = time.monotonic()
    placement = default_placement(apart=not args.shared_cpus)
    with tiny_vllm(
        args.url,
        max_num_seqs=MAX_NUM_SEQS,
        max_model_len=MAX_MODEL_LEN,
        wait_s=args.wait_for_others,
        startup_timeout=STARTUP_TIMEOUT_S,
        extra_args=() if args.url else SERVER_ARGS,
        placement=placement,
    ) as url:
        record.fact("placement", placement_facts(placement, [server_group(url)]))
        others_at_start = {"busiest": busiest_processes(), "vllm": vllm_processes()}
        record.fact("busiest_at_start", others_at_start["busiest"])
        if len(others_at_start["vllm"]) > 1:
            record.note(f"{len(others_at_start['vllm'])} vLLM servers ran on the machine")
        with contextlib.nullcontext() if args.no_save else record.kept_if_aborted():
            payload = asyncio.run(bench(url, args, record))
    payload.update(
        machine=machine(),
        at_start=others_at_start,
        args={**vars(args), "goodput": args.goodput.text()},
        wall_s=round(time.monotonic() - started, 1),
    )
    trace = write_results("headline", payload)
    print(render([{**record.payload(), "_file": "(this run)"}]))
    if args.no_save:
        print(f"\nwrote the trace {trace} only (--no-save)")
        return
    kept = record.save()
    print(f"\nwrote {kept.relative_to(kept.parents[3])} (kept) and the trace {trace}")


if __name__ == "__main__":
    main()
