"""Where a call's attempts go: one interface for one server and for a pool of several.

    backend = SingleServer(endpoint, probe=probe_url, sleep=anyio.sleep, rng=rng)
    if not backend.gate_is_open(model):
        await backend.gate(model)                     # wait while no server for it answers
    slot = await backend.acquire(Admission("short", model=model))
    server = backend.server_of(slot)                  # send to server.url, then
    backend.settle(slot, None, model)                 # its health hears how it went,
    slot.release("ok")                                # and its limit controller

The request path (:mod:`dsclient.client._pipeline`) and the client's discovery and views call
only this interface, so a call follows one path whether the client has one server or several:
:class:`SingleServer` here, or :class:`~dsclient.governor._pool.ServerPool`, which adds a front
queue per model, a router and a breaker per server. What differs between the two lives in the
two implementations and nowhere else.
"""

from __future__ import annotations

import logging
import math
import random
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Protocol

import anyio

from ._admission import Admission, slot_for
from ._governor import Governor, GovernorStats
from ._health import FIRST_WAIT_S, Reachability

if TYPE_CHECKING:
    from .._http import httpx
    from .._server_info import ServerInfo
    from ._endpoint import Endpoint

__all__ = ["Backend", "Lease", "SingleServer", "rediscover_backoff"]

logger = logging.getLogger("dsclient")


def rediscover_backoff(failures: int, rng: random.Random) -> float:
    """Seconds before asking an unanswered ``/v1/models`` again after ``failures`` failures:
    ``0.5 * 2**(failures-1)`` capped at 30, jittered to 50-100% of that."""
    ceiling = min(30.0, 0.5 * math.pow(2.0, min(failures - 1, 16)))
    return rng.uniform(ceiling / 2, ceiling)


class Lease(Protocol):
    """One attempt's admission, as a backend gives it: a governor's
    :class:`~dsclient.governor._governor.Slot` (one server), or a
    :class:`~dsclient.governor._pool.PoolSlot` (a place in a pool's line and a server's slot).

    The request path sets ``work``, then releases the lease with the attempt's outcome
    (``lease.release(outcome, error=exc)``); the release feeds the server's limit controller.
    """

    queued_s: float
    work: float | None

    def release(self, outcome: str | None = None, *, error: BaseException | None = None) -> None:
        """Give the lease back (see :meth:`~dsclient.governor._governor.Slot.release`)."""
        ...


class Backend(Protocol):
    """The servers of one client, as the request path and discovery see them.

    Attributes:
        endpoints: every server, in the caller's order (one for :class:`SingleServer`).
        reach: whether any server answers; calls wait at its gate while none does.
    """

    endpoints: tuple[Endpoint, ...]
    reach: Reachability

    # -- one attempt -----------------------------------------------------------------------
    def gate_is_open(self, model: str | None) -> bool:
        """Whether a call for ``model`` may go on without waiting (cheap: no await)."""
        ...

    def gate(self, model: str | None) -> Awaitable[None]:
        """Wait, on the client, while no server for ``model`` answers (within the outage
        wait; then :class:`~dsclient.ConnectionError`)."""
        ...

    def acquire(
        self, admission: Admission, *, avoid: frozenset[str] = frozenset()
    ) -> Awaitable[Lease]:
        """A slot for one attempt of the call ``admission`` describes (``avoid``: servers it
        failed on)."""
        ...

    def server_of(self, lease: Lease) -> Endpoint:
        """The server an attempt holding ``lease`` goes to."""
        ...

    def settle(self, lease: Lease, exc: BaseException | None, model: str | None) -> bool:
        """Tell the server's health how an attempt went (``exc``: ``None`` for an answer).
        Returns whether another server for ``model`` is still in rotation (after a failure,
        the call may go there at once)."""
        ...

    def prefix_of(self, prompt: object) -> str | None:
        """What the router of this backend matches a call by (``None``: it has none)."""
        ...

    def wake(self) -> None:
        """A call started: the servers' pollers may run."""
        ...

    async def probe_all(self) -> bool:
        """Probe the servers now: whether any answers (those that do are back in rotation)."""
        ...

    # -- what the client shows ---------------------------------------------------------------
    def limit_for(self, model: str | None) -> int:
        """The in-flight limit for calls of ``model``: the servers' in rotation that serve it."""
        ...

    def long_in_flight(self, model: str | None) -> int:
        """Long-lane calls of ``model`` holding a slot now."""
        ...

    @property
    def in_flight(self) -> int: ...

    def stats(self, model: str | None) -> GovernorStats:
        """The calls of ``model`` as they wait and run, against :meth:`limit_for`."""
        ...

    def serving(self, model: str | None) -> list[Endpoint]:
        """The servers discovery found serving ``model``."""
        ...

    def in_rotation(self, endpoint: Endpoint) -> bool:
        """Whether ``endpoint`` takes calls now."""
        ...

    # -- background work -----------------------------------------------------------------------
    def needs_background(self) -> bool:
        """Whether :meth:`run` has work (scraping an adaptive limit's server, probing servers
        out of rotation)."""
        ...

    async def run(
        self,
        http: httpx.AsyncClient,
        rediscover: Callable[[Endpoint], Awaitable[None]],
    ) -> None:
        """Scrape and probe the servers while the client is open; runs until cancelled.
        ``rediscover`` discovers a server that answers again after an incomplete discovery."""
        ...

    # -- discovery ---------------------------------------------------------------------------
    def info(self, model: str | None) -> ServerInfo | None:
        """What discovery found, as one server for planning (``None`` before it ran)."""
        ...

    def discovered(self, endpoint: Endpoint) -> None:
        """``endpoint`` was just discovered (``endpoint.info`` is set): follow it, and where
        its ``/v1/models`` did not answer, plan when it is asked again."""
        ...

    def rediscover_due(self) -> bool:
        """Whether a call may ask an incomplete discovery again now."""
        ...


