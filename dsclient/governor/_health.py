"""Whether a server answers at all: calls wait, on the client, while it does not.

    reach = Reachability(probe, sleep=anyio.sleep, rng=random.Random())
    await reach.wait_up()          # at once while the server answers
    reach.mark_down("connection refused")   # an attempt could not reach it

A server that dies (kill -9, an OOM, a restart) refuses connections until it is back. Retrying
every call against it would spend the retry budget in a second and turn a batch into failures;
so the first attempt that cannot connect marks the server *down*, and from then on calls wait
before taking a slot. One of the waiting calls probes (``probe()``, e.g. ``GET /health``) with
jittered exponential backoff, ``first`` seconds doubling up to ``cap``; the first answer, or any
attempt that succeeds, marks it up again and every waiting call proceeds. No background task:
the probing is done by a waiting call, and if that call is cancelled (its timeout) the next
waiting one takes over. How long a call waits is bounded by its own timeout.

A server that has never answered since the client started is another matter: a typo'd port or
host, not an outage. With ``first_wait`` set, calls wait that long for it (a few probes), then
fail with what was wrong ("nothing listens on 127.0.0.1:8001", "no such host"): the words given
to :meth:`Reachability.mark_down` or :meth:`Reachability.unreachable`. Once it has answered
(:meth:`Reachability.answered`), an outage is waited through for up to ``max_wait``.

An outage is *confirmed* once a probe in it fails: the server really did not answer, as opposed
to one connection dropped by a live server (whose first probe answers at once). The request path
uses that to tell the victims of an outage (calls whose connection died with the server) from
calls failing against a live server: see :meth:`Reachability.confirmed`.
"""

from __future__ import annotations

import logging
import math
import random
import time
from collections.abc import Awaitable, Callable

import anyio

from .._exceptions import ConnectionError

__all__ = ["FIRST_WAIT_S", "Reachability"]

logger = logging.getLogger("dsclient")

#: Seconds of probing a client gives a server that has not answered since the client started
#: (a typo'd port or host) before its calls fail: six probes or so, with the default backoff.
FIRST_WAIT_S = 5.0


