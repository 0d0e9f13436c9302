"""The governor on a real (tiny, CPU) vLLM: online and batch traffic, dsclient against 6 peers.

    .venv/bin/python -m benchmarks governor              # 3 runs of every leg, ~20-30 min
    .venv/bin/python -m benchmarks governor --runs 1 --online-seconds 8 --no-save  # a quick look
    .venv/bin/python -m benchmarks governor --scenarios online --rates 4,8  # two arrival rates

Starts ONE vLLM server through ``dsclient.launcher`` (the tiny random Llama, ``max_num_seqs`` 8,
``max_model_len`` 2048, served as ``"tiny"``) and stops it at the end. Two scenarios:

* **online**: short requests (~20 words, 16-32 tokens out) arrive as a Poisson process at
  ``--rate`` per second (8; ``--rates 4,8`` runs each rate in turn, rows labelled with it) for
  ``--online-seconds`` (default 16); at t = 1 s a burst of
  ``--burst`` (40) long requests (prompts calibrated to ~1000 tokens of the served model's
  tokenizer with ``/tokenize``, 256 tokens out) is submitted at once. Runs until all finish.
* **batch**: ``--batch`` (160) requests, 3 short : 1 long in a seeded shuffle, submitted at once.

Every request sends ``ignore_eos``, so the output lengths are exactly what was asked. Strategies:

* ``dsclient``: ``dsclient.AsyncClient(url)`` with its defaults; discovery reads the launcher's
  record (``max_num_seqs`` 8), so the limit starts at 5 and then follows vLLM's queue (its
  closed loop); ``client.limit`` is sampled every 0.2 s, and each dsclient row keeps its mean
  and maximum and the long lane's limit at the end;
* ``unbounded``: ``asyncio.gather`` over ``openai.AsyncOpenAI(base_url=url + "/v1")`` calls;
* ``unbounded+priority``: the same, sending vLLM's ``priority`` 0 with short requests and 1 with
  long ones (the server runs with ``--scheduling-policy priority``: lower runs first);
* ``semaphoreN+priority`` for N = 5, 8, 16 (0.7x, 1x, 2x ``max_num_seqs``): the same behind
  ``asyncio.Semaphore(N)``;
* ``semaphore8``: ``unbounded`` behind ``asyncio.Semaphore(8)``, without ``priority``.

Each scenario runs the strategies interleaved, each run starting one strategy later, so that
drift on the machine hits them alike. The conditions (commit, versions, the server's vLLM, cores,
load) are recorded before the server starts and one summary row per strategy and run is kept in
``benchmarks/results/governor/<UTC start>.json`` (in git; ``python -m benchmarks report`` renders
the page's section from it). A row keeps p50, p95, p99 and the maximum with the count of answers;
the page calls a tail p99 only where every run had 200 answers of that kind, else p95 or max.

Every run gets fresh random prompts (same sizes, same arrival
times), so vLLM's prefix cache cannot favour a later run. Latency is counted from submission:
what the caller waits, client-side queueing included. Per-request traces go to the gitignored
``benchmarks/results/governor.json``; the section's tables are printed at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import random
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import _report as report_
from benchmarks._common import (
    WORDS,
    busiest_processes,
    client_facts,
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
from benchmarks._common import gauge as _gauge  # noqa: F401  (tests/test_bench_governor.py)
from benchmarks._results import Run

MAX_NUM_SEQS = 8
MAX_MODEL_LEN = 2048
MODEL = "tiny"
LONG_PROMPT_TOKENS = 1000
LONG_TOKENS_OUT = 256
SHORT_WORDS = 20
SHORT_TOKENS_OUT = (16, 32)
STRATEGIES = (
    "dsclient",
    "unbounded",
    "unbounded+priority",
    "semaphore5+priority",
    "semaphore8+priority",
    "semaphore16+priority",
    "semaphore8",
)
#: What each leg is, for the tables (kept in the results file's facts).
ABOUT = {
    "dsclient": "`AsyncClient(url)` defaults, `generate()` per request",
    "unbounded": "`AsyncOpenAI`, `asyncio.gather`, unbounded, no `priority`",
    "unbounded+priority": "`AsyncOpenAI`, unbounded, `priority` 0 for shorts, 1 for longs",
    **{
        f"semaphore{n}+priority": f"the same behind `asyncio.Semaphore({n})` ({x} max_num_seqs)"
        for n, x in ((5, "0.7x"), (8, "1x"), (16, "2x"))
    },
    "semaphore8": "`AsyncOpenAI` behind `asyncio.Semaphore(8)`, no `priority`",
}
#: vLLM took over 300 s (the launcher's default) to start beside other engineers' servers.
STARTUP_TIMEOUT_S = 900.0
#: vLLM honours the request field ``priority`` (lower runs first) only with this policy.
SERVER_ARGS = ("--scheduling-policy", "priority")
PRIORITY = {"short": 0, "long": 1}
#: Requests (3 short : 1 long) sent at once before the first measured run. After a warm-up of
#: 8, the first measured run was once the session's slowest by far (short service times 4-7x
#: the next run's); 40 take a few seconds more and leave vLLM having run every batch size.
WARM_UP = 40
#: Variants of dsclient for diagnosis (``--strategies``): what the cap and the lane each cost.
DIAGNOSTICS: dict[str, dict[str, Any]] = {
    "dsclient-nolane": {"long_share": 1.0},  # cap 5, long requests may take all 5
    "dsclient-cap8": {"headroom": 1.0},  # cap 8, long lane 4
}


# -- workload ------------------------------------------------------------------------------------
@dataclass
class Request:
    kind: str  # "short" | "long"
    at: float  # submission time, seconds after the run's start
    prompt: str
    max_tokens: int
    prompt_tokens: int | None = None  # exact, for long prompts (calibrated with /tokenize)


@dataclass
class Outcome:
    kind: str
    at: float
    submitted: float  # seconds after the run's start, as it happened
    latency: float | None = None  # finish - submitted
    error: str | None = None
    lane: str | None = None  # dsclient only
    queued_s: float | None = None  # dsclient only: time spent in the governor's queue
    ttft: float | None = None  # streamed legs: first text, from submission
    tokens: int | None = None  # streamed legs: output tokens (ignore_eos: as asked)


def short_request(rng: random.Random, at: float) -> Request:
    return Request("short", at, words(rng, SHORT_WORDS), rng.randint(*SHORT_TOKENS_OUT))


async def long_request(
    rng: random.Random, at: float, count: Callable[[str], Awaitable[int]], per_word: list[float]
) -> Request:
    """A request whose prompt is LONG_PROMPT_TOKENS (+-1%) tokens for the served tokenizer."""
    tolerance = LONG_PROMPT_TOKENS // 100
    body = [rng.choice(WORDS) for _ in range(round(LONG_PROMPT_TOKENS / per_word[0]))]
    for _ in range(20):
        tokens = await count(" ".join(body) + ".")
        per_word[0] = tokens / len(body)
        gap = LONG_PROMPT_TOKENS - tokens
        if abs(gap) <= tolerance:
            break
        step = max(1, round(abs(gap) / per_word[0]))
        if gap > 0:
            body += [rng.choice(WORDS) for _ in range(step)]
        else:
            del body[-step:]
    else:
        raise RuntimeError(f"could not calibrate a {LONG_PROMPT_TOKENS}-token prompt")
    return Request("long", at, " ".join(body) + ".", LONG_TOKENS_OUT, prompt_tokens=tokens)


def burst_times(args: argparse.Namespace) -> list[float]:
    """When the long requests arrive: ``burst`` of them from ``burst_at``, evenly over
    ``burst_window`` seconds (0, or absent: all at once)."""
    window = float(getattr(args, "burst_window", 0.0) or 0.0)
    n = int(args.burst)
    return [args.burst_at + (window * i / n if n else 0.0) for i in range(n)]


async def online_workload(
    seed: int,
    args: argparse.Namespace,
    count: Callable[[str], Awaitable[int]],
    per_word: list[float],
    rate: float,
) -> list[Request]:
    # Arrival times come from the scenario's own seed (identical in every run); the prompts'
    # words from the run's seed.
    times = random.Random(args.seed)
    text = random.Random(seed)
    requests: list[Request] = []
    t = times.expovariate(rate)
    while t < args.online_seconds:
        requests.append(short_request(text, t))
        t += times.expovariate(rate)
    requests += await asyncio.gather(
        *(
            long_request(random.Random(seed * 1000 + i), at, count, per_word)
            for i, at in enumerate(burst_times(args))
        )
    )
    requests.sort(key=lambda r: r.at)
    return requests


async def batch_workload(
    seed: int,
    args: argparse.Namespace,
    count: Callable[[str], Awaitable[int]],
    per_word: list[float],
    rate: float | None = None,  # unused: a batch arrives at once
) -> list[Request]:
    n_long = args.batch // 4
    kinds = ["long"] * n_long + ["short"] * (args.batch - n_long)
    random.Random(args.seed).shuffle(kinds)  # the same order in every run
    text = random.Random(seed)
    longs = iter(
        await asyncio.gather(
            *(
                long_request(random.Random(seed * 1000 + i), 0.0, count, per_word)
                for i in range(n_long)
            )
        )
    )
    return [next(longs) if kind == "long" else short_request(text, 0.0) for kind in kinds]


# -- strategies ----------------------------------------------------------------------------------
Call = Callable[[Request], Awaitable[Outcome | None]]


@contextlib.asynccontextmanager
async def dsclient_strategy(
    url: str, **options: Any
) -> AsyncIterator[tuple[Call, Callable[[], Any]]]:
    import dsclient

    # Discovery happens on entering, before the run; the limit is sampled from then on.
    async with (
        dsclient.AsyncClient(url, **options) as client,
        sample_every(lambda: client.limit) as limits,
    ):

        async def call(request: Request) -> Outcome | None:
            result = await client.generate(
                request.prompt, max_tokens=request.max_tokens, ignore_eos=True
            )
            outcome = Outcome(request.kind, 0.0, 0.0)
            outcome.lane, outcome.queued_s = result.lane, result.queued_s
            return outcome

        def info() -> dict[str, Any]:
            return {
                **client_facts(client),
                "limit_samples": spread(limits),
                "lanes": {
                    name: {"limit": lane.limit, "done": lane.done, "failed": lane.failed}
                    for name, lane in client.stats().lanes.items()
                },
            }

        yield call, info


def openai_call(client: Any, gate: asyncio.Semaphore | None, priority: bool = False) -> Call:
    """One request through ``client`` (an ``openai.AsyncOpenAI``), behind ``gate`` if given,
    with vLLM's ``priority`` (shorts first) if ``priority``."""

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

    async def call(request: Request) -> Outcome | None:
        if gate is None:
            await send(request)
        else:
            async with gate:
                await send(request)
        return None

    return call


