"""map()'s start order: ``order="shape"`` (prefix groups, longest first) vs ``order="input"``.

    flock /tmp/dsclient-vllm.lock python -m benchmarks batch-shape          # 3 workloads x 2 runs
    python -m benchmarks batch-shape --workloads prefix-heavy --runs 1       # some only
    python -m benchmarks batch-shape --url http://127.0.0.1:8000             # a server running

One tiny vLLM (the launcher's), with prefix caching on and a **small KV cache**
(``--num-gpu-blocks-override``, default 24 blocks of 128 tokens: 3072 tokens, the least that
``max_model_len`` 2048 allows with some room), so that the prefix-heavy batch's 20 prefixes
(~400 tokens, 3 blocks each) do not all fit beside the requests running. (64 blocks held them:
input order hit 82% of prompt tokens, the first kept invocation.) Three batches
(:func:`make_batch`), each sent by one ``client.map()`` with client defaults:

- ``prefix-heavy``: 20 system prompts of ~1500 characters x 30 questions each, shuffled, 8
  tokens out;
- ``mixed``: 90% short items (32 tokens out), 10% long (512 out), in random order;
- ``plain``: neither shape: unique short prompts, 64 tokens out each (no cost expected).

Legs, on the same server: ``shape`` (``order="shape"``, the default) and ``input``
(``order="input"``), alternating which goes first from run to run. Every prompt of a leg begins
with a salt of its own (workload, leg, run), so no leg finds another's prefixes in the cache.
Outputs are fixed-length (``ignore_eos``, temperature 0).

Measured per leg: the makespan (the map() call, from its start to its last result), failures,
and vLLM's prefix-cache hit rate over the leg: the increase of ``vllm:prefix_cache_hits_total``
over that of ``vllm:prefix_cache_queries_total`` (tokens), read before and after. Goals (issue
27): prefix-heavy hit rate >= 1.5x input order's and makespan <= 0.85x; mixed makespan <= 0.9x;
plain within 3%. One summary row per leg and run is kept in
``benchmarks/results/batch-shape/<UTC start>.json`` (:mod:`benchmarks._results`).

Not measured here (yet): two replicas, and vllm-router's ``cache_aware`` in front of them fed in
input order, which the issue also asks for.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import _report as report_
from benchmarks._common import gauge, say, tiny_vllm, words
from benchmarks._results import Run

MODEL = "tiny"
WORKLOADS = ("prefix-heavy", "mixed", "plain")
LEGS = ("shape", "input")
#: The issue's goals: (figure, shape / input must be at most (or at least) this).
GOALS: dict[str, list[tuple[str, str, float]]] = {
    "prefix-heavy": [("hit_rate", ">=", 1.5), ("makespan_s", "<=", 0.85)],
    "mixed": [("makespan_s", "<=", 0.9)],
    "plain": [("makespan_s", "<=", 1.03)],
}


def make_batch(workload: str, seed: int, salt: str, scale: float = 1.0) -> list[dict[str, Any]]:
    """The request dicts of one leg's batch (``scale`` shrinks the counts, for a quick look)."""
    rng = random.Random(seed)
    items: list[dict[str, Any]] = []
    if workload == "prefix-heavy":
        prefixes, questions = 20, max(2, round(30 * scale))
        systems = [f"[{salt}] System prompt {p}: " + words(rng, 250) for p in range(prefixes)]
        for s in systems:
            for q in range(questions):
                items.append({"prompt": f"{s}\nQuestion {q}: {words(rng, 8)}", "max_tokens": 8})
    elif workload == "mixed":
        n = max(10, round(200 * scale))
        for i in range(n):
            out = 512 if rng.random() < 0.1 else 32
            items.append({"prompt": f"[{salt}] Item {i}: {words(rng, 12)}", "max_tokens": out})
    elif workload == "plain":
        n = max(10, round(200 * scale))
        for i in range(n):
            items.append({"prompt": f"[{salt}] Item {i}: {words(rng, 12)}", "max_tokens": 64})
    else:
        raise ValueError(f"workload must be one of {WORKLOADS}, got {workload!r}")
    rng.shuffle(items)
    return items


def leg_order(run: int) -> list[str]:
    """``shape`` first on odd runs, ``input`` first on even ones."""
    return list(LEGS) if run % 2 else list(reversed(LEGS))


def hit_rate(before: tuple[float, float], after: tuple[float, float]) -> float | None:
    """Hits over queries (prompt tokens) between two ``(hits, queries)`` readings."""
    queries = after[1] - before[1]
    return round((after[0] - before[0]) / queries, 4) if queries > 0 else None


def ratios(rows: Sequence[dict[str, Any]], workload: str, key: str) -> list[float]:
    """Per run, shape's figure over input's."""
    out = []
    for run in sorted({r["run"] for r in rows if r.get("workload") == workload}):
        pair = {
            r["leg"]: r.get(key) for r in rows if r.get("workload") == workload and r["run"] == run
        }
        a, b = pair.get("shape"), pair.get("input")
        if isinstance(a, int | float) and isinstance(b, int | float) and b:
            out.append(round(a / b, 3))
    return out


