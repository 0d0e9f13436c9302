"""Which server takes the next attempt: load, prefix affinity and a circuit breaker, no I/O.

:class:`Router` is the policy the multi-server client asks for each attempt
(``dsclient.governor._pool``); it holds no connection and never sleeps.

Typical use (the caller owns the I/O: it reads ``/metrics`` and ``/health``, sends, and reports)::

    router = Router()
    states = [ServerState(url=u, models=frozenset({"tiny"}), limit=8, in_flight=n) for u, n in ...]
    decision = router.choose(states, RouteRequest(model="tiny", prefix="You are a helpful ..."))
    if isinstance(decision, Route):
        ...                                    # send to decision.url, then:
        router.record_success(decision.url)    # or router.record_failure(url, "timeout")
    elif isinstance(decision, Wait):
        ...                                    # hold the call on the client; ask again later
    else:                                      # NoServer: no server serves that model
        raise ...

The rules, in order (each one tested in ``tests/test_routing.py``):

1. **Model.** Only servers whose ``models`` list the requested model; none: :class:`NoServer`.
2. **Breaker.** Servers whose :class:`CircuitBreaker` is open or half-open, or whose last health
   probe failed, take no requests. All of them out: :class:`Wait` until the earliest probe.
3. **Room.** A server takes a request only while ``in_flight < limit`` (the client's closed-loop
   limit for it). None has room: :class:`Wait`; the call waits on the client, never in one
   server's queue while another has room. A retry names the servers it failed on
   (``RouteRequest.avoid``): they are used only when no other server is in rotation.
4. **Idle first.** When some candidate is idle (nothing in flight, nothing queued, fresh
   metrics), a candidate with a queue at the server is never chosen.
5. **Balance escape** (vllm-router's / SGLang's cache-aware policy): when the busiest and the
   least busy candidates differ by more than ``balance_abs`` requests *and* the busiest has more
   than ``balance_rel`` times the least, prefix affinity is ignored and the least loaded wins.
6. **Prefix** (the cache-aware policy of vllm-router and SGLang's router), among the
   unsaturated candidates (all of them when every one is): when the best share of the
   request's leading blocks a candidate holds reaches ``cache_threshold`` (0.5), the candidates
   with that best match are the only ones left (the score breaks their ties). Below it, no
   server holds the prefix: the score spreads the new prefix by load.
7. **Score** (llm-d's endpoint picker weights): ``2 x queue + 2 x KV + 3 x prefix`` plus
   ``2 x room`` (the client's own view, which llm-d does not have), among the same
   candidates. A server is saturated when ``max(waiting / 5, kv_usage / 0.8) >= 1`` or
   when its metrics are older than ``stale_after``. Ties go to the random source.

Prefix affinity is approximate, as in those routers: each server keeps an LRU set of the chained
block hashes of the prefixes routed to it (:class:`PrefixIndex`); a request's match is the
share of its leading blocks found there. The router records a request's blocks on the server it
chose. vLLM's own evictions are not seen, so the LRU's size should be about the server's KV
cache in blocks.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

__all__ = [
    "BreakerState",
    "CircuitBreaker",
    "FailureKind",
    "NoServer",
    "PrefixIndex",
    "Route",
    "RouteRequest",
    "Router",
    "RoutingPolicy",
    "ServerState",
    "Wait",
    "prefix_blocks",
    "prefix_text",
]

BreakerState = Literal["closed", "open", "half_open"]
#: ``"connect"``: refused or reset before an answer (the process is gone): ejects at once.
#: ``"timeout"`` / ``"server_error"`` (5xx other than overload): count toward ``eject_after``.
FailureKind = Literal["connect", "timeout", "server_error"]


#: Prefix-index size per server until its KV cache size is known (``RoutingPolicy.index_blocks``).
_DEFAULT_INDEX_BLOCKS = 8192

#: Characters per token, to size an index of character blocks to a cache counted in tokens.
CHARS_PER_TOKEN = 4.0


# --- inputs ------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class ServerState:
    """One server as the client sees it at the moment of choosing.

    ``ServerState(url="http://10.0.0.5:8000", models=frozenset({"tiny"}), limit=8, in_flight=3,
    waiting=0, kv_usage=0.2, metrics_age=0.1)``

    Parameters:
        url: the server's root URL (the key the router keeps its state by).
        models: the served model names; a server listing none is never chosen for a model.
        limit: the client's limit for it (closed-loop); ``in_flight < limit`` means room.
        in_flight: the client's requests at that server now.
        running: sequences in the server's batch (from ``/metrics``), or ``None``; carried for
            the caller's statistics: the score reads the queue and the KV cache, as llm-d's.
        waiting: requests in the server's own queue (from ``/metrics``), or ``None``.
        kv_usage: share of its KV cache in use, ``[0, 1]``, or ``None``.
        metrics_age: seconds since those gauges were read; ``None`` when the server publishes
            none (then the client-side counts stand for them, and they are never stale).
        healthy: the last health probe's verdict (``False`` ejects it); ``None``: not probed.
        room: whether the server takes this request now, when the caller knows better than
            ``in_flight < limit`` (a governor whose lane or group cap is full); ``None``: that.
    """

    url: str
    models: frozenset[str]
    limit: int
    in_flight: int
    running: int | None = None
    waiting: int | None = None
    kv_usage: float | None = None
    metrics_age: float | None = None
    healthy: bool | None = None
    room: bool | None = None

    def has_room(self) -> bool:
        """``room`` when given, else ``in_flight < limit``."""
        return self.in_flight < self.limit if self.room is None else self.room

    def __post_init__(self) -> None:
        if self.limit < 0:
            raise ValueError(f"ServerState.limit must be >= 0, got {self.limit!r}")
        if self.in_flight < 0:
            raise ValueError(f"ServerState.in_flight must be >= 0, got {self.in_flight!r}")
        if self.kv_usage is not None and not 0.0 <= self.kv_usage <= 1.0:
            raise ValueError(f"ServerState.kv_usage must be in [0, 1], got {self.kv_usage!r}")


@dataclass(frozen=True, kw_only=True)
class RouteRequest:
    """What the router needs of a request: its model and, for affinity, its prefix.

    ``RouteRequest(model="tiny", prefix=system_prompt + document)`` or
    ``RouteRequest(model="tiny", blocks=token_block_hashes)``

    Parameters:
        model: the model the request names; ``None``: any server.
        prefix: the text whose beginning identifies a cached prefix (hashed into blocks).
        blocks: chained hashes of the request's token blocks (e.g. vLLM's block hashes); when
            given, ``prefix`` is not used.
        avoid: servers this attempt should not go to (where its previous attempt failed): they
            are chosen only when no other server for the model is in rotation; when the others
            are merely full, the attempt waits for them.
    """

    model: str | None = None
    prefix: str | None = None
    blocks: tuple[Hashable, ...] | None = None
    avoid: frozenset[str] = frozenset()

    def block_keys(self, block_chars: int) -> tuple[Hashable, ...]:
        """The request's block hashes: ``blocks`` as given, else ``prefix`` hashed."""
        if self.blocks is not None:
            return self.blocks
        if self.prefix:
            return prefix_blocks(self.prefix, block_chars)
        return ()