@contextlib.asynccontextmanager
async def openai_strategy(
    url: str, gate: asyncio.Semaphore | None, priority: bool = False
) -> AsyncIterator[tuple[Call, Callable[[], Any]]]:
    import openai

    cap = gate._value if gate else None
    async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="x") as client:
        yield openai_call(client, gate, priority), lambda: {"semaphore": cap, "priority": priority}


def dsclient_options(name: str) -> dict[str, Any] | None:
    """``dsclient``, a name in DIAGNOSTICS, or ``dsclient[key=value;...]``: AsyncClient options.

    Values are read as Python literals (``dsclient[long_share=0.8;short_first=True]``); ``None``
    for a name that is not a dsclient strategy.
    """
    if name == "dsclient":
        return {}
    if name in DIAGNOSTICS:
        return DIAGNOSTICS[name]
    if name.startswith("dsclient[") and name.endswith("]"):
        import ast

        pairs = (item.partition("=") for item in name[len("dsclient[") : -1].split(";") if item)
        return {key.strip(): ast.literal_eval(value.strip()) for key, _, value in pairs}
    return None


def strategy(name: str, url: str) -> contextlib.AbstractAsyncContextManager[Any]:
    options = dsclient_options(name)
    if options is not None:
        return dsclient_strategy(url, **options)
    priority = name.endswith("+priority")
    base = name.removesuffix("+priority")
    if base == "unbounded":
        return openai_strategy(url, None, priority)
    if base.startswith("semaphore") and base[len("semaphore") :].isdigit():
        return openai_strategy(url, asyncio.Semaphore(int(base[len("semaphore") :])), priority)
    raise ValueError(f"unknown strategy {name!r}")


