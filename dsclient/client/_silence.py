"""Saying once that a server has sent nothing for a while: :class:`Silence`.

    silence = Silence("http://127.0.0.1:8000", in_flight=lambda: backend.in_flight)
    silence.sent()      # a call goes out (the first one arms the timer)
    silence.ended(True)  # a call came back: an answer, or an error (False: it timed out)

A server that hangs (a deadlocked engine, a proxy that holds the connection) answers nothing,
and each call waits its whole timeout, 600 s by default: a user saw nothing for minutes. So
when calls are out and none has come back for ``after`` seconds, one warning says so, with the
server's name, how many calls wait and for how long; the next answer ends that silence, and a
later one is told again. A batch of long generations can be as quiet for a while, so the words
say what is known (nothing came back), not a diagnosis.

No background task and no cost per call beyond two counters: one timer on the event loop
(asyncio's ``call_later``), armed while calls are out. Under trio it says nothing.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import sniffio

__all__ = ["SILENCE_S", "Silence"]

logger = logging.getLogger("dsclient")

#: Seconds without any call coming back, while calls are out, before the warning.
SILENCE_S = 60.0


class Silence:
    """Warns once when the calls out have had nothing back for ``after`` seconds.

    Parameters:
        label: how the warning names the server (its URL).
        in_flight: how many calls hold a slot now (sent, not queued on the client).
        after: the seconds of silence before the warning.
        clock: injectable for tests; the timer runs on the loop's own clock, this one measures.
    """

    __slots__ = (
        "_armed",
        "_clock",
        "_in_flight",
        "_loop",
        "_out",
        "_since",
        "_told",
        "after",
        "label",
    )

    def __init__(
        self,
        label: str,
        *,
        in_flight: Callable[[], int],
        after: float = SILENCE_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not after > 0:
            raise ValueError(f"after must be > 0 seconds, got {after!r}")
        self.label = label
        self.after = after
        self._in_flight = in_flight
        self._clock = clock
        self._out = 0  # calls of this caller sent and not back
        self._since = clock()  # the last answer, or when calls went out after none were
        self._told = False
        self._armed: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def sent(self) -> None:
        """A call goes out."""
        if self._out == 0:
            self._since = self._clock()  # quiet before now was idleness, not silence
        self._out += 1
        if self._armed is None or self._loop_changed():
            self._arm(self.after)

    def ended(self, answered: bool) -> None:
        """A call is over: ``answered`` if the server gave anything back (an answer or an
        error), which ends the silence; not if it timed out or was cancelled."""
        self._out = max(0, self._out - 1)
        if not answered:
            return
        self._since = self._clock()
        if self._told:
            self._told = False
            logger.info("dsclient: %s answers again", self.label)

    def check(self) -> str | None:
        """The warning due now, if any (and it is logged); the timer calls this."""
        self._armed = None
        waiting = min(self._out, self._in_flight())
        if waiting <= 0:
            return None  # nothing out: the next sent() arms again
        quiet = self._clock() - self._since
        if quiet < self.after:
            self._arm(self.after - quiet)
            return None
        self._arm(self.after)
        if self._told:
            return None
        self._told = True
        message = (
            f"dsclient: {self.label}: {waiting} call{'s' if waiting != 1 else ''} out and "
            f"nothing back for {quiet:.0f} s; long generations can take this long, a server "
            "that hangs does too (each call waits up to its timeout)"
        )
        logger.warning("%s", message)
        return message

    def _loop_changed(self) -> bool:
        """Whether the armed timer is on a loop other than this one (a client used again from
        a new ``asyncio.run``): that timer never fires here."""
        try:
            return asyncio.get_running_loop() is not self._loop
        except RuntimeError:
            return False

    def _arm(self, delay: float) -> None:
        if sniffio.thread_local.name not in (None, "asyncio"):
            return  # trio: no timer of the loop's to borrow
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        self._loop = loop
        self._armed = loop.call_later(delay, self.check)