class Reachability:
    """The up / down state of one server, and the gate calls wait at while it is down.

    Parameters:
        probe: answers ``True`` when the server answers again (any HTTP answer that is not a
            5xx, or whatever the caller decides); must not raise for a server that is down.
        sleep, rng, clock: injectable for tests.
        first, cap: the probe's backoff, in seconds (full jitter on each wait).
        label: how log lines name the server (its URL).
        max_wait: seconds of probing in one outage before calls stop waiting (``None``: only
            the calls' own timeouts bound the wait).
        first_wait: the same, for a server that has not answered since this object was made
            (``None``: ``max_wait`` applies to it too).
    """

    def __init__(
        self,
        probe: Callable[[], Awaitable[bool]],
        *,
        sleep: Callable[[float], Awaitable[None]] = anyio.sleep,
        rng: random.Random | None = None,
        clock: Callable[[], float] = time.monotonic,
        first: float = 0.25,
        cap: float = 2.0,
        label: str = "server",
        max_wait: float | None = 300.0,
        first_wait: float | None = None,
    ) -> None:
        if not 0 < first <= cap:
            raise ValueError(f"need 0 < first <= cap, got first={first!r}, cap={cap!r}")
        if max_wait is not None and not max_wait > 0:
            raise ValueError(f"max_wait must be > 0 seconds or None, got {max_wait!r}")
        if first_wait is not None and not first_wait > 0:
            raise ValueError(f"first_wait must be > 0 seconds or None, got {first_wait!r}")
        self.max_wait = max_wait
        self.first_wait = first_wait
        #: Whether the server has answered since this object was made.
        self.has_answered = False
        #: What the last attempt that could not reach it said (``None``: nothing yet).
        self.why: str | None = None
        self._probe = probe
        self._sleep = sleep
        self._rng = rng or random.Random()
        self._clock = clock
        self.first = first
        self.cap = cap
        self.label = label
        self.down = False
        self.down_since: float | None = None
        self.outages = 0  #: times the server was marked down
        self.probes = 0  #: probes sent, over all outages
        self.last_outage_s: float | None = None  #: how long the last outage lasted
        self._confirmed: list[int] = []  # outages (by number) in which a probe failed, newest last
        self._probing = False
        self._waited = 0.0  # seconds slept between probes in this outage
        self._changed: anyio.Event | None = None  # made by the first waiter (needs a loop)

    def __repr__(self) -> str:
        state = "down" if self.down else "up"
        return f"Reachability({self.label}: {state}, outages={self.outages})"

    def mark_down(self, why: str) -> int:
        """An attempt could not reach the server: hold calls until it answers again.

        Returns the outage's number (:attr:`outages`; the current one if already down), for
        :meth:`confirmed`.
        """
        if self.down:
            return self.outages
        if self.why is None or self.has_answered:
            self.why = why  # an earlier, more telling word (unreachable()) is kept
        self.down = True
        self.down_since = self._clock()
        self._waited = 0.0
        self.outages += 1
        logger.warning(
            "dsclient: %s does not answer (%s); calls wait for it (each within its timeout)",
            self.label,
            why,
        )
        return self.outages

    def answered(self) -> None:
        """The server answered (discovery, a call): from now on, not answering is an outage."""
        self.has_answered = True

    def unreachable(self, why: str) -> None:
        """What was wrong the last time the server could not be reached (discovery's words:
        "nothing listens on 127.0.0.1:8001 (connection refused)"), for the error calls get."""
        self.why = why

    def confirmed(self, outage: int) -> bool:
        """Whether outage number ``outage`` was real: a probe failed while it lasted."""
        return outage in self._confirmed

    def _confirm(self) -> None:
        if self.down and (not self._confirmed or self._confirmed[-1] != self.outages):
            self._confirmed.append(self.outages)
            del self._confirmed[:-16]  # only recent outages are ever asked about

    def mark_up(self) -> None:
        """The server answered: let every waiting call through."""
        self.has_answered = True
        if not self.down:
            return
        self.down = False
        since, self.down_since = self.down_since, None
        if since is not None:
            self.last_outage_s = self._clock() - since
        logger.warning(
            "dsclient: %s answers again after %.1f s", self.label, self.last_outage_s or 0.0
        )
        self._fire()

    def _fire(self) -> None:
        event, self._changed = self._changed, None
        if event is not None:
            event.set()

    @property
    def _limit(self) -> float | None:
        if not self.has_answered and self.first_wait is not None:
            return self.first_wait
        return self.max_wait

    @property
    def given_up(self) -> bool:
        """Down for longer than ``max_wait`` of probing (``first_wait`` for a server that never
        answered): calls no longer wait for it."""
        limit = self._limit
        return self.down and limit is not None and self._waited >= limit

    def _gone(self) -> ConnectionError:
        why = f": {self.why}" if self.why else ""
        if not self.has_answered and self.first_wait is not None:
            return ConnectionError(
                f"{self.label} has not answered since the client started{why}; is the URL "
                f"right? (probed for {self._waited:.0f} s; a server that answered before is "
                f"waited for through an outage, up to outage_wait)"
            )
        return ConnectionError(
            f"{self.label} has not answered for {self._waited:.0f} s "
            f"(max_wait {self.max_wait:g} s){why}"
        )

    async def wait_up(self) -> None:
        """Return at once while the server is up; else wait (probing, if nobody else is) until
        it is. Raises :class:`~dsclient.ConnectionError` once the server is given up on and a
        fresh probe finds it still down."""
        while self.down:
            if self.given_up:
                self.probes += 1
                if await self._probe():
                    self.mark_up()
                    return
                self._confirm()
                raise self._gone()
            if self._probing:
                if self._changed is None:
                    self._changed = anyio.Event()
                await self._changed.wait()
            else:
                await self._probe_until_up()

    async def _probe_until_up(self) -> None:
        self._probing = True
        try:
            attempt = 0
            while self.down and not self.given_up:
                self.probes += 1
                if await self._probe():
                    self.mark_up()
                    return
                self._confirm()
                attempt += 1
                ceiling = min(self.cap, self.first * math.pow(2, attempt - 1))
                delay = self._rng.uniform(ceiling / 2, ceiling)
                await self._sleep(delay)
                self._waited += delay
            if self.given_up:
                logger.warning(
                    "dsclient: %s has not answered for %.0f s; calls fail until it does",
                    self.label,
                    self._waited,
                )
        finally:
            self._probing = False
            if self.down:
                self._fire()  # cancelled, or given up: the waiting calls look again
