"""The knee of a server that says nothing about its load: how many requests in flight still buy
throughput, found from the answers alone.

Pure: no network, no clock of its own (every method takes ``now``). The limit controller feeds
it every finished attempt (when it was admitted, its service time, its work: the tokens it
produced) and a tick a period (with what is in flight); it answers with the limit it wants next.

**Why throughput, not latency alone.** A batching server's latency rises long before its
throughput stops rising: on a GPU one decode step for 256 sequences costs a little more than for
one, so every request takes longer while the server does far more work. What tells the knee is
the *elasticity* of throughput in the limit, measured between two limits held in turn::

    e = ln(X2 / X1) / ln(L2 / L1)      # X: work finished per second at limit L (tokens/s)

``e = 1`` is a server with room (double the limit, double the throughput); ``e = 0`` is a server
whose batch is full (more in flight only queues). The knee is where ``e`` falls to
:data:`ELASTICITY` (0.15: doubling the limit buys less than 11% more throughput).

**The estimate, and why a flat server reads as flat.** An epoch's throughput is Little's law
over a *cohort*: the calls admitted in a window of the epoch, every one of them waited for::

    X = mean in flight x sum(work) / sum(service)      # over the whole cohort

Little's law holds for a cohort only if none of it is left out. The estimate this replaces
closed an epoch on the answers that had come back by then: after a step up that put a queue
at the server, the quickest answers (those that found the queue short) came back first and the
slow ones had not, so a flat server read as elastic (e = 1.00) and slow start doubled a server
of 10 seats to 448 in flight. Now the epoch closes only once the last call of its cohort has
come back, whatever the spread of service times. The cohort also leaves out the burst admitted
the moment the limit rose (those calls queue behind fewer than the new limit makes): it starts
at the first tick after the rise, when each call admitted has the whole new limit beside it.
After a cut, it starts once what is in flight has drained to the new limit. After a rise of
:data:`_SETTLE_RISE` calls or more, the first epoch is measured again: the rise opens as many
new connections, and the calls admitted meanwhile on connections that answers freed reach the
server before them (on a server of 256 seats that first cohort read Little's count as 284-333
running; measured again, 252-266).

**The queue guard** (:class:`~dsclient.governor._guard.QueueGuard`) reads every epoch too: what
the server is seen to run (throughput times the unqueued time per unit of work) and the queue
beyond it. Whatever the elasticity says, a limit over what the server runs plus the target queue
is cut to it; growth past that must be proven by completions: a step up whose throughput rose
(e >= :data:`ELASTICITY`), measured on enough answers, passes the guard unless more than half
of what is in flight waits. Little's count reads a server whose calls slow as its batch fills
(transformers' on a CPU) as queueing; only completions tell it from one whose batch is full
(that one's throughput is flat past its batch; the other's keeps rising, step after step). What
a noisy step proved, a probe down that loses nothing takes back. In slow start a count of less
than two waiting cuts nothing: at limits of 2 or 3 it is off by half either way.

**Phases.**

* *Slow start*: from the start (1 where the server states no batch: a server of one seat then
  never holds more than two waiting), multiply the limit by 3 an epoch while throughput rises
  in proportion (``e >= 0.5``) and nothing waits, up to 2.5 times what the server is seen to
  run, under a limit of :data:`_BIG_STEP_UNDER`; otherwise by 2 while ``e >= ELASTICITY``,
  up to twice what it runs (a step that crosses the batch leaves at most 1.5 batches waiting,
  one past a queue already seen; a step that bought throughput in proportion goes at least
  x2, but for the step from 1, which any server pays for, and no step is smaller than x1.25,
  the least an epoch can judge). It ends at a
  batch the server states (plus the target queue), where a queue stands after a step that
  bought little (at the guard's cap), or between the last two limits, nearer the lower the
  flatter the last step was. Where its next limit is a stated batch anyway, its first epoch
  closes on the first answer (it decides nothing by its figure).
* *Hold*: probe one step up (x1.5, within the guard's cap; past it once per
  :data:`_ABOVE_GUARD_S`, doubling while such probes buy nothing, at once again after one that
  bought throughput; under a limit of :data:`_BIG_STEP_UNDER` the first comes right after the
  first rest), keep it if ``e >= ELASTICITY`` and probe up again from there; where the cap
  leaves no room to probe up and the limit stands only on what a step proved, probe down
  instead; otherwise (the probe up
  bought nothing) probe one step down, keep it if the
  step it gave up was worth less than that too and probe down again, else go back to the base
  and rest there a few epochs (2, then 4, up to 16 while nothing changes) before probing again:
  a probe down a step costs a third of the throughput for its epoch. A server that changes
  (other clients, longer prompts) moves the knee, and the probes follow it.

An epoch in which the client did not keep the limit full (no calls waiting for most of it) says
nothing about the limit and is measured again. A refusal for load or a cut by another rule
restarts the epoch at the new limit in the hold phase (see :meth:`KneeFinder.restart`).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Final, Literal

from ._guard import QueueGuard

__all__ = ["ELASTICITY", "MIN_SAMPLES", "Epoch", "KneeFinder", "Phase"]

Phase = Literal["slow start", "hold"]
_Stage = Literal["drain", "burst", "open", "closing"]

#: The knee: a step up is kept only if throughput rises at least this much in proportion
#: (``e`` as in the module docstring): doubling the limit must buy at least 11% more throughput.
#: Steps of x1.5 need 6% more, above the noise of an epoch's estimate on the servers tried.
ELASTICITY: Final = 0.15
#: Slow start grows by :data:`_FAST` while throughput scales at least this well with the limit.
_FAST_ELASTICITY: Final = 0.5
_DOUBLE: Final = 2.0
#: x3, not x4: a step from a limit the server still runs whole (no queue yet) to three times
#: it leaves at most two batches waiting however small the batch; x4 left three.
_FAST: Final = 3.0
#: Slow start never goes past this many times what the server is seen to run: a step from
#: there leaves at most one batch waiting (2.5 left a server of 256 seats 310 waiting).
_REACH: Final = 2.0
_FREE_REACH: Final = 2.5
#: x3 steps (and the 2.5x reach) only under this limit. A step of hundreds of calls at once
#: opens hundreds of connections, and the calls admitted meanwhile on the connections the
#: answers freed reach the server first: their cohort finds no queue and reads a server past
#: its batch as elastic (256 seats: 179 -> 446 read x2.42, and the next step went to 1024 in
#: flight, a queue of three batches, in 2 of 6 runs).
_BIG_STEP_UNDER: Final = 64
#: After a rise of this many calls or more the first epoch is measured again (see
#: :meth:`KneeFinder.on_tick`).
_SETTLE_RISE: Final = 128
#: An epoch sets the guard's unqueued time only if its mean in flight reached this share of
#: its limit.
_FILLED: Final = 0.9
#: Where more than this share of what is in flight waits (by the guard's count), no step's
#: elasticity overrides the guard: a noisy epoch read 235 -> 671 on 256 seats as "in
#: proportion", and slow start went on to 1024 in flight.
_DEEP_SHARE: Final = 0.5
#: Slow start ends where the guard sees this share of what is in flight waiting (at least one).
_QUEUED_SHARE: Final = 0.1
#: A slow-start step proves what the server runs (as a hold phase's probe up does) only if
#: both its epochs counted this many answers.
_PROOF_SAMPLES: Final = 8
#: The hold phase's step, as a factor of the limit.
_STEP: Final = 1.5
#: The smallest step a probe up is judged on: over a step of one call in fifteen, the noise
#: of two epochs' estimates made an elasticity of 2.4 out of nothing.
_SMALLEST_STEP: Final = 1.25
#: Completions an epoch counts at least (or the limit, if fewer; an eighth of it, if more).
MIN_SAMPLES: Final = 8
#: Answers the first epoch of slow start counts where its next limit is the batch the server
#: states anyway (it decides nothing by its figure).
_FIRST_SAMPLES: Final = 1
#: The longest an epoch waits for the last of its cohort, past its window: a call that hangs
#: (a stalled stream) must not stall the knee; the cohort is then measured as it came back.
_MAX_WINDOW_S: Final = 60.0
#: An epoch counts only if calls were waiting for a slot in at least this share of its ticks.
_FULL_SHARE: Final = 0.7
#: A probe above the guard's cap is tried at most once in this many seconds; each such probe
#: that bought nothing doubles the wait (up to :data:`_ABOVE_GUARD_MAX_S`).
_ABOVE_GUARD_S: Final = 30.0
_ABOVE_GUARD_MAX_S: Final = 480.0
#: Epochs the hold phase rests at a base it just confirmed (doubling, up to the most).
_REST_FIRST: Final = 2
_REST_MOST: Final = 16


@dataclass(frozen=True)
class Epoch:
    """One limit held and measured: ``throughput`` in work per second (tokens/s where answers
    report tokens), ``latency`` the median service time, over ``samples`` completions;
    ``per_work`` the median service time per unit of work, ``in_flight`` the mean in flight."""

    limit: int
    throughput: float
    latency: float
    samples: int
    per_work: float = 0.0
    in_flight: float = 0.0
    #: The mean service time per unit of work (all service over all work), 0 if unknown.
    work_time: float = 0.0


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
    throughput, with the server's queue held near its target.

        knee = KneeFinder(start=1, ceiling=1024)
        knee.on_release(now, admitted_at=t0, service_s=0.8, work=64)   # each attempt
        wanted = knee.on_tick(now, demand=True, in_flight=5)           # a new limit, or None

    Parameters:
        start: the limit it starts from, >= 1.
        ceiling: the most it may ask for (the controller's bound), >= start.
        elasticity: see :data:`ELASTICITY`, in (0, 1).
        min_samples: completions an epoch counts at least.
        guard: the queue guard (what the server states, the target queue's share); default:
            one that knows nothing stated and aims at half of what the server runs.
    """

    __slots__ = (
        "_a",
        "_above_fails",
        "_above_ok_at",
        "_b",
        "_began",
        "_busy",
        "_cohort",
        "_confirming",
        "_elasticity",
        "_full_ticks",
        "_in_flight_a",
        "_in_flight_sum",
        "_latencies",
        "_min_samples",
        "_pending",
        "_per_work",
        "_probe_above",
        "_released",
        "_rest",
        "_rest_next",
        "_returned",
        "_settling",
        "_stage",
        "_ticks",
        "_work",
        "best_latency_per_work",
        "ceiling",
        "epochs",
        "guard",
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
        guard: QueueGuard | None = None,
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
        self.guard = guard if guard is not None else QueueGuard()
        self.ceiling = ceiling
        self.limit = start
        self.phase: Phase = "slow start"
        self.reason = "start"
        #: Epochs measured, newest last (the two or three the decisions read).
        self.epochs: list[Epoch] = []
        #: The last epoch measured (``None`` before the first).
        self.last: Epoch | None = None
        #: The best service time per unit of work of any answer (seconds per token).
        self.best_latency_per_work: float | None = None
        #: The hold phase's probe under way: ``"up"`` / ``"down"`` from the epoch at the base
        #: limit (``None``: measuring the base).
        self._pending: tuple[Literal["up", "down"], Epoch] | None = None
        self._probe_above = False
        self._above_ok_at = -math.inf
        self._above_fails = 0
        self._rest = 0
        self._rest_next = _REST_FIRST
        self._confirming = False
        self._settling = False
        self._begin(now=None, drained=True)

    # -- epochs -----------------------------------------------------------------------------
    def _begin(self, now: float | None, *, drained: bool) -> None:
        """Hold the current limit from ``now``. The cohort's window opens at the next tick
        (``drained``: nothing over the limit is in flight, as after a rise), or, after a cut,
        at the first tick with no more than the limit in flight."""
        self._began = -math.inf if now is None else now
        self._stage: _Stage = "burst" if drained else "drain"
        self._a = math.inf
        self._b: float | None = None
        self._in_flight_a: int | None = None
        self._released = 0
        self._cohort = 0
        self._returned = 0
        self._work = 0.0
        self._busy = 0.0
        self._latencies: list[float] = []
        self._per_work: list[float] = []
        self._ticks = 0
        self._full_ticks = 0
        self._in_flight_sum = 0

    def on_release(
        self, now: float, *, admitted_at: float, service_s: float, work: float, ok: bool = True
    ) -> None:
        """An attempt ended (``ok``: answered well), admitted at ``admitted_at``: ``service_s``
        from its slot to its answer, ``work`` what it produced (output tokens; 1 where
        unknown). It counts if it belongs to the epoch's cohort (admitted in its window)."""
        if ok and service_s >= 0 and work > 0:
            per_work = service_s / work
            if self.best_latency_per_work is None or per_work < self.best_latency_per_work:
                self.best_latency_per_work = per_work
        if self._stage not in ("open", "closing"):
            return
        if self._stage == "open":
            self._released += 1
        if admitted_at <= self._a or (self._b is not None and admitted_at > self._b):
            return
        self._returned += 1
        if ok and service_s >= 0 and work > 0:
            self._work += work
            self._busy += service_s
            self._latencies.append(service_s)
            self._per_work.append(service_s / work)

    def on_completion(self, now: float, *, service_s: float, work: float) -> None:
        """A request answered well (admitted ``service_s`` before ``now``)."""
        self.on_release(now, admitted_at=now - service_s, service_s=service_s, work=work)

    def restart(self, now: float, limit: int, reason: str) -> None:
        """Another rule set the limit (a refusal for load, a latency target): measure from
        there, in the hold phase, with no probe under way."""
        self.limit = max(1, min(limit, self.ceiling))
        self.phase = "hold"
        self.reason = reason
        self._pending = None
        self._probe_above = False
        self._rest = 0
        self.guard.forget_proof()
        self._begin(now, drained=False)

    def _needed(self) -> int:
        if self.phase == "hold":
            return max(2 * self._min_samples, math.ceil(self.limit / 4))
        # At a small limit, one call per slot will do: a second wave doubles the epoch.
        needed = max(min(self._min_samples, self.limit), math.ceil(self.limit / 8))
        stated = self.guard.stated_cap()
        if self.last is None and stated is not None and math.ceil(self.limit * _FAST) >= stated:
            # The first epoch goes on to the batch the server states whatever it measures:
            # it only shows that the server answers. Waiting for a full epoch held a batch of
            # 8- and 300-token items at 11 of a stated 16 for 1.3 s (3.5% of the makespan).
            return min(needed, _FIRST_SAMPLES)
        return needed

    def _advance(self, now: float, in_flight: int | None, demand: bool) -> Epoch | None:
        """Move the epoch along at a tick; the epoch once its whole cohort came back."""
        if self._stage == "drain":
            if in_flight is not None and in_flight > self.limit:
                return None
            self._stage = "burst"
        if self._stage == "burst":
            # The calls admitted up to now include the burst of the rise: the window opens here.
            self._stage = "open"
            self._a = now
            self._in_flight_a = in_flight
            return None
        self._ticks += 1
        self._full_ticks += demand
        self._in_flight_sum += self.limit if in_flight is None else in_flight
        if self._stage == "open":
            if in_flight is None or self._in_flight_a is None:
                admitted = self._returned  # no count of what is in flight: what came back
            else:
                admitted = in_flight - self._in_flight_a + self._released
            if admitted < self._needed():
                return None
            self._stage = "closing"
            self._b = now
            self._cohort = admitted
            if in_flight is None:
                self._cohort = self._returned
        b = self._b if self._b is not None else now
        # The first epoch of slow start decides nothing by its figure (the next limit is x3 of
        # the start, or what the server states): it closes once enough of its cohort came back.
        # Waiting for the last one held a batch of 8- and 300-token items at 0.7 x a stated
        # batch of 16 for 7.8 s, behind one long call.
        first = self.phase == "slow start" and self.last is None
        enough = first and self._returned >= self._needed()
        if self._returned < self._cohort and now - b < _MAX_WINDOW_S and not enough:
            return None
        count = len(self._latencies)
        if count == 0 or self._busy <= 0:
            self._begin(now, drained=True)  # the whole cohort failed: measure again
            return None
        in_flight_mean = self._in_flight_sum / self._ticks if self._ticks else float(self.limit)
        return Epoch(
            self.limit,
            in_flight_mean * self._work / self._busy,
            statistics.median(self._latencies),
            count,
            per_work=statistics.median(self._per_work),
            in_flight=in_flight_mean,
            work_time=self._busy / self._work if self._work > 0 else 0.0,
        )

    # -- deciding ------------------------------------------------------------------------------
    def on_tick(self, now: float, *, demand: bool, in_flight: int | None = None) -> int | None:
        """A period passed (``demand``: calls wait for a slot; ``in_flight``: this client's
        requests at the server now). Returns the limit wanted next, or ``None`` to keep it."""
        epoch = self._advance(now, in_flight, demand)
        if epoch is None:
            return None
        if self._full_ticks < _FULL_SHARE * self._ticks:
            # The client did not keep this limit full: the epoch measured the client's demand,
            # not the server. Measure again; the limit stays.
            self._begin(now, drained=True)
            return None
        if self._settling:
            # The first epoch after a rise of hundreds of calls: those calls open as many new
            # connections, and the calls admitted meanwhile on the connections the answers
            # freed reach the server first, past the queue the rise put there. Their cohort
            # read 282 -> 553 on a server of 256 seats as x1.96, and Little's count as 500
            # running: the limit stood at 553 (queue p90 290) for half a batch. Measured again
            # at the same limit, the queue is steady.
            self._settling = False
            self.reason = f"measuring {self.limit} again: the first epoch after a rise"
            self._begin(now, drained=True)
            return None
        self.epochs = [*self.epochs[-2:], epoch]
        previous, self.last = self.last, epoch
        step_from = None
        probe = self._pending
        low = probe[1] if probe is not None and probe[0] == "up" else None
        if low is None and self.phase == "slow start" and previous is not None:
            # Slow start's steps prove too, where both epochs counted enough answers: a server
            # whose calls slow as its batch fills (transformers' on a CPU) shows partial gains
            # step after step, which a server of N seats never does past N; Little's count
            # (from the unqueued time at the lowest limit) reads it as running a few and
            # queueing the rest. Epochs of a few answers prove nothing (see _PROOF_SAMPLES),
            # nor do steps of hundreds of calls (see _BIG_STEP_UNDER: 282 -> 561 read x1.99 on
            # a server of 256 seats, and "proved" 351 running).
            counted = min(previous.samples, epoch.samples) >= _PROOF_SAMPLES
            if counted and epoch.limit <= _BIG_STEP_UNDER:
                low = previous
        if (
            low is not None
            and _SMALLEST_STEP * low.limit <= epoch.limit
            and elasticity(low, epoch) >= self._elasticity
        ):
            # A step up that bought throughput proves what the server runs. What a noisy
            # epoch proved wrongly, the hold phase's probe down takes back (see _decide).
            step_from = (low.in_flight or float(low.limit), low.throughput)
        self.guard.observe(
            limit=epoch.limit,
            in_flight=epoch.in_flight or float(epoch.limit),
            throughput=epoch.throughput,
            per_work=epoch.work_time,
            # An epoch that did not keep its limit full (a batch still being handed out: the
            # client's own start-up slowed its first answers by half) sets no unqueued time.
            samples=epoch.samples if epoch.in_flight >= _FILLED * epoch.limit else 0,
            step_from=step_from,
        )
        wanted = self._guarded(now, epoch, previous, proved=step_from is not None)
        wanted = max(1, min(wanted, self.ceiling))
        self._begin(now, drained=wanted >= self.limit)
        if wanted == self.limit:
            return None
        self._settling = wanted - self.limit >= _SETTLE_RISE
        self.limit = wanted
        return wanted

    def _guarded(self, now: float, epoch: Epoch, previous: Epoch | None, *, proved: bool) -> int:
        """The knee's decision within the queue guard's cap (see the module docstring);
        ``proved``: the step into this epoch bought throughput, measured on enough answers."""
        cap = self.guard.cap(room=self.phase == "slow start")
        limit = self.limit
        above, self._probe_above = self._probe_above, False
        # A step into this limit that bought throughput in proportion (e >= 0.5) shows no
        # queue, whatever Little's count says: a GPU's answers slow as its batch fills, so
        # the count comes out low there (a batch of 256 read as 150 and cut to 190).
        seen = self.guard.seen_running()
        queued = None if seen is None else epoch.in_flight - seen
        deep = queued is not None and queued > _DEEP_SHARE * epoch.in_flight
        strong = (
            previous is not None
            and previous.limit < epoch.limit
            and elasticity(previous, epoch) >= _FAST_ELASTICITY
            and not deep  # more than half of what is in flight waits: no step says otherwise
        )
        # In slow start, a count of less than two calls waiting cuts nothing: at a limit of 2
        # or 3 it is off by half either way, and on transformers' server one such epoch read
        # "1 of 2 running" and held the limit at 1, a third of the server's throughput, for
        # 30 s. The knee's own step judges it (a server of one seat: flat from 1 to 2).
        waiting_few = self.phase == "slow start" and (queued is None or queued < 2)
        # A step that bought throughput on enough answers passes the guard too, unless the
        # queue is deep: completions, not service times, say what the server runs (a server
        # whose calls slow as its batch fills reads as queueing by Little's count). The next
        # step up from there must prove itself again, and a probe down takes back what noise
        # proved.
        # The cap aims under the target; the cut comes only where the queue the guard counts at
        # this limit is over the target itself (or the limit passes what the server states): an
        # epoch whose client left the limit part empty counts all it had in flight as running,
        # and its cap came out under the limit with no queue seen ("6 of 6 running, queue 0 >
        # target 3"; cut after cut, a stated batch of 8 fell to 2).
        stated = self.guard.stated_cap()
        over = (
            seen is None
            or limit - seen > self.guard.target(max(1.0, seen))
            or (stated is not None and limit > stated)
        )
        bought = proved and not deep
        if (
            cap is not None
            and limit > cap
            and over
            and not strong
            and not waiting_few
            and not bought
        ):
            if above:
                # A probe past the guard that proved nothing: wait longer for the next one.
                self._above_fails += 1
            else:
                self._probe_above_soon(now, limit)
            view = self.guard.view()
            self.phase = "hold"
            self._pending = None
            # Rest at the guard's limit before probing up again: each probe over it puts a
            # queue at the server for an epoch (a server of one seat: a call waiting behind
            # another, a whole service time more for an urgent call that comes then).
            self._rest, self._rest_next = self._rest_next, min(_REST_MOST, 2 * self._rest_next)
            running = view.running if view.running is not None else float(cap)
            queue = max(0.0, epoch.in_flight - running) if epoch.in_flight else 0.0
            self.reason = (
                f"queue guard: the server runs about {running:.0f} of {epoch.in_flight:.0f} "
                f"in flight (queue about {queue:.0f} > target {view.target}); "
                f"limit {limit} -> {cap}"
            )
            return cap
        if above:
            # The probe proved more: the next one past the guard may go at once.
            self._above_fails = 0
            self._above_ok_at = now
        judged = self._pending  # the probe this epoch measured (``_decide`` sets the next)
        wanted = self._decide(now, epoch, previous)
        if wanted <= limit:
            return wanted
        if judged is not None and judged[0] == "down" and wanted == judged[1].limit:
            # Back to the base a probe down left (it lost throughput there): the base was
            # held before, and the cap counted at the lower limit (all running, a small
            # target) would otherwise hold the limit under it.
            return wanted
        if self.phase == "slow start":
            stated = self.guard.stated_cap()
            if stated is not None and wanted > stated:
                # A batch the server states is where slow start stops (with the target queue).
                self.phase = "hold"
                self.reason = f"slow start ends at what the server states: limit -> {stated}"
                return max(limit, stated)
            if seen is None:
                # No unqueued time yet (no epoch kept its limit full: a client starting
                # thousands of calls at once): no further than 2.5x what was in flight. Without
                # this, x3 steps ran a server of 256 seats to 905 in flight.
                return min(wanted, max(limit + 1, math.floor(_FREE_REACH * epoch.in_flight)))
            queued = epoch.in_flight - seen
            waits = queued > max(1.0, _QUEUED_SHARE * limit)
            # Throughput rose in proportion and nothing waits: x3, up to 2.5 times what the
            # server runs (at most 1.5 batches waiting, if the batch fills within the step).
            # Otherwise no further than twice what it runs (at most one batch waiting).
            reach = _FREE_REACH if strong and not waits and limit < _BIG_STEP_UNDER else _REACH
            least = self._judged_step(limit)
            paired = previous is not None and previous.limit >= 2
            if strong and paired and limit < _BIG_STEP_UNDER:
                # A step that bought throughput in proportion (e >= 0.5) shows room, whatever
                # Little's count says (it reads a server whose calls slow as its batch fills as
                # running half of what it does): x2 at least, at most one limit waiting at a
                # server whose batch it just filled. On transformers' server slow start ended
                # at 7, a third of the best, after 2 -> 5 bought x1.8. Not the step from 1: one
                # call at a time leaves the server idle for each round trip, and any server,
                # one of one seat too, gains from a second call (llama.cpp's of one seat read
                # 1 -> 2 as x1.45 with the client's cores busy, and x2 put 3 calls waiting).
                least = max(least, math.floor(_DOUBLE * limit))
            wanted = min(wanted, max(least, math.floor(reach * seen)))
            if cap is not None and wanted > cap and waits and not strong:
                # A queue stands and the step bought little: the batch filled within it. More
                # would only queue: no further than the guard's cap. (A step that bought much,
                # e >= 0.5, went on above: a GPU's answers slow as its batch fills, so Little's
                # count of what it runs comes out low there while its throughput still scales.)
                self.phase = "hold"
                self._probe_above_soon(now, limit)
                self.reason = (
                    f"slow start ends: the server runs about {seen:.0f} of "
                    f"{epoch.in_flight:.0f} in flight; limit {limit} -> {max(limit, cap)}"
                )
                return max(limit, cap)
            return wanted
        if cap is None or wanted <= cap:
            return wanted
        # A probe up past the guard's cap: only now and then (it costs a queue while it lasts).
        wait = min(_ABOVE_GUARD_MAX_S, _ABOVE_GUARD_S * 2**self._above_fails)
        if self._above_ok_at == -math.inf:
            self._above_ok_at = now + wait  # not at once: first the guard's own limit a while
        if now >= self._above_ok_at:
            self._above_ok_at = now + wait
            self._probe_above = True
            return wanted
        if cap >= _SMALLEST_STEP * limit:
            return cap  # the probe goes as far as the guard allows (still pending "up")
        # No room to probe up, and the limit stands where only a step's proof allows it (over
        # Little's count plus the target, or over a batch the server states): probe down
        # instead, as at the ceiling. What a noisy step proved (and lifted the cap to) is
        # taken back if the step down loses nothing. (Elsewhere a step down only costs
        # throughput: a queue within the target, or the batch stated, is what it would test.)
        pending = self._pending
        self._pending = None
        if pending is not None and pending[0] == "up" and self._doubted(limit):
            return self._probe_down(pending[1])
        self.reason = f"holding {limit}: the guard's cap ({cap}) leaves no room to probe up"
        return limit

    def _probe_above_soon(self, now: float, limit: int) -> None:
        """Slow start ended under the guard (at its cap, at a knee, or by a cut): the first
        probe past the guard comes after the first rest, not in :data:`_ABOVE_GUARD_S`. The
        count may be wrong (a server whose calls slow as its batch fills reads as queueing,
        and only a step past the count tells it from one whose batch is full; slow start's
        small epochs may have ended it early), and a batch is often done in 30 s. Not for
        hundreds of calls: x1.5 from 491 put 481 waiting at a server of 256 seats."""
        if self._above_ok_at == -math.inf and limit <= _BIG_STEP_UNDER:
            self._above_ok_at = now

    @staticmethod
    def _judged_step(limit: int) -> int:
        """The smallest step up from ``limit`` that slow start takes: one an epoch can judge
        (x :data:`_SMALLEST_STEP`) under :data:`_BIG_STEP_UNDER`, one more call above it."""
        if limit >= _BIG_STEP_UNDER:
            return limit + 1
        return max(limit + 1, math.ceil(_SMALLEST_STEP * limit))

    def _doubted(self, limit: int) -> bool:
        """Whether ``limit`` stands only on what a step proved (see :meth:`_guarded`)."""
        guard = self.guard
        if guard.batch is not None:
            return guard.proven is not None and guard.proven > guard.batch
        little = guard.running
        return little is not None and limit - little > guard.target(max(1.0, little))

    def _decide(self, now: float, epoch: Epoch, previous: Epoch | None) -> int:
        limit = self.limit
        if self.phase == "slow start":
            if previous is None or previous.limit >= epoch.limit:
                # The start is a guess (1 for a server that states nothing, or 0.7 x a stated
                # batch): most servers take more, and one that does not shows it next epoch.
                self.reason = f"slow start: {epoch.throughput:.3g}/s at {limit}"
                return math.ceil(limit * _FAST)
            e = elasticity(previous, epoch)
            if e >= self._elasticity:
                self._confirming = False
                fast = e >= _FAST_ELASTICITY and limit < _BIG_STEP_UNDER
                factor = _FAST if fast else _DOUBLE
                self.reason = (
                    f"slow start: throughput x{epoch.throughput / previous.throughput:.2f} "
                    f"for limit {previous.limit} -> {limit} (elasticity {e:.2f})"
                )
                return math.ceil(limit * factor)
            view = self.guard.view()
            unqueued = view.queue is not None and view.queue <= (view.target or 0)
            small = epoch.samples < self._min_samples  # a limit of 2 counts 2 answers
            if not self._confirming and (unqueued or small):
                # Flat throughput, yet the answers took no longer than unqueued ones, or the
                # epoch counted a few: on a noisy server a small epoch's estimate is off by a
                # quarter either way (transformers' server read 1 -> 2 as x0.81 on 2 answers,
                # where 2 runs 1.3-1.8x what 1 does). Measure this limit once more against the
                # same epoch before calling it the knee.
                self._confirming = True
                self.last = previous
                self.reason = f"slow start: measuring {limit} again (elasticity {e:.2f})"
                return limit
            self._confirming = False
            # Past the knee: between the last two limits, nearer the lower the flatter the
            # last step (e = 0: the lower one; e just under the threshold: the higher one).
            share = max(0.0, e) / self._elasticity
            knee: float = previous.limit * math.pow(limit / previous.limit, share)
            self.phase = "hold"
            self._probe_above_soon(now, limit)
            self.reason = (
                f"knee between {previous.limit} and {limit}: throughput "
                f"x{epoch.throughput / previous.throughput:.2f} (elasticity {e:.2f})"
            )
            return max(1, round(knee))
        pending, self._pending = self._pending, None
        if pending is None:
            if self._rest > 0:
                self._rest -= 1
                self.reason = f"holding {limit} (the last probes found nothing better)"
                return limit
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
                self._rest_next = _REST_FIRST
                return self._probe_up(epoch)
            # Not worth it: probe below the base.
            return self._probe_down(base)
        e = elasticity(epoch, base)
        if e < self._elasticity:
            # Kept the lower limit; the next step goes down again from it. Whatever a step up
            # proved beyond it, the server does not run: the completions say so now.
            self.guard.disprove(epoch.in_flight or float(limit))
            self.reason = f"{limit} -> {base.limit} bought little (elasticity {e:.2f})"
            return self._probe_down(epoch)
        self.reason = f"held at {base.limit}: {limit} lost throughput (elasticity {e:.2f})"
        self._rest, self._rest_next = self._rest_next, min(_REST_MOST, 2 * self._rest_next)
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
            self._rest, self._rest_next = self._rest_next, min(_REST_MOST, 2 * self._rest_next)
            return base.limit
        self._pending = ("down", base)
        return down
