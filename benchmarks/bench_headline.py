"""The headline: dsclient against what a user would write instead, on one real tiny vLLM.

    .venv/bin/python -m benchmarks headline            # 2 rounds of every leg: 9-13 min
    .venv/bin/python -m benchmarks headline --quick    # 1 round, smaller workloads: ~3.5 min
    .venv/bin/python -m benchmarks headline --url http://127.0.0.1:8011   # a running server
    .venv/bin/python -m benchmarks headline --wait-for-others 120   # then run beside them

LiteLLM is in the ``bench`` extra (``pip install -e '.[bench]'``); a client whose library is
missing is skipped with a note.

Starts ONE vLLM server through ``dsclient.launcher`` (the tiny random Llama, ``max_num_seqs`` 8,
``max_model_len`` 2048, served as ``"tiny"``) and stops it at the end. Clients:

* ``dsclient``: ``dsclient.AsyncClient(url)`` with its defaults: ``client.map()`` for the batch,
  ``client.generate()`` per request online;
* ``openai``: ``asyncio.gather`` over ``openai.AsyncOpenAI(base_url=url + "/v1")`` calls, its
  defaults (``max_retries`` 2, timeout 600 s);
* ``openai-sem``: the same behind ``asyncio.Semaphore(floor(0.7 x max_num_seqs))`` (5 here);
* ``litellm``: ``litellm.Router`` with one ``hosted_vllm/`` deployment whose
  ``max_parallel_requests`` is the same 5, through ``router.atext_completion``; the Router's
  other settings are its defaults;
* ``httpx``: the baseline, a plain unbounded ``asyncio.gather`` of ``httpx`` POSTs to
  ``/v1/completions`` (no pool limit, timeout 600 s, no retries).

Workloads, every request with ``ignore_eos`` so output lengths are exactly what was asked:

* **batch**: ``--batch`` (400) short completions (20 words, 16-32 tokens out) at once:
  makespan and failures.
* **online**: the governor benchmark's mixed traffic: short requests as a Poisson stream at
  ``--rate`` (8/s) for ``--online-seconds`` (16), and at t = 1 s a burst of ``--burst`` (40)
  long requests (~1000-token prompts, 256 out): short p99 counted from submission, makespan.

Legs run interleaved (every client once per round, ``--runs`` rounds, each round starting one
client later), each with fresh prompts of the same sizes. Every figure is also given as a ratio
to the ``httpx`` leg of the same workload and round. Each leg records how busy the shared
machine was (cores used by this process, by the server, by everything else). Raw results:
``benchmarks/results/headline.json`` (and a copy named by the time), a markdown summary on
stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import shutil
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import (
    busiest_processes,
    client_facts,
    cpu_snapshot,
    cpu_split,
    engine_sampler,
    machine,
    sample_every,
    say,
    server_group,
    spread,
    tiny_vllm,
    vllm_processes,
    write_results,
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
    summarize,
    warm_up,
)

MAX_NUM_SEQS = 8
MAX_MODEL_LEN = 2048
#: The cap people are told to use in front of vLLM: 0.7 x max_num_seqs, rounded down.
CAP = math.floor(0.7 * MAX_NUM_SEQS)
STRATEGIES = ("dsclient", "openai", "openai-sem", "litellm", "httpx")
BASELINE = "httpx"
WORKLOADS = ("batch", "online")
TIMEOUT_S = 600.0
#: vLLM took over 300 s (the launcher's default) to start beside other engineers' servers.
STARTUP_TIMEOUT_S = 900.0
#: What each client is, for the tables.
ABOUT = {
    "dsclient": "dsclient `AsyncClient(url)` defaults (`map` / `generate`)",
    "openai": "openai-python `AsyncOpenAI`, `asyncio.gather`, unbounded",
    "openai-sem": f"openai-python behind `asyncio.Semaphore({CAP})` (0.7 x max_num_seqs)",
    "litellm": f"LiteLLM `Router`, `max_parallel_requests={CAP}`",
    "httpx": "plain `asyncio.gather` of httpx POSTs, unbounded (the baseline)",
}


# -- clients -------------------------------------------------------------------------------------
Call = Callable[[Request], Awaitable[Outcome | None]]


@dataclass
class Leg:
    """One client, ready: ``call`` sends one request (raises on failure); ``batch`` runs many."""

    call: Call
    info: Callable[[], dict[str, Any]] = dict
    batch: Callable[[list[Request]], Awaitable[tuple[list[Outcome], float]]] | None = None


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

        def info() -> dict[str, Any]:
            return {**client_facts(client), "limit_samples": spread(limits)}

        yield Leg(call, info, batch)


@contextlib.asynccontextmanager
async def openai_leg(url: str, cap: int | None) -> AsyncIterator[Leg]:
    import openai

    gate = asyncio.Semaphore(cap) if cap else None
    async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="x") as client:

        async def send(request: Request) -> None:
            await client.completions.create(
                model=MODEL,
                prompt=request.prompt,
                max_tokens=request.max_tokens,
                extra_body={"ignore_eos": True},
            )

        async def call(request: Request) -> None:
            if gate is None:
                await send(request)
            else:
                async with gate:
                    await send(request)

        yield Leg(call, lambda: {"semaphore": cap, "openai": openai.__version__})


def litellm_model_list(url: str, cap: int) -> list[dict[str, Any]]:
    """One vLLM deployment, as LiteLLM's docs write it: ``hosted_vllm/`` plus ``api_base``."""
    return [
        {
            "model_name": MODEL,
            "litellm_params": {
                "model": f"hosted_vllm/{MODEL}",
                "api_base": url + "/v1",
                "api_key": "x",
                "max_parallel_requests": cap,
            },
        }
    ]


