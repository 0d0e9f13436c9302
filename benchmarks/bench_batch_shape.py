"""map()'s start order: ``order="shape"`` (prefix groups, longest first) vs ``order="input"``.

    flock /tmp/dsclient-vllm.lock python -m benchmarks batch-shape          # 3 workloads x 2 runs
    python -m benchmarks batch-shape --workloads prefix-heavy --runs 1       # some only
    python -m benchmarks batch-shape --replicas 2 --legs shape,input,router-cache
    python -m benchmarks batch-shape --urls http://127.0.0.1:8000            # servers running
    python -m benchmarks batch-shape --server flat --runs 3                   # issue 46's server

One tiny vLLM (the launcher's), with prefix caching on and a **small KV cache**
(``--num-gpu-blocks-override``, default 24 blocks of 128 tokens: 3072 tokens, the least that
``max_model_len`` 2048 allows with some room), so that the prefix-heavy batch's 20 prefixes
(~400 tokens, 3 blocks each) do not all fit beside the requests running. (64 blocks held them:
input order hit 82% of prompt tokens, the first kept invocation.) ``--max-num-seqs`` (8 by
default) sets how many sequences it runs at once. Three batches (:func:`make_batch`), each sent
by one ``client.map()`` with client defaults:

- ``prefix-heavy``: 20 system prompts of ~1500 characters x 30 questions each, shuffled, 8
  tokens out;
- ``mixed``: 90% short items (32 tokens out), 10% long (512 out), in random order;
- ``plain``: neither shape: unique short prompts, 64 tokens out each (no cost expected).

Legs, on the same server(s): ``shape`` (``order="shape"``, the default) and ``input``
(``order="input"``), rotating which goes first from run to run. With ``--replicas 2`` the
launcher starts two replicas (one core each) and the client gets both URLs (its pool routes by
load and prefix); the ``router-cache`` leg then sends the batch in input order through
vllm-router (pinned as in ``bench_routing``) with ``--policy cache_aware`` at its guide's
settings, started in front of the same replicas for the leg (the client sees one server: the
router). Every prompt of a leg begins with a salt of its own (workload, leg, run), so no leg finds
another's prefixes in the cache. Outputs are fixed-length (``ignore_eos``, temperature 0).

How much any start order can gain depends on the server as much as on the batch: a mixed batch
gains from longest first only where the server runs its long items beside one another. A model
of vLLM's scheduler (:func:`model_steps`: first come, first served within the sequences and
the blocks, preempting the latest start) given each run's whole batch at once puts shape
order's engine steps at 0.89x-0.98x input order's on 8 sequences and 23 usable blocks (about 5
long items at their largest), and at 0.76x-0.84x on 16 sequences and 47 blocks
(``--max-num-seqs 16 --blocks 48``; seeds 28-33). The shape leg's row of one server keeps the
model's ratio for its batch (``model_ratio``) and the page shows it beside the goals. Fewer
steps are a shorter batch only where a full step takes about as long as a nearly empty one (a
GPU's decode); before the legs, one server's step time is measured by the sequences it runs
(:func:`step_cost`), and each leg's row gives its tokens and milliseconds a step.

Measured per leg: the makespan (the map() call, from its start to its last result), failures,
and vLLM's prefix-cache hit rate over the leg: the increase of ``vllm:prefix_cache_hits_total``
over that of ``vllm:prefix_cache_queries_total`` (tokens), summed over the replicas, read before
and after; vLLM's engine steps over the leg (``vllm:iteration_tokens_total_count``, summed): how
many batches the server ran for the leg, which a busy machine moves less than the makespan (a
schedule that keeps the server's batch fuller takes fewer steps; the page shows their ratios
beside the goals, :func:`step_lines`); the sequences vLLM preempted for lack of KV cache
(``vllm:num_preemptions_total``): whether an order that starts long items together thrashed
the cache (issue 46); for the shape leg, how many items it started at another
place than input order (:func:`moved`, computed without a server). Goals (issue 27), against
each other leg: prefix-heavy hit rate >= 1.5x and makespan <= 0.85x; mixed makespan <= 0.9x;
plain within 3%.

``--server flat`` runs issue 46's batch on a simulated server whose decode step is nearly flat
in its batch, as a GPU's is (:data:`FLAT_LEGS`, :func:`render_flat`): what a start order gains
where the steps are the makespan, against a plain client with a semaphore in input order and
sorted longest first, and an interactive call's latency beside the batch.

Against servers given by ``--urls`` the model is not run (their batch and cache are not the
flags'); a server without vLLM's ``/metrics`` gives no hit rate, steps or step time, only
makespans. One summary row per leg and run is kept in
``benchmarks/results/batch-shape/<UTC start>.json``
(:mod:`benchmarks._results`); the page shows the latest invocation per server setup.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import sys
import time
from collections import deque
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import _report as report_
from benchmarks._common import gauge, say, tiny_vllm, words
from benchmarks._results import Run

MODEL = "tiny"
WORKLOADS = ("prefix-heavy", "mixed", "plain")
#: ``router-cache`` needs several servers (``--replicas`` or ``--urls``) and vllm-router.
LEGS = ("shape", "input", "router-cache")
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


def moved(items: Sequence[dict[str, Any]]) -> int:
    """Items that ``order="shape"`` starts at another place than input order does.

    The plain batch's goal (within 3% of input order) rests on this being 0: a makespan then
    differs by the server's run-to-run noise only.
    """
    return sum(1 for place, index in enumerate(shape_order(items)) if place != index)


def shape_order(items: Sequence[dict[str, Any]]) -> list[int]:
    """The indexes of ``items`` in the order ``order="shape"`` starts them.

    Computed as map()'s batch runner does it (a window of ``WINDOW`` read ahead, one read per
    start; prefixes and predicted tokens from the prompt's bytes), without a server and without
    the runner's skipping of long items while its long ones wait for the cache.
    """
    from dsclient.batch._order import WINDOW, ItemShape, Lineup, predicted_tokens, prefix_of
    from dsclient.client._tokens import TokenCounter

    counter = TokenCounter()
    shapes = [
        ItemShape(
            blocks=prefix_of(item["prompt"]),
            cost=predicted_tokens(item["prompt"], item["max_tokens"], counter),
        )
        for item in items
    ]
    lineup: Lineup[int] = Lineup()
    order: list[int] = []
    for index, shape in enumerate(shapes):
        if len(lineup) == WINDOW:
            order.append(lineup.pop())
        lineup.add(index, shape)
    while len(lineup):
        order.append(lineup.pop())
    return order


def model_steps(
    sizes: Sequence[tuple[int, int]], seats: int, blocks: int, block_tokens: int = 128
) -> int:
    """The engine steps a model of vLLM's scheduler takes for ``sizes`` (prompt tokens, output
    tokens) queued at once in that order: the best a start order can do on a server, not what
    a client does.

    Each step every running sequence adds a token; sequences start first come, first served
    while fewer than ``seats`` run and their next token's blocks fit ``blocks``; a sequence that
    needs a block the cache does not have preempts the one started last, which goes back to the
    head of the queue keeping its tokens (vLLM's recompute, its prefill not counted). A
    sequence's whole prompt is one step (chunked prefill, beside the others' decodes). No
    prefix cache: the mixed batch shares no prefix.

    ``model_steps([(30, 512)] * 2 + [(30, 32)] * 2, seats=2, blocks=99)`` is ``512 + 32``: the
    two long ones first, the short ones after them.
    """
    queue: deque[list[int]] = deque([prompt, out, 0] for prompt, out in sizes)
    running: list[list[int]] = []
    steps = 0

    def need(seq: list[int]) -> int:  # blocks for its next token
        return -(-(seq[0] + seq[2] + 1) // block_tokens)

    while queue or running:
        while running and sum(need(seq) for seq in running) > blocks:
            queue.appendleft(running.pop())
        used = sum(need(seq) for seq in running)
        while queue and len(running) < seats and used + need(queue[0]) <= blocks:
            used += need(queue[0])
            running.append(queue.popleft())
        if not running:
            raise ValueError(f"a sequence of {need(queue[0])} blocks does not fit {blocks}")
        steps += 1
        for seq in running:
            seq[2] += 1
        running = [seq for seq in running if seq[2] < seq[1]]
    return steps


def model_ratio(items: Sequence[dict[str, Any]], seats: int, blocks: int) -> float:
    """:func:`model_steps` of ``items`` in shape order over input order: what the start order
    alone gains on a server of ``seats`` and ``blocks`` (the usable blocks: vLLM keeps one), by
    the model. Prompt tokens are predicted from bytes, as the order predicts them."""
    from dsclient.batch._order import predicted_tokens
    from dsclient.client._tokens import TokenCounter

    counter = TokenCounter()
    sizes = [
        (predicted_tokens(item["prompt"], 0, counter), int(item["max_tokens"])) for item in items
    ]
    shaped = [sizes[i] for i in shape_order(items)]
    return round(model_steps(shaped, seats, blocks) / model_steps(sizes, seats, blocks), 3)


def leg_order(legs: Sequence[str], run: int) -> list[str]:
    """``legs`` rotated by one per run: run 1 as given, run 2 from the second, ..."""
    k = (run - 1) % len(legs)
    return [*legs[k:], *legs[:k]]


def hit_rate(before: Sequence[float], after: Sequence[float]) -> float | None:
    """Hits over queries (prompt tokens) between two ``(hits, queries, ...)`` readings."""
    queries = after[1] - before[1]
    return round((after[0] - before[0]) / queries, 4) if queries > 0 else None


def ratios(
    rows: Sequence[dict[str, Any]], workload: str, key: str, peer: str = "input"
) -> list[float]:
    """Per run, shape's figure over ``peer``'s."""
    out = []
    for run in sorted({r["run"] for r in rows if r.get("workload") == workload}):
        pair = {
            r["leg"]: r.get(key) for r in rows if r.get("workload") == workload and r["run"] == run
        }
        a, b = pair.get("shape"), pair.get(peer)
        if isinstance(a, int | float) and isinstance(b, int | float) and b:
            out.append(round(a / b, 3))
    return out


def goal_lines(rows: Sequence[dict[str, Any]]) -> list[str]:
    """One line per goal and peer: the ratios per run and whether every run met it."""
    lines = []
    peers = [leg for leg in LEGS if leg != "shape" and any(r["leg"] == leg for r in rows)]
    for workload, goals in GOALS.items():
        for key, sense, bound in goals:
            for peer in peers:
                found = ratios(rows, workload, key, peer)
                if not found:
                    continue
                met = all((x >= bound) if sense == ">=" else (x <= bound) for x in found)
                shown = ", ".join(f"{x:.2f}x" for x in found)
                name = "hit rate" if key == "hit_rate" else "makespan"
                lines.append(
                    f"- {workload}, {name}: shape / {peer} = {shown} (goal {sense} {bound}x): "
                    + ("met" if met else "**not met**")
                )
                if key == "makespan_s" and len(found) >= 4:
                    # The runs are paired (the legs take turns), so the ratio of the sums is
                    # the estimate that a run's noise moves least.
                    total = summed(rows, workload, key, peer)
                    held = (total >= bound) if sense == ">=" else (total <= bound)
                    lines.append(
                        f"  - over the {len(found)} runs together (sum / sum): {total:.3f}x: "
                        + ("met" if held else "**not met**")
                    )
    return lines


def step_lines(rows: Sequence[dict[str, Any]]) -> list[str]:
    """Per workload and peer, shape's engine steps over the peer's, per run and summed: not a
    goal, the makespan's companion that the machine's load moves less (rows before the steps
    were counted have none, and give no line)."""
    lines = []
    peers = [leg for leg in LEGS if leg != "shape" and any(r["leg"] == leg for r in rows)]
    for workload in WORKLOADS:
        for peer in peers:
            found = ratios(rows, workload, "engine_steps", peer)
            if not found:
                continue
            shown = ", ".join(f"{x:.2f}x" for x in found)
            line = f"- {workload}, engine steps: shape / {peer} = {shown}"
            if len(found) >= 4:
                line += f" (sum / sum: {summed(rows, workload, 'engine_steps', peer):.3f}x)"
            lines.append(line)
    return lines


def model_lines(rows: Sequence[dict[str, Any]]) -> list[str]:
    """Per workload, the model's shape / input step ratio of each run's batch (rows of one
    server carry it, :func:`model_ratio`)."""
    lines = []
    for workload in WORKLOADS:
        found = [
            r["model_ratio"]
            for r in sorted(rows, key=lambda r: r["run"])
            if r.get("workload") == workload and r["leg"] == "shape" and "model_ratio" in r
        ]
        if found:
            lines.append(f"- {workload}: " + ", ".join(f"{x:.2f}x" for x in found))
    return lines


def summed(rows: Sequence[dict[str, Any]], workload: str, key: str, peer: str) -> float:
    """Shape's figure summed over the runs that have both legs, over ``peer``'s."""
    mine = theirs = 0.0
    for run in {r["run"] for r in rows if r.get("workload") == workload}:
        pair = {
            r["leg"]: r.get(key) for r in rows if r.get("workload") == workload and r["run"] == run
        }
        a, b = pair.get("shape"), pair.get(peer)
        if isinstance(a, int | float) and isinstance(b, int | float) and b:
            mine, theirs = mine + a, theirs + b
    return round(mine / theirs, 3) if theirs else float("nan")


async def metrics(urls: Sequence[str]) -> tuple[float, float, float, float]:
    """``(hits, queries, steps, preemptions)``: vLLM's prefix cache (tokens), engine steps and
    preempted sequences, summed over ``urls``."""
    import httpx

    hits = queries = steps = preempted = 0.0
    async with httpx.AsyncClient(timeout=30.0) as http:
        for url in urls:
            text = (await http.get(url + "/metrics")).text
            hits += gauge(text, "vllm:prefix_cache_hits_total")
            queries += gauge(text, "vllm:prefix_cache_queries_total")
            steps += gauge(text, "vllm:iteration_tokens_total_count")
            preempted += gauge(text, "vllm:num_preemptions_total")
    return hits, queries, steps, preempted


#: How many sequences :func:`step_cost` runs at once, in turn.
STEP_COST_BATCHES = (1, 2, 4, 8, 16)


async def step_cost(url: str, seqs: int, tokens: int = 256) -> dict[str, float]:
    """Milliseconds an engine step of the server at ``url`` takes with 1, 2, 4 ... ``seqs``
    sequences running (each ``tokens`` out, sent together, the server otherwise idle): the
    makespan over the steps (:func:`metrics`). Whether fewer, fuller steps (longest first)
    make a shorter batch depends on it: on a GPU's decode a step takes about as long full as
    nearly empty; on this CPU it does not."""
    import httpx

    found: dict[str, float] = {}
    async with httpx.AsyncClient(timeout=300.0) as http:
        for n in [b for b in STEP_COST_BATCHES if b <= seqs]:
            before = (await metrics([url]))[2]
            t0 = time.perf_counter()
            body = {"model": MODEL, "max_tokens": tokens, "ignore_eos": True, "temperature": 0}
            calls = [
                http.post(url + "/v1/completions", json={**body, "prompt": f"step cost {n} {i}"})
                for i in range(n)
            ]
            for answer in await asyncio.gather(*calls):
                answer.raise_for_status()
            took = time.perf_counter() - t0
            steps = (await metrics([url]))[2] - before
            if not steps:
                return {}  # a server that does not count its steps (no vLLM /metrics)
            found[str(n)] = round(1000 * took / steps, 2)
    return found


async def run_leg(
    urls: Sequence[str], items: list[dict[str, Any]], leg: str, router: Path | None = None
) -> dict[str, Any]:
    """One map() of ``items``; its makespan, failures, and the servers' hit rate and engine
    steps over it."""
    before = await metrics(urls)
    if leg == "router-cache":
        from benchmarks.bench_routing import running_router

        assert router is not None
        async with running_router(router, urls, "cache_aware") as url:
            found = await send(url, items, "input")
    else:
        found = await send(list(urls) if len(urls) > 1 else urls[0], items, leg)
    after = await metrics(urls)
    steps = after[2] - before[2]
    # A long item preempted for lack of KV cache recomputes its prompt and what it had answered:
    # the count says whether an order that starts long items together thrashed the cache.
    return {
        **found,
        "hit_rate": hit_rate(before, after),
        "engine_steps": steps or None,
        "preemptions": after[3] - before[3] if steps else None,
    }


async def send(url: str | list[str], items: list[dict[str, Any]], order: str) -> dict[str, Any]:
    """``client.map(items, order=order)`` with client defaults; what came back."""
    from dsclient import AsyncClient

    async with AsyncClient(url, model=MODEL) as client:
        await client.discover()
        t0 = time.perf_counter()
        results = await client.map(
            items, temperature=0.0, ignore_eos=True, progress=False, order=order
        )
        makespan = time.perf_counter() - t0
        limit = client.limit
    tokens = sum(r.usage.completion_tokens for r in results.ok)
    return {
        "makespan_s": round(makespan, 3),
        "failed": len(results.failures),
        "items": len(results),
        "completion_tokens": tokens,
        "limit_end": limit,
    }


async def run_all(
    args: argparse.Namespace, urls: Sequence[str], run: Run, router: Path | None
) -> None:
    for n in range(1, args.runs + 1):
        for workload in args.workloads:
            for leg in leg_order(args.legs, n):
                salt = f"{workload}-{leg}-{n}-{args.seed}"
                items = make_batch(workload, args.seed + n, salt, args.scale)
                say(f"run {n}, {workload}, {leg}: {len(items)} items ...")
                found = await run_leg(urls, items, leg, router)
                if leg == "shape":
                    found["moved"] = moved(items)
                    if workload != "prefix-heavy" and len(urls) == 1 and not args.urls:
                        usable = args.blocks - 1  # vLLM keeps one block
                        found["model_ratio"] = model_ratio(items, args.max_num_seqs, usable)
                row = run.add(leg=leg, run=n, workload=workload, servers=len(urls), **found)
                say(f"  {row}")


@contextlib.contextmanager
def servers(args: argparse.Namespace) -> Iterator[list[str]]:
    """The servers of the run: ``--urls`` as given, else one or ``--replicas`` launched."""
    extra = ["--num-gpu-blocks-override", str(args.blocks), "--enable-prefix-caching"]
    if args.urls or args.replicas == 1:
        url = args.urls.split(",")[0] if args.urls else None
        if args.urls and "," in args.urls:
            yield [u.rstrip("/") for u in args.urls.split(",")]
            return
        with tiny_vllm(
            url, max_num_seqs=args.max_num_seqs, max_model_len=2048, wait_s=args.wait,
            extra_args=extra,
        ) as one:  # fmt: skip
            yield [one]
        return
    from dsclient.launcher import launch, make_tiny_model, resolve_server_python

    install = resolve_server_python()
    group = launch(
        make_tiny_model(python=install.python), python=install.python,
        max_num_seqs=args.max_num_seqs, max_model_len=2048, served_model_name=MODEL,
        dtype="float32", replicas=args.replicas, extra_args=extra,
        progress=lambda m: say(f"[vllm] {m}"),
    )  # fmt: skip
    with group:
        yield list(group.urls)


# -- the flat-step server (issue 46) ----------------------------------------------------------
#: ``--server flat``: a simulated continuous-batching server process (``tests/seat_server.py``:
#: real sockets, real time) whose decode step is nearly flat in its batch, as a GPU's is:
#: ``FLAT_STEP_S[0] + FLAT_STEP_S[1] x running`` seconds, :data:`FLAT_SEATS` sequences, a
#: first-come queue, no KV limit and no ``/metrics``; the client is told its batch. On it the
#: schedule is the makespan (a step's time hardly depends on how full it is), which this CPU's
#: vLLM cannot show.
FLAT_SEATS = 16
FLAT_STEP_S = (0.010, 0.0002)
#: Legs on the flat server: map() in both orders (client defaults, told ``max_num_seqs``), the
#: same beside an interactive call every :data:`CALL_EVERY_S`, map() with its limit fixed at
#: the batch plus half a batch (24: what the governor alone costs, apart from where the limit
#: controller starts and how it grows), and a plain client (httpx and a semaphore) in input
#: order and sorted longest first, at the server's batch and at 1.5x it.
FLAT_LEGS = (
    "shape",
    "input",
    "shape-limit-24",
    "shape+calls",
    "input+calls",
    "semaphore-input",
    "semaphore-longest-16",
    "semaphore-longest-24",
)
CALL_EVERY_S = 0.25
#: The issue's goals on the flat server: (leg, peers (the best of them), at most this).
FLAT_GOALS: list[tuple[str, tuple[str, ...], float]] = [
    ("shape", ("input",), 0.9),
    ("shape", ("semaphore-longest-16", "semaphore-longest-24"), 1.02),
    ("input", ("semaphore-input",), 1.02),
]


def make_flat_batch(seed: int, salt: str) -> list[dict[str, Any]]:
    """Issue 46's batch: 400 items, 27 asking 300 tokens and 373 asking 8, in random order."""
    rng = random.Random(seed)
    items = [
        {"prompt": f"[{salt}] Item {i}: {words(rng, 12)}", "max_tokens": 300 if i < 27 else 8}
        for i in range(400)
    ]
    rng.shuffle(items)
    return items


