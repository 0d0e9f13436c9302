"""Soak: minutes of steady traffic at about 80% of measured capacity; nothing may creep.

    .venv/bin/python -m benchmarks soak                   # ~7 min; writes results/soak.json
    .venv/bin/python -m benchmarks soak --minutes 2       # a quicker look
    .venv/bin/python -m benchmarks soak --url URL         # a running server

Starts ONE vLLM through ``dsclient.launcher`` (the tiny random Llama, ``max_num_seqs`` 8, served
as ``"tiny"``) unless ``--url`` is given, then:

1. **capacity**: ``--probe`` (160) requests of the soak's shape (~20 words in, 32 tokens out,
   ``ignore_eos``) through ``client.map()`` at once; capacity = requests per second.
2. **soak**: requests arrive as a Poisson process at ``--load`` (0.8) x capacity for
   ``--minutes`` (5): 80% ``generate``, 10% ``chat``, 10% ``stream`` read to the end, all on one
   ``AsyncClient``. Every ``--window`` (10 s) the client process's RSS (``/proc/self/status``),
   its open sockets (``/proc/self/fd``), its asyncio tasks, the governor's in-flight and waiting
   counts and ``client.limit`` are sampled, with the window's completions, errors and latency.

Verdict: after the first minute (warm-up: caches, tokenizer, the limit finding its level), the
last window against the first may grow by at most ``--rss-slack`` MiB (8) of RSS, and not at all
in sockets or tasks beyond the concurrency of the moment; every call ended, none failed. The
figures go to ``benchmarks/results/soak.json`` and a markdown summary is printed.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import contextlib

from benchmarks._common import (
    client_facts,
    machine,
    percentile,
    say,
    tiny_vllm,
    words,
    write_results,
)

MAX_NUM_SEQS = 8
MAX_MODEL_LEN = 2048
MODEL = "tiny"
PROMPT_WORDS = 20
TOKENS_OUT = 32
WARM_UP_S = 60.0


def rss_mib() -> float:
    """This process's resident set now, in MiB (Linux)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def open_sockets() -> int:
    """Sockets this process holds open (client connections, the event loop's own pair)."""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
                count += 1
        except OSError:
            continue
    return count


@dataclass
class Window:
    """One sampling window of the soak."""

    t_s: float
    rss_mib: float
    sockets: int
    tasks: int
    in_flight: int
    waiting: int
    limit: int
    calls_open: int  # calls submitted and not yet ended (client queue + in flight)
    done: int = 0
    failed: int = 0
    p50_s: float | None = None
    p99_s: float | None = None
    gc_objects: int = 0


@dataclass
class Tally:
    latencies: list[float] = field(default_factory=list)
    failed: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    messages: list[str] = field(default_factory=list)  # the first few, whole
    open: int = 0
    done_total: int = 0
    failed_total: int = 0


async def call(client: Any, rng: random.Random, kind: str) -> None:
    prompt = words(rng, PROMPT_WORDS)
    if kind == "chat":
        await client.chat(
            [{"role": "user", "content": prompt}], max_tokens=TOKENS_OUT, ignore_eos=True
        )
    elif kind == "stream":
        async with client.stream(prompt, max_tokens=TOKENS_OUT, ignore_eos=True) as stream:
            async for _ in stream:
                pass
    else:
        await client.generate(prompt, max_tokens=TOKENS_OUT, ignore_eos=True)


async def measure_capacity(client: Any, n: int, seed: int) -> float:
    rng = random.Random(seed)
    prompts = [words(rng, PROMPT_WORDS) for _ in range(n)]
    begun = time.perf_counter()
    results = await client.map(prompts, max_tokens=TOKENS_OUT, ignore_eos=True, progress=False)
    elapsed = time.perf_counter() - begun
    if results.failures:
        raise SystemExit(f"capacity probe: {len(results.failures)} of {n} failed")
    return n / elapsed


