"""dsclient on servers that publish nothing about their load, and against vLLM's own priority.

    python -m benchmarks blackbox                    # 3 runs of everything (~65 min here)
    python -m benchmarks blackbox --quick            # a smoke test with small sizes (~6 min)
    python -m benchmarks blackbox --servers transformers --runs 1

Three servers, one after another (never two at once on this 2-core machine), each started here
and stopped at the end, its processes (and nginx) on their own CPUs and the client on another
(:func:`benchmarks._common.plan_placement`; ``--shared-cpus`` to mix them):

* ``nginx-vllm``: the tiny random Llama on vLLM through dsclient's launcher (``max_num_seqs``
  ``--max-num-seqs``, 32), behind nginx passing only ``/v1/*`` (tests/integration/blackbox.py):
  the client sees no ``/metrics``, no ``/tokenize``, no launch record; vLLM's
  ``endpoint-load-metrics`` answer header is all it can learn the load from.
* ``transformers``: transformers' own server (``transformers serve --continuous-batching``, CPU)
  serving the tiny model without an end-of-sequence token as ``local/m``: no load signal at all.
* ``vllm-priority``: vLLM launched with ``--scheduling-policy priority`` (direct, ``/metrics``
  open, the launch record says the policy), where the server itself puts shorts first.

Two workloads on each: ``batch``, ``--batch`` short requests (12-40 words, ``--short-tokens``
out) at once; ``online``, short requests arriving as a Poisson process at ``--rate`` per second
for ``--online-seconds`` plus a burst of ``--burst`` long prompts (``--long-words`` words, about
1.5 tokens each, ``--long-tokens`` out) at ``--burst-at`` s. Every answer is as long as asked
(vLLM: ``ignore_eos``; transformers: the model has no EOS token). Legs:

* ``unbounded``: every request sent at once on one httpx client (what vLLM's maintainers advise);
* ``semaphore 8`` / ``semaphore 32`` / ``semaphore 128``: the same behind ``asyncio.Semaphore``;
* ``dsclient``: ``dsclient.AsyncClient(url)`` with its defaults;
* ``unbounded + priority`` (vllm-priority only, with ``dsclient``): unbounded, each request
  carrying vLLM's ``priority`` (shorts 0, longs 1; lower runs first).

Legs run interleaved (each leg once per run), the order rotated by one every run so that none is
always first; the server is drained between legs (a 1-token request answered within 1 s). Each
leg's prompts start with three words of its own (:func:`salted`), so no leg finds the previous
legs' prompts in vLLM's prefix cache.
Latency counts from submission. Figures per leg: makespan, throughput, short and long p50 and
tails (p99 where a leg has 200 samples, else p95 or max, as the report labels), errors, the
server's own queue (peak and p90 of ``vllm:num_requests_waiting``, read from vLLM's ``/metrics``
behind nginx's back, for the report only: the client never sees it; transformers serve has no
such count), client and server CPU (cores), and for
dsclient the limit it started at, reached and ended at, with its mode and signal. One results
file per invocation through :mod:`benchmarks._results`; ``python -m benchmarks report`` renders
it. Goals (issue 23): batch makespan at most 1.1x the run's best leg; online short p99 at most
0.3x the unbounded client's at a makespan at most 1.15x; against vLLM's priority, short p99 and
makespan each at most 1.0x :func:`goals` checks them per run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import _report as report_
from benchmarks._common import (
    cpu_snapshot,
    cpu_split,
    default_placement,
    engine_sampler,
    percentile,
    placement_facts,
    sample_every,
    say,
    server_group,
    starting_server,
    wait_for_no_vllm,
    words,
)
from benchmarks._results import Run

SERVERS = ("nginx-vllm", "transformers", "vllm-priority")
WORKLOADS = ("batch", "online")
PLAIN_LEGS = ("unbounded", "semaphore 8", "semaphore 32", "semaphore 128", "dsclient")
PRIORITY_LEGS = ("unbounded + priority", "dsclient")
ABOUT = {
    "unbounded": "every request at once (httpx)",
    "semaphore 8": "httpx behind asyncio.Semaphore(8)",
    "semaphore 32": "httpx behind asyncio.Semaphore(32)",
    "semaphore 128": "httpx behind asyncio.Semaphore(128)",
    "dsclient": "AsyncClient(url), defaults",
    "unbounded + priority": "every request at once with vLLM's priority (shorts 0, longs 1)",
}
#: vLLM's ``priority``: lower runs first.
PRIORITY = {"short": 0, "long": 1}


# -- workload (pure) -----------------------------------------------------------------------------
@dataclass(frozen=True)
class Request:
    kind: str  # "short" | "long"
    at: float  # seconds after the leg's start
    prompt: str
    max_tokens: int


@dataclass
class Outcome:
    kind: str
    submitted: float
    latency: float | None = None
    error: str | None = None


def batch_requests(seed: int, n: int, max_tokens: int) -> list[Request]:
    """``n`` short requests (12-40 words), all at t = 0."""
    rng = random.Random(seed)
    return [Request("short", 0.0, words(rng, rng.randint(12, 40)), max_tokens) for _ in range(n)]


def online_requests(
    seed: int,
    *,
    rate: float,
    seconds: float,
    burst: int,
    burst_at: float,
    short_tokens: int,
    long_words: int,
    long_tokens: int,
) -> list[Request]:
    """Poisson shorts at ``rate`` / s over ``[0, seconds)`` and ``burst`` longs at ``burst_at``.

    Arrival times depend on ``seed`` only through a generator of their own, so that every run of
    a benchmark (different prompt seeds, same ``seed // 1000``) has the same arrivals.
    """
    times = random.Random(seed // 1000)
    text = random.Random(seed)
    found = []
    t = times.expovariate(rate)
    while t < seconds:
        found.append(Request("short", t, words(text, text.randint(12, 40)), short_tokens))
        t += times.expovariate(rate)
    found += [Request("long", burst_at, words(text, long_words), long_tokens) for _ in range(burst)]
    return sorted(found, key=lambda r: r.at)


def salted(requests: Sequence[Request], salt: str) -> list[Request]:
    """``requests`` with ``salt`` (a few words) in front of every prompt.

    Each leg gets its own salt: the legs of a run send the same prompts, and without it every leg
    after the first found the previous legs' prompts in vLLM's prefix cache (in the priority
    benchmark, the second online leg's long prompts took half the time of the first's whichever
    client sent them). The salt starts the first block, so no block's hash is shared across legs.
    """
    return [replace(r, prompt=f"{salt} {r.prompt}") for r in requests]


def leg_salt(seed: int, run: int, leg: str) -> str:
    """Three words, the same for one (seed, run, leg) and different for any other."""
    return words(random.Random(f"{seed}/{run}/{leg}"), 3)


def rotated(legs: Sequence[str], run: int) -> list[str]:
    """The legs' order in run ``run`` (from 1): shifted by one a run, so none is always first."""
    shift = (run - 1) % len(legs)
    return [*legs[shift:], *legs[:shift]]


def _tails(latencies: list[float], prefix: str) -> dict[str, float | int | None]:
    def pct(p: float) -> float | None:
        found = percentile(latencies, p)
        return None if found is None else round(found, 3)

    return {
        f"{prefix}_n": len(latencies),
        f"{prefix}_p50_s": pct(50),
        f"{prefix}_p95_s": pct(95),
        f"{prefix}_p99_s": pct(99),
        f"{prefix}_max_s": round(max(latencies), 3) if latencies else None,
    }


def summarize(outcomes: Sequence[Outcome], makespan: float) -> dict[str, float | int | None]:
    """A leg's figures: makespan, throughput (answers / s), tails of each kind, errors.

    ``short_n`` / ``long_n`` count the answered requests of each kind (the samples behind
    their percentiles).
    """
    done = [o for o in outcomes if o.error is None and o.latency is not None]
    figures: dict[str, float | int | None] = {
        "makespan_s": round(makespan, 2),
        "throughput_rps": round(len(done) / makespan, 2) if makespan > 0 else None,
        "errors": sum(o.error is not None for o in outcomes),
    }
    for kind in ("short", "long"):
        figures.update(_tails([o.latency for o in done if o.kind == kind and o.latency], kind))
    return figures


def server_queue(engine: Mapping[str, float]) -> dict[str, float | None]:
    """The server's own queue during a leg, from :func:`benchmarks._common.engine_sampler`:
    ``queue_p90`` and ``queue_max`` (``vllm:num_requests_waiting``) and the engine's mean batch;
    ``None`` where the server has no engine-side count (transformers serve)."""
    return {
        "queue_p90": engine.get("waiting_p90"),
        "queue_max": engine.get("waiting_max"),
        "running_mean": engine.get("running_mean"),
    }


def cpu_columns(split: Mapping[str, float]) -> dict[str, float | None]:
    """Client (this process), server and other work's CPU in cores over a leg."""
    return {key: split.get(key) for key in ("own_cores", "server_cores", "others_cores")}


# -- goals (pure) --------------------------------------------------------------------------------
def _tail_key(rows: Sequence[Mapping[str, Any]], kind: str) -> str:
    return report_.resolve(report_.Column("", f"{kind}_{{tail}}_s", count=f"{kind}_n"), rows)[1]


def goals(rows: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Issue 23's goals, checked per server, workload and run where the legs are there.

    * batch: dsclient's makespan / the best leg's of the run <= 1.1;
    * online (no priority): dsclient's short tail / unbounded's <= 0.3 with makespan <= 1.15x;
    * against ``unbounded + priority``: short tail and makespan each <= 1.0x.

    The tail is the p99 where every leg compared had 200 samples, else p95, else max (named in
    ``tail``). Returns one dict per check: server, workload, run, goal, ratios, met.
    """
    found: list[dict[str, Any]] = []
    keys = sorted({(r.get("server"), r.get("workload"), r.get("run")) for r in rows}, key=str)
    for server, workload, run in keys:
        mine = report_.select(rows, server=server, workload=workload, run=run)
        ours = report_.select(mine, leg="dsclient")
        if not ours:
            continue
        me = ours[0]
        peers = {str(r["leg"]): r for r in mine if r["leg"] != "dsclient"}
        base = {"server": server, "workload": workload, "run": run}
        if workload == "batch" and peers:
            best = min(float(r["makespan_s"]) for r in mine)
            ratio = float(me["makespan_s"]) / best
            found.append({**base, "goal": "makespan <= 1.1x the best leg",
                          "makespan_x": round(ratio, 3), "met": ratio <= 1.1})  # fmt: skip
        for peer, limit_tail, limit_span in (("unbounded", 0.3, 1.15),
                                             ("unbounded + priority", 1.0, 1.0)):  # fmt: skip
            if workload != "online" or peer not in peers:
                continue
            other = peers[peer]
            key = _tail_key([me, other], "short")
            if me.get(key) is None or not other.get(key):
                continue
            tail = float(me[key]) / float(other[key])
            span = float(me["makespan_s"]) / float(other["makespan_s"])
            found.append({
                **base, "goal": f"short {key.split('_')[1]} <= {limit_tail}x and makespan <= "
                f"{limit_span}x {peer}", "short_tail_x": round(tail, 3),
                "makespan_x": round(span, 3), "met": tail <= limit_tail and span <= limit_span,
            })  # fmt: skip
    return found


# -- report --------------------------------------------------------------------------------------
TABLE = (
    report_.Column("makespan s", "makespan_s", 1),
    report_.Column("req/s", "throughput_rps", 1),
    report_.Column("short p50 s", "short_p50_s"),
    report_.Column("short {tail} s", "short_{tail}_s", count="short_n"),
    report_.Column("long p50 s", "long_p50_s"),
    report_.Column("long {tail} s", "long_{tail}_s", count="long_n"),
    report_.Column("server queue p90", "queue_p90", 0),
    report_.Column("queue peak", "queue_max", 0),
    report_.Column("errors", "errors", 0),
    report_.Column("limit at end", "limit_end", 0),
    report_.Column("client cores", "own_cores"),
    report_.Column("server cores", "server_cores"),
)


def newest_per_server(records: Sequence[Mapping[str, Any]]) -> dict[str, Mapping[str, Any]]:
    """Each server's newest invocation that ran it (an invocation may run only some servers:
    ``--servers``), in :data:`SERVERS` order."""
    found: dict[str, Mapping[str, Any]] = {}
    for server in SERVERS:
        for record in reversed(records):
            if report_.select(record["rows"], server=server):
                found[server] = record
                break
    return found


def render(records: Sequence[dict[str, Any]]) -> str:
    """Per server and workload, one line per leg (median and range over runs); then the goals.
    Each server's figures come from the newest invocation that ran it."""
    newest = newest_per_server(records)
    assert newest
    rows = [r for server, rec in newest.items() for r in report_.select(rec["rows"], server=server)]
    used = sorted({id(r): r for r in newest.values()}.values(), key=lambda r: str(r["started_utc"]))
    about = used[-1].get("facts", {}).get("legs", ABOUT)
    parts = []
    for server in [s for s in SERVERS if report_.select(rows, server=s)]:
        for workload in WORKLOADS:
            mine = report_.select(rows, server=server, workload=workload)
            if not mine:
                continue
            control = {(r.get("mode"), r.get("signal")) for r in mine if r.get("mode")}
            said = ", ".join(f"mode {m}, signal {s}" for m, s in sorted(control, key=str))
            title = f"**{server}, {workload}**" + (f" (dsclient: {said})" if said else "")
            parts.append(title + "\n\n" + report_.leg_table(mine, TABLE, about=about))
    checks = goals(rows)
    if checks:
        lines = ["| server | workload | run | goal | ratio | met |", "|---|---|---|---|---|---|"]
        for c in checks:
            ratio = ", ".join(
                f"{k.removesuffix('_x').replace('_', ' ')} {c[k]:.2f}\N{MULTIPLICATION SIGN}"
                for k in ("short_tail_x", "makespan_x") if k in c
            )  # fmt: skip
            met = "yes" if c["met"] else "**no**"
            lines.append(
                f"| {c['server']} | {c['workload']} | {c['run']} | {c['goal']} | {ratio} | {met} |"
            )
        parts.append("Goals, per run:\n\n" + "\n".join(lines))
    sources = []
    for record in used:
        shown = ", ".join(server for server, rec in newest.items() if rec is record)
        rest = [r for r in records if all(r is not u for u in used)] if record is used[-1] else []
        sources.append(f"{shown}: " + report_.conditions(record, rest))
    return "\n\n".join([*parts, *sources])


def headline(records: Sequence[dict[str, Any]]) -> list[report_.Versus]:
    """dsclient over each other leg, per server and workload: makespan, short and long tails."""
    newest = newest_per_server(records)
    rows = [r for server, rec in newest.items() for r in report_.select(rec["rows"], server=server)]
    lines = []
    for server in SERVERS:
        for workload in WORKLOADS:
            mine = report_.select(rows, server=server, workload=workload)
            if not report_.select(mine, leg="dsclient"):
                continue
            split = f"{server}, {workload}"
            for peer in report_.legs(mine):
                if peer == "dsclient":
                    continue
                pair = report_.select(mine, leg="dsclient") + report_.select(mine, leg=peer)
                for column, key in (
                    ("makespan", "makespan_s"),
                    ("short-request tail", _tail_key(pair, "short")),
                    ("long-request tail", _tail_key(pair, "long")),
                ):
                    found = report_.ratios(mine, key, peer)
                    if found:
                        label = "" if column == "makespan" else key.split("_")[1]
                        lines.append(report_.Versus("blackbox", peer, column, found, label,
                                                    workload=split))  # fmt: skip
                lines += report_.failures(mine, "errors", peer, "blackbox", workload=split)
    return lines


# -- clients -------------------------------------------------------------------------------------
Call = Callable[[Request], Awaitable[None]]


@dataclass
class Leg:
    """One client strategy for one leg: ``call`` sends a request; ``facts()`` after the leg."""

    call: Call
    facts: Callable[[], dict[str, Any]] = field(default=lambda: {})


def _body(model: str, request: Request, extra: Mapping[str, Any]) -> dict[str, Any]:
    return {"model": model, "prompt": request.prompt, "max_tokens": request.max_tokens, **extra}


@contextlib.asynccontextmanager
async def http_leg(
    url: str, model: str, extra: Mapping[str, Any], *, gate: int | None, priority: bool
) -> AsyncIterator[Leg]:
    """Raw httpx POSTs, all at once or behind a semaphore of ``gate``."""
    import httpx

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    semaphore = asyncio.Semaphore(gate) if gate else None
    async with httpx.AsyncClient(base_url=url, timeout=900, limits=limits) as http:

        async def send(request: Request) -> None:
            body = _body(model, request, extra)
            if priority:
                body["priority"] = PRIORITY[request.kind]
            answer = await http.post("/v1/completions", json=body)
            answer.raise_for_status()

        async def call(request: Request) -> None:
            if semaphore is None:
                await send(request)
            else:
                async with semaphore:
                    await send(request)

        yield Leg(call)


@contextlib.asynccontextmanager
async def dsclient_leg(url: str, extra: Mapping[str, Any]) -> AsyncIterator[Leg]:
    """``dsclient.AsyncClient(url)`` with its defaults; its limit sampled every 0.2 s."""
    import dsclient

    async with dsclient.AsyncClient(url) as client:
        start = client.limit
        async with sample_every(lambda: client.limit) as limits:

            async def call(request: Request) -> None:
                await client.generate(request.prompt, max_tokens=request.max_tokens, **extra)

            def facts() -> dict[str, Any]:
                control = client.stats().control
                return {
                    "limit_start": start,
                    "limit_max": max([*limits, client.limit]),
                    "limit_end": client.limit,
                    "mode": getattr(control, "mode", None),
                    "signal": getattr(control, "signal", None),
                    "limit_changes": getattr(control, "changes", None),
                    # The order dsclient sent vLLM's `priority` in (None: not sent), and
                    # whether discovery knew the server to honour it.
                    "priority_sent": getattr(client.server, "priority", None),
                    "priority_honoured": getattr(client.server, "priority_honoured", None),
                }

            yield Leg(call, facts)


def leg_context(
    name: str, url: str, model: str, extra: Mapping[str, Any]
) -> contextlib.AbstractAsyncContextManager[Leg]:
    if name == "dsclient":
        return dsclient_leg(url, extra)
    if name == "unbounded + priority":
        return http_leg(url, model, extra, gate=None, priority=True)
    gate = int(name.split()[1]) if name.startswith("semaphore ") else None
    return http_leg(url, model, extra, gate=gate, priority=False)


async def execute(call: Call, requests: Sequence[Request]) -> tuple[list[Outcome], float]:
    """Submit each request at its time, wait for all; outcomes and the makespan."""
    loop = asyncio.get_running_loop()
    start = loop.time()

    async def one(request: Request) -> Outcome:
        submitted = loop.time()
        outcome = Outcome(request.kind, submitted - start)
        try:
            await call(request)
        except Exception as exc:  # counted: errors are part of the result
            outcome.error = f"{type(exc).__name__}: {exc}"[:200]
        outcome.latency = loop.time() - submitted
        return outcome

    tasks = []
    for request in requests:
        delay = start + request.at - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(request)))
    outcomes = list(await asyncio.gather(*tasks))
    return outcomes, loop.time() - start