async def send_plain(url: str, items: list[dict[str, Any]], n: int, longest: bool) -> float:
    """The plain client's makespan: every item at once behind ``asyncio.Semaphore(n)``, in
    input order or sorted longest first (by ``max_tokens``)."""
    import httpx

    if longest:
        items = sorted(items, key=lambda item: -int(item["max_tokens"]))
    gate = asyncio.Semaphore(n)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=300.0, limits=limits) as http:

        async def one(item: dict[str, Any]) -> None:
            async with gate:
                body = {"model": FLAT_MODEL, **item}
                answer = await http.post(url + "/v1/completions", json=body)
                answer.raise_for_status()

        t0 = time.perf_counter()
        await asyncio.gather(*(one(item) for item in items))
        return round(time.perf_counter() - t0, 3)


async def send_with_calls(
    url: str,
    items: list[dict[str, Any]],
    order: str,
    seats: int,
    calls: bool,
    limit: int | None = None,
) -> dict[str, Any]:
    """``client.map(items, order=order)`` on a client told the server's batch (``limit``: a
    fixed limit; ``None``: the client's own); with ``calls``, one ``generate()`` of 8 tokens
    every :data:`CALL_EVERY_S` beside it, from the same client (someone waits on those: their
    latency, from the call to its answer)."""
    from dsclient import AsyncClient

    latencies: list[float] = []
    async with AsyncClient(url, model=FLAT_MODEL, max_num_seqs=seats, limit=limit) as client:
        await client.discover()

        async def call(i: int) -> None:
            t = time.perf_counter()
            await client.generate(f"Interactive {i}: a short question.", max_tokens=8)
            latencies.append(time.perf_counter() - t)

        async def caller(done: asyncio.Event) -> None:
            async with asyncio.TaskGroup() as tg:
                i = 0
                while not done.is_set():
                    tg.create_task(call(i))
                    i += 1
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(done.wait(), CALL_EVERY_S)

        done = asyncio.Event()
        task = asyncio.create_task(caller(done)) if calls else None
        t0 = time.perf_counter()
        results = await client.map(items, progress=False, order=order)
        makespan = time.perf_counter() - t0
        done.set()
        if task is not None:
            await task
        end = client.limit
    found: dict[str, Any] = {
        "makespan_s": round(makespan, 3),
        "failed": len(results.failures),
        "items": len(results),
        "limit_end": end,
    }
    if latencies:
        ordered = sorted(latencies)
        found["calls"] = len(ordered)
        found["call_p50_s"] = round(ordered[len(ordered) // 2], 3)
        found["call_p99_s"] = round(ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))], 3)
    return found


