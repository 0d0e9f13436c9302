"""Routing over two replicas, one slowed: dsclient vs client round-robin vs vllm-router.

    flock /tmp/dsclient-vllm.lock python -m benchmarks routing             # 6 legs x 3 runs
    python -m benchmarks routing --legs round-robin,router-rr --runs 1      # some legs only
    python -m benchmarks routing --urls http://127.0.0.1:8000,http://127.0.0.1:8001

Two tiny-vLLM replicas (``launch(..., replicas=2)``: one CPU per engine on the 2-core machine)
with prefix caching on and a **small KV cache** (``--num-gpu-blocks-override``, default 96
blocks of 128 tokens per replica), so that the shared prefixes of the workload do not all fit
on one replica but do fit on two. The second replica is **slowed** by a background load sent
to it directly during every leg (open loop on an absolute schedule, by default 3 a second, each
1200 random token ids, 64 tokens out); it starts ``--background-lead`` seconds before the leg,
and after the leg stops sending and waits for what it sent before the counters are read.

The workload of a leg (:func:`make_workload`): ``--long`` requests built on ``--prefixes``
shared long prefixes (a document block of ``--prefix-words`` words, ~850 tokens, then a short
question), all sent at once (a batch), and ``--short`` interactive requests (a few words, no
shared prefix) arriving at random over ``--short-window`` seconds. Every prompt of a leg starts
with a few words unique to that leg and run (its salt), so no leg finds the previous one's
prefixes in the caches.

Legs, over the SAME replicas, in an order that rotates between runs (each run starts one leg
later):

- ``dsclient``: ``dsclient.AsyncClient([url_a, url_b], model=...)``, one ``generate()`` per
  request, every call started at its arrival (``asyncio.gather``), client defaults;
- ``round-robin``: plain ``httpx.AsyncClient`` alternating the two URLs, **unbounded** (every
  call started at its arrival; the connection pool's limit lifted, as ``asyncio.gather`` over
  the openai SDK, whose pool allows 1000, would do here);
- ``router-rr`` / ``router-cache`` / ``router-p2``: the same unbounded httpx client through
  ``vllm-router`` (pinned, :data:`ROUTER_VERSION`; a Rust binary) started in front of the two
  replicas with ``--policy round_robin`` / ``cache_aware`` with its load-balancing guide's
  settings (:data:`ROUTER_SETTINGS`) / ``power_of_two``, stopped after the leg. It is installed
  on first use into its own venv (``--router-venv``, default
  ``~/.cache/dsclient/venvs/vllm-router``), never into the repo's. The background's seed is
  the same in every leg.
- ``router-cache+priority``: ``router-cache`` with every request carrying vLLM's ``priority``
  (shorts 0, longs 1), which the replicas schedule by (``--scheduling-policy priority``, on both
  replicas for every leg; dsclient sends it too, from the launch record).

Since issue 43 the background goes straight to the slowed replica in every leg, routers' too
(before, a router leg sent it through the router), and the long requests arrive evenly over
``--long-window`` (5 s) rather than all at t = 0. Two replicas take one CPU each on the 2-core
machine, so the client cannot have a CPU of its own here; the results file says so
(``placement``).

Measured per leg: makespan (from the leg's start until its last request ended), short-request
latency p50 / p99 (from its arrival, so time queued on the client counts), failed requests,
how many requests each replica served (vLLM's ``vllm:request_success_total``, less the
background's), and the prefix-cache hit rate: the increase of ``vllm:prefix_cache_hits_total``
over that of ``vllm:prefix_cache_queries_total``, summed over both replicas (read before and
after the leg). ``hit_rate`` counts every query, the background's too; ``hit_rate_own``
subtracts the background's prompt tokens sent during the leg (random ids: they cannot hit, and
they would otherwise count a leg that spares the slowed replica as missing more). The goal
uses ``hit_rate_own``. Ratios dsclient / other are given per run; the goal (issue 16): dsclient
better than each other leg on each of makespan, short p99 and hit rate, in both runs. Where a
leg knows which replica answered (dsclient, round-robin), ``facts.last_answer_s`` says when
each replica's last answer came; for dsclient, ``facts.servers`` holds each server's limit and
lanes at the end.

One summary row per leg and run is kept in ``benchmarks/results/routing/<UTC start>.json``
(:mod:`benchmarks._results`, conditions recorded before the replicas start); the full rows go
to ``benchmarks/results/routing-<timestamp>.json`` (gitignored); the summary table is printed.
Hold the vLLM lock while it runs (it starts two vLLM servers).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import _report as report_
from benchmarks._common import (
    START_CPUS,
    gauge,
    machine,
    percentile,
    pin_process,
    placement_facts,
    say,
    server_group,
    words,
    write_results,
)
from benchmarks._results import Run

LEGS = (
    "dsclient",
    "round-robin",
    "router-rr",
    "router-cache",
    "router-p2",
    "router-cache+priority",
)
ROUTER_POLICY = {
    "router-rr": "round_robin",
    "router-cache": "cache_aware",
    "router-p2": "power_of_two",
    "router-cache+priority": "cache_aware",
}
#: The replicas schedule by vLLM's ``priority`` field (lower first), as vLLM's docs set it up for
#: clients that send it; a request without it has 0.
REPLICA_ARGS = ("--scheduling-policy", "priority")
#: vLLM's ``priority`` per request kind, for the router leg that sends it: shorts first.
PRIORITY = {"short": 0, "long": 1}
#: Router legs whose client sends ``priority`` in each body (through the router to the replica).
SENDS_PRIORITY = ("router-cache+priority",)
#: vllm-router's flags per policy beyond the defaults: its load-balancing guide's cache-aware
#: settings (docs/load_balancing.md in vllm-project/router: "--cache-threshold 0.5
#: --balance-abs-threshold 32 --balance-rel-threshold 1.1").
ROUTER_SETTINGS: dict[str, tuple[str, ...]] = {
    "cache_aware": (
        "--cache-threshold", "0.5",
        "--balance-abs-threshold", "32",
        "--balance-rel-threshold", "1.1",
    ),
}  # fmt: skip
#: Opt-in diagnostic legs (``--legs``): dsclient with one option changed, to tell what a
#: difference comes from. Not compared in the goal.
DIAGNOSTIC_LEGS: dict[str, dict[str, Any]] = {
    "dsclient-long1": {"long_share": 1.0},  # the long lane may take the whole limit
    # the prefix index sized to vLLM's cache here: 96 blocks x 128 tokens ~ 46 kB of this
    # workload's text ~ 180 blocks of 256 characters (the default keeps 8192)
    "dsclient-index": {"routing": {"index_blocks": 180}},
}
ROUTER_VENV = Path("~/.cache/dsclient/venvs/vllm-router").expanduser()
ROUTER_VERSION = "0.1.17"
ROUTER_PACKAGE = f"vllm-router=={ROUTER_VERSION}"
MODEL = "tiny"
#: The three metrics of the goal: (key in a leg's summary, True when higher is better).
GOAL_METRICS = (("makespan_s", False), ("short_p99_s", False), ("hit_rate_own", True))


# -- the workload (pure) ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Shape:
    """The shape of a leg's workload; see the module docstring."""

    long: int = 360
    short: int = 90
    prefixes: int = 16
    prefix_words: int = 600
    question_words: int = 12
    short_words: int = 16
    long_tokens: int = 32
    short_tokens: int = 16
    short_window_s: float = 10.0
    long_window_s: float = 0.0  # 0: all long requests at once; else uniformly over it

    def __post_init__(self) -> None:
        for name in ("long", "short", "prefixes", "prefix_words", "question_words", "short_words"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.long and not self.prefixes:
            raise ValueError("prefixes must be >= 1 when there are long requests")
        if self.long_tokens < 1 or self.short_tokens < 1:
            raise ValueError("long_tokens and short_tokens must be >= 1")
        for name in ("short_window_s", "long_window_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")


@dataclass(frozen=True)
class Item:
    """One request of a workload: sent ``at`` seconds after the leg's start."""

    index: int
    kind: str  # "long" | "short"
    prompt: str
    max_tokens: int
    at: float
    prefix: int | None  # which shared prefix a long request is built on


def make_workload(shape: Shape, seed: int, salt: str = "") -> list[Item]:
    """The requests of one leg, ordered by arrival.

        items = make_workload(Shape(long=8, short=2, prefixes=2), seed=1, salt="Leg one.")

    Long requests use the prefixes in turn (request ``i`` the prefix ``i % prefixes``), in a
    shuffled order, all at ``at=0`` (or, with ``long_window_s``, uniformly at random within
    it). Short requests arrive uniformly at random within ``short_window_s``. The same
    ``seed`` gives the same texts whatever the salt; the salt starts every prompt, so two salts
    share no prefix at all (vLLM hashes blocks in a chain).
    """
    rng = random.Random(seed)
    lead = f"{salt} " if salt else ""
    prefixes = [words(rng, shape.prefix_words) for _ in range(shape.prefixes)]
    uses = [i % shape.prefixes for i in range(shape.long)] if shape.long else []
    rng.shuffle(uses)
    items: list[Item] = []
    for p in uses:
        question = words(rng, shape.question_words)
        prompt = f"{lead}{prefixes[p]}\n\nQuestion: {question}\nAnswer:"
        # drawn only for a window, so that the default workload stays as it was
        at = round(rng.uniform(0.0, shape.long_window_s), 3) if shape.long_window_s else 0.0
        items.append(Item(0, "long", prompt, shape.long_tokens, at, p))
    for _ in range(shape.short):
        at = round(rng.uniform(0.0, shape.short_window_s), 3)
        items.append(
            Item(0, "short", lead + words(rng, shape.short_words), shape.short_tokens, at, None)
        )
    items.sort(key=lambda it: it.at)  # stable: longs first, in their shuffled order
    return [
        Item(i, it.kind, it.prompt, it.max_tokens, it.at, it.prefix) for i, it in enumerate(items)
    ]


def salt_for(seed: int, run: int, leg: str) -> str:
    """A few words unique to (seed, run, leg) that start every prompt of that leg."""
    return words(random.Random(f"{seed}/{run}/{leg}"), 4)


def leg_order(legs: Sequence[str], run: int) -> list[str]:
    """The legs' order in run ``run`` (from 1): each run starts one leg later, so no leg is
    always first, last, or after the same one while the machine's load drifts."""
    shift = (run - 1) % len(legs) if legs else 0
    return [*legs[shift:], *legs[:shift]]


# -- results (pure) --------------------------------------------------------------------------------
@dataclass(frozen=True)
class Outcome:
    """What became of one request: sent and ended in seconds after the leg's start."""

    index: int
    kind: str
    sent: float
    ended: float
    ok: bool
    error: str | None = None

    @property
    def latency(self) -> float:
        return self.ended - self.sent


def leg_stats(outcomes: Sequence[Outcome]) -> dict[str, Any]:
    """Makespan, latency percentiles per kind and failures of one leg's outcomes."""
    ok = [o for o in outcomes if o.ok]
    found: dict[str, Any] = {
        "requests": len(outcomes),
        "ok": len(ok),
        "failed": len(outcomes) - len(ok),
        "makespan_s": round(max((o.ended for o in outcomes), default=0.0), 3),
    }
    for kind in ("short", "long"):
        lat = [o.latency for o in ok if o.kind == kind]
        found[f"{kind}_n"] = len(lat)
        for p in (50, 95, 99):
            value = percentile(lat, p)
            found[f"{kind}_p{p}_s"] = None if value is None else round(value, 3)
        found[f"{kind}_max_s"] = round(max(lat), 3) if lat else None
    errors: dict[str, int] = {}
    for o in outcomes:
        if not o.ok:
            key = o.error or "unknown"
            errors[key] = errors.get(key, 0) + 1
    found["errors"] = errors
    found["failures"] = [asdict(o) for o in outcomes if not o.ok][:20]
    return found


#: vLLM counters read before and after each leg (sums over every label set).
COUNTERS = {
    "hits": "vllm:prefix_cache_hits_total",
    "queries": "vllm:prefix_cache_queries_total",
    "success": "vllm:request_success_total",
    "prompt_tokens": "vllm:prompt_tokens_total",
    "preemptions": "vllm:num_preemptions_total",
}


def read_counters(metrics: str) -> dict[str, float]:
    """The :data:`COUNTERS` of one ``/metrics`` text (0 for a counter it does not carry)."""
    return {key: gauge(metrics, name) for key, name in COUNTERS.items()}


def counter_deltas(
    before: Sequence[dict[str, float]], after: Sequence[dict[str, float]]
) -> list[dict[str, float]]:
    """Per server, how much each counter grew during the leg."""
    return [{k: a[k] - b.get(k, 0.0) for k in a} for b, a in zip(before, after, strict=True)]


def hit_rate(
    deltas: Sequence[dict[str, float]], background_prompt_tokens: float = 0.0
) -> dict[str, Any]:
    """Prefix-cache hit rate over all servers: sum of hits / sum of queries (tokens).

    ``hit_rate_own`` leaves out ``background_prompt_tokens`` from the queries (the background
    load's prompts are unique, so they add queries and no hits).
    """
    hits = sum(d["hits"] for d in deltas)
    queries = sum(d["queries"] for d in deltas)
    own = queries - background_prompt_tokens
    return {
        "hit_rate": round(hits / queries, 4) if queries > 0 else None,
        "hit_rate_own": round(hits / own, 4) if own > 0 else None,
        "hit_tokens": hits,
        "query_tokens": queries,
    }


def summarize(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per run, each other leg against dsclient: the ratio dsclient / other for each goal metric
    and whether dsclient was better (lower makespan and p99, higher hit rate)."""
    out = []
    for run in sorted({r["run"] for r in rows}):
        by = {r["leg"]: r for r in rows if r["run"] == run}
        mine = by.get("dsclient")
        if mine is None:
            continue
        for leg, other in by.items():
            if leg == "dsclient" or leg in DIAGNOSTIC_LEGS:
                continue
            entry: dict[str, Any] = {"run": run, "against": leg}
            for key, higher_better in GOAL_METRICS:
                a, b = mine.get(key), other.get(key)
                if a is None or b is None or b == 0:
                    entry[f"{key}_ratio"], entry[f"{key}_better"] = None, None
                    continue
                entry[f"{key}_ratio"] = round(a / b, 3)
                entry[f"{key}_better"] = a > b if higher_better else a < b
            entry["better_on_all"] = all(entry[f"{k}_better"] is True for k, _ in GOAL_METRICS)
            out.append(entry)
    return out


def goal_met(summary: Sequence[dict[str, Any]]) -> bool:
    """The goal: dsclient better than each other leg on each metric, in every run."""
    return bool(summary) and all(s["better_on_all"] for s in summary)


def _fmt(value: Any, digits: int = 2) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def report(rows: Sequence[dict[str, Any]], summary: Sequence[dict[str, Any]]) -> str:
    """The printed summary: one line per leg and run, then the ratios dsclient / other."""
    lines = [
        "| run | leg | makespan s | short p50 s | short p99 s | long p99 s | hit rate | own | "
        "served A/B | failed | load |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        served = "/".join(_fmt(n, 0) for n in r.get("served", []))
        lines.append(
            f"| {r['run']} | {r['leg']} | {_fmt(r['makespan_s'], 1)} | {_fmt(r['short_p50_s'])} | "
            f"{_fmt(r['short_p99_s'])} | {_fmt(r['long_p99_s'])} | {_fmt(r['hit_rate'], 3)} | "
            f"{_fmt(r['hit_rate_own'], 3)} | {served} | {r['failed']} | {r.get('load', '')} |"
        )
    if summary:
        lines += [
            "",
            "dsclient / other (makespan and p99: lower is better; hit rate: higher is better)",
            "",
            "| run | against | makespan | short p99 | hit rate (own) | better on all |",
            "|---|---|---|---|---|---|",
        ]
        for s in summary:
            lines.append(
                f"| {s['run']} | {s['against']} | {_fmt(s['makespan_s_ratio'])} | "
                f"{_fmt(s['short_p99_s_ratio'])} | {_fmt(s['hit_rate_own_ratio'])} | "
                f"{'yes' if s['better_on_all'] else 'no'} |"
            )
        lines += [
            "",
            "goal (better than each on each, every run): "
            + ("met" if goal_met(summary) else "NOT met"),
        ]
    return "\n".join(lines)


# -- vllm-router -----------------------------------------------------------------------------------
def router_argv(
    binary: str | os.PathLike[str], urls: Sequence[str], policy: str, port: int
) -> list[str]:
    """The command line that starts vllm-router in front of ``urls`` with ``policy``.

    The listen address, the workers, the policy, its documented settings
    (:data:`ROUTER_SETTINGS`) and the startup check interval (30 s by default, which only
    delays its start).
    """
    return [
        os.fspath(binary), "--host", "127.0.0.1", "--port", str(port),
        "--worker-urls", *urls, "--policy", policy, *ROUTER_SETTINGS.get(policy, ()),
        "--worker-startup-check-interval", "1", "--log-level", "warning",
    ]  # fmt: skip


def ensure_router(venv: Path = ROUTER_VENV) -> Path:
    """The ``vllm-router`` executable, installed into ``venv`` first if it is not there yet.

    Raises ``SystemExit`` with what to do when it cannot be installed (no network, no wheel for
    this platform).
    """
    binary = venv / "bin" / "vllm-router"
    if binary.exists():
        found = router_version(venv)
        if found != ROUTER_VERSION:
            raise SystemExit(
                f"{venv} has vllm-router {found}, the benchmark pins {ROUTER_VERSION}: "
                f"{venv}/bin/pip install {ROUTER_PACKAGE}"
            )
        return binary
    say(f"installing {ROUTER_PACKAGE} into {venv} (once) ...")
    python = venv / "bin" / "python"
    steps = [
        [sys.executable, "-m", "venv", os.fspath(venv)],
        [os.fspath(python), "-m", "pip", "install", "--quiet", ROUTER_PACKAGE],
    ]
    for argv in steps:
        done = subprocess.run(argv, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            tail = (done.stderr or done.stdout)[-1500:]
            raise SystemExit(
                f"could not install {ROUTER_PACKAGE} into {venv} ({' '.join(argv[:4])} ... "
                f"exited {done.returncode}):\n{tail}\nInstall it by hand "
                f"(python -m venv {venv} && {venv}/bin/pip install {ROUTER_PACKAGE}) or run "
                "without the router legs (--legs dsclient,round-robin)."
            )
    if not binary.exists():
        raise SystemExit(f"{ROUTER_PACKAGE} installed into {venv} but {binary} is missing")
    return binary


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.asynccontextmanager
async def running_router(
    binary: Path, urls: Sequence[str], policy: str, timeout: float = 120.0
) -> AsyncIterator[str]:
    """vllm-router in front of ``urls`` for the block; yields its URL once it answers."""
    import httpx

    port = free_port()
    argv = router_argv(binary, urls, policy, port)
    fd, log_name = tempfile.mkstemp(prefix="bench-vllm-router-", suffix=".log")
    with os.fdopen(fd, "wb") as log:
        proc = await asyncio.create_subprocess_exec(
            *argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        begun = time.monotonic()
        async with httpx.AsyncClient(timeout=2.0) as http:
            while True:
                if proc.returncode is not None:
                    tail = Path(log_name).read_text(errors="replace")[-2000:]
                    raise SystemExit(f"vllm-router exited with status {proc.returncode}:\n{tail}")
                if time.monotonic() - begun > timeout:
                    raise SystemExit(
                        f"vllm-router not ready after {timeout:.0f} s; log: {log_name}"
                    )
                with contextlib.suppress(httpx.HTTPError):
                    if (await http.get(url + "/v1/models")).status_code == 200:
                        break
                await asyncio.sleep(0.5)
        say(
            f"  vllm-router --policy {policy} ready at {url} after {time.monotonic() - begun:.1f} s"
        )
        yield url
    finally:
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, 15)
            try:
                await asyncio.wait_for(proc.wait(), 10.0)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, 9)
                await proc.wait()
        Path(log_name).unlink(missing_ok=True)


# -- sending ---------------------------------------------------------------------------------------
Send = Callable[[Item], Awaitable[None]]


async def drive(items: Sequence[Item], send: Send) -> list[Outcome]:
    """Send every item at its arrival time (each its own task, so nothing bounds concurrency
    here) and return the outcomes in the items' order."""
    loop = asyncio.get_running_loop()
    start = loop.time()

    async def one(item: Item) -> Outcome:
        delay = start + item.at - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        sent = loop.time() - start
        try:
            await send(item)
        except Exception as exc:  # a failed request is a result, whatever raised it
            error = f"{type(exc).__name__}: {exc}"[:120] if str(exc) else type(exc).__name__
            return Outcome(item.index, item.kind, sent, loop.time() - start, False, error)
        return Outcome(item.index, item.kind, sent, loop.time() - start, True)

    return list(await asyncio.gather(*(one(it) for it in items)))


def unbounded_http() -> Any:
    import httpx

    return httpx.AsyncClient(
        timeout=httpx.Timeout(900.0, connect=30.0),
        limits=httpx.Limits(max_connections=None, max_keepalive_connections=None),
    )


#: Transport errors (a connection reset) are retried this often, as the openai SDK does by
#: default (``max_retries=2``): a user of plain httpx would want the same, and without it the
#: httpx legs lost a few requests per run to connections the server closed.
RETRIES = 2


def body_of(item: Item, priority: bool = False) -> dict[str, Any]:
    """The completion body of ``item``; with ``priority``, vLLM's field by its kind."""
    body: dict[str, Any] = {
        "model": MODEL,
        "prompt": item.prompt,
        "max_tokens": item.max_tokens,
        "ignore_eos": True,
    }
    if priority:
        body["priority"] = PRIORITY[item.kind]
    return body


async def post_completion(
    http: Any,
    url: str,
    item: Item,
    retried: dict[str, int] | None = None,
    *,
    priority: bool = False,
) -> None:
    import httpx

    for attempt in range(RETRIES + 1):
        try:
            response = await http.post(url + "/v1/completions", json=body_of(item, priority))
            break
        except httpx.TransportError as exc:
            if attempt == RETRIES:
                raise
            if retried is not None:
                name = type(exc).__name__
                retried[name] = retried.get(name, 0) + 1
    response.raise_for_status()
    if not response.json().get("choices"):
        raise ValueError("an answer without choices")


@contextlib.asynccontextmanager
async def sender(
    leg: str, urls: Sequence[str], router: Path | None
) -> AsyncIterator[tuple[Send, dict[str, Any]]]:
    """The leg's way of sending one request, and a dict it fills with facts about the leg."""
    facts: dict[str, Any] = {}
    # (server, monotonic time) of every answer, where the leg knows the server: dsclient and
    # round-robin (a router does not say which replica answered)
    finished: list[tuple[str, float]] = []
    facts["finished"] = finished
    if leg == "dsclient" or leg in DIAGNOSTIC_LEGS:
        import dsclient

        options = dict(DIAGNOSTIC_LEGS.get(leg, {}))
        facts["options"] = dict(options)
        if "routing" in options:
            options["routing"] = dsclient.RoutingPolicy(**options["routing"])
        async with dsclient.AsyncClient(list(urls), model=MODEL, **options) as client:
            client.add_observer(lambda record: finished.append((record.server, time.monotonic())))

            async def send_ds(item: Item) -> None:
                await client.generate(item.prompt, max_tokens=item.max_tokens, ignore_eos=True)

            try:
                yield send_ds, facts
            finally:
                facts["servers"] = [server_facts(s) for s in client.servers]
        return
    retried: dict[str, int] = {}
    facts["retried"] = retried
    async with unbounded_http() as http:
        if leg == "round-robin":
            turn = iter(range(10**12))

            async def send_rr(item: Item) -> None:
                url = urls[next(turn) % len(urls)]
                await post_completion(http, url, item, retried)
                finished.append((url, time.monotonic()))

            yield send_rr, facts
            return
        if router is None:
            raise ValueError(f"leg {leg!r} needs vllm-router")
        async with running_router(router, urls, ROUTER_POLICY[leg]) as url:
            facts["router_url"] = url

            async def send_router(item: Item) -> None:
                await post_completion(http, url, item, retried, priority=leg in SENDS_PRIORITY)

            yield send_router, facts


def last_answers(finished: Sequence[tuple[str, float]], t0: float) -> dict[str, float]:
    """Per server, when its last answer came (seconds after ``t0``): which replica finished
    last, and how long after the other."""
    last: dict[str, float] = {}
    for server, at in finished:
        last[server] = max(last.get(server, 0.0), round(at - t0, 3))
    return last


def server_facts(view: Any) -> dict[str, Any]:
    """What a dsclient client knew of one server at the end of a leg (for the diagnosis)."""
    stats = view.stats
    lanes = getattr(stats, "lanes", {}) or {}
    return {
        "url": view.url,
        "limit": view.limit,
        "health": str(view.health),
        "lanes": {
            name: {k: getattr(lane, k, None) for k in ("limit", "done", "failed", "p50", "p99")}
            for name, lane in lanes.items()
        },
        "control": repr(getattr(stats, "control", None))[:300],
    }


# -- the background load on one replica ------------------------------------------------------------
@dataclass
class Background:
    """Long unique prompts sent straight to one replica at ``rate`` a second (open loop).

    An open loop sends as much background work per second whatever the leg does, so a leg that
    spares the slowed replica does not let more background through (with a closed loop it would,
    and that background would then churn the replica's prefix cache more). The prompts are
    random token ids (never a prefix-cache hit), ``prompt_tokens`` long, so the prefix-cache
    queries they cause are known exactly: ``counted_tokens`` sums those sent after
    :meth:`count_from_now`.
    """

    url: str
    rate: float = 3.0
    prompt_tokens: int = 1200
    max_tokens: int = 64
    seed: int = 0
    vocab: tuple[int, int] = (4, 512)  # the tiny model's ids past its special tokens

    def __post_init__(self) -> None:
        self.sent = 0
        self.done = 0
        self.failed = 0
        self.counted_tokens = 0
        self._counting = False
        self._rng = random.Random(self.seed)
        self._tasks: set[asyncio.Task[None]] = set()
        self._loop_task: asyncio.Task[None] | None = None

    def counts(self) -> dict[str, int]:
        return {
            "sent": self.sent,
            "done": self.done,
            "failed": self.failed,
            "counted_tokens": self.counted_tokens,
        }

    def count_from_now(self) -> None:
        self._counting = True

    async def _one(self, http: Any, prompt: list[int]) -> None:
        try:
            response = await http.post(
                self.url + "/v1/completions",
                json={
                    "model": MODEL,
                    "prompt": prompt,
                    "max_tokens": self.max_tokens,
                    "ignore_eos": True,
                },
            )
            response.raise_for_status()
            self.done += 1
        except asyncio.CancelledError:
            raise
        except Exception:  # counted; the background keeps going
            self.failed += 1

    async def _loop(self, http: Any) -> None:
        low, high = self.vocab
        loop = asyncio.get_running_loop()
        due = loop.time()
        while True:
            # on an absolute schedule: a late wake-up (the leg's own client keeps this event
            # loop busy) sends what was due at once, so the rate holds whatever the leg does
            due += self._rng.expovariate(self.rate)
            await asyncio.sleep(max(0.0, due - loop.time()))
            prompt = [self._rng.randrange(low, high) for _ in range(self.prompt_tokens)]
            task = asyncio.create_task(self._one(http, prompt))
            self.sent += 1
            if self._counting:
                self.counted_tokens += self.prompt_tokens
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def stop_and_drain(self, timeout: float = 300.0) -> None:
        """Send no more; wait for those sent to end (their prefix-cache queries all counted)."""
        if self._loop_task is not None:
            self._loop_task.cancel()
            await asyncio.gather(self._loop_task, return_exceptions=True)
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=timeout)

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[Background]:
        if self.rate <= 0:
            yield self
            return
        async with unbounded_http() as http:
            self._loop_task = asyncio.create_task(self._loop(http))
            try:
                yield self
            finally:
                for task in (self._loop_task, *self._tasks):
                    task.cancel()
                await asyncio.gather(self._loop_task, *self._tasks, return_exceptions=True)


# -- one leg ---------------------------------------------------------------------------------------
async def metrics_of(http: Any, urls: Sequence[str]) -> list[dict[str, float]]:
    texts = await asyncio.gather(*(http.get(u + "/metrics") for u in urls))
    return [read_counters(t.text) for t in texts]


def loadavg() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "?"


async def run_leg(
    leg: str,
    run: int,
    urls: Sequence[str],
    items: Sequence[Item],
    args: argparse.Namespace,
    router: Path | None,
) -> dict[str, Any]:
    load_before = loadavg()
    async with (
        unbounded_http() as http,
        sender(leg, urls, router) as (send, facts),
    ):
        # The background goes to the slowed replica directly in every leg, routers' included
        # (each peer meets the same slowed replica; a router learns of that load only as
        # dsclient does, from what the replica answers). The same seed in every leg and run.
        via_router = False
        background = Background(
            urls[-1],
            args.background,
            args.background_prompt,
            args.background_tokens,
            seed=args.seed,
        )
        async with background.running():
            # the slowed replica is already busy when the leg starts
            await asyncio.sleep(args.background_lead)
            before = await metrics_of(http, urls)
            background.count_from_now()
            bg_before = background.counts()
            t0 = time.monotonic()
            outcomes = await drive(items, send)
            drained = time.monotonic()
            await background.stop_and_drain()
            facts["background_drain_s"] = round(time.monotonic() - drained, 1)
            after = await metrics_of(http, urls)
            bg_after = background.counts()
    deltas = counter_deltas(before, after)
    facts["last_answer_s"] = last_answers(facts.pop("finished", []), t0)
    facts["background_via"] = "router" if via_router else "replica B"
    bg = {k: bg_after[k] - bg_before[k] for k in bg_after}
    served = [d["success"] for d in deltas]
    if not via_router:  # through a router, which replica ran the background is not known
        served[-1] -= bg["done"]
    row: dict[str, Any] = {"run": run, "leg": leg, **leg_stats(outcomes)}
    row.update(hit_rate(deltas, bg["counted_tokens"]))
    row.update(
        served=served,
        preemptions=[d["preemptions"] for d in deltas],
        per_server=deltas,
        background=bg,
        load=f"{load_before} -> {loadavg()}",
        facts=facts,
    )
    return row


# -- replicas --------------------------------------------------------------------------------------
@contextlib.contextmanager
def replicas(args: argparse.Namespace) -> Iterator[list[str]]:
    """Two tiny-vLLM replicas with a small KV cache (or the ``--urls`` given)."""
    if args.urls:
        yield [u.rstrip("/") for u in args.urls.split(",")]
        return
    from dsclient.launcher import launch, make_tiny_model, resolve_server_python

    install = resolve_server_python()
    say(f"vLLM: {install.dist} {install.version} ({install.python})")
    model = make_tiny_model(python=install.python)
    group = launch(
        model,
        python=install.python,
        max_num_seqs=args.max_num_seqs,
        max_model_len=2048,
        served_model_name=MODEL,
        dtype="float32",
        replicas=2,
        extra_args=[
            "--num-gpu-blocks-override", str(args.blocks), "--enable-prefix-caching",
            *REPLICA_ARGS,
        ],
        startup_timeout=args.startup_timeout,
        progress=lambda m: say(f"[vllm] {m}"),
    )
    with group:
        yield list(group.urls)


async def cache_facts(urls: Sequence[str], sample: str) -> dict[str, Any]:
    """What the replicas say about their KV cache, and the token count of one long prompt."""
    import httpx

    found: dict[str, Any] = {}
    async with httpx.AsyncClient(timeout=30.0) as http:
        text = (await http.get(urls[0] + "/metrics")).text
        for line in text.splitlines():
            if line.startswith("vllm:cache_config_info{"):
                labels = line[line.index("{") + 1 : line.rindex("}")]
                for part in labels.split('",'):
                    key, _, value = part.partition("=")
                    if key in (
                        "block_size",
                        "num_gpu_blocks",
                        "enable_prefix_caching",
                        "num_gpu_blocks_override",
                    ):
                        found[key] = value.strip('"')
        tok = await http.post(urls[0] + "/tokenize", json={"model": MODEL, "prompt": sample})
        found["long_prompt_tokens"] = tok.json().get("count")
    return found


def kept(row: dict[str, Any]) -> dict[str, Any]:
    """A leg's summary as :meth:`Run.add` keeps it: scalars, one per replica where it matters."""
    keys = [
        "makespan_s", "requests", "failed", "hit_rate", "hit_rate_own",
        *(f"{kind}_{stat}" for kind in ("short", "long")
          for stat in ("n", "p50_s", "p95_s", "p99_s", "max_s")),
    ]  # fmt: skip
    found: dict[str, Any] = {key: row.get(key) for key in keys}
    for name, values in (("served", row.get("served")), ("preemptions", row.get("preemptions"))):
        for label, value in zip("ab", values or [], strict=False):
            found[f"{name}_{label}"] = value
    background = row.get("background") or {}
    found.update(
        background_sent=background.get("sent"),
        background_done=background.get("done"),
        background_failed=background.get("failed"),
        background_via=(row.get("facts") or {}).get("background_via"),
    )
    errors = row.get("errors") or {}
    if errors:
        found["first_error"] = str(next(iter(errors)))[:120]
    return found


async def run_all(
    urls: list[str], args: argparse.Namespace, router: Path | None, record: Run | None = None
) -> dict[str, Any]:
    shape = shape_of(args)
    sample = make_workload(
        Shape(long=1, short=0, prefixes=1, prefix_words=args.prefix_words), args.seed
    )
    facts = await cache_facts(urls, sample[0].prompt)
    say(f"replicas {urls}; cache {facts}")
    say("warm-up: 24 requests round-robin (not counted) ...")
    warm = make_workload(
        Shape(long=16, short=8, prefixes=2, prefix_words=50, short_window_s=1.0), args.seed - 1
    )
    async with unbounded_http() as http:
        turn = iter(range(10**9))
        await drive(warm, lambda it: post_completion(http, urls[next(turn) % 2], it))
    rows = []
    for run in range(1, args.runs + 1):
        for leg in leg_order(args.legs, run):
            items = make_workload(shape, args.seed, salt_for(args.seed, run, leg))
            say(f"run {run} {leg}: {len(items)} requests ...")
            row = await run_leg(leg, run, urls, items, args, router)
            say(
                "  "
                + json.dumps({k: v for k, v in row.items() if k not in ("per_server", "facts")})
            )
            rows.append(row)
            if record is not None:
                record.add(leg=leg, run=run, **kept(row))
            await asyncio.sleep(args.pause)
    return {"cache": facts, "rows": rows}


def shape_of(args: argparse.Namespace) -> Shape:
    return Shape(
        long=args.long,
        short=args.short,
        prefixes=args.prefixes,
        prefix_words=args.prefix_words,
        short_window_s=args.short_window,
        long_window_s=args.long_window,
    )


def legs_arg(text: str) -> list[str]:
    legs = [x.strip() for x in text.split(",") if x.strip()]
    known = (*LEGS, *DIAGNOSTIC_LEGS)
    unknown = [x for x in legs if x not in known]
    if unknown or not legs:
        raise argparse.ArgumentTypeError(f"legs must be among {', '.join(known)}; got {text!r}")
    return legs


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks routing", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--urls", help="two running vLLMs, comma-separated (default: launch two)")
    p.add_argument("--legs", type=legs_arg, default=list(LEGS), help=",".join(LEGS))
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--seed", type=int, default=16)
    p.add_argument("--long", type=int, default=Shape.long, help="requests on shared prefixes")
    p.add_argument("--short", type=int, default=Shape.short, help="short interactive requests")
    p.add_argument("--prefixes", type=int, default=Shape.prefixes)
    p.add_argument("--prefix-words", type=int, default=Shape.prefix_words)
    p.add_argument("--short-window", type=float, default=Shape.short_window_s, help="seconds")
    p.add_argument(
        "--long-window",
        type=float,
        default=5.0,
        help="seconds over which long requests arrive (0: all at once)",
    )
    p.add_argument("--blocks", type=int, default=96, help="KV blocks per replica (128 tokens each)")
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument(
        "--background", type=float, default=3.0, help="background requests a second on B (0: none)"
    )
    p.add_argument("--background-prompt", type=int, default=1200, help="tokens per prompt")
    p.add_argument("--background-tokens", type=int, default=64)
    p.add_argument("--background-lead", type=float, default=2.0, help="seconds before a leg")
    p.add_argument("--pause", type=float, default=3.0, help="seconds between legs")
    p.add_argument("--router-venv", type=Path, default=ROUTER_VENV)
    p.add_argument("--startup-timeout", type=float, default=600.0)
    p.add_argument("--no-save", action="store_true", help="keep no results file (a try-out)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    began = machine()
    router = (
        ensure_router(args.router_venv) if any(leg in ROUTER_POLICY for leg in args.legs) else None
    )
    record = Run.begin(
        "routing",
        params={k: (os.fspath(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
                if k != "no_save"},
        versions={"vllm-router": router_version(args.router_venv) if router else None},
    )
    record.fact("legs", {leg: ABOUT[leg] for leg in args.legs if leg in ABOUT})
    with replicas(args) as urls:
        # Two replicas take a CPU each on the 2-core machine: nothing is left for the client,
        # which shares them (recorded as not apart); the replicas themselves are the launcher's.
        pin_process(START_CPUS)
        record.fact("placement", placement_facts(None, [server_group(u) for u in urls]))
        found = asyncio.run(run_all(urls, args, router, record))
    record.fact("cache", found["cache"])
    rows = found["rows"]
    summary = summarize(rows)
    payload = {
        "machine": began,
        "ended": time.strftime("%Y-%m-%d %H:%M:%S"),
        "args": {k: (os.fspath(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "shape": asdict(shape_of(args)),
        "cache": found["cache"],
        "router": {"package": ROUTER_PACKAGE, "binary": os.fspath(router) if router else None,
                   "version": router_version(args.router_venv) if router else None},
        "goal_met": goal_met(summary),
        "summary": summary,
        "rows": rows,
    }  # fmt: skip
    path = write_results(f"routing-{time.strftime('%Y%m%d-%H%M%S')}", payload)
    print(report(rows, summary))
    say(f"raw results: {path}" + ("" if args.no_save else f"; kept: {record.save()}"))


ABOUT = {
    "dsclient": "`AsyncClient([url_a, url_b])` defaults, one `generate()` per request",
    "round-robin": "httpx alternating the two URLs, unbounded",
    "router-rr": f"httpx, unbounded, through vllm-router {ROUTER_VERSION} `--policy round_robin`",
    "router-cache": f"the same, `--policy cache_aware {' '.join(ROUTER_SETTINGS['cache_aware'])}`",
    "router-p2": "the same, `--policy power_of_two`",
    "router-cache+priority": "router-cache, each request sending vLLM's `priority` (shorts 0, "
    "longs 1) to replicas scheduling by it",
}

TABLE = (
    report_.Column("makespan s", "makespan_s", 1),
    report_.Column("short {tail} s", "short_{tail}_s", count="short_n"),
    report_.Column("long {tail} s", "long_{tail}_s", count="long_n"),
    report_.Column("prefix hit rate (own)", "hit_rate_own", 3),
    report_.Column("served by A", "served_a", 0),
    report_.Column("served by B (slowed)", "served_b", 0),
    report_.Column("failed", "failed", 0),
)


def render(records: Sequence[dict[str, Any]]) -> str:
    """One line per leg: makespan, tails, hit rate, where requests went; median (range)."""
    record = report_.latest(records)
    assert record is not None
    about = record.get("facts", {}).get("legs", ABOUT)
    table = report_.leg_table(record["rows"], TABLE, about=about)
    return table + "\n\n" + report_.conditions(record, records)


def headline(records: Sequence[dict[str, Any]]) -> list[report_.Versus]:
    """dsclient over each other leg, per run: makespan, short and long tails, hit rate."""
    record = report_.latest(records)
    if record is None:
        return []
    rows = record["rows"]
    lines = []
    for peer in report_.legs(rows):
        if peer == "dsclient" or peer in DIAGNOSTIC_LEGS:
            continue
        pair = [r for r in rows if r["leg"] in ("dsclient", peer)]  # the tail both support
        short = report_.resolve(report_.Column("", "short_{tail}_s", count="short_n"), pair)[1]
        long_ = report_.resolve(report_.Column("", "long_{tail}_s", count="long_n"), pair)[1]
        figures = [
            ("makespan", "makespan_s", ""),
            ("short-request tail", short, short.split("_")[1]),
            ("long-request tail", long_, long_.split("_")[1]),
            ("other", "hit_rate_own", "prefix hit rate (higher is better)"),
        ]
        for column, key, label in figures:
            found = report_.ratios(rows, key, peer)
            if found:
                higher = key == "hit_rate_own"
                lines.append(report_.Versus("routing", peer, column, found, label,
                                            higher_better=higher))  # fmt: skip
        lines += report_.failures(rows, "failed", peer, "routing")
    return lines


def router_version(venv: Path) -> str | None:
    """The vllm-router installed in ``venv`` (its own interpreter's metadata), or ``None``."""
    code = "import importlib.metadata as m; print(m.version('vllm-router'))"
    done = subprocess.run(
        [os.fspath(venv / "bin" / "python"), "-c", code],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    return done.stdout.strip() or None if done.returncode == 0 else None


if __name__ == "__main__":
    main()