async def execute(call: Call, requests: list[Request]) -> tuple[list[Outcome], float]:
    """Submit each request at its time; wait for all. Returns outcomes and the makespan."""
    loop = asyncio.get_running_loop()
    start = loop.time()

    async def one(request: Request) -> Outcome:
        submitted = loop.time()
        try:
            outcome = await call(request) or Outcome(request.kind, 0.0, 0.0)
        except Exception as exc:  # counted, never fatal: errors are part of the result
            outcome = Outcome(request.kind, 0.0, 0.0, error=f"{type(exc).__name__}: {exc}"[:300])
        outcome.latency = loop.time() - submitted
        outcome.at, outcome.submitted = request.at, submitted - start
        return outcome

    tasks = []
    for request in requests:  # sorted by `at`
        delay = start + request.at - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(request)))
    outcomes = list(await asyncio.gather(*tasks))
    makespan = max(o.submitted + (o.latency or 0.0) for o in outcomes)
    return outcomes, makespan


def summarize(outcomes: list[Outcome], makespan: float) -> dict[str, Any]:
    row: dict[str, Any] = {"makespan_s": round(makespan, 2)}
    for kind in ("short", "long"):
        ok = [o.latency for o in outcomes if o.kind == kind and o.error is None and o.latency]
        row[f"{kind}_n"] = sum(o.kind == kind for o in outcomes)
        row[f"{kind}_p50_s"] = round(percentile(ok, 50) or 0.0, 3)
        row[f"{kind}_p99_s"] = round(percentile(ok, 99) or 0.0, 3)
        row[f"{kind}_max_s"] = round(max(ok, default=0.0), 3)
    longs = [o for o in outcomes if o.kind == "long" and o.latency is not None]
    if longs:  # from the burst's submission to its last answer
        first = min(o.submitted for o in longs)
        row["long_span_s"] = round(max(o.submitted + (o.latency or 0) for o in longs) - first, 2)
    row["errors"] = sum(o.error is not None for o in outcomes)
    queued = [o.queued_s for o in outcomes if o.queued_s is not None and o.kind == "short"]
    if queued:
        row["short_queued_p99_s"] = round(percentile(queued, 99) or 0.0, 3)
    lanes = {(o.kind, o.lane) for o in outcomes if o.lane is not None}
    if lanes:
        row["lanes"] = sorted(f"{kind}->{lane}" for kind, lane in lanes)
    return row


