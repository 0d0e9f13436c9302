"""Client CPU per request: bare httpx vs dsclient vs openai, in-process, no network, no model.

    .venv/bin/python -m benchmarks client-cost                 # 5 rounds x 5000 requests each
    .venv/bin/python -m benchmarks client-cost --n 2000 --rounds 3
    .venv/bin/python -m benchmarks client-cost --profile dsclient   # cProfile of one strategy

Every strategy answers from an in-process mock transport with a canned vLLM completion (and
``/v1/models`` for dsclient's discovery), so what is timed is the client's own work: building the
request, the transport plumbing, parsing the answer. All run ``--tasks`` worker tasks (64) pulling
from the same ``--n`` requests:

* ``httpx``: a bare ``httpx.AsyncClient`` POST plus ``json.loads`` of the body (the floor);
* ``dsclient``: ``dsclient.AsyncClient(url).generate(prompt, max_tokens=16)`` with defaults,
  discovery done before timing (no ``max_num_seqs`` given, so the cap is 5 and most tasks wait
  in the governor whenever a request yields);
* ``dsclient-cap64``: the same with ``max_num_seqs=92`` (cap 64), so no task ever waits: the
  per-request cost of the common path alone;
* ``openai``: ``openai.AsyncOpenAI(...).completions.create`` with its defaults; openai 3.x sits on
  the ``httpx2`` package, so the mock is ``httpx2.MockTransport`` handed over through
  ``http_client=openai.DefaultAsyncHttpxClient(transport=...)``.

CPU is ``time.process_time()`` around the N requests of one strategy, divided by N. Strategies are
interleaved within each round (after one uncounted warm-up round) so machine noise hits all
of them alike; the report gives the median
over rounds and its ratio to bare httpx. Raw numbers go to ``benchmarks/results/client_cost.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import gc
import pstats
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import (
    CANNED_COMPLETION,
    CANNED_MODELS,
    machine,
    median,
    write_results,
)

URL = "http://127.0.0.1:8000"
MAX_TOKENS = 16
JSON = {"content-type": "application/json"}


def prompt(i: int) -> str:
    return f"Request {i}: write one sentence about the sea"


class Mock:
    """The server's side: counts calls per path; ``module`` is ``httpx`` or ``httpx2``."""

    def __init__(self, module: Any) -> None:
        self.module = module
        self.calls: Counter[str] = Counter()

    def __call__(self, request: Any) -> Any:
        path = request.url.path
        self.calls[path] += 1
        if path == "/v1/completions":
            return self.module.Response(200, content=CANNED_COMPLETION, headers=JSON)
        if path == "/v1/models":
            return self.module.Response(200, content=CANNED_MODELS, headers=JSON)
        return self.module.Response(404, content=b'{"detail":"Not Found"}', headers=JSON)


async def _drive(n: int, tasks: int, one: Callable[[int], Awaitable[str]]) -> float:
    """Run ``one(i)`` for i in range(n) on ``tasks`` workers; CPU seconds spent."""
    source = iter(range(n))
    got = 0

    async def worker() -> None:
        nonlocal got
        for i in source:
            text = await one(i)
            got += bool(text)

    gc.collect()
    cpu = time.process_time()
    await asyncio.gather(*(worker() for _ in range(tasks)))
    cpu = time.process_time() - cpu
    assert got == n, (got, n)
    return cpu


async def strategy_httpx(n: int, tasks: int) -> dict[str, Any]:
    import json

    import httpx

    mock = Mock(httpx)
    async with httpx.AsyncClient(
        transport=httpx.MockTransport(mock), limits=httpx.Limits(max_connections=None)
    ) as http:

        async def one(i: int) -> str:
            body = {"model": "tiny", "prompt": prompt(i), "max_tokens": MAX_TOKENS}
            response = await http.post(URL + "/v1/completions", json=body)
            response.raise_for_status()
            text: str = json.loads(response.content)["choices"][0]["text"]
            return text

        await one(-1)
        mock.calls.clear()
        cpu = await _drive(n, tasks, one)
    return {"cpu_s": cpu, "calls": dict(mock.calls)}


async def _strategy_dsclient(n: int, tasks: int, max_num_seqs: int | None) -> dict[str, Any]:
    import httpx

    import dsclient

    mock = Mock(httpx)
    async with dsclient.AsyncClient(
        URL, transport=httpx.MockTransport(mock), max_num_seqs=max_num_seqs
    ) as client:  # discovery runs here, before timing

        async def one(i: int) -> str:
            return (await client.generate(prompt(i), max_tokens=MAX_TOKENS)).text

        await one(-1)
        mock.calls.clear()
        cpu = await _drive(n, tasks, one)
        stats = client.stats()
        waited = sum(lane.done for lane in stats.lanes.values())
    return {"cpu_s": cpu, "calls": dict(mock.calls), "cap": stats.limit, "released": waited}