def prefix_text(prompt: object) -> str:
    """The text whose beginning a router matches against cached prefixes: the prompt, or the
    messages' roles and contents in order (at most 64 KiB of it)."""
    if isinstance(prompt, str):
        return prompt[:65536]
    if not isinstance(prompt, Iterable):
        return ""
    parts: list[str] = []
    size = 0
    for m in prompt:
        content = m.get("content") if isinstance(m, Mapping) else None
        text = content if isinstance(content, str) else json.dumps(content, default=str)
        part = f"<{m.get('role') if isinstance(m, Mapping) else ''}>{text}\n"
        parts.append(part)
        size += len(part)
        if size >= 65536:
            break
    return "".join(parts)[:65536]


def prefix_blocks(text: str, block_chars: int = 256) -> tuple[str, ...]:
    """Chained hashes of ``text``'s whole blocks of ``block_chars`` characters.

    ``prefix_blocks("a" * 600, 256)`` has 2 entries; the i-th depends on every character before
    the end of block i, so two texts share the i-th hash exactly when they share that prefix
    (as vLLM's block hashes do for tokens). A trailing partial block is left out, like vLLM's.
    """
    if block_chars < 1:
        raise ValueError(f"block_chars must be >= 1, got {block_chars!r}")
    out: list[str] = []
    previous = b""
    for start in range(0, len(text) - block_chars + 1, block_chars):
        chunk = text[start : start + block_chars].encode("utf-8", "surrogatepass")
        previous = hashlib.blake2b(previous + chunk, digest_size=12).digest()
        out.append(previous.hex())
    return tuple(out)