# -- the run -------------------------------------------------------------------------------------
async def warm_up(url: str, requests: list[Request]) -> None:
    import openai

    async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="x") as client:
        await asyncio.gather(
            *(
                client.completions.create(
                    model=MODEL,
                    prompt=r.prompt,
                    max_tokens=r.max_tokens,
                    extra_body={"ignore_eos": True},
                )
                for r in requests
            )
        )


async def bench(url: str, args: argparse.Namespace, record: Run | None = None) -> dict[str, Any]:
    import dsclient

    scenarios = [s for s in ("online", "batch") if s in args.scenarios.split(",")]
    names = args.strategies.split(",")
    say("calibrating prompts with /tokenize ...")
    async with dsclient.AsyncClient(url) as counter:

        async def count(text: str) -> int:
            return await counter.count_tokens(text)

        short_tokens = await count(words(random.Random(0), SHORT_WORDS))
        per_word = [1.5]
        plans: list[tuple[str, float | None, int, str, list[Request]]] = []
        for scenario in scenarios:
            build = online_workload if scenario == "online" else batch_workload
            for rate in args.rates if scenario == "online" else [None]:
                for run in range(1, args.runs + 1):
                    shift = (run - 1) % len(names)
                    for name in [*names[shift:], *names[:shift]]:
                        seed = args.seed + 7919 * (len(plans) + 1)
                        requests = await build(seed, args, count, per_word, rate)
                        plans.append((scenario, rate, run, name, requests))
        warm = await batch_workload(
            args.seed - 1, argparse.Namespace(**{**vars(args), "batch": WARM_UP}), count, per_word
        )
        server_info = counter.server
    say(
        f"  short prompt {short_tokens} tokens; long prompts "
        f"{min(r.prompt_tokens or 0 for p in plans for r in p[-1] if r.kind == 'long')}-"
        f"{max(r.prompt_tokens or 0 for p in plans for r in p[-1] if r.kind == 'long')} tokens"
    )
    say("warming the server up ...")
    await warm_up(url, warm)

    runs: list[dict[str, Any]] = []
    for scenario, rate, run, name, requests in plans:
        at = f" at {rate:g}/s" if rate is not None else ""
        say(
            f"{scenario}{at} run {run} {name}: {sum(r.kind == 'short' for r in requests)} short, "
            f"{sum(r.kind == 'long' for r in requests)} long ..."
        )
        async with strategy(name, url) as (call, info), engine_sampler(url) as engine:
            outcomes, makespan = await execute(call, requests)
            details = info()
        row = {
            "scenario": scenario,
            "rate": rate,
            "run": run,
            "strategy": name,
            **summarize(outcomes, makespan),
            **{f"engine_{key}": value for key, value in engine.items()},
            "client": details,
            "loadavg_1min_after": round(os.getloadavg()[0], 2),
        }
        say("  " + json.dumps({k: v for k, v in row.items() if k != "client"}))
        if record is not None:
            record.add(leg=name, run=run, **kept(row, outcomes))
        errors = sorted({o.error for o in outcomes if o.error})
        row["error_samples"] = errors[:5]
        row["requests"] = [asdict(o) for o in outcomes]
        runs.append(row)
        await asyncio.sleep(args.pause)
    return {
        "server": {
            "url": url,
            "max_num_seqs": MAX_NUM_SEQS,
            "max_model_len": MAX_MODEL_LEN,
            "discovered": {
                "max_num_seqs": getattr(server_info, "max_num_seqs", None),
                "sources": dict(getattr(server_info, "sources", {}) or {}),
            },
        },
        "short_prompt_tokens": short_tokens,
        "runs": runs,
    }