class SingleServer:
    """A client's one server: its governor, its limit controller and its reachability.

    Parameters:
        endpoint: the server.
        probe: ``await probe(url)`` answers whether the server at ``url`` answers ``/health``.
        sleep, rng, clock: injectable for tests (the probe backoff, and
            :func:`rediscover_backoff` on ``clock``).
        outage_wait: seconds calls wait for the server while it does not answer (``None``:
            only their own timeouts). A server that has not answered since the client started
            is given :data:`~dsclient.governor._health.FIRST_WAIT_S` of it (when not ``None``).
    """

    def __init__(
        self,
        endpoint: Endpoint,
        *,
        probe: Callable[[str], Awaitable[bool]],
        sleep: Callable[[float], Awaitable[None]] = anyio.sleep,
        rng: random.Random | None = None,
        clock: Callable[[], float] = time.monotonic,
        outage_wait: float | None = 300.0,
    ) -> None:
        self.endpoints: tuple[Endpoint, ...] = (endpoint,)
        self.endpoint = endpoint
        self._governor: Governor = endpoint.governor
        self._probe = probe
        self.reach = Reachability(
            self.probe_all,
            sleep=sleep,
            rng=rng,
            label=endpoint.url,
            max_wait=outage_wait,
            first_wait=None if outage_wait is None else min(FIRST_WAIT_S, outage_wait),
        )
        reach = self.reach
        endpoint.watch_health(lambda: "down" if reach.down else "up")
        self._rng = rng or random.Random()
        self._clock = clock
        #: Discoveries in a row whose ``/v1/models`` did not answer, and when to ask again.
        self._failures = 0
        self._again_at = -math.inf

    def __repr__(self) -> str:
        return f"SingleServer({self.endpoint.url!r}, limit={self._governor.limit})"

    # -- one attempt -----------------------------------------------------------------------
    def gate_is_open(self, model: str | None) -> bool:
        return not self.reach.down

    def gate(self, model: str | None) -> Awaitable[None]:
        return self.reach.wait_up()

    def acquire(
        self, admission: Admission, *, avoid: frozenset[str] = frozenset()
    ) -> Awaitable[Lease]:
        # The slot's own entry, not a coroutine around it: one frame fewer on every call.
        return slot_for(self._governor, admission).__aenter__()

    def server_of(self, lease: Lease) -> Endpoint:
        return self.endpoint

    def settle(self, lease: Lease, exc: BaseException | None, model: str | None) -> bool:
        if exc is None and (self.reach.down or not self.reach.has_answered):
            self.reach.mark_up()  # any answer opens the gate
        return False  # no other server

    def prefix_of(self, prompt: object) -> str | None:
        return None

    def wake(self) -> None:
        self.endpoint.wake()

    async def probe_all(self) -> bool:
        return await self._probe(self.endpoint.url)

    # -- what the client shows ---------------------------------------------------------------
    def limit_for(self, model: str | None) -> int:
        return self._governor.limit

    def long_in_flight(self, model: str | None) -> int:
        return self._governor.long_in_flight

    @property
    def in_flight(self) -> int:
        return self._governor.in_flight

    def stats(self, model: str | None) -> GovernorStats:
        return self._governor.stats(control=self.endpoint.control_stats())

    def serving(self, model: str | None) -> list[Endpoint]:
        info = self.endpoint.info
        return [self.endpoint] if info is not None and model in info.models else []

    def in_rotation(self, endpoint: Endpoint) -> bool:
        return True

    # -- background work -----------------------------------------------------------------------
    def needs_background(self) -> bool:
        return self.endpoint.controller.mode != "fixed"

    async def run(
        self,
        http: httpx.AsyncClient,
        rediscover: Callable[[Endpoint], Awaitable[None]],
    ) -> None:
        if self.needs_background():
            await self.endpoint.run_poller(http)

    # -- discovery ---------------------------------------------------------------------------
    def info(self, model: str | None) -> ServerInfo | None:
        return self.endpoint.info

    def discovered(self, endpoint: Endpoint) -> None:
        """An incomplete discovery is asked again by a later call, after
        :func:`rediscover_backoff` (there is no other server to take the calls meanwhile)."""
        info, url = endpoint.info, endpoint.url
        if info is not None and (info.complete or info.kind != "unknown"):
            self.reach.answered()
        elif info is not None and "/v1/models" in info.sources:
            self.reach.unreachable(info.sources["/v1/models"])
        if info is not None and info.complete:
            if self._failures:
                logger.warning("dsclient: %s/v1/models answers again; model %s", url, info.model)
            self._failures = 0
            return
        self._failures += 1
        delay = rediscover_backoff(self._failures, self._rng)
        self._again_at = self._clock() + delay
        log = logger.warning if self._failures == 1 else logger.debug
        log(
            "dsclient: %s/v1/models gave no model list (try %d: %s); the model and context "
            "stay unknown, asked again in %.1f s or later",
            url,
            self._failures,
            (info.sources.get("/v1/models") if info is not None else None) or "no answer",
            delay,
        )

    def rediscover_due(self) -> bool:
        return self._clock() >= self._again_at
