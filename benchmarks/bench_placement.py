"""Where vLLM's EngineCore runs, on a real (tiny, CPU) vLLM: the launcher's placement vs vLLM's.

    .venv/bin/python -m benchmarks placement             # ~4 min; writes results/placement.json
    .venv/bin/python -m benchmarks placement --url http://127.0.0.1:8011 --rounds 2

The launcher moves vLLM's EngineCore process onto the engine's CPUs once the server is healthy
(docs/launcher.md). This benchmark measures what that buys on ONE server: each round moves the
EngineCore's threads to the launcher's CPUs ("moved") or back to every CPU this process may use,
which is where vLLM leaves it ("vllm"), and sends the same load each time: ``--requests`` (128)
completions of 20 words in and 64 tokens out (``ignore_eos``), at each concurrency in
``--concurrency`` (5 and 8), through a bare ``httpx.AsyncClient`` behind a semaphore. Latency is
timed from when the semaphore lets a request go. The two placements alternate (A B, B A, ...),
and the summary reports the median over rounds of the within-round throughput ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import machine, percentile, write_results

MODEL = "tiny"
WORDS = ("the", "a", "model", "server", "token", "request", "batch", "queue", "limit", "client")


def say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def find_engine_core(pgid: int | None) -> int:
    """The EngineCore's pid: in the launched server's group, or the only one on the machine."""
    from dsclient.launcher._placement import ENGINE_CORE_COMM, engine_core_pids

    if pgid is not None:
        pids = engine_core_pids(pgid)
    else:
        pids = []
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    if (entry / "comm").read_text().strip() == ENGINE_CORE_COMM:
                        pids.append(int(entry.name))
                except OSError:
                    continue
    if len(pids) != 1:
        raise SystemExit(f"expected one vLLM EngineCore process, found {pids}")
    return pids[0]


async def load(url: str, requests: int, concurrency: int) -> dict[str, float]:
    import httpx

    gate = asyncio.Semaphore(concurrency)
    latencies: list[float] = []

    async def one(http: httpx.AsyncClient) -> None:
        prompt = " ".join(random.choice(WORDS) for _ in range(20))
        async with gate:
            begun = time.perf_counter()
            response = await http.post(
                url + "/v1/completions",
                json={"model": MODEL, "prompt": prompt, "max_tokens": 64, "ignore_eos": True},
            )
            response.raise_for_status()
            latencies.append(time.perf_counter() - begun)

    async with httpx.AsyncClient(timeout=300) as http:
        begun = time.perf_counter()
        await asyncio.gather(*(one(http) for _ in range(requests)))
        elapsed = time.perf_counter() - begun
    return {
        "req_per_s": round(requests / elapsed, 2),
        "p50_s": round(percentile(latencies, 50) or 0.0, 3),
        "p99_s": round(percentile(latencies, 99) or 0.0, 3),
    }


def bench(url: str, pgid: int | None, args: argparse.Namespace) -> dict[str, Any]:
    from dsclient.launcher._command import format_cpu_list
    from dsclient.launcher._placement import pin_process

    everything = sorted(os.sched_getaffinity(0))
    if len(everything) < 2:
        raise SystemExit("one CPU: there is nothing to separate")
    placements = {"moved": everything[:-1], "vllm": everything}
    core = find_engine_core(pgid)
    say(f"EngineCore pid {core}; moved = CPUs {format_cpu_list(placements['moved'])}, "
        f"vllm = CPUs {format_cpu_list(everything)}")  # fmt: skip
    asyncio.run(load(url, 16, 8))  # warm-up
    rows: list[dict[str, Any]] = []
    order = list(placements)
    for round_ in range(1, args.rounds + 1):
        for name in order if round_ % 2 else order[::-1]:
            pin_process(core, placements[name])
            time.sleep(1.0)
            for concurrency in args.concurrency:
                row = {"round": round_, "placement": name, "concurrency": concurrency}
                row.update(asyncio.run(load(url, args.requests, concurrency)))
                say("  " + str(row))
                rows.append(row)
    pin_process(core, placements["moved"])  # leave the server as the launcher set it
    summary = []
    for concurrency in args.concurrency:
        mine = [r for r in rows if r["concurrency"] == concurrency]
        ratios = []
        for round_ in range(1, args.rounds + 1):
            got = {r["placement"]: r["req_per_s"] for r in mine if r["round"] == round_}
            ratios.append(got["moved"] / got["vllm"])
        entry: dict[str, Any] = {
            "concurrency": concurrency,
            "ratio_median": round(statistics.median(ratios), 2),
            "ratios": [round(x, 2) for x in ratios],
        }
        for name in placements:
            theirs = [r for r in mine if r["placement"] == name]
            entry[name] = {
                key: statistics.median(r[key] for r in theirs)
                for key in ("req_per_s", "p50_s", "p99_s")
            }
        summary.append(entry)
    return {"rows": rows, "summary": summary}


def table(summary: list[dict[str, Any]]) -> str:
    lines = [
        "| in flight | moved req/s | vLLM's req/s | moved / vLLM's (median of rounds) "
        "| moved p50 / p99 s | vLLM's p50 / p99 s |",
        "|---|---|---|---|---|---|",
    ]
    for s in summary:
        moved, vllm = s["moved"], s["vllm"]
        ratios = ", ".join(f"{x:.2f}" for x in s["ratios"])
        lines.append(
            f"| {s['concurrency']} | {moved['req_per_s']:.1f} | {vllm['req_per_s']:.1f} | "
            f"**{s['ratio_median']:.2f}x** ({ratios}) | {moved['p50_s']:.2f} / "
            f"{moved['p99_s']:.2f} | {vllm['p50_s']:.2f} / {vllm['p99_s']:.2f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks placement", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--rounds", type=int, default=4, help="rounds (each runs both placements)")
    parser.add_argument("--requests", type=int, default=128, help="requests per measurement")
    parser.add_argument(
        "--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[5, 8]
    )
    parser.add_argument("--url", help="a running server (its EngineCore must be the only one)")
    args = parser.parse_args(argv)
    started = time.monotonic()
    if args.url:
        payload = bench(args.url.rstrip("/"), None, args)
    else:
        from dsclient.launcher import launch, make_tiny_model, resolve_server_python

        install = resolve_server_python()
        model = make_tiny_model(python=install.python)
        server = launch(model, python=install.python, max_num_seqs=8, max_model_len=2048,
                        served_model_name=MODEL, dtype="float32",
                        progress=lambda m: say(f"[vllm] {m}"))  # fmt: skip
        with server:
            payload = bench(server.url, server.pid, args)
    payload.update(machine=machine(), args=vars(args), wall_s=round(time.monotonic() - started, 1))
    path = write_results("placement", payload)
    print(table(payload["summary"]))
    print(f"\nwrote {path} in {payload['wall_s']:.0f} s")


if __name__ == "__main__":
    main()