def kept(row: dict[str, Any], outcomes: list[Outcome]) -> dict[str, Any]:
    """A run's summary as :meth:`Run.add` keeps it: scalars, with p95 and the counts."""
    found = {
        key: value
        for key, value in row.items()
        if key not in ("run", "strategy", "client", "lanes")
        and (value is None or isinstance(value, int | float | str | bool))
    }
    for kind in ("short", "long"):
        ok = [o.latency for o in outcomes if o.kind == kind and o.error is None and o.latency]
        found[f"{kind}_n"] = len(ok)  # answered, for the tail the page may call p99
        p95 = percentile(ok, 95)
        found[f"{kind}_p95_s"] = None if p95 is None else round(p95, 3)
    client = row.get("client") or {}
    limits = client.get("limit_samples") or {}
    if limits:  # dsclient: where its closed loop took the limit during the run
        found["limit_mean"], found["limit_max"] = limits.get("mean"), limits.get("max")
        found["long_lane_limit"] = (client.get("lanes") or {}).get("long", {}).get("limit")
    return found


TABLE = (
    report_.Column("shorts", "short_n", 0),
    report_.Column("short {tail} s", "short_{tail}_s", count="short_n"),
    report_.Column("long {tail} s", "long_{tail}_s", count="long_n"),
    report_.Column("makespan s", "makespan_s", 1),
    report_.Column("errors", "errors", 0),
)