@contextlib.asynccontextmanager
async def litellm_leg(url: str, cap: int) -> AsyncIterator[Leg]:
    # The cost map is fetched from the network at import unless this is set (none here).
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    import litellm

    litellm.telemetry = False
    litellm.suppress_debug_info = True
    router = litellm.Router(model_list=litellm_model_list(url, cap))

    async def call(request: Request) -> None:
        await router.atext_completion(
            model=MODEL,
            prompt=request.prompt,
            max_tokens=request.max_tokens,
            ignore_eos=True,
        )

    version = getattr(litellm, "version", None) or _version("litellm")
    yield Leg(call, lambda: {"max_parallel_requests": cap, "litellm": version})


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

        yield Leg(call, lambda: {"httpx": httpx.__version__})


def _version(dist: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return None


def leg(name: str, url: str) -> contextlib.AbstractAsyncContextManager[Leg]:
    if name == "dsclient":
        return dsclient_leg(url)
    if name == "openai":
        return openai_leg(url, None)
    if name == "openai-sem":
        return openai_leg(url, CAP)
    if name == "litellm":
        return litellm_leg(url, CAP)
    if name == "httpx":
        return httpx_leg(url)
    raise ValueError(f"unknown client {name!r}")


def missing(names: Sequence[str]) -> dict[str, str]:
    """Clients that cannot run here, with why: their library is not installed."""
    needs = {"openai": "openai", "openai-sem": "openai", "litellm": "litellm"}
    found = {}
    for name in names:
        module = needs.get(name)
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


def online_row(outcomes: list[Outcome], makespan: float) -> dict[str, Any]:
    """The governor benchmark's summary, plus ``failures`` under the batch's name."""
    row = summarize(outcomes, makespan)
    row["failures"] = row["errors"]
    row["requests"] = len(outcomes)
    return row


TIMES = "\N{MULTIPLICATION SIGN}"
#: The figures each workload is judged by, each also given as a ratio to the baseline.
COMPARED = {"batch": ("makespan_s",), "online": ("short_p99_s", "makespan_s")}


def ratio(value: float | None, base: float | None) -> float | None:
    if value is None or not base:
        return None
    return round(value / base, 2)


def add_ratios(rows: list[dict[str, Any]], baseline: str = BASELINE) -> list[dict[str, Any]]:
    """Give each row ``<figure>_x``: its figure over the baseline's in the same workload and run.

    A row whose workload and run have no baseline row (or a baseline of 0) gets ``None``.
    """
    bases = {(r["workload"], r["run"]): r for r in rows if r["client"] == baseline}
    for row in rows:
        base = bases.get((row["workload"], row["run"]))
        for figure in COMPARED.get(row["workload"], ()):
            row[f"{figure}_x"] = ratio(row.get(figure), base.get(figure) if base else None)
    return rows


def _cell(rows: list[dict[str, Any]], key: str, digits: int, suffix: str = "") -> str:
    values = [r.get(key) for r in rows]
    if not values or all(v is None for v in values):
        return "-"
    return " / ".join("-" if v is None else f"{v:.{digits}f}{suffix}" for v in values)


def headline_table(rows: list[dict[str, Any]], clients: Sequence[str] = STRATEGIES) -> str:
    """One line per client: batch and online figures, each run's value separated by ``/``."""
    lines = [
        "| client | batch makespan s | batch vs baseline | batch failures "
        "| online short p99 s | short p99 vs baseline | online makespan vs baseline "
        "| online failures |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for client in clients:
        mine = [r for r in rows if r["client"] == client]
        if not mine:
            continue
        batch = sorted((r for r in mine if r["workload"] == "batch"), key=lambda r: r["run"])
        online = sorted((r for r in mine if r["workload"] == "online"), key=lambda r: r["run"])
        x = TIMES
        lines.append(
            f"| {client} | {_cell(batch, 'makespan_s', 1)} | {_cell(batch, 'makespan_s_x', 2, x)} "
            f"| {_cell(batch, 'failures', 0)} | {_cell(online, 'short_p99_s', 2)} "
            f"| {_cell(online, 'short_p99_s_x', 2, x)} | {_cell(online, 'makespan_s_x', 2, x)} "
            f"| {_cell(online, 'failures', 0)} |"
        )
    return "\n".join(lines)


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


async def run_leg(url: str, plan: Plan, server_pgid: int | None) -> dict[str, Any]:
    async with leg(plan.client, url) as client, engine_sampler(url) as engine:
        before = cpu_snapshot(server_pgid)
        if plan.workload == "batch" and client.batch is not None:
            outcomes, makespan = await client.batch(plan.requests)
        else:
            outcomes, makespan = await execute(client.call, plan.requests)
        after = cpu_snapshot(server_pgid)
        details = client.info()
    summary = batch_row if plan.workload == "batch" else online_row
    errors = sorted({o.error for o in outcomes if o.error})
    return {
        "workload": plan.workload,
        "run": plan.run,
        "client": plan.client,
        **summary(outcomes, makespan),
        **{f"engine_{key}": value for key, value in engine.items()},
        "cpu": cpu_split(before, after),
        "details": details,
        "error_samples": errors[:5],
        "outcomes": [asdict(o) for o in outcomes],
    }


async def bench(url: str, args: argparse.Namespace) -> dict[str, Any]:
    import dsclient

    names = [n for n in args.clients.split(",") if n]
    skipped = missing(names)
    for name, why in skipped.items():
        say(f"skipping {name}: {why}")
    names = [n for n in names if n not in skipped]
    workloads = [w for w in WORKLOADS if w in args.workloads.split(",")]
    server_pgid = server_group(url)
    say(f"server process group: {server_pgid}")

    say("calibrating prompts with /tokenize ...")
    online_args = argparse.Namespace(
        seed=args.seed, online_seconds=args.online_seconds, burst=args.burst, burst_at=1.0,
        batch=WARM_UP,
    )  # fmt: skip
    async with dsclient.AsyncClient(url) as counter:

        async def count(text: str) -> int:
            return await counter.count_tokens(text)

        per_word = [1.5]
        plans: list[Plan] = []
        for workload in workloads:
            for run in range(1, args.runs + 1):
                for name in leg_order(names, run):
                    seed = args.seed + 7919 * (len(plans) + 1)
                    if workload == "batch":
                        requests = batch_requests(seed, args.batch)
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
        row = await run_leg(url, plan, server_pgid)
        say("  " + json.dumps({k: v for k, v in row.items() if k not in ("details", "outcomes")}))
        rows.append(row)
        await asyncio.sleep(args.pause)
    if "litellm" in names:  # its cached aiohttp sessions, shared by every Router of the process
        import litellm

        await litellm.close_litellm_async_clients()
    add_ratios(rows)
    return {
        "server": {"url": url, "max_num_seqs": MAX_NUM_SEQS, "max_model_len": MAX_MODEL_LEN},
        "cap": CAP,
        "baseline": BASELINE,
        "clients": {name: ABOUT[name] for name in names},
        "skipped": skipped,
        "noise": noise_summary(rows),
        "rows": rows,
    }


def code_state() -> dict[str, Any]:
    """The commit measured, and whether dsclient's files differed from it (a shared work tree)."""
    import subprocess

    def git(*argv: str) -> str:
        done = subprocess.run(
            ["git", *argv], cwd=Path(__file__).resolve().parents[1],
            capture_output=True, text=True, check=False,
        )  # fmt: skip
        return done.stdout.strip()

    return {
        "commit": git("rev-parse", "HEAD"),
        "dsclient_changed": git("status", "--porcelain", "--", "dsclient").splitlines(),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks headline", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "--quick", action="store_true", help="1 run, a batch of 200, 8 s online, a burst of 20"
    )
    parser.add_argument("--runs", type=int, default=2, help="runs of every leg")
    parser.add_argument("--clients", default=",".join(STRATEGIES),
                        help=f"comma-separated, from {', '.join(STRATEGIES)}")  # fmt: skip
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--batch", type=int, default=400, help="short requests in the batch")
    parser.add_argument("--rate", type=float, default=8.0, help="online short arrivals per second")
    parser.add_argument("--online-seconds", type=float, default=16.0)
    parser.add_argument("--burst", type=int, default=40, help="long requests in the online burst")
    parser.add_argument("--pause", type=float, default=2.0, help="idle seconds between legs")
    parser.add_argument("--seed", type=int, default=20261203)
    parser.add_argument("--url", help="use this running server instead of launching one")
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
    for name in args.clients.split(","):
        if name not in STRATEGIES:
            parser.error(f"unknown client {name!r}")
    if BASELINE not in args.clients.split(","):
        parser.error(f"the baseline client {BASELINE!r} must run: ratios are against it")

    started = time.monotonic()
    with tiny_vllm(
        args.url,
        max_num_seqs=MAX_NUM_SEQS,
        max_model_len=MAX_MODEL_LEN,
        wait_s=args.wait_for_others,
        startup_timeout=STARTUP_TIMEOUT_S,
    ) as url:
        others_at_start = {"busiest": busiest_processes(), "vllm": vllm_processes()}
        payload = asyncio.run(bench(url, args))
    payload.update(
        machine=machine(),
        code=code_state(),
        at_start=others_at_start,
        args=vars(args),
        wall_s=round(time.monotonic() - started, 1),
    )
    path = write_results("headline", payload)
    stamped = path.with_name(f"headline-{time.strftime('%Y%m%d-%H%M%S')}.json")
    shutil.copyfile(path, stamped)
    print(headline_table(payload["rows"]))
    print("\n" + "\n".join(f"- {name}: {about}" for name, about in ABOUT.items()))
    print(f"\nmachine: {json.dumps(payload['noise'])}")
    print(f"wrote {path} and {stamped.name} in {payload['wall_s']:.0f} s")


if __name__ == "__main__":
    main()
