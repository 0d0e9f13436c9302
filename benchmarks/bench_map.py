"""map() overhead and memory, against an in-process mock server (no network, no model).

    .venv/bin/python benchmarks/bench_map.py                 # every leg; writes results/map.json
    .venv/bin/python benchmarks/bench_map.py --n 2000        # a quicker run
    .venv/bin/python benchmarks/bench_map.py --profile map   # cProfile of one leg

Legs, each in its own subprocess so that their peak RSS do not mix:

* ``map``: ``AsyncClient.map()`` over N prompts (``httpx.MockTransport``, a canned completion).
* ``httpx``: a bare ``httpx.AsyncClient`` doing the same POSTs plus ``json.loads``, with the
  same concurrency (as many worker tasks as map() runs calls at once).
* ``openai``: ``asyncio.gather`` over ``openai.AsyncOpenAI().completions.create`` behind a
  semaphore of that size; openai 3.x sits on ``httpx2``, so its mock is ``httpx2.MockTransport``
  passed through ``http_client=openai.DefaultAsyncHttpxClient(transport=...)``.
* ``imap_output``: ``imap()`` over a generator of N items with ``output=`` a JSONL file, at
  10k, 100k and 1M items, to show that peak RSS does not grow with the item count.

CPU is ``time.process_time()`` over the leg (the interpreter's startup and imports excluded);
RSS is the process's peak (``ru_maxrss``) after the leg, and its RSS after the imports.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "map.json"
URL = "http://127.0.0.1:8000"
MAX_NUM_SEQS = 64  # the client's cap is floor(0.7 * 64) = 44 calls in flight
CANNED = json.dumps(
    {
        "id": "cmpl-bench",
        "object": "text_completion",
        "created": 1,
        "model": "tiny",
        "choices": [
            {
                "index": 0,
                "text": " and the rest of the story",
                "finish_reason": "length",
                "logprobs": None,
            }
        ],
        "usage": {"prompt_tokens": 6, "completion_tokens": 8, "total_tokens": 14},
    }
).encode()
MODELS = json.dumps(
    {
        "object": "list",
        "data": [{"id": "tiny", "object": "model", "owned_by": "vllm", "max_model_len": 2048}],
    }
).encode()


def prompt(i: int) -> str:
    return f"Request {i}: once upon a time"


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def respond(module: Any, request: Any) -> Any:
    path = request.url.path
    if path == "/v1/completions":
        return module.Response(200, content=CANNED, headers={"content-type": "application/json"})
    if path == "/v1/models":
        return module.Response(200, content=MODELS, headers={"content-type": "application/json"})
    return module.Response(404, content=b'{"detail": "Not Found"}')


# -- legs ----------------------------------------------------------------------------------------
async def leg_map(n: int) -> dict[str, Any]:
    import httpx

    import dsclient

    transport = httpx.MockTransport(lambda r: respond(httpx, r))
    async with dsclient.AsyncClient(URL, transport=transport, max_num_seqs=MAX_NUM_SEQS) as client:
        await client.generate(prompt(-1), max_tokens=8)  # warm up: tokenizer, connections
        base = rss_mib()
        cpu, wall = time.process_time(), time.perf_counter()
        results = await client.map((prompt(i) for i in range(n)), max_tokens=8, progress=False)
        cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
        assert len(results) == n and not results.failures
        concurrency = client.limit
    return {"cpu_s": cpu, "wall_s": wall, "base_rss_mib": base, "concurrency": concurrency}


async def leg_httpx(n: int) -> dict[str, Any]:
    import anyio
    import httpx

    transport = httpx.MockTransport(lambda r: respond(httpx, r))
    concurrency = int(0.7 * MAX_NUM_SEQS)
    async with httpx.AsyncClient(
        transport=transport, limits=httpx.Limits(max_connections=None)
    ) as http:
        await http.post(URL + "/v1/completions", json={"prompt": prompt(-1)})
        base = rss_mib()
        source = iter(range(n))
        texts = 0

        async def worker() -> None:
            nonlocal texts
            for i in source:
                body = {"model": "tiny", "prompt": prompt(i), "max_tokens": 8}
                response = await http.post(URL + "/v1/completions", json=body)
                response.raise_for_status()
                data = json.loads(response.content)
                texts += len(data["choices"][0]["text"]) > 0

        cpu, wall = time.process_time(), time.perf_counter()
        async with anyio.create_task_group() as tg:
            for _ in range(concurrency):
                tg.start_soon(worker)
        cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    assert texts == n
    return {"cpu_s": cpu, "wall_s": wall, "base_rss_mib": base, "concurrency": concurrency}


async def leg_openai(n: int) -> dict[str, Any]:
    import httpx2
    import openai

    transport = httpx2.MockTransport(lambda r: respond(httpx2, r))
    concurrency = int(0.7 * MAX_NUM_SEQS)
    client = openai.AsyncOpenAI(
        api_key="none",
        base_url=URL + "/v1",
        max_retries=0,
        http_client=openai.DefaultAsyncHttpxClient(transport=transport),
    )
    async with client:
        await client.completions.create(model="tiny", prompt=prompt(-1), max_tokens=8)
        base = rss_mib()
        gate = asyncio.Semaphore(concurrency)

        async def one(i: int) -> str:
            async with gate:
                completion = await client.completions.create(
                    model="tiny", prompt=prompt(i), max_tokens=8
                )
                return completion.choices[0].text

        cpu, wall = time.process_time(), time.perf_counter()
        texts = await asyncio.gather(*(one(i) for i in range(n)))
        cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    assert len(texts) == n
    return {"cpu_s": cpu, "wall_s": wall, "base_rss_mib": base, "concurrency": concurrency}


async def leg_imap_output(n: int) -> dict[str, Any]:
    import httpx

    import dsclient

    transport = httpx.MockTransport(lambda r: respond(httpx, r))
    checkpoints = {n // 10, n // 2, n}
    rss_at: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out.jsonl"
        async with dsclient.AsyncClient(
            URL, transport=transport, max_num_seqs=MAX_NUM_SEQS
        ) as client:
            await client.generate(prompt(-1), max_tokens=8)
            base = rss_mib()
            cpu, wall = time.process_time(), time.perf_counter()
            count = 0
            async for _index, _result in client.imap(
                (prompt(i) for i in range(n)), max_tokens=8, output=out, progress=False
            ):
                count += 1
                if count in checkpoints:
                    rss_at[str(count)] = round(rss_mib(), 1)
            cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
        lines = sum(1 for _ in out.open("rb"))
    assert count == n == lines
    return {"cpu_s": cpu, "wall_s": wall, "base_rss_mib": base, "rss_at_mib": rss_at}


LEGS = {"map": leg_map, "httpx": leg_httpx, "openai": leg_openai, "imap_output": leg_imap_output}


def run_leg(name: str, n: int) -> dict[str, Any]:
    result = asyncio.run(LEGS[name](n))
    result.update(
        leg=name,
        n=n,
        cpu_us_per_req=round(result["cpu_s"] / n * 1e6, 1),
        req_per_s=round(n / result["wall_s"], 0),
        peak_rss_mib=round(peak_rss_mib(), 1),
    )
    result["base_rss_mib"] = round(result["base_rss_mib"], 1)
    return result


def spawn(name: str, n: int) -> dict[str, Any]:
    """One leg in a fresh interpreter; its result is the last line of its stdout."""
    done = subprocess.run(
        [sys.executable, __file__, "--leg", name, "--n", str(n)],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    )
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    print(
        f"  {name:12} n={n:>9,}  {result['cpu_us_per_req']:8.1f} us CPU/req  "
        f"{result['req_per_s']:>8,.0f} req/s  peak RSS {result['peak_rss_mib']:7.1f} MiB "
        f"(after imports {result['base_rss_mib']:.1f})",
        flush=True,
    )
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--leg", choices=sorted(LEGS), help="run one leg here (internal)")
    parser.add_argument("--n", type=int, default=10_000, help="requests per overhead leg")
    parser.add_argument("--repeat", type=int, default=3, help="runs of each overhead leg")
    parser.add_argument("--sizes", default="10000,100000,1000000", help="imap_output sizes")
    parser.add_argument("--profile", choices=sorted(LEGS), help="cProfile one leg, top 30")
    args = parser.parse_args()
    if args.leg:
        print(json.dumps(run_leg(args.leg, args.n)))
        return
    if args.profile:
        import cProfile
        import pstats

        profiler = cProfile.Profile()
        profiler.runcall(run_leg, args.profile, args.n)
        pstats.Stats(profiler).sort_stats("tottime").print_stats(30)
        return

    print(f"python {sys.version.split()[0]}, {os.cpu_count()} CPUs", flush=True)
    runs: list[dict[str, Any]] = []
    for _ in range(args.repeat):  # interleaved, so that machine noise hits every leg alike
        for name in ("map", "httpx", "openai"):
            runs.append(spawn(name, args.n))
    best = {
        name: min(r["cpu_us_per_req"] for r in runs if r["leg"] == name)
        for name in ("map", "httpx", "openai")
    }
    memory = [spawn("imap_output", int(size)) for size in args.sizes.split(",")]
    # Also the ratio within each round (the legs of a round ran back to back): its median is
    # steadier than a ratio of two minima when the machine's speed drifts between rounds.
    per_round = [
        round(m["cpu_us_per_req"] / h["cpu_us_per_req"], 2)
        for m, h in zip(
            [r for r in runs if r["leg"] == "map"],
            [r for r in runs if r["leg"] == "httpx"],
            strict=True,
        )
    ]
    summary = {
        "best_cpu_us_per_req": best,
        "map_over_httpx": round(best["map"] / best["httpx"], 2),
        "map_over_httpx_per_round": per_round,
        "map_over_httpx_median_of_rounds": statistics.median(per_round),
        "openai_over_httpx": round(best["openai"] / best["httpx"], 2),
        "imap_output_peak_rss_mib": {str(m["n"]): m["peak_rss_mib"] for m in memory},
    }
    print(json.dumps(summary, indent=2))
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(
        json.dumps(
            {
                "python": sys.version.split()[0],
                "cpus": os.cpu_count(),
                "when": time.strftime("%F %T"),
                "summary": summary,
                "runs": runs,
                "memory": memory,
            },
            indent=2,
        )
        + "\n"
    )
    print(f"wrote {RESULTS.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
