"""Four processes, one server: a shared budget in Redis against one process doing the same work.

    python -m benchmarks shared                      # 3 runs x 5 legs, launches vLLM and Redis
    python -m benchmarks shared --requests 240 --runs 1
    python -m benchmarks shared --url http://127.0.0.1:8000 --redis redis://127.0.0.1:6379/0
    python -m benchmarks shared --cost               # CPU per request, shared= vs not (~1 min)
    python -m benchmarks shared --cost --callgrind   # the same in instructions (~5 min)

The tiny random Llama is launched through dsclient's launcher with ``max_num_seqs`` 24 (known to
the clients from the launch record, so the single-client target queue is ``ceil(0.5 x 24)`` = 12),
and a redis-server is started on a free loopback port (``tests/redis_server.py``). Every request
is ~20 words in and 64 tokens out with ``ignore_eos``. Legs, interleaved within each run:

* ``one``: one process maps ``--requests`` (480) through ``AsyncClient(url)`` (its own loop);
* ``four-shared``: four processes map a quarter each through ``AsyncClient(url, shared=redis)``
  (one budget: one leader's loop, leased blocks);
* ``four-own``: the same four without ``shared=`` (four loops on one queue: the uncoordinated
  case the simulation puts at 5-8x the target);
* ``four-static``: four processes without dsclient, each an ``asyncio.gather`` of httpx POSTs
  behind its own ``asyncio.Semaphore(max_num_seqs / 4)`` (6): the static split an operator
  would configure by hand, the obvious control for a shared budget;
* ``four-static-2x``: the same at twice the share (``max_num_seqs / 2`` each, 2x the batch in
  all): the best fixed setting of the headline's semaphore sweep, the static split at its best.

All processes of a leg start their map at the same wall-clock time. Legs run in an order that
rotates between runs (each run starts one leg later). The conditions are recorded before the
first leg, and one summary row per leg and run is kept in
``benchmarks/results/shared/<UTC start>.json`` (:mod:`benchmarks._results`).

Reported per leg: the makespan
(first start to last end), its ratio to ``one`` of the same run (goal for four-shared: <= 1.1),
the server's waiting queue (p90 / mean / max of ``vllm:num_requests_waiting`` polled every 0.2 s
while anything ran; goal for four-shared: p90 <= 12), the engine's mean batch, failures, and the
machine's load (``/proc/loadavg``) before and after each leg. Raw results:
``benchmarks/results/shared.json``. Run it under ``flock /tmp/dsclient-vllm.lock`` on a shared
machine.

``--cost`` measures the client's CPU per request instead (``time.process_time`` over ``--n``
requests on 64 tasks, the client-cost benchmark's in-process mock server, ``--rounds`` interleaved
rounds after an uncounted one, medians): bare httpx, dsclient at a limit of 64, and the same with
``shared=``. The mock answers without yielding to the event loop, so the background sync does not
run while requests are timed: its CPU is measured apart (``sync_cpu_us``, one sync; there are 5 a
second) and given as a share of the client's CPU at 100 requests a second. Raw results:
``benchmarks/results/shared_cost.json``. ``--cost --callgrind`` counts instructions instead
(``valgrind --tool=callgrind``; per request = the difference between 1200 and 200 requests):
repeatable on a busy machine, where CPU seconds scatter by 20 %. Raw results:
``benchmarks/results/shared_instructions.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import random
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import _report as report_
from benchmarks._common import (
    ROOT,
    cpu_snapshot,
    cpu_split,
    default_placement,
    engine_sampler,
    machine,
    placement_facts,
    say,
    server_group,
    spread,
    tiny_vllm,
    words,
    write_results,
)
from benchmarks._results import Run

MAX_NUM_SEQS = 24
TARGET = math.ceil(0.5 * MAX_NUM_SEQS)  # the single client's target queue (queue_share 0.5)
TOKENS_OUT = 64
PROMPT_WORDS = 20
MAKESPAN_GOAL = 1.1
LEGS = ("one", "four-shared", "four-own", "four-static", "four-static-2x")
#: Each ``four-static`` process's semaphore: an even split of the server's batch.
STATIC_SPLIT = MAX_NUM_SEQS // 4
#: Each static process's semaphore per leg: 1x and 2x the even split. The headline benchmark's
#: best fixed semaphore is 2x max_num_seqs (a short queue at the server keeps the batch full),
#: so the 2x split is the static split at its best.
STATIC_SPLITS = {"four-static": STATIC_SPLIT, "four-static-2x": 2 * STATIC_SPLIT}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks shared", description=__doc__)
    p.add_argument("--url", help="a running vLLM (default: launch the tiny one)")
    p.add_argument("--redis", help="a running Redis (default: start redis-server)")
    p.add_argument("--requests", type=int, default=480, help="requests per leg (all processes)")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--seed", type=int, default=17)
    p.add_argument("--pause", type=float, default=3.0, help="seconds between legs")
    p.add_argument("--wait-for-others", type=float, metavar="SECONDS",
                   help="wait at most this long for other vLLMs to stop (default: for ever)")
    p.add_argument(
        "--cost", action="store_true", help="CPU per request only (mock server, real Redis)"
    )
    p.add_argument("--no-save", action="store_true", help="keep no results file (a try-out)")
    p.add_argument("--rounds", type=int, default=5, help="--cost: interleaved rounds")
    p.add_argument(
        "--callgrind", action="store_true", help="--cost: in callgrind instructions instead"
    )
    # worker mode (one client process)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--n", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--shared", default="", help=argparse.SUPPRESS)
    p.add_argument("--key", default="dsclient", help=argparse.SUPPRESS)
    p.add_argument("--start-at", type=float, default=0.0, help=argparse.SUPPRESS)
    p.add_argument("--static", type=int, default=0, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def prompts(seed: int, n: int) -> list[str]:
    rng = random.Random(seed)
    return [words(rng, PROMPT_WORDS) for _ in range(n)]


def loadavg() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "?"


# -- one client process ---------------------------------------------------------------------------
async def static_worker(args: argparse.Namespace) -> dict[str, Any]:
    """A process without dsclient: httpx POSTs behind ``asyncio.Semaphore(args.static)``."""
    import httpx

    gate = asyncio.Semaphore(args.static)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=args.url, timeout=600.0, limits=limits) as http:
        texts = prompts(args.seed, args.n)
        await asyncio.sleep(max(0.0, args.start_at - time.time()))
        late = time.time() - args.start_at

        async def one(text: str) -> bool:
            async with gate:
                try:
                    response = await http.post(
                        "/v1/completions",
                        json={"model": "tiny", "prompt": text, "max_tokens": TOKENS_OUT,
                              "ignore_eos": True},
                    )  # fmt: skip
                    return response.status_code == 200
                except httpx.HTTPError:
                    return False

        begun = time.time()
        results = await asyncio.gather(*(one(t) for t in texts))
        ended = time.time()
    ok = sum(results)
    return {
        "items": len(results),
        "ok": ok,
        "failed": len(results) - ok,
        "begun": begun,
        "ended": ended,
        "late_s": round(late, 3),
        "makespan_s": round(ended - begun, 3),
    }


async def worker(args: argparse.Namespace) -> dict[str, Any]:
    import dsclient
    from benchmarks._common import sample_every

    shared = args.shared or None
    async with dsclient.AsyncClient(args.url, shared=shared, shared_key=args.key) as client:
        texts = prompts(args.seed, args.n)
        await asyncio.sleep(max(0.0, args.start_at - time.time()))
        late = time.time() - args.start_at
        async with sample_every(lambda: client.limit) as limits:
            begun = time.time()
            results = await client.map(
                texts, max_tokens=TOKENS_OUT, ignore_eos=True, progress=False
            )
            ended = time.time()
        blocks = client._endpoint.governor.limit
        terms = client._shared.terms if client._shared is not None else None
    ok = sum(1 for r in results if r.ok)
    return {
        "items": len(results),
        "ok": ok,
        "failed": len(results) - ok,
        "begun": begun,
        "ended": ended,
        "late_s": round(late, 3),
        "makespan_s": round(ended - begun, 3),
        "limit_samples": spread(limits),
        "final_block": blocks,
        "leader_terms": terms,
    }


# -- CPU per request (in-process mock server, real Redis) -----------------------------------------
async def cost_leg(name: str, n: int, tasks: int, redis_url: str) -> dict[str, Any]:
    """CPU per request of ``httpx`` (bare), ``dsclient`` (limit 64, own loop) or
    ``dsclient-shared`` (the same with ``shared=``: a block of 64 leases, synced every 0.2 s in
    the background, whose CPU counts too), on the client-cost benchmark's mock server."""
    import httpx

    import dsclient
    from benchmarks.bench_client_cost import URL, Mock, _drive, prompt, strategy_httpx

    if name == "httpx":
        return await strategy_httpx(n, tasks)
    mock = Mock(httpx)
    shared = redis_url if name == "dsclient-shared" else None
    async with dsclient.AsyncClient(
        URL, transport=httpx.MockTransport(mock), max_num_seqs=92, shared=shared
    ) as client:

        async def one(i: int) -> str:
            return (await client.generate(prompt(i), max_tokens=16)).text

        await _drive(2 * tasks * 10, tasks, one)  # untimed: the block grows to the demand
        cpu = await _drive(n, tasks, one)
        block = client._endpoint.governor.limit
    return {"cpu_s": cpu, "block": block, "limit": client.limit}