@dataclass(frozen=True, kw_only=True)
class RoutingPolicy:
    """The router's knobs; the defaults are those of the routers named beside each.

    ``RoutingPolicy(balance_abs=64, balance_rel=1.5)``

    Parameters:
        queue_weight, kv_weight, prefix_weight: llm-d's endpoint picker (2, 2, 3).
        room_weight: weight of the client's free room under its limit (2, as queue and KV).
        queue_threshold, kv_threshold: saturated at ``max(waiting / 5, kv / 0.8) >= 1`` (llm-d's
            saturation detector).
        stale_after: metrics older than this (seconds) count as saturated. The client reads
            ``/metrics`` every 0.25 s; 2 s is eight missed reads, not one slow answer.
        balance_abs, balance_rel: plain load balancing when ``max - min > 64`` and
            ``max > 1.5 x min`` in-flight requests (the cache-aware policy of vllm-router).
        cache_threshold: the share of a request's leading blocks a server must hold for the
            prefix alone to choose among the candidates (SGLang's router: 0.5). Scored as one
            term among four, the prefix lost to one request's difference in queue length (the
            queue term is normalised over the candidates), and the benchmark's hit rate was
            below round-robin's.
        block_chars: characters per prefix block when hashing text prefixes.
        index_blocks: how many block hashes each server's :class:`PrefixIndex` keeps; ``None``
            (default): as many as the server's KV cache holds, from its ``/metrics``
            (:meth:`Router.size_index`; about 4 characters a token), and 8192 until that is known.
            An index larger than the cache claims prefixes vLLM has evicted.
        eject_after: consecutive timeouts or 5xx that open a server's breaker (see
            :class:`CircuitBreaker` for why 3).
        backoff_base, backoff_cap: seconds before the first / at most before any half-open
            probe; doubled per consecutive opening, with jitter.
    """

    queue_weight: float = 2.0
    kv_weight: float = 2.0
    prefix_weight: float = 3.0
    room_weight: float = 2.0
    queue_threshold: float = 5.0
    kv_threshold: float = 0.8
    stale_after: float = 2.0
    balance_abs: int = 64
    balance_rel: float = 1.5
    cache_threshold: float = 0.5
    block_chars: int = 256
    index_blocks: int | None = None
    eject_after: int = 3
    backoff_base: float = 1.0
    backoff_cap: float = 30.0

    def __post_init__(self) -> None:
        for name in ("queue_weight", "kv_weight", "prefix_weight", "room_weight"):
            if getattr(self, name) < 0:
                raise ValueError(f"RoutingPolicy.{name} must be >= 0, got {getattr(self, name)!r}")
        for name in ("queue_threshold", "kv_threshold", "stale_after", "backoff_base"):
            if not getattr(self, name) > 0:
                raise ValueError(f"RoutingPolicy.{name} must be > 0, got {getattr(self, name)!r}")
        if self.backoff_cap < self.backoff_base:
            raise ValueError(
                f"RoutingPolicy.backoff_cap ({self.backoff_cap}) must be >= backoff_base"
                f" ({self.backoff_base})"
            )
        if not 0 < self.cache_threshold <= 1:
            raise ValueError(
                f"RoutingPolicy.cache_threshold must be in (0, 1], got {self.cache_threshold!r}"
            )
        if self.balance_abs < 0 or self.balance_rel < 1:
            raise ValueError("RoutingPolicy.balance_abs must be >= 0 and balance_rel >= 1")
        if self.index_blocks is not None and self.index_blocks < 1:
            raise ValueError(f"RoutingPolicy.index_blocks must be >= 1, got {self.index_blocks!r}")
        for name in ("block_chars", "eject_after"):
            if getattr(self, name) < 1:
                raise ValueError(f"RoutingPolicy.{name} must be >= 1, got {getattr(self, name)!r}")