async def flat_leg(url: str, items: list[dict[str, Any]], leg: str) -> dict[str, Any]:
    """One leg of the flat server's runs (:data:`FLAT_LEGS`)."""
    if leg.startswith("semaphore-"):
        n = int(leg.rsplit("-", 1)[1]) if leg.startswith("semaphore-longest") else FLAT_SEATS
        took = await send_plain(url, items, n, leg.startswith("semaphore-longest"))
        return {"makespan_s": took, "items": len(items)}
    order, _, calls = leg.partition("+")
    order, _, limit = order.partition("-limit-")
    return await send_with_calls(
        url, items, order, FLAT_SEATS, bool(calls), int(limit) if limit else None
    )


#: The seat server's model name.
FLAT_MODEL = "sim"


@contextlib.contextmanager
def flat_server(url: str | None) -> Iterator[str]:
    """The flat server at ``url``, else one started here for the run (it states no context:
    what is long, the client judges beside the calls it sends)."""
    if url:
        yield url.rstrip("/")
        return
    from tests.seat_server import SeatServer, Shape

    a, b = FLAT_STEP_S
    shape = Shape(seats=FLAT_SEATS, step_ms=1000 * a, step_per_seq_ms=1000 * b, context=False)
    # Not pinned: on this shared 2-core machine other tenants' vLLM engines bind themselves to
    # a core, and a server (or client) pinned to that core ran a 10 s batch in 29-53 s.
    with SeatServer(shape) as server:
        yield server.url


