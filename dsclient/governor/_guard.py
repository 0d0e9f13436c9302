"""The queue guard: what a server that reports nothing is seen to run, and the most in flight that
keeps its queue near the target.

Pure: no network, no clock. The knee finder (:mod:`dsclient.governor._knee`) feeds it each
epoch it measures; the limit controller asks it for :meth:`QueueGuard.cap`.

**What the server runs, by Little's law.** A request in flight is either running (in the
server's batch) or waiting (in its first-come queue). Over an epoch at a limit held full, the
server finishes ``X`` units of work a second (tokens; 1 a call where answers do not say), and a
request alone takes ``s0`` seconds a unit of work (its *unqueued* time). Then the server runs
``R = X x s0`` requests at once, and the rest of what is in flight, ``L - R``, waits::

    running = throughput x unqueued time          # R = X * s0
    queue   = in_flight - running                 # Q = L - R
    cap     = running + target,  target = floor(queue_share x running)

``s0`` is the mean time per unit of work (sum of service times over sum of work) of the
latest epoch at the lowest limit measured on at least :data:`BASE_SAMPLES` answers: the
lowest limit has the shortest queue (slow start starts low; the hold phase probes down). Not
the quickest answer, nor the quickest of many epochs' medians: with noisy service times (x1.6
either way) those are a fraction of the usual time, and they read a server of 8 seats as
running 4, and cut it there. An epoch that did not keep its limit full sets nothing (the
client's own start-up slowed its first answers by half). ``R`` counts what the server is
*seen* to run: where a request takes longer in a fuller batch (a GPU's step grows with the
batch) ``R`` comes out under the truth, so the guard errs towards a shorter queue; the knee
finder lets a step that bought throughput in proportion pass it.

**Why it cannot run away.** ``X`` comes from completions, and a flat server's completions do not
rise with the limit: doubling what is in flight doubles ``L`` and leaves ``R``, so the estimated
queue grows with every request added, whichever answers come back first. (The knee finder's
own estimate of ``X`` counts every request of an epoch's cohort, the slow ones included: see
:mod:`dsclient.governor._knee`.)

**What proves more.** A step up from ``L1`` to ``L2`` whose throughput rose by ``X2 / X1`` shows
that the server runs at least ``min(L2, L1 x X2 / X1)`` at once (a server with room scales in
proportion; one past its batch does not scale at all). That is *proven*; the guard's running
count is the larger of Little's and the proven one, so a server whose answers slow as its batch
fills (its ``s0`` from a smaller batch) still gets every seat its completions pay for.

**What the server states.** A batch it queues behind (vLLM's ``max_num_seqs``, SGLang's
``max_running_requests``, llama.cpp's slots) bounds the cap at that batch plus the target
queue, unless a step proved more (several replicas behind one URL). A hard cap it refuses past
(TGI's ``max_concurrent_requests``: 429 "Model is overloaded") is a ceiling, never passed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Final

__all__ = ["BASE_SAMPLES", "GuardView", "QueueGuard"]

#: The share of the target queue the cap aims at (see :meth:`QueueGuard.cap`).
_AIM: Final = 0.8
#: An epoch sets the unqueued time only if it counted this many answers.
BASE_SAMPLES: Final = 5


@dataclass(frozen=True)
class GuardView:
    """What the guard believes after the last epoch (``None``: not known yet)."""

    running: float | None
    queue: float | None
    target: int | None
    cap: int | None
    proven: float | None
    source: str


class QueueGuard:
    """The most in flight that keeps the server's queue near ``queue_share`` of its batch.

        guard = QueueGuard(queue_share=0.5)
        guard.observe(limit=20, in_flight=20.0, throughput=50.0, per_work=0.02)  # R = 1
        guard.cap()   # 1: one seat, no queue to keep

    Parameters:
        queue_share: the target queue as a share of what the server runs, in (0, 1].
        batch: the batch the server states (it queues past it), or ``None``.
        hard_cap: the most in flight the server takes (it refuses past it), or ``None``.
    """

    __slots__ = (
        "_base",
        "_last",
        "batch",
        "hard_cap",
        "last_in_flight",
        "proven",
        "queue_share",
        "running",
    )

    def __init__(
        self,
        *,
        queue_share: float = 0.5,
        batch: int | None = None,
        hard_cap: int | None = None,
    ) -> None:
        if not 0 < queue_share <= 1:
            raise ValueError(f"queue_share must be in (0, 1], got {queue_share!r}")
        for name, value in (("batch", batch), ("hard_cap", hard_cap)):
            if value is not None and (isinstance(value, bool) or value < 1):
                raise ValueError(f"{name} must be an int >= 1 or None, got {value!r}")
        self.queue_share = queue_share
        self.batch = batch
        self.hard_cap = hard_cap
        #: Little's estimate of what the server runs at once, after the last epoch.
        self.running: float | None = None
        #: The most the steps up have proven the server runs at once.
        self.proven: float | None = None
        self.last_in_flight: float | None = None
        #: The lowest limit measured well and its mean time per unit of work.
        self._base: tuple[int, float] | None = None
        self._last: float | None = None

    @property
    def unqueued(self) -> float | None:
        """The unqueued time per unit of work (seconds): see the module docstring."""
        return self._base[1] if self._base is not None else None

    def observe(
        self,
        *,
        limit: int,
        in_flight: float,
        throughput: float,
        per_work: float,
        samples: int = BASE_SAMPLES,
        step_from: tuple[float, float] | None = None,
    ) -> None:
        """One epoch measured: ``throughput`` units of work a second at ``in_flight`` on
        average (limit ``limit``), ``per_work`` its mean seconds a unit of work over
        ``samples`` answers;
        ``step_from``: what was in flight and the throughput in the epoch before, where this
        one is a step up from it that bought throughput (what the step proves)."""
        base = self._base
        well = per_work > 0 and math.isfinite(per_work) and samples >= BASE_SAMPLES
        if well and (base is None or limit <= base[0]):
            self._base = (limit, per_work)
        unqueued = self.unqueued
        if unqueued is not None and throughput > 0:
            now = min(in_flight, throughput * unqueued)
            # The larger of this epoch's and the last one's: one slow epoch (a client that
            # other work on its cores held back a moment) read 6 seats of 8 and cut to 9.
            self.running = now if self._last is None else max(now, min(self._last, in_flight))
            self._last = now
        self.last_in_flight = in_flight
        if step_from is not None:
            low, low_throughput = step_from
            if low < limit and low_throughput > 0 and throughput > 0:
                shown = min(in_flight, low * throughput / low_throughput)
                if shown > low:  # the step bought something: that much is proven
                    self.proven = max(self.proven or 0.0, shown)

    def disprove(self, running: float) -> None:
        """A step down to ``running`` in flight lost nothing: the server runs no more than
        that, whatever a step up (a noisy epoch) proved before."""
        if self.proven is not None:
            self.proven = min(self.proven, running)

    def forget_proof(self) -> None:
        """The server changed (a refusal, a restart): what steps proved no longer holds."""
        self.proven = None

    def seen_running(self) -> float | None:
        """What the server is seen to run: Little's estimate or the proven count, the larger."""
        values = [v for v in (self.running, self.proven) if v is not None]
        return max(values) if values else None

    def target(self, running: float) -> int:
        """The queue aimed at beside ``running`` requests: ``floor(queue_share x running)``
        (0 for a server of one seat: a queue there only adds a whole service time)."""
        return max(0, math.floor(self.queue_share * running + 1e-9))

    def cap(self, *, room: bool = True) -> int | None:
        """The most in flight: what the server runs plus the target queue, within what it
        states (``None``: nothing known yet, no bound). ``room``: where nothing waits, one
        more than is in flight is allowed (how slow start leaves a limit of 1); the hold
        phase asks without it, so that it does not probe a server of one seat over and over
        (each probe put a call behind another, and an urgent call behind both)."""
        bound: int | None = None
        seen = self.seen_running()
        if seen is not None:
            # To the nearest request: an estimate of 1.99 at 2 in flight is a server that runs
            # both, not one with a queue.
            running = float(max(1, round(seen)))
            # Aimed under the target: the estimate runs a few percent either way, and held at
            # the target itself the queue's p90 stood over it (38 against 32, 64 seats).
            bound = round(running) + math.floor(_AIM * self.target(running) + 1e-9)
            last = self.last_in_flight
            if room and last is not None and last - seen < max(0.5, self.target(running)):
                # The queue is within its target: the server may run more than has been
                # tried (the estimate is noisy, and a limit of 1 has no target at all), so
                # one more is always allowed; the knee judges whether it buys anything.
                bound = max(bound, round(last) + 1)
        stated = self.stated_cap()  # several replicas behind one URL: what a probe proved
        if stated is not None:
            bound = stated if bound is None else min(bound, stated)
        return bound

    def stated_cap(self) -> int | None:
        """The bound from what the server states alone: its batch plus the target queue (or
        what a probe proved beyond it), and its hard cap (``None``: it states neither)."""
        bound: int | None = None
        if self.batch is not None:
            stated = float(self.batch)
            if self.proven is not None and self.proven > stated:
                stated = float(round(self.proven))
            bound = round(stated) + self.target(stated)
        if self.hard_cap is not None:
            bound = self.hard_cap if bound is None else min(bound, self.hard_cap)
        return bound

    def view(self) -> GuardView:
        """A snapshot for the controller's reason and stats."""
        seen = self.seen_running()
        queue = None
        if seen is not None and self.last_in_flight is not None:
            queue = max(0.0, self.last_in_flight - seen)
        source = "proven" if self.proven is not None and seen == self.proven else "little"
        if seen is None:
            source = "stated" if self.batch is not None or self.hard_cap is not None else "none"
        return GuardView(
            running=seen,
            queue=queue,
            target=None if seen is None else self.target(max(1.0, seen)),
            cap=self.cap(),
            proven=self.proven,
            source=source,
        )