def goal_lines(rows: Sequence[dict[str, Any]]) -> list[str]:
    """One line per goal: the ratios per run and whether every run met it."""
    lines = []
    for workload, goals in GOALS.items():
        for key, sense, bound in goals:
            found = ratios(rows, workload, key)
            if not found:
                continue
            met = all((x >= bound) if sense == ">=" else (x <= bound) for x in found)
            shown = ", ".join(f"{x:.2f}x" for x in found)
            name = "hit rate" if key == "hit_rate" else "makespan"
            lines.append(
                f"- {workload}, {name}: shape / input = {shown} (goal {sense} {bound}x): "
                + ("met" if met else "**not met**")
            )
    return lines


async def metrics(url: str) -> tuple[float, float]:
    import httpx

    async with httpx.AsyncClient(timeout=30.0) as http:
        text = (await http.get(url + "/metrics")).text
    return gauge(text, "vllm:prefix_cache_hits_total"), gauge(
        text, "vllm:prefix_cache_queries_total"
    )


async def run_leg(url: str, items: list[dict[str, Any]], order: str) -> dict[str, Any]:
    """One map() of ``items``; its makespan, failures and the server's hit rate over it."""
    from dsclient import AsyncClient

    before = await metrics(url)
    async with AsyncClient(url, model=MODEL) as client:
        await client.discover()
        t0 = time.perf_counter()
        results = await client.map(
            items, temperature=0.0, ignore_eos=True, progress=False, order=order
        )
        makespan = time.perf_counter() - t0
        limit = client.limit
    after = await metrics(url)
    tokens = sum(r.usage.completion_tokens for r in results.ok)
    return {
        "makespan_s": round(makespan, 3),
        "hit_rate": hit_rate(before, after),
        "failed": len(results.failures),
        "items": len(results),
        "completion_tokens": tokens,
        "limit_end": limit,
    }


async def run_all(args: argparse.Namespace, url: str, run: Run) -> None:
    for n in range(1, args.runs + 1):
        for workload in args.workloads:
            for leg in leg_order(n):
                salt = f"{workload}-{leg}-{n}-{args.seed}"
                items = make_batch(workload, args.seed + n, salt, args.scale)
                say(f"run {n}, {workload}, order={leg}: {len(items)} items ...")
                found = await run_leg(url, items, leg)
                row = run.add(leg=leg, run=n, workload=workload, **found)
                say(f"  {row}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks batch-shape",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument(
        "--workloads",
        default=",".join(WORKLOADS),
        help="comma-separated, from " + ", ".join(WORKLOADS),
    )
    parser.add_argument("--scale", type=float, default=1.0, help="shrink the batches (0.2: fast)")
    parser.add_argument("--seed", type=int, default=27)
    parser.add_argument("--blocks", type=int, default=24, help="KV blocks (128 tokens each)")
    parser.add_argument("--max-num-seqs", type=int, default=8)
    parser.add_argument("--url", help="a running vLLM instead of a launched one")
    parser.add_argument(
        "--wait",
        type=float,
        default=120.0,
        help="seconds to wait for other vLLMs to finish before starting anyway",
    )
    args = parser.parse_args(argv)
    args.workloads = [w for w in args.workloads.split(",") if w]
    for w in args.workloads:
        if w not in WORKLOADS:
            parser.error(f"unknown workload {w!r}; choose from {', '.join(WORKLOADS)}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    params = {k: v for k, v in vars(args).items() if k != "url"}
    params["url_given"] = bool(args.url)
    run = Run.begin("batch-shape", params=params)
    extra = ["--num-gpu-blocks-override", str(args.blocks), "--enable-prefix-caching"]
    with tiny_vllm(
        args.url,
        max_num_seqs=args.max_num_seqs,
        max_model_len=2048,
        wait_s=args.wait,
        extra_args=extra,
    ) as url:
        run.fact(
            "server",
            {
                "max_num_seqs": args.max_num_seqs,
                "kv_blocks": args.blocks,
                "block_tokens": 128,
                "prefix_caching": True,
            },
        )
        asyncio.run(run_all(args, url, run))
    path = run.save()
    say(f"kept {path}")
    print(render([{**run.payload(), "_file": path.name}]))


TABLE = (
    report_.Column("makespan s", "makespan_s"),
    report_.Column("prefix hit rate", "hit_rate", 3),
    report_.Column("failed", "failed", 0),
)


def render(records: Sequence[dict[str, Any]]) -> str:
    """Per workload, one line per leg (median (range) over the runs), then the goals."""
    record = report_.latest(records)
    assert record is not None
    rows = record["rows"]
    parts = []
    for workload in WORKLOADS:
        mine = report_.select(rows, workload=workload)
        if not mine:
            continue
        n = max((r.get("items") or 0) for r in mine)
        parts.append(f"**{workload}** ({n} items)\n\n" + report_.leg_table(mine, TABLE))
    goals = goal_lines(rows)
    if goals:
        parts.append("Against the issue's goals, per run:\n\n" + "\n".join(goals))
    parts.append(report_.conditions(record, records))
    return "\n\n".join(parts)


if __name__ == "__main__":
    main()