async def run_flat(args: argparse.Namespace, url: str, run: Run) -> None:
    for n in range(1, args.runs + 1):
        for leg in leg_order(list(FLAT_LEGS), n):
            items = make_flat_batch(args.seed + n, f"flat-{leg}-{n}-{args.seed}")
            say(f"run {n}, flat, {leg}: {len(items)} items ...")
            row = run.add(leg=leg, run=n, workload="flat", **await flat_leg(url, items, leg))
            say(f"  {row}")


def flat_ratios(rows: Sequence[dict[str, Any]], leg: str, peers: Sequence[str]) -> list[float]:
    """Per run, ``leg``'s makespan over the best (least) of ``peers``'."""
    out = []
    for run in sorted({r["run"] for r in rows}):
        times = {r["leg"]: r.get("makespan_s") for r in rows if r["run"] == run}
        mine = times.get(leg)
        theirs = [t for p in peers if isinstance(t := times.get(p), int | float)]
        if isinstance(mine, int | float) and theirs:
            out.append(round(mine / min(theirs), 3))
    return out


def flat_goal_lines(rows: Sequence[dict[str, Any]]) -> list[str]:
    """Issue 46's goals on the flat server, per run, and whether every run met each."""
    lines = []
    for leg, peers, bound in FLAT_GOALS:
        found = flat_ratios(rows, leg, peers)
        if not found:
            continue
        shown = ", ".join(f"{x:.2f}x" for x in found)
        peer = peers[0] if len(peers) == 1 else "the best of " + " and ".join(peers)
        met = all(x <= bound for x in found)
        lines.append(
            f"- {leg} / {peer} = {shown} (goal <= {bound}x): " + ("met" if met else "**not met**")
        )
    return lines


