"""Several servers behind one client: where a call waits, which server takes each attempt, and
which servers are in rotation.

    pool = ServerPool(endpoints, Router(), governor_options, probe=probe_url, sleep=anyio.sleep,
                      rng=random.Random(), clock=time.monotonic, outage_wait=300.0)
    await pool.gate("tiny")                       # at once while a server for it is in rotation
    slot = await pool.acquire(Admission("short", model="tiny", prefix=prompt))
    ...                                           # send to slot.endpoint.url, then
    pool.settle(slot, error_or_None)              # the breaker hears how it went
    slot.release("ok")                            # and the server's limit controller

How an attempt gets a server:

1. It takes a slot of the **front governor** of its model: the one queue where calls wait on the
   client, ordered by urgency, lanes and groups exactly as with one server. The front's limit is
   the sum of the limits of the servers that serve the model and are in rotation, so holding a
   front slot means that some server has room (lane caps and a limit cut in between aside: then
   the call waits, holding its place, until a server has room).
2. The **router** (:mod:`dsclient.governor._routing`, pure) chooses among the servers whose own
governor
   admits the call now: load (room under the closed-loop limit, the server's queue and KV cache
   from its ``/metrics``), prefix affinity, and the circuit breaker.
3. It takes a slot of **that server's governor**, whose release feeds that server's limit
   controller (service time, outcome), as with one server.

So a call never waits behind one busy server while another has room: the first slot freed on any
server that serves its model goes to the first call in line.

**Health.** A server leaves the rotation at once when a connection to it is refused or drops
(its process is gone), or after ``RoutingPolicy.eject_after`` consecutive timeouts or 5xx
answers that are not overload (429 / 503 say "busy": the limit controller handles those). Its
breaker then waits a jittered backoff (1 s doubling to 30 s), and :meth:`ServerPool.run_health`
probes ``/health``; an answer that is not a 5xx brings it back, its limit where it was and its
prefix index empty. With every server for a model out, calls wait at :attr:`ServerPool.reach`
(a :class:`~dsclient.governor._health.Reachability` whose probe asks every server): bounded by their
timeout and ``outage_wait``, after which they fail with :class:`~dsclient.ConnectionError`.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import time
from collections.abc import Awaitable, Callable, Hashable, Iterable, Mapping, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any

import anyio

from .._exceptions import ConnectionError, DSClientError, Overloaded, ServerError
from .._exceptions import TimeoutError as DSTimeoutError
from .._server_info import ServerInfo
from ._admission import Admission, slot_for
from ._governor import Governor, GovernorStats, Slot
from ._health import FIRST_WAIT_S, Reachability
from ._lanes import Lane
from ._routing import (
    CircuitBreaker,
    NoServer,
    Route,
    Router,
    RouteRequest,
    ServerState,
    prefix_text,
)

if TYPE_CHECKING:
    from .._http import httpx
    from ._backend import Lease
    from ._endpoint import Endpoint, Health

__all__ = ["NoServerError", "PoolSlot", "ServerPool"]

logger = logging.getLogger("dsclient")

#: Seconds between two looks at the breakers while some server is out of rotation.
_HEALTH_PERIOD_S = 0.25


class NoServerError(DSClientError):
    """No server of the client serves the model a call asks for (waiting will not help)."""


class PoolSlot:
    """A call's admission to a pool: a front slot (its place in line) and a slot of the server
    the router chose (which that server's limit controller hears about)."""

    __slots__ = ("_front", "_pool", "_server", "endpoint", "queued_s")

    def __init__(self, pool: ServerPool, front: Slot, server: Slot, endpoint: Endpoint) -> None:
        self._pool = pool
        self._front = front
        self._server = server
        self.endpoint = endpoint
        self.queued_s = front.queued_s + server.queued_s

    def set_outcome(self, outcome: str) -> None:
        self._server.set_outcome(outcome)
        self._front.set_outcome(outcome)

    @property
    def work(self) -> float | None:
        """What the attempt produced (the server's slot's: its controller reads it)."""
        return self._server.work

    @work.setter
    def work(self, value: float | None) -> None:
        self._server.work = value
        self._front.work = value  # the front queue's tenants are charged from it too

    async def __aenter__(self) -> PoolSlot:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release(error=exc)

    def release(self, outcome: str | None = None, *, error: BaseException | None = None) -> None:
        """Give back the server's slot and the place in the front queue, as
        :meth:`Slot.release <dsclient.governor._governor.Slot.release>` does."""
        try:
            self._server.release(outcome, error=error)
        finally:
            self._front.release(outcome, error=error)
            self._pool.notify()


def failure_kind(exc: BaseException) -> str | None:
    """What a failed attempt says about its server, for the breaker: ``"connect"`` (refused or
    dropped: the process is gone), ``"timeout"``, ``"server_error"`` (a 5xx that is not
    overload), or ``None`` (the server answered: a refusal for load or for the request)."""
    if isinstance(exc, ConnectionError):
        return "connect"
    if isinstance(exc, DSTimeoutError):
        return "timeout"
    if isinstance(exc, Overloaded):
        return None
    status = getattr(exc, "status", None)
    if isinstance(exc, ServerError) and isinstance(status, int) and status >= 500:
        return "server_error"
    return None


def _health_of(breaker: CircuitBreaker) -> Callable[[], Health]:
    """A server of a pool is up while its breaker lets requests through."""
    return lambda: "up" if breaker.allows_requests else "down"


class ServerPool:
    """The servers of one client, a front governor per model, the router and the breakers: the
    :class:`~dsclient.governor._backend.Backend` of a client of several servers.

    Parameters:
        endpoints: one :class:`~dsclient.governor._endpoint.Endpoint` per server, in the caller's
        order.
        router: the routing policy and its per-server state (breakers, prefix indexes).
        governor_options: keyword arguments of the front governors (lanes, groups, queue bound),
            the same the servers' own governors got.
        probe: ``await probe(url)`` answers whether the server at ``url`` answers ``/health``.
        sleep, rng, clock: injectable for tests.
        outage_wait: seconds calls wait while no server for their model is in rotation.
    """

    def __init__(
        self,
        endpoints: Iterable[Endpoint],
        router: Router,
        governor_options: Mapping[str, Any],
        *,
        probe: Callable[[str], Awaitable[bool]],
        sleep: Callable[[float], Awaitable[None]] = anyio.sleep,
        rng: random.Random | None = None,
        clock: Callable[[], float] = time.monotonic,
        outage_wait: float | None = 300.0,
    ) -> None:
        self.endpoints = tuple(endpoints)
        self._by_url = {e.url: e for e in self.endpoints}
        self.router = router
        self._options = dict(governor_options)
        self._fronts: dict[str | None, Governor] = {}
        self._probe = probe
        self._clock = clock
        self._changed: anyio.Event | None = None
        self._health_wake: anyio.Event | None = None
        self.reach = Reachability(
            self.probe_all,
            sleep=sleep,
            rng=rng,
            clock=clock,
            label="every server (" + ", ".join(self._by_url) + ")",
            max_wait=outage_wait,
            first_wait=None if outage_wait is None else min(FIRST_WAIT_S, outage_wait),
        )
        #: Why each server that never answered did not (discovery's words), for the error.
        self._unreached: dict[str, str] = {}
        for endpoint in self.endpoints:
            endpoint.on_change(self.refresh)
            endpoint.traffic = self.traffic
            endpoint.watch_health(_health_of(router.breaker(endpoint.url)))
            endpoint.scrape_for_routing = True

    def __repr__(self) -> str:
        up = sum(self.in_rotation(e) for e in self.endpoints)
        return f"ServerPool({len(self.endpoints)} servers, {up} in rotation, limit={self.limit})"

    # -- state ---------------------------------------------------------------------------------

    @staticmethod
    def serves(endpoint: Endpoint, model: str | None) -> bool:
        """Whether discovery found ``model`` at ``endpoint`` (``None``: any model)."""
        info = endpoint.info
        if info is None or not info.complete:
            return False
        return model is None or model == info.model or model in info.models

    def serving(self, model: str | None) -> list[Endpoint]:
        return [e for e in self.endpoints if self.serves(e, model)]

    def in_rotation(self, endpoint: Endpoint) -> bool:
        return self.router.breaker(endpoint.url).allows_requests

    @property
    def limit(self) -> int:
        """The sum of the limits of the servers in rotation."""
        return sum(e.governor.limit for e in self.endpoints if self.in_rotation(e))

    def limit_for(self, model: str | None) -> int:
        """The sum of the limits of the servers in rotation that serve ``model``."""
        return sum(e.governor.limit for e in self.serving(model) if self.in_rotation(e))

    def long_in_flight(self, model: str | None) -> int:
        """Long-lane calls of ``model`` holding a slot now (its front queue's)."""
        front = self._fronts.get(model)
        return front.long_in_flight if front is not None else 0

    @property
    def in_flight(self) -> int:
        return sum(e.governor.in_flight for e in self.endpoints)

    def stats(self, model: str | None) -> GovernorStats:
        """The calls of ``model`` as they wait and run (its front queue), against the sum of
        the limits of the servers that serve it; each server's own is in its view."""
        return dataclasses.replace(self.front(model).stats(), limit=self.limit_for(model))

    def info(self, model: str | None) -> ServerInfo | None:
        """Several servers as one for planning (``None`` before any was discovered): the
        first that serves ``model``, with the smallest context of those that do; incomplete
        while none does."""
        if all(e.info is None for e in self.endpoints):
            return None
        serving = [e.info for e in self.serving(model) if e.info is not None]
        if not serving:
            first = self.endpoints[0].info
            kinds = {e.info.kind for e in self.endpoints if e.info is not None}
            return ServerInfo(
                url=self.endpoints[0].url,
                kind=kinds.pop() if len(kinds) == 1 else "unknown",
                model=model,
                sources=first.sources if first is not None else {},
                complete=False,
            )
        contexts = [i.max_model_len for i in serving if i.max_model_len is not None]
        return dataclasses.replace(
            serving[0],
            max_model_len=min(contexts) if contexts else None,
            has_tokenize=any(i.has_tokenize for i in serving),
        )

    def discovered(self, endpoint: Endpoint) -> None:
        """The fronts follow what a server serves. A server whose discovery got no answer from
        ``/v1/models`` stays out of rotation until a probe answers (:meth:`run_health` then
        discovers it again)."""
        info = endpoint.info
        if info is not None and (info.complete or info.kind != "unknown"):
            self.reach.answered()
            self._unreached.pop(endpoint.url, None)
        elif info is not None and "/v1/models" in info.sources:
            self._unreached[endpoint.url] = info.sources["/v1/models"]
            self.reach.unreachable(
                "; ".join(f"{url}: {why}" for url, why in self._unreached.items())
            )
        if info is None or not info.complete:
            self.router.record_failure(endpoint.url, "connect")
            why = info.sources.get("/v1/models") if info is not None else None
            logger.warning(
                "dsclient: %s/v1/models gave no model list (%s); it stays out of rotation "
                "until it does",
                endpoint.url,
                why or "no answer",
            )
        self.refresh()  # the fronts follow the servers that serve each model

    def rediscover_due(self) -> bool:
        """Always: a call that finds no server discovered for its model asks again (the
        health loop rediscovers each server that answers again, on its breaker's backoff)."""
        return True

    def prefix_of(self, prompt: object) -> str | None:
        """The text the router matches against the prefixes each server probably caches."""
        return prefix_text(prompt)

    @property
    def fronts(self) -> Mapping[str | None, Governor]:
        """The front governor of each model asked for so far."""
        return self._fronts

    def traffic(self) -> bool:
        """Whether any call is in flight or waiting anywhere in the pool (every server's poller
        scrapes while this is true, so the router compares fresh gauges)."""
        return any(g.in_flight or g.waiting for g in self._fronts.values()) or any(
            e.governor.in_flight for e in self.endpoints
        )

    def front(self, model: str | None) -> Governor:
        """The governor calls for ``model`` wait in (made on first use)."""
        governor = self._fronts.get(model)
        if governor is None:

            def pick(waiters: Sequence[Slot], model: str | None = model) -> int:
                return self._pick(model, waiters)

            governor = Governor(limit=1, clock=self._clock, pick=pick, **self._options)
            self._fronts[model] = governor
            self._size(model, governor)
        return governor

    def refresh(self) -> None:
        """A server's limit moved, or it left or rejoined the rotation: the fronts follow."""
        for model, governor in self._fronts.items():
            self._size(model, governor)
        self.notify()

    def _size(self, model: str | None, governor: Governor) -> None:
        members = [e for e in self.serving(model) if self.in_rotation(e)]
        total = sum(e.governor.limit for e in members)
        batches = [e.controller.capacity for e in members]
        known = [b for b in batches if b is not None]
        batch = sum(known) if members and len(known) == len(batches) else None
        governor.set_limit(max(1, total), batch=batch)
        # The front lends long calls as far as the members' caches hold them all together;
        # each member's own governor then holds them to its cache.
        caches = [e.governor.kv_tokens for e in members]
        whole = None not in caches and bool(caches)
        governor.set_kv(sum(c for c in caches if c is not None) if whole else None)

    def notify(self) -> None:
        """Wake the calls that hold a front slot and wait for a server's room."""
        event, self._changed = self._changed, None
        if event is not None:
            event.set()

    def wake(self) -> None:
        """A call started: every server's poller may run."""
        for endpoint in self.endpoints:
            endpoint.wake()

    def states(
        self,
        model: str | None,
        lane: Lane,
        group: str | None,
        batch: Hashable = False,
        tokens: int = 0,
        prompt_tokens: int = 0,
    ) -> list[ServerState]:
        """Each discovered server as the router sees it for one attempt."""
        now = self._clock()
        states = []
        for e in self.endpoints:
            info = e.info
            if info is None or not info.complete:
                continue
            models = frozenset((*info.models, *((info.model,) if info.model else ())))
            load = e.load
            age = None if e.load_at is None or load is None else max(0.0, now - e.load_at)
            waiting = load.waiting if load is not None else None
            kv_usage = load.kv_usage if load is not None else None
            if age is not None and age > self.router.policy.stale_after:
                # Old gauges say nothing about the server's queue now (the router counts the
                # server as saturated); a queue seen at discovery kept a server out for good.
                waiting = kv_usage = None
            if load is not None and load.kv_cache_size_tokens:
                self.router.size_index(e.url, kv_cache_tokens=load.kv_cache_size_tokens)
            governor = e.governor
            states.append(
                ServerState(
                    url=e.url,
                    models=models,
                    limit=governor.limit,
                    in_flight=governor.in_flight,
                    running=load.running if load is not None else None,
                    waiting=waiting,
                    kv_usage=kv_usage,
                    metrics_age=age,
                    room=governor.admits(
                        lane=lane,
                        group=group,
                        batch=batch,
                        tokens=tokens,
                        prompt_tokens=prompt_tokens,
                    ),
                )
            )
        return states

    def _pick(self, model: str | None, waiters: Sequence[Slot]) -> int:
        """Which waiting call a freed slot goes to: the first (in line) whose prefix a server
        with room for it holds, else the head. Under saturation the first slot freed anywhere
        goes to the head of the line, and the router then has one server to choose: affinity
        would decide only while two servers have room, which in a batch is rarely."""
        threshold = self.router.policy.cache_threshold
        members = [e for e in self.serving(model) if self.in_rotation(e)]
        for index, slot in enumerate(waiters):
            blocks = slot.tag
            if not isinstance(blocks, tuple) or not blocks:
                continue
            for endpoint in members:
                if not endpoint.governor.admits(
                    lane=slot.lane,
                    group=slot.group,
                    batch=slot.batch,
                    tokens=slot.tokens,
                    prompt_tokens=slot.prompt_tokens,
                ):
                    continue
                if self.router.match(endpoint.url, blocks) >= threshold:
                    return index
        return 0

    # -- one attempt ---------------------------------------------------------------------------
    def gate_is_open(self, model: str | None) -> bool:
        """Whether a server for ``model`` is in rotation (:meth:`gate` would return at once)."""
        return any(self.in_rotation(e) for e in self.serving(model))

    async def gate(self, model: str | None) -> None:
        """Return at once while a server for ``model`` is in rotation; else wait (probing every
        server) until one is, within ``outage_wait`` (then ``ConnectionError``)."""
        while not any(self.in_rotation(e) for e in self.serving(model)):
            if not self.serving(model):
                self._no_server(model)
            self.reach.mark_down(f"no server for model {model!r} is in rotation")
            await self.reach.wait_up()

    def _no_server(self, model: str | None) -> None:
        served = sorted({m for e in self.endpoints if e.info is not None for m in e.info.models})
        waiting = [e.url for e in self.endpoints if e.info is None or not e.info.complete]
        if waiting:
            return  # a server not yet discovered may serve it: wait for it like an outage
        raise NoServerError(
            f"no server of this client serves model {model!r}; they serve: "
            f"{', '.join(map(repr, served)) or '(nothing listed)'}"
        )

    async def acquire(
        self, admission: Admission, *, avoid: frozenset[str] = frozenset()
    ) -> PoolSlot:
        """A place in the front queue of the call's model, then a server with room for it."""
        model, prefix = admission.model, admission.prefix
        front = slot_for(self.front(model), admission)
        request = RouteRequest(model=model, prefix=prefix, avoid=avoid)
        blocks = request.block_keys(self.router.policy.block_chars)
        if blocks:
            request = RouteRequest(model=model, blocks=blocks, avoid=avoid)
            front.tag = blocks
        await front.__aenter__()
        try:
            while True:
                states = self.states(
                    model,
                    admission.lane,
                    admission.group,
                    admission.batch,
                    admission.tokens,
                    admission.prompt_tokens,
                )
                decision = self.router.choose(states, request)
                if isinstance(decision, Route):
                    endpoint = self._by_url[decision.url]
                    server = slot_for(endpoint.governor, admission)
                    await server.__aenter__()  # the router checked its room: at once
                    return PoolSlot(self, front, server, endpoint)
                if isinstance(decision, NoServer):
                    self._no_server(model)
                    await self.gate(model)
                elif decision.reason == "ejected":
                    await self.gate(model)
                else:  # full: a lane cap, or a limit cut since the front admitted the call
                    event = self._changed
                    if event is None:
                        event = self._changed = anyio.Event()
                    await event.wait()
        except BaseException as exc:
            front.release(error=exc)
            raise

    def server_of(self, lease: Lease) -> Endpoint:
        """The server the router chose for the attempt holding ``lease``."""
        if not isinstance(lease, PoolSlot):
            raise TypeError(f"not a slot of this pool: {lease!r}")
        return lease.endpoint

    def settle(self, lease: Lease, exc: BaseException | None, model: str | None) -> bool:
        """Tell the breaker how an attempt went. Returns whether another server for the same
        model is still in rotation after a failure (the call may fail over at once)."""
        url = self.server_of(lease).url
        router = self.router
        if exc is None:
            router.record_success(url)
            if not self.reach.has_answered:
                self.reach.answered()
            return True
        kind = failure_kind(exc)
        if kind is None:
            return True
        before = router.breaker(url).allows_requests
        router.record_failure(url, kind)  # type: ignore[arg-type]
        if before and not router.breaker(url).allows_requests:
            others = [
                e.url
                for e in self.endpoints
                if e.url != url and e.info is not None and self.in_rotation(e)
            ]
            logger.warning(
                "dsclient: %s leaves the rotation (%s: %s); %s",
                url,
                router.breaker(url).last_reason,
                exc,
                f"{len(others)} other server(s) take its calls" if others else "no other server",
            )
            self.refresh()
            event = self._health_wake
            if event is not None:
                event.set()
        return any(self.in_rotation(e) for e in self.serving(model) if e.url != url)

    # -- background work -------------------------------------------------------------------------
    def needs_background(self) -> bool:
        """Always: the router compares the servers' gauges, and the breakers need probes."""
        return True

    async def run(
        self,
        http: httpx.AsyncClient,
        rediscover: Callable[[Endpoint], Awaitable[None]],
    ) -> None:
        """Each server's load poller and the health loop (:meth:`run_health`), until
        cancelled."""
        async with anyio.create_task_group() as group:
            group.start_soon(self.run_health, rediscover)
            for endpoint in self.endpoints:
                group.start_soon(endpoint.run_poller, http)

    # -- health --------------------------------------------------------------------------------
    async def _probe_each(self, urls: Iterable[str]) -> dict[str, bool]:
        """Probe ``urls`` at the same time: whether each answers."""
        answered: dict[str, bool] = {}

        async def one(url: str) -> None:
            answered[url] = await self._probe(url)

        async with anyio.create_task_group() as group:
            for url in urls:
                group.start_soon(one, url)
        return answered

    async def probe_all(self) -> bool:
        """Probe every server now; those that answer are back in rotation. Whether any did."""
        answered = await self._probe_each(e.url for e in self.endpoints)
        back = [url for url, ok in answered.items() if ok]
        for url in back:
            if not self.router.breaker(url).allows_requests:
                self.router.readmit(url)
                logger.warning("dsclient: %s answers again; back in rotation", url)
        if back:
            self.refresh()
        return bool(back)

    async def run_health(
        self, rediscover: Callable[[Endpoint], Awaitable[None]] | None = None
    ) -> None:
        """Probe the servers out of rotation when their breaker says so; runs until cancelled.
        A server back whose discovery never completed is discovered (``rediscover``) first."""
        router = self.router
        while True:
            out = [e.url for e in self.endpoints if not self.in_rotation(e)]
            if not out:
                self._health_wake = anyio.Event()
                if all(self.in_rotation(e) for e in self.endpoints):
                    await self._health_wake.wait()
                continue
            due = router.probes_due(out)
            if due:
                for url, ok in (await self._probe_each(due)).items():
                    router.record_probe(url, healthy=ok)
                    endpoint = self._by_url[url]
                    info = endpoint.info
                    if ok and rediscover is not None and (info is None or not info.complete):
                        await rediscover(endpoint)
                    if ok and router.breaker(url).allows_requests:
                        logger.warning("dsclient: %s answers again; back in rotation", url)
                        self.refresh()
                        if self.reach.down:
                            self.reach.mark_up()
            await anyio.sleep(_HEALTH_PERIOD_S)