def _workloads(rows: Sequence[dict[str, Any]]) -> list[tuple[str, float | None]]:
    """(scenario, rate) pairs in the page's order: online by rate, then batch."""
    found = []
    for scenario in ("online", "batch"):
        rates = {r.get("rate") for r in rows if r.get("scenario") == scenario}
        found += [(scenario, rate) for rate in sorted(rates, key=lambda x: x or 0)]
    return found


def render(records: Sequence[dict[str, Any]]) -> str:
    """Per scenario (and rate), one line per strategy: median (range) over runs."""
    record = report_.latest(records)
    assert record is not None
    rows = record["rows"]
    about = record.get("facts", {}).get("legs", ABOUT)
    parts = []
    for scenario, rate in _workloads(rows):
        mine = report_.select(rows, scenario=scenario, rate=rate)
        title = f"**{scenario}**" + (f" at {rate:g}/s" if rate is not None else "")
        parts.append(title + "\n\n" + report_.leg_table(mine, TABLE, about=about))
    parts.append(report_.conditions(record, records))
    return "\n\n".join(parts)


def headline(records: Sequence[dict[str, Any]]) -> list[report_.Versus]:
    """dsclient over each peer, per run: makespan, and the short and long tails both support.

    The batch's makespan is the figure a batch is run for; the online makespan is the burst's
    last answer. A peer whose calls failed gets an "other" cell with the counts.
    """
    record = report_.latest(records)
    if record is None:
        return []
    rows = record["rows"]
    lines: list[report_.Versus] = []
    several = len({rate for scenario, rate in _workloads(rows) if scenario == "online"}) > 1
    for scenario, rate in _workloads(rows):
        match = {"scenario": scenario, "rate": rate}
        workload = f"online {rate:g}/s" if several and rate is not None else scenario
        mine = report_.select(rows, **match)
        for peer in report_.legs(mine):
            if peer == "dsclient":
                continue
            pair = [r for r in mine if r["leg"] in ("dsclient", peer)]
            figures = [("makespan", "makespan_s", "")]
            for column, kind in (("short-request tail", "short"), ("long-request tail", "long")):
                tail = report_.Column("", f"{kind}_{{tail}}_s", count=f"{kind}_n")
                key = report_.resolve(tail, pair)[1]
                figures.append((column, key, key.split("_")[1]))
            for column, key, label in figures:
                found = report_.ratios(mine, key, peer)
                if found:
                    lines.append(report_.Versus("governor", peer, column, found, label, workload))
            # ``mine`` is this workload's rows already (they carry scenario and rate, not the
            # ``workload`` field failures() would select on): name the workload afterwards.
            failed = report_.failures(mine, "errors", peer, "governor")
            lines += [dataclasses.replace(v, workload=workload) for v in failed]
    return lines