async def sync_cost(redis_url: str, steps: int = 300) -> float:
    """CPU (this process's) of one background sync: the Lua script's round trip and parsing."""
    import httpx

    import dsclient
    from benchmarks.bench_client_cost import URL, Mock

    async with dsclient.AsyncClient(
        URL, transport=httpx.MockTransport(Mock(httpx)), max_num_seqs=92, shared=redis_url
    ) as client:
        budget, endpoint = client._shared, client._endpoint
        assert budget is not None
        cpu = time.process_time()
        for _ in range(steps):
            await budget.step(endpoint)
        return (time.process_time() - cpu) / steps * 1e6


async def cost(redis_url: str, args: argparse.Namespace) -> dict[str, Any]:
    names = ["httpx", "dsclient", "dsclient-shared"]
    per: dict[str, list[float]] = {name: [] for name in names}
    for round_ in range(args.rounds + 1):  # round 0 warms caches and is not counted
        for name in names:
            got = await cost_leg(name, args.n, 64, redis_url)
            if round_:
                per[name].append(got["cpu_s"] / args.n * 1e6)
                say(f"round {round_} {name}: {per[name][-1]:.1f} us CPU/request {got}")
    med = {name: sorted(v)[len(v) // 2] for name, v in per.items()}
    sync_us = await sync_cost(redis_url)
    return {
        "sync_cpu_us": sync_us,
        "sync_cpu_share_at_100_rps": round(sync_us * 5 / (100 * med["dsclient"]), 4),
        "us_per_request": per,
        "median_us": med,
        "shared_over_own": round(med["dsclient-shared"] / med["dsclient"], 3),
        "own_over_httpx": round(med["dsclient"] / med["httpx"], 3),
        "shared_over_httpx": round(med["dsclient-shared"] / med["httpx"], 3),
    }


def callgrind(name: str, n: int, redis_url: str, workdir: Path) -> int:
    """Instructions a fresh interpreter executes running :func:`cost_leg` for ``n`` requests."""
    import re
    import subprocess

    code = (
        f"import asyncio, sys; sys.path.insert(0, {str(ROOT)!r}); "
        "from benchmarks.bench_shared import cost_leg; "
        "asyncio.run(cost_leg(sys.argv[1], int(sys.argv[2]), 64, sys.argv[3]))"
    )
    out = workdir / f"callgrind.{name}.{n}"
    done = subprocess.run(
        ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", sys.executable, "-c",
         code, name, str(n), redis_url],
        capture_output=True, text=True, check=True, cwd=ROOT,
    )  # fmt: skip
    match = re.search(r"Collected : (\d+)", done.stderr)
    if match is None:
        raise RuntimeError(f"callgrind printed no total:\n{done.stderr[-2000:]}")
    return int(match.group(1))


def instructions(redis_url: str, small: int, large: int) -> dict[str, Any]:
    """Instructions per request (the difference between ``large`` and ``small`` requests, so
    start-up, discovery and the first lease cancel out) of each cost leg."""
    import tempfile

    per: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in ("httpx", "dsclient", "dsclient-shared"):
            counts = [callgrind(name, n, redis_url, Path(tmp)) for n in (small, large)]
            per[name] = (counts[1] - counts[0]) / (large - small)
            say(f"{name}: {per[name]:.0f} instructions per request")
    return {
        "instructions_per_request": per,
        "shared_over_own": round(per["dsclient-shared"] / per["dsclient"], 3),
        "own_over_httpx": round(per["dsclient"] / per["httpx"], 3),
        "shared_over_httpx": round(per["dsclient-shared"] / per["httpx"], 3),
    }


# -- legs -----------------------------------------------------------------------------------------
async def leg(url: str, name: str, n: int, redis_url: str, seed: int, run: int) -> dict[str, Any]:
    count = 1 if name == "one" else 4
    sizes = [n // count + (1 if i < n % count else 0) for i in range(count)]
    shared = redis_url if name == "four-shared" else ""
    static = STATIC_SPLITS.get(name, 0)
    start_at = time.time() + 6.0  # time to import dsclient, discover, take a first lease
    before = loadavg()
    pgid = server_group(url)
    cpu_before = cpu_snapshot(pgid)
    async with engine_sampler(url) as engine:
        procs = []
        for i, size in enumerate(sizes):
            argv = [
                sys.executable, "-m", "benchmarks.bench_shared", "--worker", "--url", url,
                "--n", str(size), "--seed", str(seed + i), "--shared", shared,
                "--key", f"bench-{run}", "--start-at", repr(start_at), "--static", str(static),
            ]  # fmt: skip
            procs.append(
                await asyncio.create_subprocess_exec(
                    *argv, cwd=ROOT, stdout=asyncio.subprocess.PIPE
                )
            )
        outputs = await asyncio.gather(*(p.communicate() for p in procs))
    cpu = cpu_split(cpu_before, cpu_snapshot(pgid))  # the workers were waited for: counted
    workers = []
    for proc, (stdout, _) in zip(procs, outputs, strict=True):
        if proc.returncode != 0:
            raise SystemExit(f"a {name} worker failed with status {proc.returncode}")
        workers.append(json.loads(stdout.decode().strip().splitlines()[-1]))
    makespan = max(w["ended"] for w in workers) - min(w["begun"] for w in workers)
    return {
        "run": run,
        "leg": name,
        "processes": count,
        "makespan_s": round(makespan, 3),
        "ok": sum(w["ok"] for w in workers),
        "failed": sum(w["failed"] for w in workers),
        "queue_p90": engine.get("waiting_p90"),
        "queue_mean": engine.get("waiting_mean"),
        "queue_max": engine.get("waiting_max"),
        "running_mean": engine.get("running_mean"),
        "load_before": before,
        "load_after": loadavg(),
        "own_cores": cpu.get("own_cores"),  # this process and its worker processes
        "server_cores": cpu.get("server_cores"),
        "others_cores": cpu.get("others_cores"),
        "workers": workers,
    }


def summarize(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for run in sorted({r["run"] for r in rows}):
        by = {r["leg"]: r for r in rows if r["run"] == run}
        one = by["one"]["makespan_s"]
        for name in LEGS:
            row = by[name]
            out.append(
                {
                    "run": run,
                    "leg": name,
                    "makespan_s": row["makespan_s"],
                    "ratio_to_one": round(row["makespan_s"] / one, 3),
                    "queue_p90": row["queue_p90"],
                    "queue_mean": row["queue_mean"],
                    "queue_max": row["queue_max"],
                    "running_mean": row["running_mean"],
                    "failed": row["failed"],
                    "load": f"{row['load_before']} -> {row['load_after']}",
                }
            )
    return out


def report(summary: list[dict[str, Any]]) -> str:
    lines = [
        f"target queue {TARGET} (max_num_seqs {MAX_NUM_SEQS}); goals for four-shared: makespan "
        f"<= {MAKESPAN_GOAL}x one, queue p90 <= {TARGET}",
        "",
        "| run | leg | makespan s | x one | queue p90 | mean | max | batch mean | failed | load |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in summary:
        lines.append(
            f"| {r['run']} | {r['leg']} | {r['makespan_s']:.1f} | {r['ratio_to_one']:.2f} | "
            f"{r['queue_p90']} | {r['queue_mean']} | {r['queue_max']} | {r['running_mean']} | "
            f"{r['failed']} | {r['load']} |"
        )
    return "\n".join(lines)


@contextlib.contextmanager
def redis_at(url: str | None) -> Iterator[str]:
    if url:
        yield url
        return
    sys.path.insert(0, str(ROOT))
    from tests.redis_server import RedisServer

    with RedisServer() as server:
        say(f"redis-server at {server.url}")
        yield server.url


def leg_order(legs: Sequence[str], run: int) -> list[str]:
    """The legs' order in run ``run`` (from 1): each run starts one leg later."""
    shift = (run - 1) % len(legs) if legs else 0
    return [*legs[shift:], *legs[:shift]]


def kept(row: dict[str, Any]) -> dict[str, Any]:
    """A leg's summary as :meth:`Run.add` keeps it (no per-worker detail)."""
    keys = ("processes", "makespan_s", "ok", "failed", "queue_p90", "queue_mean", "queue_max",
            "running_mean", "own_cores", "server_cores", "others_cores")  # fmt: skip
    return {key: row.get(key) for key in keys}


async def run_all(
    url: str, redis_url: str, args: argparse.Namespace, record: Run | None = None
) -> list[dict[str, Any]]:
    say("warming up with one leg of 48 requests ...")
    await leg(url, "one", 48, redis_url, args.seed - 1, 0)
    rows = []
    for run in range(1, args.runs + 1):
        for name in leg_order(LEGS, run):
            say(f"run {run} {name}: {args.requests} requests ...")
            row = await leg(url, name, args.requests, redis_url, args.seed + 1000 * run, run)
            brief = {k: v for k, v in row.items() if k != "workers"}
            say("  " + json.dumps(brief))
            rows.append(row)
            if record is not None:
                record.add(leg=name, run=run, **kept(row))
            await asyncio.sleep(args.pause)
    return rows


def main(argv: list[str] | None = None) -> None:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.worker:
        work = static_worker if args.static else worker
        print(json.dumps(asyncio.run(work(args))), flush=True)
        return
    began = machine()
    if args.cost:
        n = args.n or 5000
        args.n = n
        with redis_at(args.redis) as redis_url:
            if args.callgrind:
                found = instructions(redis_url, 200, 1200)
            else:
                found = asyncio.run(cost(redis_url, args))
        payload = {"machine": began, "args": vars(args), **found}
        path = write_results("shared_instructions" if args.callgrind else "shared_cost", payload)
        print(json.dumps({k: v for k, v in found.items() if k != "us_per_request"}, indent=2))
        say(f"raw results: {path}")
        return
    record = Run.begin(
        "shared",
        params={**{k: v for k, v in vars(args).items() if k != "no_save"},
                "max_num_seqs": MAX_NUM_SEQS, "target_queue": TARGET,
                "static_split": STATIC_SPLIT, "static_splits": STATIC_SPLITS,
                "tokens_out": TOKENS_OUT},
        peers=["httpx", "redis"],
    )  # fmt: skip
    record.fact("legs", ABOUT)
    placement = default_placement()
    # vLLM first, on the server's CPUs; Redis and the four clients start after, on the client's.
    with (
        tiny_vllm(
            args.url, max_num_seqs=MAX_NUM_SEQS, max_model_len=2048, wait_s=args.wait_for_others,
            placement=placement,
        ) as url,
        redis_at(args.redis) as redis_url,
    ):
        record.fact("placement", placement_facts(placement, [server_group(url)]))
        with contextlib.nullcontext() if args.no_save else record.kept_if_aborted():
            rows = asyncio.run(run_all(url, redis_url, args, record))
    summary = summarize(rows)
    payload = {"machine": began, "ended": time.strftime("%Y-%m-%d %H:%M:%S"), "args": vars(args)}
    payload.update(target=TARGET, summary=summary, rows=rows)
    path = write_results("shared", payload)
    print(report(summary))
    say(f"raw results: {path}" + ("" if args.no_save else f"; kept: {record.save()}"))


ABOUT = {
    "one": "one process, `AsyncClient(url)`, `map()` over all requests",
    "four-shared": "four processes, `AsyncClient(url, shared=redis)`, a quarter each",
    "four-own": "the same four processes without `shared=`",
    "four-static": f"four processes, httpx behind `asyncio.Semaphore({STATIC_SPLIT})` each "
    "(max_num_seqs / 4), no dsclient",
    "four-static-2x": f"four processes, httpx behind `asyncio.Semaphore({2 * STATIC_SPLIT})` each "
    "(2 x max_num_seqs / 4: the best fixed share), no dsclient",
}

TABLE = (
    report_.Column("makespan s", "makespan_s", 1),
    report_.Column("server queue p90", "queue_p90", 1),
    report_.Column("queue max", "queue_max", 0),
    report_.Column("engine batch mean", "running_mean", 1),
    report_.Column("failed", "failed", 0),
)


def render(records: Sequence[dict[str, Any]]) -> str:
    """One line per leg: makespan and the server's queue, median (range) over runs."""
    record = report_.latest(records)
    assert record is not None
    about = record.get("facts", {}).get("legs", ABOUT)
    table = report_.leg_table(record["rows"], TABLE, about=about)
    return table + "\n\n" + report_.conditions(record, records)


def headline(records: Sequence[dict[str, Any]]) -> list[report_.Versus]:
    """four-shared over four-own and over four-static, per run: makespan and queue p90."""
    record = report_.latest(records)
    if record is None:
        return []
    rows = record["rows"]
    lines = []
    for peer in ("four-own", "four-static", "four-static-2x"):
        for column, key, label in (
            ("makespan", "makespan_s", ""),
            ("other", "queue_p90", "server queue p90"),
        ):
            found = report_.ratios(rows, key, peer, ours="four-shared")
            if found:
                lines.append(report_.Versus("shared (four-shared)", peer, column, found, label))
    return lines


if __name__ == "__main__":
    main()