# --- outputs -----------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class Route:
    """Send the attempt to ``url``.

    ``reason``: ``"score"`` (the weighted score chose), ``"prefix"`` (the only candidate holding
    the request's prefix), ``"balance"`` (the load-balance escape chose the least loaded) or
    ``"only"`` (one candidate). ``prefix_match`` is the share of the
    request's blocks the chosen server was known to hold; ``scores`` every candidate's score.
    """

    url: str
    reason: Literal["score", "prefix", "balance", "only"]
    prefix_match: float = 0.0
    scores: Mapping[str, float] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class Wait:
    """No server can take the attempt now; hold it on the client and ask again.

    ``reason``: ``"full"`` (every eligible server is at its limit: ask when a slot frees) or
    ``"ejected"`` (every server for the model is out of rotation). ``probe_at`` is the clock
    time of the earliest half-open probe, when one is due (``None`` otherwise).
    """

    reason: Literal["full", "ejected"]
    probe_at: float | None = None


@dataclass(frozen=True, kw_only=True)
class NoServer:
    """No server serves ``model``: waiting will not help (the caller raises)."""

    model: str | None
    served: frozenset[str]


Decision = Route | Wait | NoServer


# --- the circuit breaker -----------------------------------------------------------------------


class CircuitBreaker:
    """Per-server eject / probe / readmit state: closed -> open -> half-open -> closed.

    Example::

        breaker = CircuitBreaker(eject_after=3, clock=clock, rng=random.Random(0))
        breaker.record_failure("connect")   # open at once: the process is gone
        breaker.state                       # "open"; "half_open" once breaker.probe_at passes
        breaker.record_probe(healthy=True)  # "closed"

    * **Closed**: requests flow. ``eject_after`` consecutive timeouts / 5xx, one refused
      connection, or one failed health probe open it. Overload answers (429, 503 "busy") are
      not failures: the governor slows down for those; a server that says it is full is alive.
    * **Open**: no requests. After a backoff of ``base x 2^(openings - 1)`` seconds (at most
      ``cap``), jittered into its upper half (so probes of many clients spread, and none comes
      at once), it turns half-open.
    * **Half-open**: still no requests; the caller probes ``/health`` (:attr:`probe_due`).
      Healthy: closed. Unhealthy: open again with the next, longer backoff. Requests never
      test a half-open server, so none is spent on a server that may be dead.
    * The openings count resets only on a request that succeeded, not on a probe: a server
      that answers ``/health`` but fails every request backs off further each time.

    Why 3 and 1 s - 30 s, against vllm-router's 10 failures and 60 s: a router in front of the
    servers learns of a dead one only from failed requests; this client also reads each
    server's ``/metrics`` (every 0.25 s) and ``/health``, so a refused connection or a failed
    probe is already proof. Three consecutive timeouts / 5xx tell a sick server from one slow
    answer, and at 8-64 requests in flight per server, ten would fail a batch's worth of
    attempts first. A vLLM on CPU restarts in 45-55 s here: a fixed 60 s would keep a restarted
    server out for longer than it was down, while a /health probe costs one GET.

    Parameters:
        eject_after: consecutive timeouts / 5xx that open it.
        backoff_base, backoff_cap: the backoff's first and largest value, seconds.
        clock: monotonic seconds (injected for tests).
        rng: the jitter's random source (injected for tests).
    """

    def __init__(
        self,
        *,
        eject_after: int = 3,
        backoff_base: float = 1.0,
        backoff_cap: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
    ) -> None:
        if eject_after < 1:
            raise ValueError(f"eject_after must be >= 1, got {eject_after!r}")
        if not 0 < backoff_base <= backoff_cap:
            raise ValueError(
                f"need 0 < backoff_base <= backoff_cap, got {backoff_base!r}, {backoff_cap!r}"
            )
        self.eject_after = eject_after
        self.backoff_base = backoff_base
        self.backoff_cap = backoff_cap
        self._clock = clock
        self._rng = rng or random.Random()
        self._failures = 0
        self._openings = 0
        self._open_until: float | None = None  # None: closed
        self.last_reason: str | None = None

    def __repr__(self) -> str:
        return f"<CircuitBreaker {self.state} failures={self._failures} openings={self._openings}>"

    @property
    def state(self) -> BreakerState:
        """``"closed"``, ``"open"`` or ``"half_open"`` (open and its backoff has passed)."""
        if self._open_until is None:
            return "closed"
        return "half_open" if self._clock() >= self._open_until else "open"

    @property
    def allows_requests(self) -> bool:
        """Whether requests may go to the server (closed only)."""
        return self._open_until is None

    @property
    def probe_due(self) -> bool:
        """Whether the caller should probe ``/health`` now (half-open)."""
        return self.state == "half_open"

    @property
    def probe_at(self) -> float | None:
        """Clock time the breaker turns half-open; ``None`` while closed."""
        return self._open_until

    @property
    def consecutive_failures(self) -> int:
        """Failures since the last success (closed state)."""
        return self._failures

    def backoff(self, openings: int) -> float:
        """The jittered wait before the half-open probe after the ``openings``-th opening.

        ``d = min(cap, base x 2^(openings - 1))``, drawn uniformly from ``[d / 2, d]``.
        """
        ceiling = min(self.backoff_cap, self.backoff_base * 2.0 ** max(0, openings - 1))
        return ceiling / 2 + self._rng.uniform(0.0, ceiling / 2)

    def _open(self, reason: str) -> None:
        self._openings += 1
        self._failures = 0
        self._open_until = self._clock() + self.backoff(self._openings)
        self.last_reason = reason

    def record_success(self) -> None:
        """A request succeeded on the server: closed, and the backoff starts over."""
        self._failures = 0
        self._openings = 0
        self._open_until = None
        self.last_reason = None

    def record_failure(self, kind: FailureKind) -> None:
        """A request failed on the server (not an overload answer: those are not failures)."""
        if self._open_until is not None:
            return  # already out; a late failure of a request sent before does not extend it
        if kind == "connect":
            self._open("connection refused")
            return
        self._failures += 1
        if self._failures >= self.eject_after:
            self._open(f"{self._failures} consecutive {kind.replace('_', ' ')}s")

    def record_probe(self, *, healthy: bool) -> None:
        """A ``/health`` probe's verdict: healthy closes a half-open breaker (and keeps a closed
        one closed); unhealthy opens it, with the next backoff."""
        if healthy:
            if self._open_until is not None and self._clock() >= self._open_until:
                self._open_until = None
                self._failures = 0
                self.last_reason = None
            return
        if self._open_until is None or self._clock() >= self._open_until:
            self._open("unhealthy probe")

    def readmit(self) -> None:
        """A health probe answered while every server was out: closed now, without waiting
        for the backoff (calls are waiting for any server; the openings count stays)."""
        self._open_until = None
        self._failures = 0
        self.last_reason = None