def table(runs: list[dict[str, Any]]) -> str:
    head = (
        "| scenario | rate /s | strategy | run | makespan s | long span s | short p50 s "
        "| short p99 s | long p50 s | long p99 s | errors | engine running | server queue "
        "| limit min / mean / max |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
    )
    lines = [head]
    for r in runs:
        rate = f"{r['rate']:g}" if r.get("rate") is not None else "-"
        limits = r.get("client", {}).get("limit_samples") or {}
        limit = f"{limits['min']} / {limits['mean']:.1f} / {limits['max']}" if limits else "-"
        lines.append(
            f"| {r['scenario']} | {rate} | {r['strategy']} | {r['run']} | {r['makespan_s']:.1f} | "
            f"{r.get('long_span_s', 0):.1f} | {r['short_p50_s']:.2f} | {r['short_p99_s']:.2f} | "
            f"{r['long_p50_s']:.2f} | {r['long_p99_s']:.2f} | {r['errors']} | "
            f"{r.get('engine_running_mean', float('nan')):.1f} | "
            f"{r.get('engine_waiting_mean', float('nan')):.1f} | {limit} |"
        )
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, checked: ``--runs`` (3), the scenarios, strategies and rates."""
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks governor", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--runs", type=int, default=3, help="runs of each strategy per scenario")
    parser.add_argument("--scenarios", default="online,batch")
    parser.add_argument(
        "--strategies",
        default=",".join(STRATEGIES),
        help=(
            f"comma-separated, from {', '.join((*STRATEGIES, *DIAGNOSTICS))}, or"
            " dsclient[key=value;...] with AsyncClient options"
        ),
    )
    parser.add_argument("--rate", type=float, default=8.0, help="short arrivals per second")
    parser.add_argument(
        "--rates",
        type=lambda text: [float(x) for x in text.split(",") if x],
        help="several arrival rates in one invocation, e.g. 4,8 (overrides --rate)",
    )
    parser.add_argument(
        "--online-seconds", type=float, default=16.0, help="short requests arrive during [0, this)"
    )
    parser.add_argument("--burst", type=int, default=40, help="long requests in the burst")
    parser.add_argument("--burst-at", type=float, default=1.0, help="when the burst comes (s)")
    parser.add_argument("--batch", type=int, default=160, help="requests in the batch (3:1)")
    parser.add_argument("--pause", type=float, default=2.0, help="idle seconds between runs")
    parser.add_argument("--seed", type=int, default=20240611)
    parser.add_argument("--url", help="use this running server instead of launching one"
                        " (it must run with --scheduling-policy priority)")  # fmt: skip
    parser.add_argument("--no-save", action="store_true", help="keep no results file (a try-out)")
    parser.add_argument(
        "--wait-for-others",
        type=float,
        metavar="SECONDS",
        help="wait at most this long for other vLLM servers to stop, then run beside them"
        " (default: wait for ever)",
    )
    args = parser.parse_args(argv)
    args.rates = args.rates or [args.rate]
    if any(rate <= 0 for rate in args.rates):
        parser.error("rates must be > 0 per second")
    for name in args.strategies.split(","):
        if name not in STRATEGIES and dsclient_options(name) is None:
            parser.error(f"unknown strategy {name!r}")
    if args.runs < 1:
        parser.error("--runs must be at least 1")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    # Everything the figures depend on is recorded before the server and the first leg start.
    record = Run.begin(
        "governor",
        params={
            **{k: v for k, v in vars(args).items() if k != "no_save"},
            "max_num_seqs": MAX_NUM_SEQS,
            "max_model_len": MAX_MODEL_LEN,
            "server_args": list(SERVER_ARGS),
        },
        peers=["openai"],
        versions={"vllm (server)": None if args.url else server_version()},
    )
    names = args.strategies.split(",")
    record.fact("legs", {name: ABOUT.get(name, f"dsclient options {dsclient_options(name)}")
                         for name in names})  # fmt: skip
    started = time.monotonic()
    placement = default_placement()  # the server's processes on their own CPUs
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
        at_start = {"busiest": busiest_processes(), "vllm": vllm_processes()}
        record.fact("busiest_at_start", at_start["busiest"])
        if len(at_start["vllm"]) > 1:
            record.note(f"{len(at_start['vllm'])} vLLM servers ran on the machine at the start")
        payload = asyncio.run(bench(url, args, record))
    payload.update(
        machine=machine(),
        at_start=at_start,
        args=vars(args),
        wall_s=round(time.monotonic() - started, 1),
    )
    trace = write_results("governor", payload)
    print(table(payload["runs"]))
    print()
    print(render([{**record.payload(), "_file": "(this run)"}]))
    if args.no_save:
        print(f"\nwrote the trace {trace} only (--no-save), in {payload['wall_s']:.0f} s")
        return
    kept = record.save()
    print(f"\nwrote {kept} (kept) and the trace {trace}, in {payload['wall_s']:.0f} s")


def server_version() -> str | None:
    """The vLLM version the launcher will start (its own venv), for the record."""
    from dsclient.launcher import resolve_server_python

    return resolve_server_python().version


if __name__ == "__main__":
    main()