FLAT_TABLE = (
    report_.Column("makespan s", "makespan_s"),
    report_.Column("interactive p50 s", "call_p50_s", 3),
    report_.Column("interactive p99 s", "call_p99_s", 3),
    report_.Column("failed", "failed", 0),
)


def render_flat(record: dict[str, Any]) -> str:
    """The flat server's block: one line per leg, the goals, the conditions."""
    rows = report_.select(record["rows"], workload="flat")
    step = record.get("facts", {}).get("server", {})
    parts = [
        f"*A simulated server whose step is flat in its batch ({step.get('step_ms', '?')} ms "
        f"+ {step.get('step_ms_per_sequence', '?')} ms a sequence, {step.get('seats', '?')} "
        "sequences, no KV limit, no `/metrics`; the client told its batch):*",
        "**flat** (400 items: 27 asking 300 tokens, 373 asking 8, in random order)\n\n"
        + report_.leg_table(rows, FLAT_TABLE),
    ]
    goals = flat_goal_lines(rows)
    if goals:
        parts.append("Against the issue's goals, per run:\n\n" + "\n".join(goals))
    return "\n\n".join(parts)


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
    parser.add_argument("--legs", default="shape,input", help="from " + ", ".join(LEGS))
    parser.add_argument("--replicas", type=int, default=1, help="vLLM replicas to launch")
    parser.add_argument("--urls", help="running vLLMs (comma-separated) instead of launched ones")
    parser.add_argument(
        "--server",
        choices=("vllm", "flat"),
        default="vllm",
        help="flat: issue 46's simulated server whose step is flat in its batch (its own legs)",
    )
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
    args.legs = [leg for leg in args.legs.split(",") if leg]
    for leg in args.legs:
        if leg not in LEGS:
            parser.error(f"unknown leg {leg!r}; choose from {', '.join(LEGS)}")
    several = args.replicas > 1 or (args.urls and "," in args.urls)
    if "router-cache" in args.legs and not several:
        parser.error("the router-cache leg needs several servers: --replicas 2 or --urls A,B")
    if args.replicas < 1:
        parser.error("--replicas must be >= 1")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    params = {k: v for k, v in vars(args).items() if k != "urls"}
    params["urls_given"] = bool(args.urls)
    if args.server == "flat":
        main_flat(args, params)
        return
    router = None
    versions = {}
    if "router-cache" in args.legs:
        from benchmarks.bench_routing import ROUTER_VENV, ensure_router, router_version

        router = ensure_router()
        versions["vllm-router"] = router_version(ROUTER_VENV)
    run = Run.begin("batch-shape", params=params, versions=versions)
    with servers(args) as urls:
        run.fact(
            "server",
            {
                "servers": len(urls),
                "max_num_seqs": args.max_num_seqs,
                "kv_blocks": args.blocks,
                "block_tokens": 128,
                "prefix_caching": True,
            },
        )
        if len(urls) == 1:
            run.fact("step_ms_by_sequences", asyncio.run(step_cost(urls[0], args.max_num_seqs)))
        asyncio.run(run_all(args, urls, run, router))
    path = run.save()
    say(f"kept {path}")
    print(render([{**run.payload(), "_file": path.name}]))