# --- the prefix index --------------------------------------------------------------------------


class PrefixIndex:
    """An LRU set of chained block hashes: what one server probably holds in its prefix cache.

    Example::

        index = PrefixIndex(capacity=4)
        index.add(("h1", "h2"))
        index.match(("h1", "h2", "h3"))   # 2: the leading blocks found
    """

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity!r}")
        self.capacity = capacity
        self._blocks: OrderedDict[Hashable, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def match(self, blocks: Sequence[Hashable]) -> int:
        """How many of ``blocks``' leading entries are held (chained hashes: a prefix)."""
        held = 0
        for block in blocks:
            if block not in self._blocks:
                break
            held += 1
        return held

    def add(self, blocks: Iterable[Hashable]) -> None:
        """Record ``blocks`` as held (most recently used); evicts the least recently used."""
        for block in blocks:
            self._blocks[block] = None
            self._blocks.move_to_end(block)
        while len(self._blocks) > self.capacity:
            self._blocks.popitem(last=False)

    def resize(self, capacity: int) -> None:
        """Keep at most ``capacity`` blocks from now on (the least recently used go first)."""
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity!r}")
        self.capacity = capacity
        while len(self._blocks) > capacity:
            self._blocks.popitem(last=False)

    def clear(self) -> None:
        """Forget everything (the server restarted: its cache is empty)."""
        self._blocks.clear()


# --- the router --------------------------------------------------------------------------------