async def strategy_dsclient(n: int, tasks: int) -> dict[str, Any]:
    return await _strategy_dsclient(n, tasks, None)


async def strategy_dsclient_cap64(n: int, tasks: int) -> dict[str, Any]:
    return await _strategy_dsclient(n, tasks, 92)  # floor(0.7 * 92) = 64


async def strategy_openai(n: int, tasks: int) -> dict[str, Any]:
    import httpx2
    import openai

    mock = Mock(httpx2)
    client = openai.AsyncOpenAI(
        api_key="x",
        base_url=URL + "/v1",
        http_client=openai.DefaultAsyncHttpxClient(transport=httpx2.MockTransport(mock)),
    )
    async with client:

        async def one(i: int) -> str:
            completion = await client.completions.create(
                model="tiny", prompt=prompt(i), max_tokens=MAX_TOKENS
            )
            return completion.choices[0].text

        await one(-1)
        mock.calls.clear()
        cpu = await _drive(n, tasks, one)
    return {"cpu_s": cpu, "calls": dict(mock.calls)}


STRATEGIES: dict[str, Callable[[int, int], Awaitable[dict[str, Any]]]] = {
    "httpx": strategy_httpx,
    "dsclient": strategy_dsclient,
    "dsclient-cap64": strategy_dsclient_cap64,
    "openai": strategy_openai,
}


def profile(name: str, n: int, tasks: int, top: int) -> None:
    asyncio.run(STRATEGIES[name](100, tasks))  # imports and first-use caches, not profiled
    profiler = cProfile.Profile()
    profiler.enable()
    result = asyncio.run(STRATEGIES[name](n, tasks))
    profiler.disable()
    print(f"{name}: {result['cpu_s'] / n * 1e6:.1f} us CPU/request (under cProfile)")
    stats = pstats.Stats(profiler)
    stats.sort_stats("cumulative").print_stats(top)
    stats.sort_stats("tottime").print_stats(top)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks client-cost", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--n", type=int, default=5000, help="requests per strategy and round")
    parser.add_argument("--tasks", type=int, default=64, help="concurrent worker tasks")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds")
    parser.add_argument("--only", default=",".join(STRATEGIES), help="comma-separated strategies")
    parser.add_argument("--profile", choices=sorted(STRATEGIES), help="cProfile one strategy")
    parser.add_argument("--top", type=int, default=35, help="rows of the profile")
    args = parser.parse_args(argv)
    if args.profile:
        profile(args.profile, args.n, args.tasks, args.top)
        return

    names = [name for name in args.only.split(",") if name]
    for name in names:
        if name not in STRATEGIES:
            parser.error(f"unknown strategy {name!r}; choose from {', '.join(STRATEGIES)}")
    print(f"client cost: {args.n} requests x {args.tasks} tasks, {args.rounds} rounds", flush=True)
    for name in names:  # warm-up, not counted: imports, first-use caches, allocator
        asyncio.run(STRATEGIES[name](max(1, args.n // 5), args.tasks))
    runs: list[dict[str, Any]] = []
    for round_no in range(1, args.rounds + 1):
        for name in names:
            result = asyncio.run(STRATEGIES[name](args.n, args.tasks))
            us = result["cpu_s"] / args.n * 1e6
            runs.append({"round": round_no, "strategy": name, "us_per_request": us, **result})
            extra = f"  cap {result['cap']}" if "cap" in result else ""
            print(
                f"  round {round_no}  {name:15} {us:7.1f} us CPU/request  "
                f"calls {result['calls']}{extra}",
                flush=True,
            )

    summary: dict[str, dict[str, float]] = {}
    for name in names:
        us = median([r["us_per_request"] for r in runs if r["strategy"] == name])
        summary[name] = {"median_us_per_request": round(us, 1)}
    if "httpx" in summary:
        floor = summary["httpx"]["median_us_per_request"]
        for row in summary.values():
            row["ratio_to_httpx"] = round(row["median_us_per_request"] / floor, 2)
    print("\n| strategy | CPU per request (median) | vs bare httpx |\n|---|---|---|")
    for name, row in summary.items():
        ratio = row.get("ratio_to_httpx")
        print(
            f"| {name} | {row['median_us_per_request']:.1f} us | "
            f"{f'{ratio:.2f}x' if ratio is not None else '-'} |"
        )
    path = write_results(
        "client_cost",
        {
            "machine": machine(),
            "n": args.n,
            "tasks": args.tasks,
            "rounds": args.rounds,
            "summary": summary,
            "runs": runs,
        },
    )
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