async def drain(url: str, model: str, extra: Mapping[str, Any], limit: float = 120.0) -> float:
    """Wait until a 1-token request is answered within 1 s (a leg's leftovers are done)."""
    import httpx

    begun = time.monotonic()
    async with httpx.AsyncClient(base_url=url, timeout=limit) as http:
        while time.monotonic() - begun < limit:
            sent = time.monotonic()
            with contextlib.suppress(httpx.HTTPError):
                body = {"model": model, "prompt": "probe", "max_tokens": 1, **extra}
                await http.post("/v1/completions", json=body)
            if time.monotonic() - sent < 1.0:
                break
            await asyncio.sleep(1.0)
    return round(time.monotonic() - begun, 1)


# -- servers -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Target:
    """A started server: where to send, the model name, what every body carries."""

    server: str
    url: str
    model: str
    extra: dict[str, Any]
    legs: tuple[str, ...]
    #: Where the engine's own counts are read, behind any gateway's back (vLLM's /metrics):
    #: for the report only, never shown to the client. ``None``: the server has none.
    engine_url: str | None = None


def server_versions() -> dict[str, str | None]:
    """nginx's version, and transformers' in the vLLM venv (where its server runs from)."""
    import shutil
    import subprocess

    from dsclient.launcher import resolve_server_python

    found: dict[str, str | None] = {"nginx": None, "transformers (server venv)": None}
    nginx = shutil.which("nginx") or "/usr/sbin/nginx"
    with contextlib.suppress(OSError):
        done = subprocess.run([nginx, "-v"], capture_output=True, text=True, check=False)
        found["nginx"] = done.stderr.strip().rpartition("/")[2] or None
    python = str(resolve_server_python().python)
    done = subprocess.run(
        [python, "-c", "import transformers; print(transformers.__version__)"],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    found["transformers (server venv)"] = done.stdout.strip() or None
    return found


@contextlib.contextmanager
def started(server: str, args: argparse.Namespace, run: Run) -> Iterator[Target]:
    """The server, its processes started on the server's CPUs (a gateway too), this process on
    the client's afterwards; where each ran goes into the run's facts."""
    placement = default_placement(apart=not args.shared_cpus)
    with contextlib.ExitStack() as stack:
        with starting_server(placement):
            target = stack.enter_context(_started(server, args, run))
        engine = target.engine_url or target.url
        run.fact(f"placement {server}", placement_facts(placement, [server_group(engine)]))
        yield target


@contextlib.contextmanager
def _started(server: str, args: argparse.Namespace, run: Run) -> Iterator[Target]:
    from dsclient.launcher import launch, make_tiny_model, resolve_server_python
    from tests.integration.blackbox import (
        HUB_MODEL,
        hub_cache,
        model_without_eos,
        nginx_gateway,
        transformers_server,
    )

    install = resolve_server_python()
    run.fact("vllm", f"{install.dist} {install.version}")
    model = make_tiny_model(python=install.python)
    if server == "transformers":
        with tempfile.TemporaryDirectory(prefix="bench-blackbox-") as tmp:
            folder = model_without_eos(model, Path(tmp) / "model")
            hub_cache(folder, Path(tmp) / "home" / "hub")
            with transformers_server(str(install.python), hf_home=Path(tmp) / "home") as url:
                yield Target(server, url, HUB_MODEL, {}, PLAIN_LEGS)
        return
    priority = server == "vllm-priority"
    extra_args = ["--scheduling-policy", "priority"] if priority else []
    try:
        wait_for_no_vllm(args.wait_for_others)
    except SystemExit as exc:
        if not isinstance(exc.code, str):  # a signal's exit (kill), not the wait running out
            raise
        run.note(f"another vLLM still ran when {server} started: {exc}")
    handle = launch(
        model,
        python=install.python,
        max_num_seqs=args.max_num_seqs,
        max_model_len=2048,
        served_model_name="tiny",
        dtype="float32",
        extra_args=extra_args,
        progress=lambda m: say(f"[vllm] {m}"),
    )
    with handle:
        extra = {"ignore_eos": True}
        if priority:
            yield Target(server, handle.url, "tiny", extra, PRIORITY_LEGS, handle.url)
        else:
            with nginx_gateway(handle.url) as url:
                yield Target(server, url, "tiny", extra, PLAIN_LEGS, handle.url)


async def bench_server(target: Target, args: argparse.Namespace, run: Run) -> None:
    # A warm-up of 40 shorts and 8 longs at once, before anything is measured: every batch size
    # and a long prompt's shapes run once (in a smoke run the first leg to meet long prompts on
    # transformers' server took twice as long as the others).
    rng = random.Random(args.seed - 1)
    warm = batch_requests(args.seed - 1, 40, args.short_tokens) + [
        Request("long", 0.0, words(rng, args.long_words), args.long_tokens) for _ in range(8)
    ]
    async with http_leg(target.url, target.model, target.extra, gate=None, priority=False) as w:
        await execute(w.call, warm)
    pgid = server_group(target.engine_url or target.url)
    for number in range(1, args.runs + 1):
        for workload in args.workloads:
            seed = args.seed * 1000 + number
            if workload == "batch":
                requests = batch_requests(seed, args.batch, args.short_tokens)
            else:
                requests = online_requests(
                    seed,
                    rate=args.rate,
                    seconds=args.online_seconds,
                    burst=args.burst,
                    burst_at=args.burst_at,
                    short_tokens=args.short_tokens,
                    long_words=args.long_words,
                    long_tokens=args.long_tokens,
                )
            for leg in rotated(target.legs, number):
                drained = await drain(target.url, target.model, target.extra)
                sent = salted(requests, leg_salt(args.seed, number, leg))
                sampler = (
                    engine_sampler(target.engine_url)
                    if target.engine_url
                    else contextlib.nullcontext({})
                )
                async with (
                    leg_context(leg, target.url, target.model, target.extra) as client,
                    sampler as engine,
                ):
                    before = cpu_snapshot(pgid)
                    outcomes, makespan = await execute(client.call, sent)
                    after = cpu_snapshot(pgid)
                    facts = client.facts()
                errors = sorted({o.error for o in outcomes if o.error})
                if errors:
                    run.note(f"{target.server} {workload} run {number} {leg}: {errors[0]}")
                row = run.add(
                    leg=leg,
                    run=number,
                    server=target.server,
                    workload=workload,
                    **summarize(outcomes, makespan),
                    drain_s=drained,
                    **server_queue(engine),
                    **cpu_columns(cpu_split(before, after)),
                    **facts,
                )
                say("  " + " ".join(f"{k}={v}" for k, v in row.items()))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks blackbox", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--servers", default=",".join(SERVERS))
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument(
        "--shared-cpus", action="store_true",
        help="let the client share the servers' CPUs (default: servers on their own CPUs)",
    )  # fmt: skip
    parser.add_argument("--batch", type=int, default=1000, help="short requests in the batch")
    parser.add_argument("--short-tokens", type=int, default=16)
    parser.add_argument("--rate", type=float, default=8.0, help="short arrivals per second")
    parser.add_argument("--online-seconds", type=float, default=20.0)
    parser.add_argument("--burst", type=int, default=40, help="long prompts in the burst")
    parser.add_argument("--burst-at", type=float, default=1.0)
    parser.add_argument("--long-words", type=int, default=600, help="about 1.5 tokens a word")
    parser.add_argument("--long-tokens", type=int, default=128)
    parser.add_argument("--max-num-seqs", type=int, default=32, help="of the vLLM servers")
    parser.add_argument("--seed", type=int, default=23)
    parser.add_argument(
        "--wait-for-others", type=float, default=600.0,
        help="seconds to wait for other vLLMs on the machine to finish before starting one",
    )  # fmt: skip
    parser.add_argument(
        "--quick", action="store_true",
        help="smoke test: 1 run, batch 120, 6 s of arrivals at 4/s, a burst of 6",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if args.quick:
        args.runs, args.batch, args.rate, args.online_seconds = 1, 120, 4.0, 6.0
        args.burst, args.long_words, args.long_tokens = 6, 200, 32
    args.servers = [s for s in args.servers.split(",") if s]
    args.workloads = [w for w in args.workloads.split(",") if w]
    unknown = sorted({*args.servers} - {*SERVERS}) + sorted({*args.workloads} - {*WORKLOADS})
    if unknown:
        parser.error(f"unknown servers or workloads: {unknown}")
    params = {k: v for k, v in vars(args).items() if k != "wait_for_others"}
    run = Run.begin("blackbox", params=params, peers=["httpx"], versions=server_versions())
    run.fact("legs", ABOUT)
    begun = time.monotonic()
    # A smoke test's figures are not results: they go to a temporary folder, not the kept ones.
    where = Path(tempfile.mkdtemp(prefix="bench-blackbox-quick-")) if args.quick else None
    with run.kept_if_aborted(where):
        for server in args.servers:
            say(f"== {server}")
            with started(server, args, run) as target:
                asyncio.run(bench_server(target, args, run))
    run.fact("wall_s", round(time.monotonic() - begun, 1))
    path = run.save(where)
    print(render([{**run.payload(), "_file": path.name}]))
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
