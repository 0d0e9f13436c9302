"""A server as an object: its URL, what discovery found, its governor, its limit controller and its
load as last seen, with the one task that scrapes that load.

    endpoint = Endpoint("http://127.0.0.1:8000", options, clock=time.monotonic)
    endpoint.seed(info, first_load)          # discovery's facts seed the controller
    async with anyio.create_task_group() as tg:
        tg.start_soon(endpoint.run_poller, http)
        ...                                  # calls take slots from endpoint.governor

Only the controller sets the governor's limit, except under a shared budget (``shared=``, see
``dsclient.governor._shared``): there the governor's limit is the block of leases this process
holds, the
leader's controller sets the shared limit, and the others' controllers wait (they take over from
the shared limit when they become the leader, or from their own share when Redis goes away).
Discovery seeds the controller (the start, the mode, the known ``max_num_seqs``); the poller
feeds it the server's running and waiting counts; the governor feeds it every attempt's outcome.
The poller scrapes only while the governor has traffic, at most once per ``scrape_interval``, and
a call never waits for a scrape.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import anyio

from .._exceptions import DSClientError, decode_text
from .._http import httpx
from .._server_info import ServerInfo
from .._streaming import read_body
from ._control import SLOW_START, CapacityLearner, ControlStats, LimitController, Mode
from ._governor import Governor, GovernorStats, Slot, compute_limit
from ._load import (
    LOAD_HEADER,
    Load,
    parse_llamacpp_slots,
    parse_load,
    parse_load_header,
    parse_sglang_loads,
)

if TYPE_CHECKING:
    from ._shared import SharedBudget, SyncResult

__all__ = [
    "LEARNED_SOURCE",
    "METRICS_BODY_BYTES",
    "ControlOptions",
    "Endpoint",
    "Health",
    "ServerView",
    "fetch_load",
]

logger = logging.getLogger("dsclient")

#: ``ServerInfo.sources["max_num_seqs"]`` once the metrics taught it.
LEARNED_SOURCE = "learned from /metrics (most sequences running while requests waited)"

#: Sources of ``max_num_seqs`` that are guesses, which the metrics may replace.
_GUESSES = frozenset({"default", "ollama default"})

#: Where the limit starts on a server that reports no queue and states no batch: 1, so that a
#: server of one seat never holds more than two waiting (slow start's first step is x3); a
#: start of 5 put four in the queue of such a server before the first epoch was measured.
_BLACKBOX_START = 1

#: Slow start's factor for a controller that takes over a limit already grown (a new leader of
#: a shared budget, or a client falling back from one): ceil(limit x 1.01) is one more a period.
_TAKEOVER_SLOW_START = 1.01

#: Limit changes are logged at INFO at most this often (each at DEBUG).
_LOG_EVERY_S = 2.0


#: ``"up"``: in rotation; ``"down"``: it stopped answering (or failed until ejected), and is
#: probed until it answers again.
Health = Literal["up", "down"]


@dataclass(frozen=True, kw_only=True)
class ServerView:
    """One server as the client sees it now (a snapshot: ``client.servers``).

    ``ServerView(url="http://127.0.0.1:8000", limit=12, in_flight=9, health="up", ...)``

    Parameters:
        url: the server's root URL (without ``/v1``).
        info: what discovery found (``None`` before it ran).
        limit: the client's in-flight limit for this server now.
        in_flight: the client's requests at this server now.
        waiting: calls waiting on the client for a slot at this server.
        load: the server's own gauges as last scraped (``None``: none yet, or none published).
        load_age_s: seconds since that scrape (``None``: never scraped).
        health: ``"up"`` or ``"down"`` (see :data:`Health`).
        stats: per-lane counts and latencies of the attempts sent to it, and its limit's
            control state.
    """

    url: str
    info: ServerInfo | None
    limit: int
    in_flight: int
    waiting: int
    load: Load | None
    load_age_s: float | None
    health: Health
    stats: GovernorStats


@dataclass(frozen=True, kw_only=True)
class ControlOptions:
    """How the client's limit is set (the client's keyword arguments of the same names)."""

    headroom: float = 0.7
    adaptive: bool = True
    limit: int | None = None
    max_limit: int | None = None
    queue_share: float = 0.5
    slow_start: float = SLOW_START
    latency_target: float | None = None
    scrape_interval: float = 0.25


#: The most bytes of a ``/metrics`` answer read. vLLM's is about 50-100 KiB per engine (its
#: histograms carry one series per bucket); 8 MiB covers dozens of data-parallel engines, and a
#: larger answer is not read at all: the scrape counts as failed.
METRICS_BODY_BYTES = 8 * 2**20


#: Where a server's load is read, by route: ``/metrics`` (vLLM, SGLang, llama.cpp with
#: ``--metrics``, TGI), SGLang's ``/v1/loads``, llama.cpp's ``/slots``.
LoadRoute = Literal["/metrics", "/v1/loads", "/slots"]
#: The routes tried, by server kind, in order (``/metrics`` first: it has the most).
_ROUTES: dict[str, tuple[LoadRoute, ...]] = {
    "sglang": ("/metrics", "/v1/loads"),
    "llamacpp": ("/metrics", "/slots"),
}
#: ``ControlStats.signal`` for a load read from each source.
_SIGNALS: dict[str, str] = {
    "sglang /v1/loads": "sglang /v1/loads",
    "llama.cpp /slots": "llama.cpp /slots",
    LOAD_HEADER: LOAD_HEADER,
}


async def _get(http: httpx.AsyncClient, url: str, timeout: float) -> bytes | None:
    """The body of a 200 answer to ``GET url`` (at most :data:`METRICS_BODY_BYTES`), or None."""
    try:
        with anyio.fail_after(timeout):
            request = http.build_request("GET", url, timeout=timeout)
            response = await http.send(request, stream=True)
            try:
                if response.status_code != 200:
                    return None
                return await read_body(response, limit=METRICS_BODY_BYTES, what="load answer")
            finally:
                with anyio.CancelScope(shield=True):
                    await response.aclose()
    except (httpx.HTTPError, TimeoutError, DSClientError) as exc:
        logger.debug("dsclient: reading the load at %s failed: %r", url, exc)
        return None


def _parse_route(route: LoadRoute, body: bytes, model: str | None) -> Load | None:
    if route == "/metrics":
        return parse_load(decode_text(body), model=model)
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if route == "/v1/loads":
        return parse_sglang_loads(obj)
    slots = parse_llamacpp_slots(obj)
    if slots is None:
        return None
    # The queue behind the slots is not in /slots: the endpoint counts this client's requests
    # beyond the busy slots as waiting (:meth:`Endpoint.observe_load`).
    return Load(source="llama.cpp /slots", running=slots[0], waiting=0, max_num_seqs=slots[1])


async def fetch_load(
    http: httpx.AsyncClient,
    url: str,
    *,
    model: str | None,
    timeout: float,
    kind: str | None = None,
    route: LoadRoute | None = None,
) -> Load | None:
    """The server's load: ``GET {url}/metrics`` (at most :data:`METRICS_BODY_BYTES`), and for
    SGLang (``kind="sglang"``) ``/v1/loads`` and for llama.cpp ``/slots`` where ``/metrics``
    gives no queue gauges; ``route`` asks one route only. ``None`` on any failure."""
    routes = (route,) if route is not None else _ROUTES.get(kind or "", ("/metrics",))
    for each in routes:
        body = await _get(http, url + each, timeout)
        load = _parse_route(each, body, model) if body is not None else None
        if load is not None:
            return load
    return None


def _route_of(load: Load) -> LoadRoute:
    if load.source == "sglang /v1/loads":
        return "/v1/loads"
    if load.source == "llama.cpp /slots":
        return "/slots"
    return "/metrics"


class Endpoint:
    """One server: URL, :class:`ServerInfo`, governor, limit controller, load as last seen.

    Parameters:
        url: the server's root URL.
        options: how the limit is controlled.
        governor_options: keyword arguments for :class:`~dsclient.governor._governor.Governor`
            (lanes, groups, queue bound).
        clock: seconds from a monotonic source.
    """

    def __init__(
        self,
        url: str,
        options: ControlOptions,
        governor_options: Mapping[str, Any],
        *,
        start: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.url = url
        self.options = options
        self.info: ServerInfo | None = None
        self.load: Load | None = None
        self.load_at: float | None = None
        self.scrapes = 0
        self._clock = clock
        self.governor = Governor(
            limit=start, clock=clock, on_release=self._released, **governor_options
        )
        self.controller = LimitController(start=start, mode="fixed")
        self.learner = CapacityLearner()
        self._wake: anyio.Event | None = None
        self._raised: list[Callable[[], None]] = []
        self._changed: list[Callable[[], None]] = []
        #: Whether there is traffic to scrape for; default: this server's own calls. A pool of
        #: servers sets it to the pool's traffic, so that every server's gauges stay fresh for
        #: the router while any of them is busy.
        self.traffic: Callable[[], bool] = self._own_traffic
        self._health: Callable[[], Health] = lambda: "up"
        #: Scrape ``/metrics`` under a fixed limit too: a pool's router compares the servers'
        #: queues and KV caches, and gauges from discovery alone go stale at once.
        self.scrape_for_routing = False
        self._logged_at = -math.inf
        self._silenced = 0
        #: The shared budget (``None``: this client's own limit). While ``_shared_active`` the
        #: governor's limit is the block of leases held (1 until the first sync answers).
        self.shared: SharedBudget | None = None
        self._shared_active = False
        self._shared_last: SyncResult | None = None
        #: What drives the limit (``ControlStats.signal``) and where the poller reads the load
        #: (``None``: nowhere; the answers are the signal).
        self.signal = "fixed"
        self.route: LoadRoute | None = None
        #: The load vLLM put on the last answer that carried it, and when (see
        #: :meth:`observe_answer`); ``_fed_at``: when the poller last fed one to the controller.
        self._answer_load: Load | None = None
        self._answer_at: float | None = None
        self._fed_at: float | None = None
        #: When a request last asked for the header (:meth:`ask_load_header`).
        self._load_asked_at = -math.inf
        #: When the last answer came back well (the knee finder's signal).
        self._completed_at: float | None = None

    @property
    def wants_load_header(self) -> bool:
        """Whether requests should ask for the load on their answer (vLLM's
        ``endpoint-load-metrics``): when no route gives the server's queue. An unknown header
        costs other servers nothing; vLLM computes it per answer (and logs it at INFO), so it
        is not asked for where ``/metrics`` already tells."""
        return self.route is None and self.controller.mode != "fixed"

    def ask_load_header(self) -> bool:
        """Whether the request about to go asks for the load on its answer: while
        :attr:`wants_load_header`, one request every half scrape period (the controller reads
        one a period; the answers' lag spreads them).

        Not every request: vLLM builds the header by collecting its whole Prometheus registry
        and logs it at INFO, in its API server, per answer. Asked on every request, a batch of
        1000 short completions through nginx at a fixed 40 in flight took 13.9 s and 11.6 s,
        against 9.6 s and 7.2 s without the header (vLLM 0.32 on this machine's CPU)."""
        if not self.wants_load_header:
            return False
        now = self._clock()
        if now - self._load_asked_at < self.options.scrape_interval / 2:
            return False
        self._load_asked_at = now
        return True

    def _own_traffic(self) -> bool:
        return bool(self.governor.in_flight or self.governor.waiting)

    def _set_limit(self, limit: int, *, batch: int | None) -> None:
        """Set the governor's limit and tell whoever listens (a pool sums its servers' limits)."""
        self.governor.set_limit(limit, batch=batch)
        self._tell_changed()

    def _tell_changed(self) -> None:
        for callback in self._changed:
            callback()

    def on_change(self, callback: Callable[[], None]) -> None:
        """Call ``callback()`` after every change of this server's limit (or its batch, or its
        KV cache)."""
        self._changed.append(callback)

    def use_shared(self, budget: SharedBudget) -> None:
        """Put this endpoint under a shared budget: the limit is 1 until the first sync."""
        self.shared = budget
        self._shared_active = True
        self._set_limit(1, batch=self.controller.capacity)

    def __repr__(self) -> str:
        return (
            f"Endpoint(url={self.url!r}, mode={self.controller.mode!r}, "
            f"limit={self.governor.limit}, in_flight={self.governor.in_flight})"
        )

    # -- seeding -------------------------------------------------------------------------------
    def start_limit(self, info: ServerInfo) -> int:
        """Where the limit starts: ``limit=`` if given, else ``floor(headroom x max_num_seqs)``."""
        if self.options.limit is not None:
            return self.options.limit
        return compute_limit(info.max_num_seqs, self.options.headroom)

    def seed(self, info: ServerInfo, load: Load | None) -> None:
        """Discovery's facts and a first scrape choose the mode and the start; sets the limit."""
        options = self.options
        start = self.start_limit(info)
        mode: Mode
        queue = load is not None and load.running is not None and load.waiting is not None
        self.route = _route_of(load) if load is not None and queue else None
        if not options.adaptive or options.limit is not None:
            mode = "fixed"
        elif queue:
            mode = "metrics"
        else:
            mode = "throughput"
        if mode == "metrics" and load is not None:
            self.signal = _SIGNALS.get(load.source, "/metrics")
        else:
            self.signal = mode
        known = None if info.sources.get("max_num_seqs") in _GUESSES else info.max_num_seqs
        if info.sources.get("max_num_seqs") == LEARNED_SOURCE:
            known = info.max_num_seqs
        self.info = info
        if mode == "throughput" and known is None:
            start = min(start, _BLACKBOX_START)
        self.controller = self._controller(start, mode, known, options.slow_start)
        start = self.controller.limit  # within a hard cap the server states
        if mode == "throughput":
            logger.info(
                "dsclient: %s publishes no queue metrics; the limit starts at %d and finds the "
                "server's knee from its answers (throughput against requests in flight)",
                self.url,
                start,
            )
        if load is not None:
            self.load, self.load_at = load, self._clock()
            self._learn(load)
        if self._shared_active:
            held = self.shared.allowed if self.shared and self._shared_last is not None else 1
            self._set_limit(max(1, held), batch=self.controller.capacity)
        else:
            self._set_limit(start, batch=self.controller.capacity)

    def _reseed(self, start: int) -> None:
        """A fresh controller in the same mode, from ``start`` (the shared limit when this
        client becomes the leader; its own share when it falls back).

        It grows by one a period, not by slow start's factor, until the server queues: the
        limit it starts from was already grown, and doubling it again overshoots the way a cold
        start does (one of the benchmark's leaders took over a limit of 45; it reached 64)."""
        old, options = self.controller, self.options
        if old.mode == "fixed" and options.limit is not None:
            return  # an explicit limit is the same in every client
        self.controller = self._controller(
            max(1, start), old.mode, old.capacity, _TAKEOVER_SLOW_START
        )

    def _controller(
        self, start: int, mode: Mode, capacity: int | None, slow_start: float
    ) -> LimitController:
        """A limit controller with this endpoint's options."""
        options = self.options
        return LimitController(
            start=start,
            mode=mode,
            capacity=capacity,
            ceiling=options.max_limit,
            queue_share=options.queue_share,
            slow_start=slow_start,
            latency_target=options.latency_target,
            period=options.scrape_interval,
            hard_cap=self.info.max_concurrent if self.info is not None else None,
        )

    # -- the shared budget -----------------------------------------------------------------------
    @property
    def shared_active(self) -> bool:
        """Whether the shared budget sets the limit now (``False``: this client's own loop)."""
        return self._shared_active

    @property
    def shared_leader(self) -> bool:
        """Whether this client runs the shared closed loop (scrapes, publishes the limit)."""
        last = self._shared_last
        return self._shared_active and last is not None and last.leader

    def apply_shared(
        self, result: SyncResult, *, became_leader: bool, allowed: int | None = None
    ) -> None:
        """A sync answered: the governor's limit becomes ``allowed`` (the block held, or less
        while the block is over this client's share); a new leader's controller starts from the
        shared limit; the learned capacity is shared."""
        rejoined = not self._shared_active
        self._shared_active = True
        self._shared_last = result
        known = self.controller.capacity
        if result.capacity is not None and (known is None or result.capacity > known):
            self.controller.set_capacity(result.capacity)
        if (became_leader and self.controller.limit != result.limit) or rejoined:
            self._reseed(result.limit)  # the first leader of a budget published its own
        governor = self.governor
        old = governor.limit
        limit = result.granted if allowed is None else allowed
        self._set_limit(max(1, limit), batch=self.controller.capacity)
        if governor.limit > old:
            for callback in list(self._raised):
                callback()

    def leave_shared(self) -> None:
        """Redis does not answer: run this client's own closed loop from the share it held."""
        if not self._shared_active:
            return
        self._shared_active = False
        self._reseed(self.governor.limit)
        self._set_limit(self.controller.limit, batch=self.controller.capacity)

    # -- signals ---------------------------------------------------------------------------------
    def wake(self) -> None:
        """A call started: let the poller run if it sleeps for want of traffic. Cheap."""
        event = self._wake
        if event is not None and not event.is_set():
            event.set()

    def on_raise(self, callback: Callable[[], None]) -> Callable[[], None]:
        """Call ``callback()`` whenever the limit rises (the batch runner adds workers); returns
        a function that removes it."""
        self._raised.append(callback)
        return lambda: self._raised.remove(callback) if callback in self._raised else None

    def _demand(self) -> bool:
        last = self._shared_last
        if self._shared_active and last is not None:
            return last.held_back or self.governor.held_back  # any client held back
        # Only calls the limit holds back ask for more: long calls waiting on their lane's share
        # would not run under a higher limit, and growing for them took the limit to its
        # ceiling (64 against a batch of 8) in the online benchmark.
        return self.governor.held_back

    def observe_answer(self, value: str | None) -> None:
        """An answer came back with vLLM's ``endpoint-load-metrics`` header (``value``; ``None``:
        without it). The poller feeds the freshest to the controller once a period; the first
        one moves a server without another queue signal from throughput mode to the queue."""
        load = parse_load_header(value)
        if load is None:
            return
        now = self._clock()
        self._answer_load, self._answer_at = load, now
        controller = self.controller
        if self.route is None and controller.mode == "throughput" and not self._shared_active:
            # With the queue in view, the black box's cautious start (1) is no longer needed:
            # start where a server that reports its queue starts.
            start = self.governor.limit
            if self.info is not None and self.options.limit is None:
                start = max(start, self.start_limit(self.info))
            self.controller = self._controller(
                start, "metrics", controller.capacity, self.options.slow_start
            )
            self._set_limit(self.controller.limit, batch=self.controller.capacity)
            self.signal = LOAD_HEADER
            logger.info(
                "dsclient: %s reports its load on each answer (%s): the limit follows its queue",
                self.url,
                LOAD_HEADER,
            )

    def _answer_signal(self, now: float) -> Load | None:
        """The answer header's load for this period: the newest, if the poller has not fed it
        yet (it has no running count: the controller estimates the batch from the queue)."""
        load, at = self._answer_load, self._answer_at
        if load is None or at is None or (self._fed_at is not None and at <= self._fed_at):
            return None
        self._fed_at = at
        return load

    def observe_load(self, load: Load, now: float) -> None:
        """Feed one scrape to the capacity learner and the controller."""
        if load.source == "llama.cpp /slots" and load.running is not None:
            # /slots shows the busy slots, not the queue behind them: what this client has
            # in flight beyond them waits there.
            load = dataclasses.replace(load, waiting=max(0, self._in_flight() - load.running))
        self.load, self.load_at = load, now
        self.scrapes += 1
        self._learn(load)
        if load.waiting is None or (load.running is None and load.source != LOAD_HEADER):
            self.tick(now)
            return
        if self.controller.on_load(
            now,
            running=load.running,
            waiting=load.waiting,
            in_flight=self._in_flight(),
            demand=self._demand(),
            preemptions=load.preemptions,
            kv_usage=load.kv_usage,
        ):
            self._apply()

    def _in_flight(self) -> int:
        last = self._shared_last
        if self._shared_active and last is not None:
            # The leader's loop sees every client's requests; its own are the freshest.
            others = last.total_in_flight - next(
                (p.in_flight for p in last.peers if self.shared and p.id == self.shared.client_id),
                0,
            )
            total = others + self.governor.in_flight
            if self._demand():
                # The blocks follow the limit a sync later: a rise is not in flight yet, though
                # it will be. Counted as sent, so that growth waits to see it land, as a single
                # client's does (counting only what was sent, slow start doubled twice before
                # the first rise showed: 16 -> 64 against a batch of 24, queue p90 27-30).
                total = max(total, self.controller.limit)
            return total
        return self.governor.in_flight

    def tick(self, now: float) -> None:
        """A period without a scrape (no queue signal): the knee finder, the latency rules."""
        if self.controller.on_idle_period(
            now, demand=self._demand(), in_flight=self.governor.in_flight
        ):
            self._apply()

    def _learn(self, load: Load) -> None:
        learner = self.learner
        learner.bound_by_kv(
            kv_cache_size_tokens=load.kv_cache_size_tokens, block_size=load.block_size
        )
        kv = load.kv_cache_size_tokens
        if kv is not None and kv > 0 and kv != self.governor.kv_tokens:
            # Long calls borrow only as far as the cache holds them (the governor's "Borrowing
            # stops where the KV cache does"); a pool sums its servers' caches.
            block = load.block_size if load.block_size and load.block_size > 0 else None
            self.governor.set_kv(kv, block=block)
            self._tell_changed()
        if load.running is None or load.waiting is None:
            return
        # All of the queue, as the rule says (vllm:num_requests_waiting > 0): the
        # "capacity" reason alone stayed 0 on a hand-started server sharing the machine with
        # another vLLM, and nothing was learned; two queued scrapes in a row guard transients.
        if not learner.observe(running=load.running, waiting=load.waiting):
            return
        info = self.info
        if info is None or learner.value is None:
            return
        source = info.sources.get("max_num_seqs")
        if source not in _GUESSES and source != LEARNED_SOURCE:
            # A stated fact (explicit, record, the server's own report) stays. If it is wrong,
            # the controller still sees the queue: room in the batch counts only while the
            # server's queue is empty.
            return
        self.controller.set_capacity(learner.value)
        self._set_limit(self.governor.limit, batch=learner.value)
        sources = dict(info.sources, max_num_seqs=LEARNED_SOURCE)
        self.info = dataclasses.replace(info, max_num_seqs=learner.value, sources=sources)
        logger.info(
            "dsclient: %s runs at most %d sequences at once (learned from /metrics)",
            self.url,
            learner.value,
        )

    def _released(self, slot: Slot, outcome: str, service_s: float) -> None:
        now = self._clock()
        if outcome == "ok":
            self._completed_at = now
        changed = self.controller.on_outcome(
            now,
            outcome,  # type: ignore[arg-type]
            service_s,
            slot.work,
            admitted_at=slot.admitted_at,
        )
        if changed:
            self._apply()

    def _apply(self) -> None:
        governor, controller = self.governor, self.controller
        old, new = governor.limit, controller.limit
        if self._shared_active:
            # The leader's controller moved the shared limit: the next sync publishes it and
            # every client's block follows; nothing changes here before that.
            logger.debug("dsclient: %s shared limit -> %d: %s", self.url, new, controller.reason)
            return
        if new == old:
            return
        self._set_limit(new, batch=self.controller.capacity)
        now = self._clock()
        if now - self._logged_at >= _LOG_EVERY_S:
            more = f" ({self._silenced} changes since the last line)" if self._silenced else ""
            logger.info(
                "dsclient: %s limit %d -> %d: %s%s", self.url, old, new, controller.reason, more
            )
            self._logged_at, self._silenced = now, 0
        else:
            self._silenced += 1
            logger.debug("dsclient: %s limit %d -> %d: %s", self.url, old, new, controller.reason)
        if new > old:
            for callback in list(self._raised):
                callback()

    # -- the poller ------------------------------------------------------------------------------
    async def run_poller(self, http: httpx.AsyncClient) -> None:
        """Scrape the server's load while there is traffic; runs until cancelled.

        At most one scrape per ``scrape_interval``; between bursts it sleeps on an event that
        the next call sets. In latency or fixed mode there is nothing to scrape: it only ticks.
        """
        interval = self.options.scrape_interval
        traffic = self.traffic
        while True:
            if not traffic():
                self._wake = anyio.Event()
                if not traffic():
                    await self._wake.wait()
            started = self._clock()
            mode = self.controller.mode
            if self._shared_active and not self.shared_leader:
                await anyio.sleep(interval)  # the leader runs the loop for everyone
                continue
            route = self.route
            if route is None and mode == "fixed" and self.scrape_for_routing:
                route = "/metrics"  # a router needs the gauges; discovery's scrape may have failed
            if route is not None and (mode == "metrics" or self.scrape_for_routing):
                model = self.info.model if self.info is not None else None
                load = await fetch_load(
                    http, self.url, model=model, timeout=max(1.0, interval * 4), route=route
                )
                if load is not None:
                    self.observe_load(load, self._clock())
                else:
                    self.tick(self._clock())
            elif mode == "metrics":
                now = self._clock()
                load = self._answer_signal(now)  # the answers' header is the queue signal
                if load is not None:
                    self.observe_load(load, now)
                else:
                    self.tick(now)
            elif mode == "throughput":
                self.tick(self._clock())
            else:
                return  # fixed: nothing to watch
            await anyio.sleep(max(0.0, interval - (self._clock() - started)))

    def control_stats(self) -> ControlStats:
        """The controller's snapshot, with what drives the limit and how old its reading is."""
        signal = self.signal
        if signal == LOAD_HEADER:
            at = self._answer_at
        elif signal == "throughput":
            at = self._completed_at
        elif signal == "fixed":
            at = None
        else:
            at = self.load_at
        age = None if at is None else max(0.0, self._clock() - at)
        return self.controller.stats(learned=self.learner.value, signal=signal, signal_age_s=age)

    @property
    def health(self) -> Health:
        """Whether this server is in rotation: ``"down"`` while it does not answer (one server:
        its :class:`~dsclient.governor._health.Reachability` gate is closed; in a pool: its
        circuit breaker is open). Set by whoever watches it (:meth:`watch_health`)."""
        return self._health()

    def watch_health(self, health: Callable[[], Health]) -> None:
        """Where :attr:`health` comes from: the request path's gate, or a pool's breaker."""
        self._health = health

    def view(self) -> ServerView:
        """A snapshot of this server for ``client.servers``."""
        health = self.health
        governor = self.governor
        load_at = self.load_at
        return ServerView(
            url=self.url,
            info=self.info,
            limit=governor.limit,
            in_flight=governor.in_flight,
            waiting=governor.waiting,
            load=self.load,
            load_age_s=None if load_at is None else max(0.0, self._clock() - load_at),
            health=health,
            stats=governor.stats(control=self.control_stats()),
        )
