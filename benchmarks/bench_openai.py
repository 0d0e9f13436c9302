"""The openai SDK over dsclient's governor (``client.openai()``) against what openai users do now.

    .venv/bin/python -m benchmarks openai                     # cost, then online x2 (~6 min)
    .venv/bin/python -m benchmarks openai --parts cost        # client CPU only (~1 min, no vLLM)
    .venv/bin/python -m benchmarks openai --url http://127.0.0.1:8000 --parts online

Two parts:

* **cost** (in-process mock server, no network, no model): client CPU per request, as
  ``benchmarks/bench_client_cost.py`` measures it (``time.process_time()`` over ``--n`` requests
  on 64 tasks, strategies interleaved over ``--rounds``, median), for ``generate()`` and
  ``client.openai()`` on a client with a cap of 64 (no task waits), and for plain
  ``openai.AsyncOpenAI`` both on its default ``httpx2`` client and on an ``httpx.AsyncClient``
  (what ``client.openai()`` hands it). dsclient's share of ``client.openai()`` is its cost less
  the latter's.
* **online** (the real tiny vLLM, launched or ``--url``): the governor benchmark's online
  workload (``benchmarks/bench_governor.py``: Poisson shorts at 8/s for 16 s, a burst of 40
  ~1000-token prompts with 256 tokens out at t = 1 s, ``ignore_eos``), interleaved ``--runs``
  times through ``openai`` (plain ``AsyncOpenAI``, unbounded), ``openai-sem`` (the same behind
  ``asyncio.Semaphore(floor(0.7 x max_num_seqs))`` = 5, the usual hand tuning),
  ``dsclient-openai`` (``client.openai()``) and ``dsclient`` (``client.generate()``). Short p99
  and makespan from submission; also this process's CPU per request over the run.

Raw results go to ``benchmarks/results/openai.json``; a markdown summary is printed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import math
import os
import random
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import machine, median, say, tiny_vllm, write_results
from benchmarks.bench_client_cost import URL, Mock, _drive, prompt
from benchmarks.bench_governor import (
    MAX_MODEL_LEN,
    MAX_NUM_SEQS,
    WARM_UP,
    Call,
    Outcome,
    Request,
    batch_workload,
    execute,
    online_workload,
    openai_call,
    openai_strategy,
    summarize,
    warm_up,
)

MAX_TOKENS = 16
SEMAPHORE = math.floor(0.7 * MAX_NUM_SEQS)
ONLINE = ("openai", "openai-sem", "dsclient-openai", "dsclient")


# -- cost -----------------------------------------------------------------------------------------
@contextlib.contextmanager
def _observed(client: Any, metrics: bool) -> Iterator[None]:
    """With ``metrics``, a Prometheus collector counts every call (the observer path)."""
    if not metrics:
        yield
        return
    import dsclient.metrics

    with dsclient.metrics.Collector(client):
        yield


async def cost_generate(n: int, tasks: int, metrics: bool = False) -> float:
    import httpx

    import dsclient

    mock = Mock(httpx)
    async with dsclient.AsyncClient(
        URL, transport=httpx.MockTransport(mock), max_num_seqs=92
    ) as client:

        async def one(i: int) -> str:
            return (await client.generate(prompt(i), max_tokens=MAX_TOKENS)).text

        await one(-1)
        with _observed(client, metrics):
            return await _drive(n, tasks, one)


async def cost_dsclient_openai(n: int, tasks: int, metrics: bool = False) -> float:
    import httpx

    import dsclient

    mock = Mock(httpx)
    async with dsclient.AsyncClient(
        URL, transport=httpx.MockTransport(mock), max_num_seqs=92
    ) as client:
        sdk = client.openai()

        async def one(i: int) -> str:
            c = await sdk.completions.create(model="tiny", prompt=prompt(i), max_tokens=MAX_TOKENS)
            return c.choices[0].text

        await one(-1)
        with _observed(client, metrics):
            return await _drive(n, tasks, one)


async def _cost_openai(n: int, tasks: int, legacy: bool) -> float:
    import openai

    if legacy:
        import httpx

        http: Any = httpx.AsyncClient(
            transport=httpx.MockTransport(Mock(httpx)), limits=httpx.Limits(max_connections=None)
        )
    else:
        import httpx2

        http = openai.DefaultAsyncHttpxClient(transport=httpx2.MockTransport(Mock(httpx2)))
    async with openai.AsyncOpenAI(
        api_key="x", base_url=URL + "/v1", http_client=http, max_retries=0
    ) as sdk:

        async def one(i: int) -> str:
            c = await sdk.completions.create(model="tiny", prompt=prompt(i), max_tokens=MAX_TOKENS)
            return c.choices[0].text

        await one(-1)
        return await _drive(n, tasks, one)


async def cost_openai(n: int, tasks: int) -> float:
    return await _cost_openai(n, tasks, legacy=False)


async def cost_openai_httpx(n: int, tasks: int) -> float:
    return await _cost_openai(n, tasks, legacy=True)


COST = {
    "generate": cost_generate,
    "dsclient-openai": cost_dsclient_openai,
    "openai": cost_openai,
    "openai-httpx": cost_openai_httpx,
    "generate-metrics": functools.partial(cost_generate, metrics=True),
    "dsclient-openai-metrics": functools.partial(cost_dsclient_openai, metrics=True),
}


def run_cost(args: argparse.Namespace) -> dict[str, Any]:
    """Each leg of ``--cost-legs`` once a round, in a shuffled order (a leg's place in the
    round must not bias it), after an uncounted warm-up round."""
    names = args.cost_legs.split(",")
    rng = random.Random(args.seed)
    per: dict[str, list[float]] = {name: [] for name in names}
    for round_ in range(args.rounds + 1):
        order = rng.sample(names, len(names))
        for name in order:
            cpu = asyncio.run(COST[name](args.n, 64))
            if round_ > 0:  # the first round warms imports and caches
                per[name].append(cpu / args.n * 1e6)
        if round_ > 0:
            say(f"cost round {round_}: " + ", ".join(f"{k} {v[-1]:.0f} us" for k, v in per.items()))
    us = {name: median(values) for name, values in per.items()}
    # The share is a difference of two large, noisy numbers: its ratio is also taken within
    # each round (the legs of one round share the machine's mood), and the median given.
    rounds = [shares({k: v[i] for k, v in per.items()}) for i in range(args.rounds)]
    within = (
        {
            f"{key}_median_of_rounds": round(median([r[key] for r in rounds]), 2)
            for key in rounds[0]
            if key.startswith("ratio")
        }
        if rounds
        else {}
    )
    return {"us_per_request": us, "rounds_us": per, **shares(us), **within}


def shares(cost: dict[str, float]) -> dict[str, float]:
    """dsclient's share of ``client.openai()`` (its cost less the same SDK on a plain
    ``httpx.AsyncClient``) against ``generate()``, without and with a metrics collector."""
    out = {}
    for suffix in ("", "-metrics"):
        if f"dsclient-openai{suffix}" in cost and "openai-httpx" in cost:
            share = cost[f"dsclient-openai{suffix}"] - cost["openai-httpx"]
            out[f"dsclient_share{suffix}"] = round(share, 1)
            out[f"ratio_share_to_generate{suffix}"] = round(share / cost[f"generate{suffix}"], 2)
    return out


# -- online ---------------------------------------------------------------------------------------
@contextlib.asynccontextmanager
async def online_strategy(name: str, url: str) -> AsyncIterator[Call]:
    import dsclient

    if name == "dsclient":
        async with dsclient.AsyncClient(url) as client:

            async def call(request: Request) -> Outcome | None:
                await client.generate(
                    request.prompt, max_tokens=request.max_tokens, ignore_eos=True
                )
                return None

            yield call
    elif name == "dsclient-openai":
        async with dsclient.AsyncClient(url) as client:
            yield openai_call(client.openai(), None)
    else:
        gate = asyncio.Semaphore(SEMAPHORE) if name == "openai-sem" else None
        async with openai_strategy(url, gate) as (call, _):
            yield call


async def run_online(url: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    import dsclient

    wargs = argparse.Namespace(
        online_seconds=16.0, burst=40, burst_at=1.0, seed=args.seed, batch=WARM_UP
    )
    async with dsclient.AsyncClient(url) as counter:

        async def count(text: str) -> int:
            return await counter.count_tokens(text)

        per_word = [1.5]
        plans = []
        for run in range(1, args.runs + 1):
            for name in args.strategies.split(","):
                seed = args.seed + 7919 * (len(plans) + 1)
                plans.append((run, name, await online_workload(seed, wargs, count, per_word, 8.0)))
        warm = await batch_workload(args.seed - 1, wargs, count, per_word)
    say("warming the server up ...")
    await warm_up(url, warm)
    rows = []
    for run, name, requests in plans:
        say(f"online run {run} {name}: {len(requests)} requests ...")
        async with online_strategy(name, url) as call:
            cpu = time.process_time()
            outcomes, makespan = await execute(call, requests)
            cpu = time.process_time() - cpu
        row = {"run": run, "strategy": name, **summarize(outcomes, makespan)}
        row["cpu_us_per_request"] = round(cpu / len(requests) * 1e6)
        row["loadavg_1min_after"] = round(os.getloadavg()[0], 2)
        say("  " + json.dumps(row))
        rows.append(row)
        await asyncio.sleep(2.0)
    return rows


def tables(payload: dict[str, Any]) -> str:
    out = []
    cost = payload.get("cost")
    if cost:
        us = cost["us_per_request"]
        out.append("| client CPU per request (mock server) | us | vs generate() |\n|---|---|---|")
        for name, value in us.items():
            out.append(f"| {name} | {value:.0f} | {value / us['generate']:.2f}x |")
        for suffix, what in (("", ""), ("-metrics", ", with a metrics collector")):
            if f"dsclient_share{suffix}" in cost:
                out.append(
                    f"\ndsclient's share of client.openai(){what}: "
                    f"{cost[f'dsclient_share{suffix}']:.0f} us, "
                    f"{cost[f'ratio_share_to_generate{suffix}']:.2f}x generate()'s (ratio of "
                    f"medians); median of the rounds' own ratios "
                    f"{cost[f'ratio_share_to_generate{suffix}_median_of_rounds']:.2f}x"
                )
        out.append("")
    rows = payload.get("online")
    if rows:
        out.append(
            "| run | strategy | makespan s | short p50 s | short p99 s | long p99 s | errors "
            "| CPU us / request |\n|---|---|---|---|---|---|---|---|"
        )
        for r in rows:
            out.append(
                f"| {r['run']} | {r['strategy']} | {r['makespan_s']:.1f} | {r['short_p50_s']:.2f} "
                f"| {r['short_p99_s']:.2f} | {r['long_p99_s']:.2f} | {r['errors']} "
                f"| {r['cpu_us_per_request']} |"
            )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks openai", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--parts", default="cost,online")
    parser.add_argument("--n", type=int, default=3000, help="requests per cost measurement")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--cost-legs", default=",".join(COST), help="cost legs to run")
    parser.add_argument("--runs", type=int, default=2, help="online runs of each strategy")
    parser.add_argument("--strategies", default=",".join(ONLINE))
    parser.add_argument("--seed", type=int, default=20240611)
    parser.add_argument("--url", help="use this running server instead of launching one")
    args = parser.parse_args(argv)
    parts = args.parts.split(",")
    started = time.monotonic()
    payload: dict[str, Any] = {}
    if "cost" in parts:
        payload["cost"] = run_cost(args)
    if "online" in parts:
        with tiny_vllm(args.url, max_num_seqs=MAX_NUM_SEQS, max_model_len=MAX_MODEL_LEN) as url:
            payload["online"] = asyncio.run(run_online(url, args))
    payload.update(machine=machine(), args=vars(args), wall_s=round(time.monotonic() - started, 1))
    path = write_results("openai", payload)
    print(tables(payload))
    print(f"\nwrote {path} in {payload['wall_s']:.0f} s")


if __name__ == "__main__":
    main()