class Router:
    """Choose a server per attempt; keep each server's breaker and prefix index.

    Example::

        router = Router(RoutingPolicy(), clock=time.monotonic, rng=random.Random())
        decision = router.choose(states, RouteRequest(model="tiny", prefix=prompt))

    State is kept by URL, so the caller passes fresh :class:`ServerState` snapshots each time.
    Pure: no I/O, no sleeping; time and randomness come from ``clock`` and ``rng``.
    """

    def __init__(
        self,
        policy: RoutingPolicy | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
    ) -> None:
        self.policy = policy or RoutingPolicy()
        self._clock = clock
        self._rng = rng or random.Random()
        self._breakers: dict[str, CircuitBreaker] = {}
        self._indexes: dict[str, PrefixIndex] = {}

    # -- per-server state --

    def breaker(self, url: str) -> CircuitBreaker:
        """The breaker of ``url`` (made closed on first use)."""
        found = self._breakers.get(url)
        if found is None:
            p = self.policy
            found = CircuitBreaker(
                eject_after=p.eject_after,
                backoff_base=p.backoff_base,
                backoff_cap=p.backoff_cap,
                clock=self._clock,
                rng=self._rng,
            )
            self._breakers[url] = found
        return found

    def index(self, url: str) -> PrefixIndex:
        """The prefix index of ``url`` (empty on first use)."""
        found = self._indexes.get(url)
        if found is None:
            found = PrefixIndex(self.policy.index_blocks or _DEFAULT_INDEX_BLOCKS)
            self._indexes[url] = found
        return found

    def size_index(self, url: str, *, kv_cache_tokens: int) -> None:
        """Size ``url``'s prefix index to its KV cache of ``kv_cache_tokens`` tokens, unless the
        policy names a size (``index_blocks``)."""
        if self.policy.index_blocks is not None or kv_cache_tokens < 1:
            return
        blocks = max(1, int(kv_cache_tokens * CHARS_PER_TOKEN) // self.policy.block_chars)
        index = self.index(url)
        if index.capacity != blocks:
            index.resize(blocks)

    def record_success(self, url: str) -> None:
        """An attempt on ``url`` succeeded."""
        self.breaker(url).record_success()

    def record_failure(self, url: str, kind: FailureKind) -> None:
        """An attempt on ``url`` failed (refused, timed out, 5xx other than overload)."""
        breaker = self.breaker(url)
        before = breaker.allows_requests
        breaker.record_failure(kind)
        if before and not breaker.allows_requests and kind == "connect":
            self.index(url).clear()  # a process that died took its prefix cache with it

    def record_probe(self, url: str, *, healthy: bool) -> None:
        """A ``/health`` probe of ``url`` answered (``healthy``) or not."""
        self.breaker(url).record_probe(healthy=healthy)

    def readmit(self, url: str) -> None:
        """Put ``url`` back in rotation now (see :meth:`CircuitBreaker.readmit`)."""
        self.breaker(url).readmit()

    def probes_due(self, urls: Iterable[str]) -> list[str]:
        """Of ``urls``, those whose breaker is half-open: probe their ``/health`` now."""
        return [u for u in urls if u in self._breakers and self._breakers[u].probe_due]

    def forget(self, url: str) -> None:
        """Drop ``url``'s breaker and prefix index (it left the pool)."""
        self._breakers.pop(url, None)
        self._indexes.pop(url, None)

    # -- choosing --

    def saturated(self, state: ServerState) -> bool:
        """llm-d's rule: ``max(waiting / 5, kv / 0.8) >= 1``, or metrics older than
        ``stale_after``. A server that publishes no metrics (``metrics_age is None``) is judged
        by the client's own counts: saturated when it has no room."""
        p = self.policy
        if state.metrics_age is None:
            return not state.has_room()
        if state.metrics_age > p.stale_after:
            return True
        pressure = max(
            (state.waiting or 0) / p.queue_threshold, (state.kv_usage or 0.0) / p.kv_threshold
        )
        return pressure >= 1.0

    def choose(self, servers: Sequence[ServerState], request: RouteRequest) -> Decision:
        """The server for one attempt of ``request``, or why there is none (see the module)."""
        serving = [s for s in servers if request.model is None or request.model in s.models]
        if not serving:
            served = frozenset(m for s in servers for m in s.models)
            return NoServer(model=request.model, served=served)
        for s in serving:
            if s.healthy is False:
                self.breaker(s.url).record_probe(healthy=False)
        admitted = [s for s in serving if self.breaker(s.url).allows_requests]
        if not admitted:
            due = [self.breaker(s.url).probe_at for s in serving]
            return Wait(reason="ejected", probe_at=min(t for t in due if t is not None))
        # A retry goes elsewhere: to the avoided servers only when no other is in rotation.
        others = [s for s in admitted if s.url not in request.avoid]
        candidates = [s for s in (others or admitted) if s.has_room()]
        if not candidates:
            return Wait(reason="full")
        blocks = request.block_keys(self.policy.block_chars)
        if len(candidates) == 1:
            chosen = candidates[0]
            match = self._match(chosen.url, blocks)
            return self._route(chosen.url, "only", match, blocks, {chosen.url: 0.0})

        # Rule 4: an idle server beats any server with a queue of its own.
        # Stale gauges prove nothing, so a server whose metrics are stale is never "idle".
        idle = [
            s
            for s in candidates
            if s.in_flight == 0 and not (s.waiting or 0) and not self.saturated(s)
        ]
        if idle:
            candidates = [s for s in candidates if not (s.waiting or 0)]

        # Rule 5: the cache-aware policy's escape to plain load balancing.
        loads = [self._load(s) for s in candidates]
        low, high = min(loads), max(loads)
        p = self.policy
        if high - low > p.balance_abs and high > p.balance_rel * low:
            least = [s for s, load in zip(candidates, loads, strict=True) if load == low]
            chosen = least[self._rng.randrange(len(least))]
            match = self._match(chosen.url, blocks)
            return self._route(chosen.url, "balance", match, blocks, {})

        # Rules 6 and 7 among the unsaturated candidates (all of them when every one is).
        fresh = [s for s in candidates if not self.saturated(s)]
        pool = fresh or candidates
        # Rule 6: a server that holds the prefix wins over those that do not.
        if blocks:
            matches = {s.url: self._match(s.url, blocks) for s in pool}
            best_match = max(matches.values())
            if best_match >= p.cache_threshold:
                pool = [s for s in pool if math.isclose(matches[s.url], best_match, abs_tol=1e-9)]
                if len(pool) == 1:
                    return self._route(pool[0].url, "prefix", best_match, blocks, {})
        # Rule 7: the weighted score.
        scores = self._scores(pool, blocks)
        best = max(scores.values())
        top = [s for s in pool if math.isclose(scores[s.url], best, abs_tol=1e-9)]
        chosen = top[self._rng.randrange(len(top))]
        match = self._match(chosen.url, blocks)
        return self._route(chosen.url, "score", match, blocks, scores)

    # -- helpers --

    @staticmethod
    def _load(state: ServerState) -> int:
        """Requests the client has at the server, plus its queue beyond them."""
        return state.in_flight + max(0, (state.waiting or 0) - state.in_flight)

    def match(self, url: str, blocks: Sequence[Hashable]) -> float:
        """The share of ``blocks``' leading entries ``url`` is known to hold (0 to 1)."""
        return self._match(url, blocks)

    def _match(self, url: str, blocks: Sequence[Hashable]) -> float:
        if not blocks:
            return 0.0
        index = self._indexes.get(url)
        return index.match(blocks) / len(blocks) if index is not None else 0.0

    def _scores(self, pool: Sequence[ServerState], blocks: Sequence[Hashable]) -> dict[str, float]:
        p = self.policy
        queues = [s.waiting or 0 for s in pool]
        q_low, q_high = min(queues), max(queues)
        scores: dict[str, float] = {}
        for s, queue in zip(pool, queues, strict=True):
            # llm-d's queue scorer: normalised over the candidates, 1 for the shortest queue.
            queue_score = 1.0 if q_high == q_low else (q_high - queue) / (q_high - q_low)
            # KV scorer: the free share; with no gauge, the client's own share of its limit.
            used = s.kv_usage if s.kv_usage is not None else s.in_flight / max(1, s.limit)
            room = 1.0 - s.in_flight / max(1, s.limit)
            scores[s.url] = (
                p.queue_weight * queue_score
                + p.kv_weight * (1.0 - used)
                + p.prefix_weight * self._match(s.url, blocks)
                + p.room_weight * room
            )
        return scores

    def _route(
        self,
        url: str,
        reason: Literal["score", "prefix", "balance", "only"],
        match: float,
        blocks: Sequence[Hashable],
        scores: Mapping[str, float],
    ) -> Route:
        if blocks:
            self.index(url).add(blocks)
        return Route(url=url, reason=reason, prefix_match=match, scores=dict(scores))
