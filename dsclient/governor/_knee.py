"""The knee of a server that says nothing about its load: how many requests in flight still buy
throughput, found from the answers alone.

Pure: no network, no clock of its own (every method takes ``now``). The limit controller feeds
it each finished request (its service time and its work, the tokens it produced) and a tick a
period; it answers with the limit it wants next.

**Why throughput, not latency alone.** A batching server's latency rises long before its
throughput stops rising: on a GPU one decode step for 256 sequences costs a little more than for
one, so every request takes longer while the server does far more work. A limit that stopped
where latency first inflated (TCP Vegas against the best latency seen) would hold a GPU server
at a fraction of its batch. What tells the knee is the *elasticity* of throughput in the limit,
measured between two limits held in turn::

    e = ln(X2 / X1) / ln(L2 / L1)      # X: work finished per second at limit L (tokens/s)

``e = 1`` is a server with room (double the limit, double the throughput); ``e = 0`` is a server
whose batch is full (more in flight only queues). The knee is where ``e`` falls to
:data:`ELASTICITY` (0.15: doubling the limit buys less than 11% more throughput); by Little's
law (in flight = throughput x latency) the latency then rises by the rest. On a server whose
every sequence adds to the step (transformers' Python loop, a GPU past its sweet spot) the
throughput keeps rising ever more slowly, and the threshold is what decides how close to the
most it gets: 0.15 held such a simulated server at 94% of the throughput of sending
everything at once, 0.3 at 78%.

**Epochs.** The limit is held for an *epoch*: first the requests sent under the previous limit
drain (after a cut, until no more than the limit is in flight), then the requests admitted since
are counted, over at least one median service time and :data:`MIN_SAMPLES` completions (and an
eighth of the limit). An epoch in which the
client did not keep the limit full (no calls waiting for most of it) says nothing about the
limit and is measured again.

**Phases.**

* *Slow start*: from the start, multiply the limit by 4 an epoch while throughput still rises
  well (``e >= 0.5``, and after the first epoch; under a limit of 64), by 2 while ``e >=
  ELASTICITY``; then settle between the last two limits, nearer the lower the flatter the last
  step was. Its epochs are short (one median service time); where an answer after a rise
  comes back :data:`_QUEUED` times slower than the last epoch's median (the server queues at
  the new limit), counting starts again from that answer.
* *Hold*: probe one step up (x1.5), keep it if ``e >= ELASTICITY`` and probe up again from
  there; otherwise probe one step down, keep it if the step it gave up was worth less than that
  too and probe down again, else go back to the base and measure it anew. Its epochs count only
  once every request in flight when the limit moved has come back (until then the server's
  queue is not what the new limit makes it: after a step up past the batch, the first answers
  come from requests that found the queue short, and every probe up looked worth it), over two
  median service times, with twice the answers. A server that changes
  (other clients, longer prompts) moves the knee, and the probes follow it.

A refusal for load or a cut by another rule restarts the epoch at the new limit in the hold
phase (see :meth:`KneeFinder.restart`).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Final, Literal

__all__ = ["ELASTICITY", "MIN_SAMPLES", "Epoch", "KneeFinder", "Phase"]

Phase = Literal["slow start", "hold"]

#: The knee: a step up is kept only if throughput rises at least this much in proportion
#: (``e`` as in the module docstring): doubling the limit must buy at least 11% more throughput.
#: Steps of x1.5 need 6% more, above the noise of an epoch's estimate on the servers tried.
ELASTICITY: Final = 0.15
#: Slow start grows by :data:`_FAST` while throughput scales at least this well with the limit.
_FAST_ELASTICITY: Final = 0.5
_DOUBLE: Final = 2.0
_FAST: Final = 4.0
#: x4 only below this limit: past it a x4 step can put hundreds of requests in the server's
#: queue before the next epoch shows the knee (a simulated batch of 256: 320 -> 1024).
_FAST_BELOW: Final = 64
#: In slow start, an answer this many times slower than the last epoch's median means the
#: server queues at the new limit (see :meth:`KneeFinder.on_completion`).
_QUEUED: Final = 1.5
#: The hold phase's step, as a factor of the limit.
_STEP: Final = 1.5
#: Completions an epoch counts at least (or the limit, if fewer; an eighth of it, if more).
MIN_SAMPLES: Final = 8
#: An epoch lasts at least one median service time, bounded: a server whose answers take
#: minutes would otherwise hold one limit for many minutes per step.
_MAX_WINDOW_S: Final = 60.0
#: An epoch counts only if calls were waiting for a slot in at least this share of its ticks.
_FULL_SHARE: Final = 0.7


@dataclass(frozen=True)
class Epoch:
    """One limit held and measured: ``throughput`` in work per second (tokens/s where answers
    report tokens), ``latency`` the median service time, over ``samples`` completions."""

    limit: int
    throughput: float
    latency: float
    samples: int


def elasticity(low: Epoch, high: Epoch) -> float:
    """How throughput scaled between two limits: 1 in proportion, 0 flat (see the module).

    elasticity(Epoch(8, 100.0, 1.0, 16), Epoch(16, 200.0, 1.0, 16))   # 1.0
    elasticity(Epoch(8, 100.0, 1.0, 16), Epoch(16, 100.0, 2.0, 16))   # 0.0
    """
    if high.limit == low.limit or low.throughput <= 0:
        return 0.0
    if high.throughput <= 0:
        return -math.inf
    return math.log(high.throughput / low.throughput) / math.log(high.limit / low.limit)


class KneeFinder:
    """The limit for a server that publishes no queue: the most in flight that still buys
    throughput.

        knee = KneeFinder(start=5, ceiling=1024)
        knee.on_completion(now, service_s=0.8, work=64)            # each answer
        wanted = knee.on_tick(now, demand=True, in_flight=5)       # a new limit, or None

    Parameters:
        start: the limit it starts from, >= 1.
        ceiling: the most it may ask for (the controller's bound), >= start.
        elasticity: see :data:`ELASTICITY`, in (0, 1).
        min_samples: completions an epoch counts at least.
    """

    __slots__ = (
        "_began",
        "_busy",
        "_elasticity",
        "_full_ticks",
        "_in_flight_sum",
        "_latencies",
        "_min_samples",
        "_old",
        "_pending",
        "_recounted",
        "_settled",
        "_ticks",
        "_turnover",
        "_work",
        "best_latency_per_work",
        "ceiling",
        "epochs",
        "last",
        "limit",
        "phase",
        "reason",
    )

    def __init__(
        self,
        *,
        start: int,
        ceiling: int,
        elasticity: float = ELASTICITY,
        min_samples: int = MIN_SAMPLES,
    ) -> None:
        if isinstance(start, bool) or not isinstance(start, int) or start < 1:
            raise ValueError(f"start must be an int >= 1, got {start!r}")
        if ceiling < start:
            raise ValueError(f"ceiling must be >= start ({start}), got {ceiling!r}")
        if not 0 < elasticity < 1:
            raise ValueError(f"elasticity must be in (0, 1), got {elasticity!r}")
        if min_samples < 1:
            raise ValueError(f"min_samples must be >= 1, got {min_samples!r}")
        self._elasticity = elasticity
        self._min_samples = min_samples
        self.ceiling = ceiling
        self.limit = start
        self.phase: Phase = "slow start"
        self.reason = "start"
        #: Epochs measured, newest last (the two or three the decisions read).
        self.epochs: list[Epoch] = []
        #: The last epoch measured (``None`` before the first).
        self.last: Epoch | None = None
        #: The best median service time per unit of work seen (seconds per token).
        self.best_latency_per_work: float | None = None
        #: The hold phase's probe under way: ``"up"`` / ``"down"`` from the epoch at the base
        #: limit (``None``: measuring the base).
        self._pending: tuple[Literal["up", "down"], Epoch] | None = None
        self._begin(now=None, drained=True)

    # -- epochs -----------------------------------------------------------------------------
    def _begin(self, now: float | None, *, drained: bool, in_flight: int | None = None) -> None:
        """Hold the current limit from ``now``; counting starts once no more than the limit is
        in flight (``drained``: already so, as after a rise; after a cut, the requests over it
        drain first: they ran under the old one)."""
        self._began = -math.inf if now is None else now
        self._settled = drained
        #: In the hold phase counting waits until the requests in flight when the limit moved
        #: have all come back (``_old`` of them: known at the next tick): until then the
        #: server's queue is not yet what the new limit makes it.
        self._old: int | None = in_flight if drained else None
        self._turnover = self.phase == "hold" and now is not None and self._old != 0
        self._recounted = False
        self._reset_counts()

    def _reset_counts(self) -> None:
        self._work = 0.0
        self._busy = 0.0
        self._latencies: list[float] = []
        self._ticks = 0
        self._full_ticks = 0
        self._in_flight_sum = 0

    def on_completion(self, now: float, *, service_s: float, work: float) -> None:
        """A request finished well: ``service_s`` from its slot to its answer, ``work`` what it
        produced (output tokens; 1 where unknown). Only requests admitted since the epoch began
        count: those admitted before ran, in part, under the previous limit."""
        if service_s < 0 or not work > 0 or not self._settled:
            return
        if now - service_s < self._began:
            if self._turnover and self._old is not None:
                self._old -= 1
                if self._old <= 0:  # the last of the old ones: count from here
                    self._turnover = False
                    self._began = now
                    self._reset_counts()
            return
        if self._turnover:
            return
        last = self.last
        if (
            self.phase == "slow start"
            and last is not None
            and last.limit < self.limit
            and service_s > _QUEUED * last.latency
            and not self._recounted
        ):
            # The requests the rise admitted at once queue behind the old ones at a server
            # whose batch is full, and the quickest of them read a queue shorter than the new
            # limit makes (x4 steps past a server's best looked like gains: a simulated server
            # slowing past 32 was driven to 160). Count from here: a request admitted after
            # this answer has the whole new limit ahead of it. Without a queue (the answers
            # as quick as before) the first ones count at once, and slow start stays fast.
            self._recounted = True
            self._began = now
            self._reset_counts()
            return
        self._work += work
        self._busy += service_s
        self._latencies.append(service_s)
        per_work = service_s / work
        if self.best_latency_per_work is None or per_work < self.best_latency_per_work:
            self.best_latency_per_work = per_work

    def restart(self, now: float, limit: int, reason: str) -> None:
        """Another rule set the limit (a refusal for load, a latency target): measure from
        there, in the hold phase, with no probe under way."""
        self.limit = max(1, min(limit, self.ceiling))
        self.phase = "hold"
        self.reason = reason
        self._pending = None
        self._begin(now, drained=False)

    def _measured(self, now: float) -> Epoch | None:
        """The epoch, once it has counted enough; ``None`` while it goes on.

        Throughput by Little's law over the slots: with ``N`` in flight on average, each
        request holding its slot for its service time, the work done per second is
        ``N x sum(work) / sum(service)``. Unlike a count of answers per second over a window,
        it does not depend on where the window falls among waves of answers of equal length.
        """
        count = len(self._latencies)
        hold = self.phase == "hold"
        if hold:
            needed = max(2 * self._min_samples, math.ceil(self.limit / 4))
        else:
            # At a small limit, one answer per slot will do: a second wave doubles the epoch.
            needed = max(min(self._min_samples, self.limit), math.ceil(self.limit / 8))
        if count < needed or self._busy <= 0:
            return None
        median = statistics.median(self._latencies)
        # Not only the quickest of the first requests admitted. Slow start takes one median
        # service time (fast: an overshoot is what the hold phase corrects), the hold phase two.
        if now - self._began < min((2.0 if hold else 1.0) * median, _MAX_WINDOW_S):
            return None
        in_flight = self._in_flight_sum / self._ticks if self._ticks else float(self.limit)
        return Epoch(self.limit, in_flight * self._work / self._busy, median, count)

    # -- deciding ------------------------------------------------------------------------------
    def on_tick(self, now: float, *, demand: bool, in_flight: int | None = None) -> int | None:
        """A period passed (``demand``: calls wait for a slot; ``in_flight``: this client's
        requests at the server now). Returns the limit wanted next, or ``None`` to keep it."""
        if not self._settled:
            self._settled = in_flight is None or in_flight <= self.limit
            self._began = now
        if self._settled and self._turnover and self._old is None:
            # Just drained after a cut: no call was admitted since, so all in flight are old.
            self._old = self.limit if in_flight is None else in_flight
            self._turnover = self._old > 0
        if self._settled and not self._turnover:
            self._ticks += 1
            self._full_ticks += demand
            self._in_flight_sum += self.limit if in_flight is None else in_flight
        epoch = self._measured(now)
        if epoch is None:
            return None
        if self._full_ticks < _FULL_SHARE * self._ticks:
            # The client did not keep this limit full: the epoch measured the client's demand,
            # not the server. Measure again; the limit stays.
            self._begin(now, drained=True, in_flight=in_flight)
            return None
        self.epochs = [*self.epochs[-2:], epoch]
        previous, self.last = self.last, epoch
        wanted = self._decide(epoch, previous)
        wanted = max(1, min(wanted, self.ceiling))
        self._begin(now, drained=wanted >= self.limit, in_flight=in_flight)
        if wanted == self.limit:
            return None
        self.limit = wanted
        return wanted

    def _decide(self, epoch: Epoch, previous: Epoch | None) -> int:
        limit = self.limit
        if self.phase == "slow start":
            if previous is None or previous.limit >= epoch.limit:
                # The start is a guess (a default batch of 8, or 0.7 x a stated one): most
                # servers take more, and one that does not shows it in the next epoch.
                self.reason = f"slow start: {epoch.throughput:.3g}/s at {limit}"
                return math.ceil(limit * _FAST)
            e = elasticity(previous, epoch)
            if e >= self._elasticity:
                fast = e >= _FAST_ELASTICITY and limit < _FAST_BELOW
                factor = _FAST if fast else _DOUBLE
                self.reason = (
                    f"slow start: throughput x{epoch.throughput / previous.throughput:.2f} "
                    f"for limit {previous.limit} -> {limit} (elasticity {e:.2f})"
                )
                return math.ceil(limit * factor)
            # Past the knee: between the last two limits, nearer the lower the flatter the
            # last step (e = 0: the lower one; e just under the threshold: the higher one).
            share = max(0.0, e) / self._elasticity
            knee: float = previous.limit * math.pow(limit / previous.limit, share)
            self.phase = "hold"
            self.reason = (
                f"knee between {previous.limit} and {limit}: throughput "
                f"x{epoch.throughput / previous.throughput:.2f} (elasticity {e:.2f})"
            )
            return max(1, round(knee))
        pending, self._pending = self._pending, None
        if pending is None:
            # The base measured: probe one step up (at the ceiling: one step down).
            if limit >= self.ceiling:
                return self._probe_down(epoch)
            self.reason = f"probing up from {limit}"
            return self._probe_up(epoch)
        direction, base = pending
        if direction == "up":
            e = elasticity(base, epoch)
            if e >= self._elasticity:
                # Kept; the epoch just measured is the base of the next step up.
                self.reason = f"{base.limit} -> {limit} bought throughput (elasticity {e:.2f})"
                return self._probe_up(epoch)
            # Not worth it: probe below the base.
            return self._probe_down(base)
        e = elasticity(epoch, base)
        if e < self._elasticity:
            # Kept the lower limit; the next step goes down again from it.
            self.reason = f"{limit} -> {base.limit} bought little (elasticity {e:.2f})"
            return self._probe_down(epoch)
        self.reason = f"held at {base.limit}: {limit} lost throughput (elasticity {e:.2f})"
        return base.limit

    def _probe_up(self, base: Epoch) -> int:
        up = max(base.limit + 1, math.ceil(base.limit * _STEP))
        if up > self.ceiling:
            return base.limit
        self._pending = ("up", base)
        return up

    def _probe_down(self, base: Epoch) -> int:
        down = min(base.limit - 1, math.floor(base.limit / _STEP))
        if down < 1:
            self.reason = f"held at {base.limit}"
            return base.limit
        self._pending = ("down", base)
        return down