def main_flat(args: argparse.Namespace, params: dict[str, Any]) -> None:
    """The flat server's legs (:data:`FLAT_LEGS`), on ``--urls`` or on a server started here."""
    for key in ("workloads", "legs", "blocks", "max_num_seqs", "replicas", "scale"):
        params.pop(key, None)  # the vLLM runs' settings: not this server's
    run = Run.begin("batch-shape", params=params)
    with flat_server(args.urls) as url:
        a, b = FLAT_STEP_S
        run.fact(
            "server",
            {
                "seats": FLAT_SEATS,
                "step_ms": 1000 * a,
                "step_ms_per_sequence": 1000 * b,
                "states_context": False,
                "pinned": False,
            },
        )
        asyncio.run(run_flat(args, url, run))
    path = run.save()
    say(f"kept {path}")
    print(render([{**run.payload(), "_file": path.name}]))


TABLE = (
    report_.Column("makespan s", "makespan_s"),
    report_.Column("prefix hit rate", "hit_rate", 3),
    report_.Column("engine steps", "engine_steps", 0),
    report_.Column("output tokens a step", "tokens_per_step", 1),
    report_.Column("ms a step", "ms_per_step", 2),
    report_.Column("preemptions", "preemptions", 0),
    report_.Column("failed", "failed", 0),
)


