"""The main job: launch a local vLLM with the tiny model and push a batch through dsclient.

    python examples/batch_demo.py                 # build the tiny model, launch, run 200 requests
    python examples/batch_demo.py --url http://127.0.0.1:8000 --requests 500   # existing server

Prints a short summary: requests, throughput, p50/p99 latency, errors, and what the governor did.
"""

from __future__ import annotations

import argparse
import contextlib
import random
import statistics
import sys
import time
from collections.abc import Iterator
from typing import Any

import anyio

import dsclient
from dsclient import launcher


def make_items(n: int, seed: int = 0) -> Iterator[dict[str, Any]]:
    """A 3 short : 1 long mix, as a batch job would send it."""
    rng = random.Random(seed)
    words = [
        "the",
        "a",
        "server",
        "batch",
        "token",
        "lane",
        "queue",
        "model",
        "request",
        "answer",
        "time",
        "fast",
        "slow",
    ]
    for i in range(n):
        long = i % 4 == 3
        length = rng.randint(500, 900) if long else rng.randint(5, 40)
        yield {
            "id": f"item-{i}",
            "prompt": " ".join(rng.choice(words) for _ in range(length)),
            "max_tokens": 128 if long else 32,
            "ignore_eos": True,  # the tiny model is random: make every request generate its tokens
        }


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered)) - 1))] if ordered else 0.0


async def run_batch(url_or_server: Any, n: int) -> int:
    async with dsclient.AsyncClient(url_or_server, timeout=300) as client:
        info = client.server
        assert info is not None
        print(f"server: {info.kind} {info.version or ''} at {info.url}, model {info.model}")
        print(
            f"max_num_seqs {info.max_num_seqs} ({info.sources.get('max_num_seqs')}), "
            f"context {info.max_model_len}; in flight starts at {client.limit} "
            f"(0.7 x max_num_seqs), then follows the server's /metrics"
        )
        start = time.perf_counter()
        results = await client.map(make_items(n), progress=None)
        elapsed = time.perf_counter() - start
        ok = [r for r in results if isinstance(r, dsclient.Result)]
        failed = [r for r in results if isinstance(r, dsclient.Failure)]
        print()
        print(f"requests     {len(results)} ({len(ok)} ok, {len(failed)} errors)")
        print(f"makespan     {elapsed:.1f} s")
        print(
            f"throughput   {len(ok) / elapsed:.1f} req/s, "
            f"{sum(r.usage.completion_tokens for r in ok) / elapsed:.0f} tokens/s"
        )
        for lane in ("short", "long"):
            lat = [r.latency_s for r in ok if r.lane == lane]
            if lat:
                print(
                    f"{lane:<5} lane   n={len(lat):<4} p50 {statistics.median(lat):.2f} s   "
                    f"p99 {pct(lat, 0.99):.2f} s"
                )
        control = client.stats().control
        if control is not None:
            print(
                f"limit        {control.start} -> {control.limit} ({control.mode}, "
                f"{control.changes} changes; last: {control.reason})"
            )
        for f in failed[:5]:
            print(f"error        item {f.index}: {f.error_type}: {f.error}")
        return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="use this server instead of launching one")
    parser.add_argument("--requests", type=int, default=200, help="batch size (default 200)")
    args = parser.parse_args(argv)
    if args.url:
        return anyio.run(run_batch, args.url, args.requests)
    print("building the tiny random model (cached after the first time) ...", flush=True)
    model_dir = launcher.make_tiny_model()
    print(f"model: {model_dir} (random weights: its text is nonsense, its batching is real)")
    server = launcher.launch(
        model_dir,
        max_num_seqs=8,
        max_model_len=2048,
        served_model_name="tiny",
        progress=lambda line: print(line, flush=True),
    )
    with server, contextlib.suppress(KeyboardInterrupt):
        print(f"vLLM is up at {server.url} (log: {server.log_path})")
        return anyio.run(run_batch, server, args.requests)
    return 130


if __name__ == "__main__":
    sys.exit(main())