async def soak(url: str, args: argparse.Namespace) -> dict[str, Any]:
    from dsclient import AsyncClient

    async with AsyncClient(url) as client:
        await measure_capacity(client, 40, args.seed - 1)  # warm the server and the client
        capacity = await measure_capacity(client, args.probe, args.seed)
        rate = args.load * capacity
        say(f"capacity {capacity:.1f} req/s; soaking at {rate:.1f} req/s for {args.minutes} min")
        tally = Tally()
        windows: list[Window] = []
        rng = random.Random(args.seed + 1)
        duration = args.minutes * 60.0

        async def one(kind: str) -> None:
            tally.open += 1
            begun = time.perf_counter()
            try:
                await call(client, rng, kind)
            except Exception as exc:  # every error is counted, none may happen
                tally.failed += 1
                name = type(exc).__name__
                tally.errors[name] = tally.errors.get(name, 0) + 1
                if len(tally.messages) < 10:
                    tally.messages.append(f"{kind}: {name}: {exc}"[:2000])
                    say(f"  call failed: {tally.messages[-1]}")
            else:
                tally.latencies.append(time.perf_counter() - begun)
            finally:
                tally.open -= 1

        def sample(t: float) -> None:
            gov = client.stats()
            window = Window(
                t_s=round(t, 1),
                rss_mib=round(rss_mib(), 1),
                sockets=open_sockets(),
                tasks=len(asyncio.all_tasks()),
                in_flight=gov.in_flight,
                waiting=gov.waiting,
                limit=gov.limit,
                calls_open=tally.open,
                done=len(tally.latencies),
                failed=tally.failed,
                p50_s=_round(percentile(tally.latencies, 50)),
                p99_s=_round(percentile(tally.latencies, 99)),
                gc_objects=len(gc.get_objects()),
            )
            windows.append(window)
            tally.done_total += len(tally.latencies)
            tally.failed_total += tally.failed
            tally.latencies.clear()
            tally.failed = 0
            say(
                f"  t={window.t_s:6.0f}s rss {window.rss_mib:6.1f} MiB  sockets {window.sockets:3d}"
                f"  tasks {window.tasks:3d}  in flight {window.in_flight:2d}  limit"
                f" {window.limit:2d}  open {window.calls_open:3d}  done {window.done:4d}"
                f"  failed {window.failed}  p99 {window.p99_s}"
            )

        async def sampler() -> None:
            n = 1
            while True:
                await asyncio.sleep(max(0.0, start + n * args.window - time.perf_counter()))
                sample(n * args.window)
                n += 1

        start = time.perf_counter()
        sampling = asyncio.create_task(sampler())
        pending: set[asyncio.Task[None]] = set()
        due = rng.expovariate(rate)
        while due < duration:
            delay = start + due - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            roll = rng.random()
            kind = "chat" if roll < 0.1 else "stream" if roll < 0.2 else "generate"
            task = asyncio.create_task(one(kind))
            pending.add(task)
            task.add_done_callback(pending.discard)
            due += rng.expovariate(rate)
        await asyncio.sleep(max(0.0, start + duration - time.perf_counter()))
        if pending:
            await asyncio.wait(pending)
        sampling.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await sampling
        sample(time.perf_counter() - start)  # drained: every call has ended
        facts = client_facts(client)

    steady = [w for w in windows if w.t_s >= WARM_UP_S]
    verdict = judge(steady, windows[-1], args.rss_slack, tally)
    return {
        "capacity_req_s": round(capacity, 2),
        "rate_req_s": round(rate, 2),
        "load": args.load,
        "done": tally.done_total,
        "failed": tally.failed_total,
        "errors": tally.errors,
        "error_messages": tally.messages,
        "windows": [asdict(w) for w in windows],
        "client": facts,
        "verdict": verdict,
    }