def with_step_figures(row: dict[str, Any]) -> dict[str, Any]:
    """``row`` with what its engine steps held and took: output tokens a step (how full the
    server's batch ran) and milliseconds a step (the makespan over the steps). A makespan
    follows the steps only where a step takes as long full as nearly empty: on a GPU's decode,
    not on this CPU (:func:`step_cost` measures it)."""
    steps = row.get("engine_steps")
    if not isinstance(steps, int | float) or steps <= 0:
        return row
    out = dict(row)
    tokens = row.get("completion_tokens")
    if isinstance(tokens, int | float):
        out["tokens_per_step"] = tokens / steps
    out["ms_per_step"] = 1000 * row["makespan_s"] / steps
    return out


def servers_of(record: dict[str, Any]) -> int:
    """How many servers an invocation ran on (its first files predate ``--replicas``: one)."""
    return int(record.get("params", {}).get("replicas", 1))


def blocks_of(record: dict[str, Any]) -> int:
    """The KV blocks of each server an invocation ran on."""
    return int(record.get("params", {}).get("blocks", 24))


def setup_of(record: dict[str, Any]) -> tuple[int, int, int]:
    """``(servers, max_num_seqs, KV blocks)`` of an invocation: the page keeps the latest of
    each."""
    seqs = int(record.get("params", {}).get("max_num_seqs", 8))
    return servers_of(record), seqs, blocks_of(record)


