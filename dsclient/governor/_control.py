"""Limit control: how many requests one client lets through to one server, decided from what the
server says about itself.

Pure: no network, no sleeping, no clock of its own (every method takes ``now``). The client's
endpoint feeds it and applies its :attr:`LimitController.limit` to the governor.

**What it aims at.** A server's throughput is flat once its batch is full; every request beyond
that waits in the server's first-come queue, where nobody can reorder it. So the controller keeps
the server's batch full and its own queue short, and lets the excess wait on the client, where
lanes, urgency and groups order it. vLLM, SGLang, llama.cpp and TGI publish both numbers on
``/metrics`` (running, waiting); the controller holds ``waiting`` at a small target::

    target = max(1, ceil(queue_share * capacity))        # capacity: max_num_seqs, known or learned

a fraction of the batch (``queue_share`` 0.5 by default), never a multiple of it: just enough that
the batch stays full while finished sequences are replaced by requests still in transit (HTTP,
tokenizing). On a hand-started vLLM with ``max_num_seqs`` 32 here, semaphores of 48 (server queue
about 12) ran a batch of 240 fastest; a target of a quarter (8) kept the batch 24 of 32 full.

**Modes.**

==========  =====================================================================================
metrics     the server reports running and waiting. Grow while the client has calls waiting and
            the server's queue is at or under target (fast while it has never queued, up to a
            known batch plus the target queue at most, then by half
            the room under the *aim*, less the requests the last steps sent that the gauges do
            not show yet). The aim is the target, lowered while more than a tenth of the
            scrapes show the queue over the target (a quantile tracker: the queue's p90 is held
            at the target), and growth stays under the limit at which the queue last stood over
            the target for 30 s, unless the batch runs dry;
            on a queue above target set ``limit = in_flight * (running + target) / (running +
            waiting)`` (at most halving per step, once per two periods); cut by
            :data:`OVERLOAD_CUT` on 429 / 503 and on preemptions; a 429 / 503 while the server
            showed a queue also caps the target at half the longest queue seen (where the
            server's admission queue ends).
            No growth for ``cooldown`` after any cut (the cut needs a round trip to show). Room
            in the batch counts only while the queue is empty: a queue means the batch is full,
            whatever ``max_num_seqs`` says. Bounds: 1 .. ``max(64, 4 x capacity)``.
            A server that reports its queue but not its batch (vLLM's load header on each
            answer) runs the same rules on an estimated batch (:class:`QueueOnlyBatch`); it
            grows only once an answer admitted after the last step came back, and only while
            the last step bought throughput (:meth:`LimitController._step_verdict`).
throughput  no queue signal (a gateway that passes only ``/v1/*``, transformers' server, Ollama,
            any OpenAI-compatible endpoint): the limit finds the knee from the answers alone,
            rising while more in flight still buys throughput and holding where it only buys
            latency (:class:`~dsclient.governor._knee.KneeFinder`), and a queue guard keeps
            what is in flight within what the server is seen to run plus the target queue
            (:class:`~dsclient.governor._guard.QueueGuard`); cut by :data:`OVERLOAD_CUT` on
            429 / 503. A stated batch (``capacity``) is where it starts and, unless
            completions prove more, where it stops (plus the target queue): bounds 1 ..
            ``max(1024, 4 x capacity)``.
fixed       never moves (``adaptive=False`` or an explicit ``limit=``).
==========  =====================================================================================

In every mode a hard cap the server states (``hard_cap``: TGI's ``max_concurrent_requests``,
past which it refuses) bounds the limit.

In every mode, with a ``latency_target`` the limit halves when the p99 of recent service times
exceeds 120% of it, and does not grow while the p99 is over the target.

**Why proportional cuts and additive growth.** Several clients on one server each see the same
queue. Each cuts in proportion to its own in-flight count and grows by the same steps, so their
shares converge (AIMD) without talking to each other.

**Learning the capacity.** :class:`CapacityLearner` takes ``max_num_seqs`` to be the most
sequences seen running while requests waited (seen in at least two scrapes), bounded by the KV
cache's blocks where the server reports them.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass
from typing import Final, Literal

from .._percentile import nearest_rank
from ._guard import QueueGuard
from ._knee import ELASTICITY, KneeFinder

__all__ = [
    "CEILING_FLOOR",
    "OVERLOAD_CUT",
    "SLOW_START",
    "THROUGHPUT_CEILING",
    "CapacityLearner",
    "ControlStats",
    "LimitController",
    "Mode",
    "Outcome",
    "QueueOnlyBatch",
    "target_waiting",
]

Mode = Literal["metrics", "throughput", "fixed"]
Outcome = Literal["ok", "overloaded", "error", "cancelled"]

#: Multiplier on 429 / 503 (the server refused for load) and on preemptions (its KV cache ran
#: out). 0.7 rather than 0.5: the queue signal usually cuts first; a refusal is a late signal.
OVERLOAD_CUT: Final = 0.7
#: With a queue signal the limit may reach ``max(CEILING_FLOOR, 4 x capacity)``: in-flight counts
#: requests in transit too, which on a busy API server were two thirds of them (ENVIRONMENT.md).
CEILING_FLOOR: Final = 64
_CEILING_PER_SEQ: Final = 4
#: Without a queue signal the knee finder stops the limit where throughput does; this only
#: bounds it (a GPU server runs hundreds of sequences; vLLM's default batch is 256 or more).
THROUGHPUT_CEILING: Final = 1024
#: Growth before the server has ever queued, a period ("slow start"): x2 reached a batch of 32
#: from 5 in 3 periods; x1.5 took 5 (a fifth of a 240-request batch's run here).
SLOW_START: Final = 2.0
#: Slow start grows at once when the server shows at least this share of what is in flight,
#: else after this many periods.
_LANDED_SHARE: Final = 0.5
_SLOW_START_WAIT: Final = 2
#: Share of the seen room added a period once the server has queued.
_GAIN: Final = 0.5
#: A proportional cut never goes below half of in-flight in one step.
_MAX_CUT: Final = 0.5
#: Periods between two cuts on the server's queue: a cut shows in the queue only a round trip
#: later (the scrape's age plus transit), and cutting again on the same lagging queue took the
#: limit under batch + target + what is in transit, so that the batch ran dry and the regrowth
#: overshot the target (a simulated batch of 24: queue p90 1.4-1.5x the target).
_QUEUE_CUT_PERIODS: Final = 2
#: Seconds over which the usual number of this client's requests the server's gauges do not
#: show (in transit either way) is taken, as the least seen: growth counts only what is unseen
#: beyond it (the requests the last steps sent, still on their way to the queue).
_UNSEEN_WINDOW_S: Final = 2.0
#: The share of scrapes (with demand) whose queue may stand above the target: the aim of growth
#: is lowered while more do, so that the server's queue p90 sits at the target. Aiming growth at
#: the target itself left the queue swinging around it (p90 13-15 against a target of 12 on a
#: real batch of 24; 1.25-1.75x in simulation when the batch refills in waves, as it does when
#: every answer has the same length).
_OVER_SHARE: Final = 0.1
#: How far one scrape moves the aim, in requests: a scrape over the target lowers it by
#: ``(1 - _OVER_SHARE) x`` this, one at or under raises it by ``_OVER_SHARE x`` this.
_AIM_STEP: Final = 0.5
#: The aim never goes under this share of the target: the queue is what keeps the batch full
#: while finished sequences are replaced.
_AIM_FLOOR_SHARE: Final = 0.5
#: After the server's queue stood above the target, growth stays under the limit it stood at
#: for this long, then may probe again. Without it the loop cut by one on the wave's crest and
#: grew by one in its trough, and the queue stood over the target in one scrape of eight
#: (a simulated batch of 24 whose sequences all run the same length: p90 1.33x the target; on a
#: real batch of 24 the probes one above the limit that holds the target made most of the overs).
#: 30 s against 10 s: overs in the simulation sweep 18 -> 8 of 216 cases, the batch as full.
_OVER_MEMORY_S: Final = 30.0
#: That memory is dropped when the batch shows room with an empty queue in this many scrapes
#: running (a second): a limit held that low lets the batch run dry (a batch of 8 with requests
#: four periods in transit ran 81% full in simulation with the memory kept). Not fewer: on a real
#: server the trough of every wave of equal-length answers shows an empty queue for a scrape or
#: two, and forgetting there let the loop climb back over the target at once.
_DRY_SCRAPES: Final = 4
#: With a queue but no running count, a growth step is judged by the answers to this many calls
#: admitted after it, against the last :data:`_PER_WORK_WINDOW` answers before it (service time
#: per unit of work): see :meth:`LimitController._step_verdict`.
_STEP_ANSWERS: Final = 4
_PER_WORK_WINDOW: Final = 16
#: Growth is judged once it adds up to this factor since the last judged limit: a step of a
#: few calls changes the answers' times less than their noise (in simulation, steps of one
#: or two calls near a full batch were undone as often as kept).
_JUDGED_GROWTH: Final = 1.25
#: A step whose answers say it bought nothing is kept where the engine's KV usage grew by this
#: factor since it: the calls it added run in the engine (a pile-up in front of the engine,
#: an API server that fell behind, leaves the KV cache as it was).
_KV_GREW: Final = 1.25
#: A step that bought no throughput is undone, and growth rests this long; then it may probe
#: again.
_STEP_MEMORY_S: Final = 30.0
#: Seconds over which :class:`QueueOnlyBatch` takes the smallest bound on the batch.
_QUEUE_ONLY_WINDOW_S: Final = 30.0
#: Latency rule (the tuning literature's baseline): halve above 120% of the target.
_LATENCY_SLACK: Final = 1.2
_LATENCY_CUT: Final = 0.5
#: After a 429 / 503 the limit grows back only to just under where the server refused, for this
#: long; then it may probe above again. A client told the server runs 32 (it ran 12, with an
#: admission queue of 4) otherwise grew straight back over the admission cap after each cut.
_REFUSAL_MEMORY_S: Final = 10.0
#: After a 429 / 503 with a queue signal, the server queue aimed at stays at most this share of
#: the longest queue seen in the last :data:`_QUEUE_PEAK_S` seconds: a server that refuses once
#: its queue holds Q requests (vLLM's ``--max-num-queued-reqs``) told where its queue ends.
_REFUSED_QUEUE_SHARE: Final = 0.5
_QUEUE_PEAK_S: Final = 3.0
#: Service times kept for the latency rule.
_LATENCY_WINDOW: Final = 200


def target_waiting(capacity: int | None, queue_share: float, running: int) -> int:
    """The server queue the controller aims at: a fraction of the batch, at least 1.

        target_waiting(8, 0.25, 3)      # 2
        target_waiting(32, 0.25, 30)    # 8
        target_waiting(None, 0.25, 12)  # 3: unknown capacity, the batch as seen

    Parameters:
        capacity: the server's ``max_num_seqs`` if known, else ``None``.
        queue_share: the target as a share of it (default 0.25 in the client).
        running: sequences running now; stands in for an unknown capacity.
    """
    base = capacity if capacity is not None else max(running, 1)
    return max(1, math.ceil(queue_share * base - 1e-9))


@dataclass(frozen=True, kw_only=True)
class ControlStats:
    """A snapshot of the limit control of one server (``client.stats().control``).

    ``reason`` says why the limit last changed (``"start"`` until it first moves); ``changes``
    counts the changes. ``server_running`` / ``server_waiting`` are the server's own counts as
    last scraped (``None`` without a queue signal); ``target_waiting`` is the queue aimed at;
    ``learned_max_num_seqs`` what the metrics taught (``None`` until the server has queued).
    ``service_p99_s`` is the p99 of recent attempts' service times (slot to answer).

    ``signal`` says what drives the limit: ``"/metrics"`` (the server's Prometheus gauges),
    ``"endpoint-load-metrics"`` (vLLM's load on every answer), ``"sglang /v1/loads"``,
    ``"llama.cpp /slots"``, ``"throughput"`` (no queue signal: the knee found from the answers)
    or ``"fixed"``; ``signal_age_s`` how old its last reading is (``None``: none yet). In
    throughput mode ``knee_phase`` is ``"slow start"`` or ``"hold"`` and ``throughput`` the work
    per second (tokens/s where answers report tokens) measured at the last limit held;
    ``seen_running`` / ``seen_queue`` what the queue guard reads the server to run and to queue
    (by Little's law, see ``dsclient.governor._guard``) and ``guard_cap`` the most in flight it
    allows. ``hard_cap`` is the cap the server states and refuses past (``None``: none).
    """

    mode: Mode
    limit: int
    floor: int
    ceiling: int
    start: int
    reason: str
    changes: int
    server_running: int | None
    server_waiting: int | None
    target_waiting: int | None
    learned_max_num_seqs: int | None
    latency_target_s: float | None
    service_p99_s: float | None
    signal: str = "fixed"
    signal_age_s: float | None = None
    knee_phase: str | None = None
    throughput: float | None = None
    seen_running: float | None = None
    seen_queue: float | None = None
    guard_cap: int | None = None
    hard_cap: int | None = None


class CapacityLearner:
    """``max_num_seqs`` from a server's gauges: the most sequences seen running while others waited.

        learner = CapacityLearner()
        learner.observe(running=8, waiting=3)
        learner.observe(running=8, waiting=1)
        learner.value  # 8

    A single scrape with a queue may catch the scheduler between steps (a request just arrived,
    not yet scheduled), so the value is set once a queue was seen in two scrapes in a row, from
    the most running among the queued scrapes so far; it only rises after that. Where the server
    reports its KV cache (``kv_cache_size_tokens`` and ``block_size``), no more sequences than
    its blocks can run, which bounds the value.
    """

    __slots__ = ("_bound", "_candidate", "_queued_scrapes", "max_running_seen", "value")

    def __init__(self) -> None:
        self.value: int | None = None
        self.max_running_seen = 0
        self._candidate = 0
        self._queued_scrapes = 0
        self._bound: int | None = None

    def bound_by_kv(self, *, kv_cache_size_tokens: int | None, block_size: int | None) -> None:
        """Set the KV cache's bound: one block at least per running sequence."""
        if kv_cache_size_tokens and block_size and kv_cache_size_tokens > 0 and block_size > 0:
            self._bound = max(1, kv_cache_size_tokens // block_size)

    def observe(self, *, running: int, waiting: int) -> bool:
        """Feed one scrape (``waiting``: requests queued for capacity); True if the value moved."""
        if running < 0 or waiting < 0:
            return False
        self.max_running_seen = max(self.max_running_seen, running)
        if waiting <= 0 or running <= 0:
            self._queued_scrapes = 0
            return False
        self._queued_scrapes += 1
        self._candidate = max(self._candidate, running)
        if self._queued_scrapes < 2:
            return False
        value = self._candidate if self._bound is None else min(self._candidate, self._bound)
        if value != self.value:
            self.value = value
            return True
        return False


class QueueOnlyBatch:
    """The batch of a server that reports its queue but not its running count (vLLM's
    ``endpoint-load-metrics`` header on each answer: waiting and KV usage).

        batch = QueueOnlyBatch()
        batch.running(now, in_flight=60, waiting=10)   # 50: no bound yet
        batch.running(now, in_flight=60, waiting=12)   # 48: queued twice, bound 48
        batch.running(now, in_flight=90, waiting=20)   # 48: what is beyond it is in transit

    What this client has in flight less the queue is what runs plus what is still on its way
    (HTTP, an API server tokenizing): an upper bound on the batch whenever the queue stands,
    since a queue means the batch is full. The smallest bound of the last
    :data:`_QUEUE_ONLY_WINDOW_S` seconds (queued in two readings in a row, as the capacity
    learner asks) is the estimate, kept when no queue has stood since. Taking the batch as
    everything in flight instead let the target queue grow with the limit (half of it): behind
    nginx a vLLM with a batch of 32 had its limit run to 1280, requests piling up in its API
    server while its engine's queue stayed short.

    With other clients on the server their queue counts here too, so the bound comes out low
    and this client holds back: readings where the queue exceeds what is in flight are skipped.
    """

    __slots__ = ("_bounds", "_queued_last", "value")

    def __init__(self) -> None:
        self.value: int | None = None
        self._queued_last = False
        self._bounds: deque[tuple[float, int]] = deque()

    def running(self, now: float, *, in_flight: int, waiting: int) -> int:
        """This reading's running count: in flight less the queue, at most the bound."""
        seen = max(0, in_flight - max(0, waiting))
        queued = waiting > 0 and seen > 0
        if queued and self._queued_last:
            bounds = self._bounds
            while bounds and now - bounds[0][0] > _QUEUE_ONLY_WINDOW_S:
                bounds.popleft()
            while bounds and bounds[-1][1] >= seen:
                bounds.pop()  # a smaller, newer bound makes the older larger ones moot
            bounds.append((now, seen))
            self.value = bounds[0][1]
        self._queued_last = queued
        return seen if self.value is None else min(seen, self.value)


class LimitController:
    """The client's in-flight limit for one server, moved by the server's own signals.

        control = LimitController(start=5, mode="metrics", capacity=8)
        control.on_load(now, running=8, waiting=0, in_flight=5, demand=True)  # room: grows
        control.limit, control.reason

    Parameters:
        start: the limit right after discovery (``floor(headroom x max_num_seqs)``), >= 1.
        mode: ``"metrics"``, ``"throughput"`` or ``"fixed"`` (see the module docstring).
        capacity: the server's ``max_num_seqs`` when known (explicit, launcher record, the
            server's own report); ``None`` when it is only a guess. Sets the target queue.
        ceiling: the most the limit may reach; default by mode (see the module docstring).
        queue_share: the target queue as a share of the batch, in (0, 1] (default 0.5).
        latency_target: seconds; p99 of service times above 120% of it halves the limit.
        period: seconds between two growth steps, > 0.
        cooldown: seconds after a cut before the next cut for the same kind of signal.
        slow_start: the growth factor a period before the server has queued, > 1.
        hard_cap: the most in flight the server takes (it refuses past it), or ``None``.
    """

    __slots__ = (
        "_aim_deficit",
        "_answers_after",
        "_batch_seen",
        "_capacity",
        "_ceiling_fixed",
        "_dry_scrapes",
        "_hard_cap",
        "_knee",
        "_kv_usage",
        "_last_cut",
        "_last_cut_any",
        "_last_grow",
        "_last_latency_check",
        "_last_queue_cut",
        "_most_running",
        "_newest_admitted",
        "_over_at",
        "_over_limit",
        "_per_work",
        "_per_work_after",
        "_preemptions",
        "_queue_cap",
        "_queue_only",
        "_queue_seen",
        "_queued_last",
        "_refused_at",
        "_refused_at_limit",
        "_saturated",
        "_service",
        "_step_doubted",
        "_step_from",
        "_step_kv",
        "_step_undone_at",
        "_unseen_seen",
        "aim",
        "changes",
        "cooldown",
        "floor",
        "latency_target",
        "limit",
        "mode",
        "period",
        "queue_share",
        "reason",
        "server_running",
        "server_waiting",
        "slow_start",
        "start",
        "target",
    )

    def __init__(
        self,
        *,
        start: int,
        mode: Mode,
        capacity: int | None = None,
        ceiling: int | None = None,
        queue_share: float = 0.5,
        latency_target: float | None = None,
        period: float = 0.25,
        cooldown: float = 1.0,
        slow_start: float = SLOW_START,
        hard_cap: int | None = None,
    ) -> None:
        if hard_cap is not None and (
            isinstance(hard_cap, bool) or not isinstance(hard_cap, int) or hard_cap < 1
        ):
            raise ValueError(f"hard_cap must be an int >= 1 or None, got {hard_cap!r}")
        if isinstance(start, bool) or not isinstance(start, int) or start < 1:
            raise ValueError(f"start must be an int >= 1, got {start!r}")
        if mode not in ("metrics", "throughput", "fixed"):
            raise ValueError(f"mode must be 'metrics', 'throughput' or 'fixed', got {mode!r}")
        if not 0 < queue_share <= 1:
            raise ValueError(f"queue_share must be in (0, 1], got {queue_share!r}")
        if latency_target is not None and not latency_target > 0:
            raise ValueError(f"latency_target must be > 0 seconds or None, got {latency_target!r}")
        if not slow_start > 1:
            raise ValueError(f"slow_start must be > 1, got {slow_start!r}")
        if not period > 0 or not cooldown >= 0:
            raise ValueError(f"period must be > 0 and cooldown >= 0, got {period!r}, {cooldown!r}")
        if ceiling is not None and (isinstance(ceiling, bool) or not isinstance(ceiling, int)):
            raise ValueError(f"ceiling must be an int or None, got {ceiling!r}")
        self.mode: Mode = mode
        self._hard_cap = hard_cap
        if hard_cap is not None:
            start = min(start, hard_cap)
        self.start = start
        self.limit = start
        self.floor = 1
        self._capacity = capacity
        self._ceiling_fixed = ceiling
        self.queue_share = queue_share
        self.slow_start = slow_start
        self.latency_target = latency_target
        self.period = period
        self.cooldown = cooldown
        self.reason = "start"
        self.changes = 0
        self.server_running: int | None = None
        self.server_waiting: int | None = None
        self.target: int | None = None
        self.aim: int | None = None
        self._aim_deficit = 0.0
        self._over_limit: int | None = None
        self._over_at = -math.inf
        self._dry_scrapes = 0
        self._saturated = False
        self._last_grow = -math.inf
        self._last_cut: dict[str, float] = {}
        self._last_cut_any = -math.inf
        self._refused_at_limit: int | None = None
        self._refused_at = -math.inf
        self._last_latency_check = -math.inf
        self._preemptions: float | None = None
        self._queue_cap: int | None = None
        self._batch_seen: int | None = None  # the most running while the server queued
        self._queued_last = False
        self._queue_seen: deque[tuple[float, int]] = deque(maxlen=64)
        self._service: deque[float] = deque(maxlen=_LATENCY_WINDOW)
        self._unseen_seen: deque[tuple[float, int]] = deque(maxlen=64)
        self._last_queue_cut = -math.inf
        self._most_running = 0
        #: The batch estimated where the server reports no running count (its first reading).
        self._queue_only: QueueOnlyBatch | None = None
        #: When the most recently admitted answered call was admitted (``now - service_s``).
        self._newest_admitted = -math.inf
        #: Recent service times per unit of work; where the server reports no running count,
        #: the last growth step (the limit and the median time per unit of work before it) and
        #: the times of the calls admitted after it (see :meth:`_step_verdict`).
        self._per_work: deque[float] = deque(maxlen=_PER_WORK_WINDOW)
        self._step_from: tuple[int, float] | None = None
        self._per_work_after: deque[float] = deque(maxlen=2 * _PER_WORK_WINDOW)
        self._answers_after = 0
        self._step_undone_at = -math.inf
        #: The KV usage last reported, and at the last growth step (queue-only).
        self._kv_usage: float | None = None
        self._step_kv: float | None = None
        self._step_doubted = False
        #: The knee finder that moves the limit in throughput mode (``None`` in the others).
        self._knee: KneeFinder | None = None
        if mode == "throughput":
            guard = QueueGuard(queue_share=queue_share, batch=capacity, hard_cap=hard_cap)
            self._knee = KneeFinder(start=start, ceiling=self.ceiling, guard=guard)

    # -- bounds ---------------------------------------------------------------------------------
    @property
    def capacity(self) -> int | None:
        """The server's ``max_num_seqs`` as the controller knows it (``None``: unknown)."""
        return self._capacity

    @property
    def ceiling(self) -> int:
        """The most the limit may reach now (never past a hard cap the server states)."""
        if self._hard_cap is not None and self.mode != "fixed":
            return min(self._uncapped_ceiling, self._hard_cap)
        return self._uncapped_ceiling

    @property
    def hard_cap(self) -> int | None:
        """The cap the server states and refuses past (``None``: none stated)."""
        return self._hard_cap

    @property
    def _uncapped_ceiling(self) -> int:
        if self.mode == "fixed":
            return self.start
        if self._ceiling_fixed is not None:
            return max(self.start, self._ceiling_fixed)
        if self.mode == "throughput":
            # The knee finder stops where throughput does; max_num_seqs is where it starts.
            return max(self.start, THROUGHPUT_CEILING, _CEILING_PER_SEQ * (self._capacity or 0))
        # The most ever seen running, not the last scrape's: a ceiling that fell with the
        # running count left the limit above it (a batch running 17 then 12: ceiling 68 -> 64).
        seen = max(self._capacity or 0, self._most_running)
        return max(self.start, CEILING_FLOOR, _CEILING_PER_SEQ * seen)

    def set_capacity(self, capacity: int | None) -> None:
        """A better ``max_num_seqs`` (learned from the metrics, or rediscovered)."""
        if capacity is not None and capacity >= 1:
            self._capacity = capacity

    # -- signals -----------------------------------------------------------------------------
    def on_load(
        self,
        now: float,
        *,
        running: int | None,
        waiting: int,
        in_flight: int,
        demand: bool,
        preemptions: float | None = None,
        kv_usage: float | None = None,
    ) -> bool:
        """One scrape of the server's queue. True when the limit changed.

        Parameters:
            now: seconds on the caller's monotonic clock.
            running: sequences in the server's batch (``None``: the server reports only its
                queue; the batch is then estimated, see :class:`QueueOnlyBatch`);
                waiting: its queue (all clients').
            in_flight: this client's requests in flight to the server now.
            demand: whether this client has calls waiting for a slot (or uses every slot).
            preemptions: the server's cumulative preemption counter, if it has one.
            kv_usage: the share of its KV cache in use, if it says (where it reports no
                running count, what a growth step put into the engine: see
                :meth:`_step_verdict`).
        """
        queue_only = running is None
        if kv_usage is not None and kv_usage >= 0:
            self._kv_usage = kv_usage
        if running is None:
            if self._queue_only is None:
                self._queue_only = QueueOnlyBatch()
            running = self._queue_only.running(now, in_flight=in_flight, waiting=waiting)
        self.server_running, self.server_waiting = running, waiting
        self._most_running = max(self._most_running, running)
        self._queue_seen.append((now, waiting))
        if waiting > 0 and self._queued_last:
            # Queued in two scrapes running (one may be a request caught between steps): the
            # batch was full at this many, whatever max_num_seqs says.
            self._batch_seen = max(self._batch_seen or 0, running)
            if self._queue_only is not None and self._queue_only.value is not None:
                self._batch_seen = self._queue_only.value  # the smallest bound, not the most
        self._queued_last = waiting > 0
        target = target_waiting(self._capacity, self.queue_share, running)
        if self._queue_cap is not None:
            target = min(target, self._queue_cap)
        self.target = target
        if self.mode != "metrics":
            return False
        aim = self._track_aim(target, waiting, demand)
        preempted = (
            preemptions is not None
            and self._preemptions is not None
            and preemptions > self._preemptions
        )
        if preemptions is not None:
            self._preemptions = preemptions
        if preempted:
            self._saturated = True
            if self._cut(now, "preempt", OVERLOAD_CUT, "the server preempted sequences"):
                return True
        # This client's requests the gauges do not show: on their way to the server or back,
        # or sent after the scrape. Zero whenever the server shows more than this client has
        # in flight (other clients' requests), so with several clients it counts for nothing.
        unseen = max(0, in_flight - running - waiting)
        self._unseen_seen.append((now, unseen))
        usual = min(u for t, u in self._unseen_seen if now - t <= _UNSEEN_WINDOW_S)
        self._remember_overs(now, running=running, waiting=waiting, target=target)
        if waiting > target:
            self._saturated = True
            if in_flight > self.limit:
                # The last cut has not taken effect yet (calls are never cancelled; in-flight
                # drains as they finish): cutting again on the same queue would walk the
                # limit to the floor whenever other traffic keeps the queue up.
                return False
            if now - self._last_queue_cut < _QUEUE_CUT_PERIODS * self.period:
                return False  # in-flight drains fast; the queue shows the cut a round trip later
            factor = max(_MAX_CUT, (running + target) / max(1, running + waiting))
            wanted = max(self.floor, math.ceil(in_flight * factor))
            if wanted < self.limit:
                self._last_cut_any = self._last_queue_cut = now
                return self._set(
                    wanted, f"server queue {waiting} > target {target} (running {running})"
                )
            return False
        if queue_only:
            # No running count: what is in flight beyond the queue may be running or piling up
            # in an API server that fell behind, where no gauge shows it (growing on it doubled
            # the limit past a thousand). A step whose answers slowed as much as it added calls
            # bought no throughput: what it sent waits in front of the engine. It is undone,
            # and growth rests for a while.
            verdict = self._step_verdict(now)
            if verdict == "undo" and self._step_from is not None:
                back = self._step_from[0]
                self._step_from, self._step_undone_at = None, now
                return self._set(back, "the last step bought no throughput (answers as slow)")
            if verdict == "wait" or now - self._step_undone_at < _STEP_MEMORY_S:
                return False
        if not demand or now - self._last_grow < self.period or not self._latency_allows():
            return False
        if now - self._last_cut_any < self.cooldown:
            return False  # a cut needs a round trip to show in the queue before growing again
        # Requests in transit (HTTP, a busy API server tokenizing) are not in the gauges yet:
        # growing on an empty-looking server overshot to 43 in flight against a batch of 12 on a
        # cold start, and to 128 against 32 on a busy machine whose API server fell behind.
        landed = running + waiting >= _LANDED_SHARE * in_flight
        if queue_only:
            # The estimate counts what is in transit as running, so the gauges cannot tell
            # whether the last step has landed: an answer to a call admitted after it can.
            landed = self._newest_admitted >= self._last_grow
        if (
            not self._saturated
            and self._batch_seen is None
            and (
                self._capacity is None
                or (running < self._capacity and self.limit < self._capacity + target)
            )
        ):
            # Slow start, until the server has queued: paced by what the server shows.
            waited = now - self._last_grow >= _SLOW_START_WAIT * self.period
            if not landed and (queue_only or not waited):
                return False
            self._last_grow = now
            grown = math.ceil(self.limit * self.slow_start)
            if self._capacity is not None:
                # Slow start never passes a full batch and the target queue: what the server
                # has not shown yet is not room (past it, growth is by the room it shows). Four
                # processes sharing a limit doubled it from 32 to 64 while the server showed 20
                # of a batch of 24 (the rest a sync behind): its queue reached 40 against 12.
                grown = min(grown, self._capacity + target)
            why = f"server has room (running {running}, waiting {waiting})"
        else:
            if not landed:
                return False  # what was sent has not reached the server yet: no room to see
            self._last_grow = now
            room = aim - waiting
            if self._capacity is not None and waiting == 0:
                # A queue means the batch is full, whatever max_num_seqs says (the KV cache may
                # be what limits it): only an empty queue shows room in the batch, and never
                # more than the largest batch seen while requests queued. (A client told 96 of a
                # batch of 12 otherwise read a dip to 8 running as room for 88 and grew 13 -> 45.)
                batch = min(self._capacity, self._batch_seen or self._capacity)
                room += max(0, batch - running)
            # What the last steps sent and the gauges do not show yet will land in that room:
            # counting the room again each period while it is on its way grew the limit two or
            # three steps past the target before the first step showed (a queue p90 of 14-15
            # against a target of 12 on a real batch of 24). The usual unseen share (requests
            # on their way back, say) is not counted: it stays unseen at any limit.
            room -= unseen - usual
            if room < 0:
                return False
            grown = self.limit + max(1, math.ceil(_GAIN * room))
            why = f"server queue {waiting} <= aim {aim} (target {target}, running {running})"
        before = self.limit
        changed = self._set(min(grown, self._growth_cap(now)), why)
        step = self._step_from
        if changed and queue_only and (step is None or before >= _JUDGED_GROWTH * step[0]):
            # The step is judged against the calls admitted under the limit it leaves (those
            # admitted after the step before), not the last answers: on a fast ramp those came
            # from the limit before that, and a doubling judged against them counted half.
            # Small steps add up until they are worth judging (see _JUDGED_GROWTH).
            window = self._per_work_after or self._per_work
            self._step_from = (before, statistics.median(window)) if window else None
            self._step_kv = self._kv_usage
            self._per_work_after.clear()
            self._answers_after = 0
            self._step_doubted = False
        return changed

    def _step_verdict(self, now: float) -> Literal["grow", "wait", "undo"]:
        """Whether the last growth step (queue-only) bought throughput, by Little's law: the
        limit rose by ``L2 / L1`` and the time per unit of work of the calls admitted after it
        by ``T2 / T1``, so throughput by ``(L2 / L1) / (T2 / T1)``; the step bought it
        (``"grow"``) if the elasticity ``ln(X2 / X1) / ln(L2 / L1)`` is at least the knee's
        (:data:`~dsclient.governor._knee.ELASTICITY`), else ``"undo"``. Until as many calls
        admitted after it as the new limit (at least :data:`_STEP_ANSWERS`) have answered,
        ``"wait"``: the first of them queued behind the calls sent before the step, and answered
        about as fast as those (judged on the first ones added, a step past an API server's
        rate passed as often as not in simulation). A step found wanting is judged once more,
        on the answers of twice as many calls together, and undone only if it fails again and
        the engine's KV usage (where the server reports it) did not grow with the step: calls
        that wait in front of the engine occupy none of it. With no step to judge,
        ``"grow"``.

        Why not latency against the quickest seen: a batching server's answers slow down long
        before its throughput stops rising. Through nginx, a CPU vLLM with a batch of 32 took
        twice as long per token at 20 in flight as at 5; holding growth there (answers twice the
        quickest) kept the limit at 20 for 8 s of a 10 s batch."""
        step = self._step_from
        if step is None:
            return "grow"
        before_limit, before_per_work = step
        grew = self.limit / before_limit
        if grew < _JUDGED_GROWTH:
            return "grow"  # within the noise of the answers' times: judged once they add up
        if self._answers_after < max(_STEP_ANSWERS, self.limit):
            return "wait"
        recent = list(self._per_work_after)
        if not self._step_doubted:
            if self._bought(grew, recent[-_PER_WORK_WINDOW:], before_per_work):
                return "grow"
            # Judged again on the answers of twice as many calls, all of them together, before
            # it is undone: on a loaded machine one window's answers can be slow by chance, and
            # an undone step rests growth 30 s (through nginx, a limit held at 10 while
            # semaphore 32 ran the batch faster). Judging the second window alone walked an
            # API server's limit up (one pass in two was enough).
            self._step_doubted = True
        if self._answers_after < 2 * max(_STEP_ANSWERS, self.limit):
            return "wait"
        if self._bought(grew, recent, before_per_work):
            return "grow"
        kv_before, kv_now = self._step_kv, self._kv_usage
        if kv_before is not None and kv_now is not None and kv_now >= _KV_GREW * kv_before > 0:
            # The engine holds more since the step: the calls it added run there, they do not
            # wait in front of it. Through nginx the answers under 20 in flight took twice the
            # time per token of those under 10 in one run of two, and undoing that step held
            # the batch at 10 (1.3x semaphore 32's makespan); its KV usage had grown with it.
            return "grow"
        return "undo"

    @staticmethod
    def _bought(grew: float, per_work: list[float], before: float) -> bool:
        """Whether the limit grown by ``grew`` bought throughput (elasticity at least the
        knee's), the calls' time per unit of work now ``per_work`` against ``before``."""
        slowed = statistics.median(per_work) / before if before > 0 else 1.0
        return slowed <= 0 or math.log(grew / slowed) / math.log(grew) >= ELASTICITY

    def _remember_overs(self, now: float, *, running: int, waiting: int, target: int) -> None:
        """Where the queue stood above the target: growth stays under that limit for
        :data:`_OVER_MEMORY_S` (as after a refusal), unless the batch shows room with an empty
        queue in :data:`_DRY_SCRAPES` scrapes running (then the memory holds the batch short)."""
        batch = self._capacity
        if batch is not None and self._batch_seen is not None:
            batch = min(batch, self._batch_seen)
        dry = waiting == 0 and batch is not None and running < batch
        self._dry_scrapes = self._dry_scrapes + 1 if dry else 0
        if self._dry_scrapes >= _DRY_SCRAPES:
            self._over_limit = None
        if waiting > target:
            fresh = self._over_limit is None or now - self._over_at >= _OVER_MEMORY_S
            self._over_limit = self.limit if fresh else min(self._over_limit or 0, self.limit)
            self._over_at = now

    def _track_aim(self, target: int, waiting: int, demand: bool) -> int:
        """The queue growth aims at: the target, lowered while more than :data:`_OVER_SHARE` of
        the scrapes with demand show the queue above the target (a quantile tracker: at rest, a
        tenth of them are over, so the queue's p90 is the target).

        Only scrapes with demand count: without it the queue is not this client's doing. The
        aim is kept as a deficit under the target, so it follows a target that moves (a
        capacity learned, a queue cap)."""
        if demand:
            over = 1.0 if waiting > target else 0.0
            self._aim_deficit += _AIM_STEP * (over - _OVER_SHARE)
        lowest = max(1, math.ceil(_AIM_FLOOR_SHARE * target))
        self._aim_deficit = min(max(0.0, self._aim_deficit), float(target - lowest))
        aim = max(lowest, math.ceil(target - self._aim_deficit - 1e-9))
        self.aim = aim
        return aim

    def on_outcome(
        self,
        now: float,
        outcome: Outcome,
        service_s: float | None,
        work: float | None = None,
        *,
        admitted_at: float | None = None,
    ) -> bool:
        """One attempt finished. True when the limit changed.

        ``"overloaded"`` (the server answered 429 / 503) cuts by :data:`OVERLOAD_CUT`, once per
        ``cooldown``; ``service_s`` (slot to answer) feeds the latency rule, and in throughput
        mode with ``work`` (the tokens the answer produced; 1 where unknown) the knee finder,
        which hears of every attempt, failed ones too (``admitted_at``: when its slot was
        taken; default ``now - service_s``), so that an epoch waits for all of its cohort.
        """
        if self._knee is not None and service_s is not None and service_s >= 0:
            self._knee.on_release(
                now,
                admitted_at=now - service_s if admitted_at is None else admitted_at,
                service_s=service_s,
                work=work or 1.0,
                ok=outcome == "ok",
            )
        if outcome == "ok" and service_s is not None and service_s >= 0:
            self._service.append(service_s)
            self._newest_admitted = max(self._newest_admitted, now - service_s)
            per_work = service_s / (work or 1.0)
            self._per_work.append(per_work)
            if now - service_s >= self._last_grow:
                self._per_work_after.append(per_work)
                self._answers_after += 1
        if self.mode == "fixed":
            return False
        if outcome == "overloaded":
            self._saturated = True
            self._learn_queue_cap(now)
            before = self.limit
            if self._cut(now, "overload", OVERLOAD_CUT, "the server refused for load"):
                # Remember where the server said no: growth stays under it for a while.
                self._refused_at_limit, self._refused_at = before, now
                return True
            return False
        return self._check_latency(now)

    def _learn_queue_cap(self, now: float) -> None:
        """A refusal for load while the server showed a queue: that queue was about as long as
        the server takes, so aim at most at :data:`_REFUSED_QUEUE_SHARE` of it from now on.

        A refusal with no queue in view (TGI's ``max_concurrent_requests``, a proxy) caps
        nothing: the cut and the refused limit's memory deal with it."""
        peak = max((w for t, w in self._queue_seen if now - t <= _QUEUE_PEAK_S), default=0)
        if self.mode != "metrics" or peak <= 0:
            return  # no queue in view: the refusal is about something else (in-flight caps)
        # Every queue the server showed was at most its admission queue, and the gauges lag:
        # the longest queue seen near any refusal is the best lower bound, so the cap only rises.
        cap = max(1, math.floor(_REFUSED_QUEUE_SHARE * peak))
        if self._queue_cap is None or cap > self._queue_cap:
            self._queue_cap = cap
            self.target = min(self.target, cap) if self.target is not None else cap

    @property
    def queue_cap(self) -> int | None:
        """The most server queue aimed at since a refusal showed where the server's queue ends
        (``None``: no such refusal)."""
        return self._queue_cap

    def _growth_cap(self, now: float) -> int:
        """The most growth may reach now: the ceiling; under the limit at which the server last
        refused for load, for :data:`_REFUSAL_MEMORY_S` after that refusal; and under the lowest
        limit at which its queue stood above the target, for :data:`_OVER_MEMORY_S`."""
        cap = self.ceiling
        if self._refused_at_limit is not None and now - self._refused_at < _REFUSAL_MEMORY_S:
            cap = min(cap, max(self.floor, self._refused_at_limit - 1))
        if self._over_limit is not None and now - self._over_at < _OVER_MEMORY_S:
            cap = min(cap, max(self.floor, self._over_limit - 1))
        return cap

    def on_idle_period(self, now: float, *, demand: bool, in_flight: int | None = None) -> bool:
        """A period passed without a queue signal (throughput mode, or a failed scrape).

        In throughput mode the knee finder may move the limit (growth stays under the growth
        cap and the latency target); in every mode the latency rule may cut it.
        """
        if self._check_latency(now):
            return True
        return self._knee_step(now, demand=demand, in_flight=in_flight)

    def _knee_step(self, now: float, *, demand: bool, in_flight: int | None) -> bool:
        """Let the knee finder move the limit (growth under the growth cap and the latency
        target). True when the limit changed."""
        knee = self._knee
        if knee is None:
            return False
        wanted = knee.on_tick(now, demand=demand, in_flight=in_flight)
        if wanted is None:
            return False
        if wanted > self.limit:
            if not self._latency_allows() or now - self._last_cut_any < self.cooldown:
                knee.restart(now, self.limit, self.reason)
                return False
            wanted = min(wanted, self._growth_cap(now))
        changed = self._set(wanted, knee.reason)
        if knee.limit != self.limit:
            knee.restart(now, self.limit, self.reason)  # a bound held it: measure from there
        return changed

    @property
    def knee(self) -> KneeFinder | None:
        """The knee finder (throughput mode), for its phase and last measurement."""
        return self._knee

    # -- latency rule -------------------------------------------------------------------------
    def service_p99(self) -> float | None:
        """p99 of the recent attempts' service times, or ``None`` before any."""
        return nearest_rank(sorted(self._service), 99) if self._service else None

    def _latency_allows(self) -> bool:
        if self.latency_target is None or len(self._service) < 5:
            return True
        p99 = self.service_p99()
        return p99 is not None and p99 <= self.latency_target

    def _check_latency(self, now: float) -> bool:
        if self.latency_target is None or len(self._service) < 20:
            return False
        if now - self._last_latency_check < self.period:
            return False
        self._last_latency_check = now
        p99 = self.service_p99()
        if p99 is None or p99 <= _LATENCY_SLACK * self.latency_target:
            return False
        changed = self._cut(
            now,
            "latency",
            _LATENCY_CUT,
            f"p99 service time {p99:.2f} s > 120% of the target {self.latency_target:g} s",
        )
        if changed:
            # Judge the new limit on its own samples, not on the ones that caused the cut.
            self._service.clear()
        return changed

    # -- changing the limit ----------------------------------------------------------------------
    def _cut(self, now: float, kind: str, factor: float, why: str) -> bool:
        if now - self._last_cut.get(kind, -math.inf) < self.cooldown:
            return False
        self._last_cut[kind] = now
        self._last_cut_any = now
        changed = self._set(max(self.floor, math.floor(self.limit * factor)), why)
        if self._knee is not None:
            self._knee.restart(now, self.limit, why)
        return changed

    def _set(self, limit: int, reason: str) -> bool:
        limit = max(self.floor, min(limit, self.ceiling))
        if limit == self.limit:
            return False
        self.limit = limit
        self.reason = reason
        self.changes += 1
        return True

    def stats(
        self,
        learned: int | None = None,
        *,
        signal: str | None = None,
        signal_age_s: float | None = None,
    ) -> ControlStats:
        """A frozen snapshot (``learned``: the capacity the metrics taught, if any; ``signal``
        and its age: what drives the limit, as the endpoint knows it)."""
        knee = self._knee
        last = knee.last if knee is not None else None
        view = knee.guard.view() if knee is not None else None
        if signal is None:
            signal = {"metrics": "/metrics", "throughput": "throughput"}.get(self.mode, "fixed")
        return ControlStats(
            mode=self.mode,
            limit=self.limit,
            floor=self.floor,
            ceiling=self.ceiling,
            start=self.start,
            reason=self.reason,
            changes=self.changes,
            server_running=self.server_running,
            server_waiting=self.server_waiting,
            target_waiting=self.target,
            learned_max_num_seqs=learned,
            latency_target_s=self.latency_target,
            service_p99_s=self.service_p99(),
            signal=signal,
            signal_age_s=signal_age_s,
            knee_phase=knee.phase if knee is not None else None,
            throughput=last.throughput if last is not None else None,
            seen_running=view.running if view is not None else None,
            seen_queue=view.queue if view is not None else None,
            guard_cap=view.cap if view is not None else None,
            hard_cap=self._hard_cap,
        )