def judge(steady: list[Window], drained: Window, rss_slack: float, tally: Tally) -> dict[str, Any]:
    """Flat from the first steady window to the last, and nothing left behind once drained."""
    if len(steady) < 3:
        return {"ok": False, "why": "too few windows after the warm-up; soak longer"}
    first, last = steady[0], steady[-2]  # steady[-1] is the drained sample
    checks = {
        "rss_growth_mib": round(last.rss_mib - first.rss_mib, 1),
        "sockets_first_last": (first.sockets, last.sockets),
        "tasks_first_last": (first.tasks, last.tasks),
        "drained_in_flight": drained.in_flight,
        "drained_calls_open": drained.calls_open,
        "drained_tasks": drained.tasks,
        "failed": tally.failed_total,
    }
    # Tasks are the calls open plus a fixed few: compare them net of the calls. Sockets are the
    # calls in flight plus the pool's idle connections, which come and go with the concurrency
    # of the last seconds: compare the peaks of the first and last thirds of the soak instead.
    third = max(1, len(steady[:-1]) // 3)
    first_peak = max(w.sockets for w in steady[:third])
    last_peak = max(w.sockets for w in steady[:-1][-third:])
    checks["sockets_peak_first_last_third"] = (first_peak, last_peak)
    sockets_grew = last_peak - first_peak > 2
    tasks_grew = (last.tasks - last.calls_open) - (first.tasks - first.calls_open) > 2
    ok = (
        checks["rss_growth_mib"] <= rss_slack
        and not sockets_grew
        and not tasks_grew
        and drained.in_flight == 0
        and drained.calls_open == 0
        and tally.failed_total == 0
    )
    return {"ok": ok, **checks}


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


def table(payload: dict[str, Any]) -> str:
    v = payload["verdict"]
    rows = [
        "| capacity | rate | calls | failed | RSS growth (steady) | sockets first/last |"
        " tasks first/last | drained in flight | verdict |",
        "|---|---|---|---|---|---|---|---|---|",
        f"| {payload['capacity_req_s']} req/s | {payload['rate_req_s']} req/s"
        f" | {payload['done'] + payload['failed']} | {payload['failed']}"
        f" | {v.get('rss_growth_mib')} MiB | {v.get('sockets_peak_first_last_third')}"
        f" | {v.get('tasks_first_last')} | {v.get('drained_in_flight')}"
        f" | {'flat' if v['ok'] else 'NOT flat'} |",
    ]
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks soak", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--minutes", type=float, default=5.0, help="length of the soak")
    parser.add_argument("--load", type=float, default=0.8, help="share of measured capacity")
    parser.add_argument("--probe", type=int, default=160, help="requests to measure capacity")
    parser.add_argument("--window", type=float, default=10.0, help="seconds per sample")
    parser.add_argument("--rss-slack", type=float, default=8.0, help="MiB of RSS growth allowed")
    parser.add_argument("--seed", type=int, default=20261203)
    parser.add_argument("--url", help="use this running server instead of launching one")
    parser.add_argument("--name", default="soak", help="results file name (results/NAME.json)")
    args = parser.parse_args(argv)
    if not 0 < args.load <= 1.5:
        parser.error("--load must be in (0, 1.5]")
    if args.minutes * 60 < WARM_UP_S + 3 * args.window:
        parser.error(f"--minutes must leave at least 3 windows after {WARM_UP_S:.0f} s of warm-up")

    started = time.monotonic()
    with tiny_vllm(args.url, max_num_seqs=MAX_NUM_SEQS, max_model_len=MAX_MODEL_LEN) as url:
        payload = asyncio.run(soak(url, args))
    payload.update(machine=machine(), args=vars(args), wall_s=round(time.monotonic() - started, 1))
    path = write_results(args.name, payload)
    print(table(payload))
    print(f"\nwrote {path} in {payload['wall_s']:.0f} s")
    if not payload["verdict"]["ok"]:
        raise SystemExit(f"soak: not flat: {payload['verdict']}")


if __name__ == "__main__":
    main()