def render(records: Sequence[dict[str, Any]]) -> str:
    """The latest invocation per server setup (:func:`setup_of`): per workload, one line per leg
    (median (range) over the runs), then the goals, then its conditions."""
    sections = []
    flat = [r for r in records if r.get("params", {}).get("server") == "flat"]
    records = [r for r in records if r.get("params", {}).get("server", "vllm") == "vllm"]
    setups = sorted({setup_of(r) for r in records})
    for n, seqs, blocks in setups:
        mine = [r for r in records if setup_of(r) == (n, seqs, blocks)]
        record = report_.latest(mine)
        assert record is not None
        rows = [with_step_figures(row) for row in record["rows"]]
        where = "One server" if n == 1 else f"{n} replicas"
        parts = (
            [f"*{where}, {seqs} sequences and {blocks} KV blocks each:*"] if len(setups) > 1 else []
        )
        for workload in WORKLOADS:
            these = report_.select(rows, workload=workload)
            if not these:
                continue
            count = max((r.get("items") or 0) for r in these)
            table = report_.leg_table(these, TABLE)
            shifts = [r["moved"] for r in these if r["leg"] == "shape" and "moved" in r]
            if shifts:
                table += (
                    "\n\nItems that shape started at another place than input order, per run: "
                    + ", ".join(str(x) for x in shifts)
                    + f" of {count}."
                )
            parts.append(f"**{workload}** ({count} items)\n\n" + table)
        goals = goal_lines(rows)
        if goals:
            parts.append("Against the issue's goals, per run:\n\n" + "\n".join(goals))
        steps = step_lines(rows)
        if steps:
            parts.append("The server's engine steps, per run (not a goal):\n\n" + "\n".join(steps))
        models = model_lines(rows)
        if models:
            parts.append(
                "What the start order alone can gain on this server, by a model of vLLM's "
                "scheduler given the whole batch at once (`model_steps` in "
                "`benchmarks/bench_batch_shape.py`; engine steps, shape / input, per run):\n\n"
                + "\n".join(models)
            )
        cost = record.get("facts", {}).get("step_ms_by_sequences")
        if cost:
            shown = ", ".join(f"{n}: {ms:.1f} ms" for n, ms in cost.items())
            parts.append(
                "The server's engine step, by the sequences it ran (256 tokens each, measured "
                f"before the legs by `step_cost`): {shown}."
            )
        parts.append(report_.conditions(record, mine))
        sections.append("\n\n".join(parts))
    latest = report_.latest(flat)
    if latest is not None:
        sections.append(render_flat(dict(latest)) + "\n\n" + report_.conditions(latest, flat))
    return "\n\n".join(sections)


if __name__ == "__main__":
    main()
