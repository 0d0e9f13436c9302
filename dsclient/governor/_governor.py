"""Admission control: how many requests may be in flight at once, and who goes next.

The client takes a slot for every attempt at a request, and gives it back with the outcome::

    slot = await governor.acquire(lane="short", urgency=0, group=None)
    ...  # send once; slot.queued_s is the time it waited for admission
    slot.release("overloaded")  # or "ok" (default), "error", "cancelled"

``async with governor.slot(...) as slot:`` does the same around a block (an exception leaving
it is ``"error"``, a cancellation ``"cancelled"``).

On release the governor calls ``on_release(slot, outcome, service_s)`` (service time: admission
to release), which is how the client's limit controller hears about every attempt.

**The cap.** At most ``limit`` requests are in flight. It starts at
``max(1, floor(headroom * max_num_seqs))`` (:func:`compute_limit`) and the client's limit
controller (``dsclient.governor._control``) moves it with ``set_limit``; the governor does not care
where
the number comes from. A client cap does not make the server faster; it moves the queue from the
server to the client, where it can be ordered. Raising the cap admits waiters at once, lowering
it never cancels running work, it only admits nobody until in-flight drops below the new cap.

**Lanes.** A request is ``"short"`` or ``"long"`` (``dsclient.governor._lanes``). Long requests
may hold at most ``max(1, floor(long_share * min(limit, batch)))`` slots (``batch``: the server's
``max_num_seqs`` when known; an adaptive limit can pass it, and half of 12 slots would be 6 of
the server's 8 sequences: at 11 short requests a second the shorts then queued 3-4 s); short
requests may use every slot, including those the long lane leaves idle. This is a ceiling on
one lane, not a fixed split: on the reference CPU vLLM server a burst of long requests held
short ones up to 10 s behind a plain semaphore, and 0.4 s with long requests held to half of
the cap, at the same makespan, while a fixed 4 + 1 split made a mixed batch 2.5x slower. A long
request that waits because its lane is full never blocks short requests queued behind it.

**Borrowing is lent, not given.** Long requests may borrow slots short requests leave idle: while
short requests are about (none waiting) and the server's batch is known (``set_limit(...,
batch=)``), up to ``min(limit, batch)`` less the shorts in flight and a reserve of a quarter of it
for the next arrivals, unless the short requests have slowed down (their latest 8 took twice
their quickest 8's service time per output token: what the long requests beside them cost
them); while no short request has asked for a slot for ``long_idle_borrow`` seconds, up to
``limit - 1``.
A long request runs for seconds, so short requests can always reclaim them: a short request is
admitted while ``short in flight + min(long in flight, long share) < limit``, that is, borrowed
long slots do not count against it. In-flight may then pass the limit by what was borrowed, for
as long as those long requests run; the limit controller sees the server's queue and cuts.

**Pacing, where the batch is unknown** (``long_pacing=True``, as the client builds its
governors). A server that says nothing (no ``/metrics``, no batch
size: transformers' server, a gateway) gives the governor no batch to lend from, and its limit,
found from throughput alone, can grow far past what the server runs at once. Beside short
calls the long lane then starts at one slot and takes one more for each window of 8 short
calls that kept their pace while the long lane was full; a window that took more than twice
the quickest window's time per token halves it (never below 1). Long calls already running
are never touched, and with no short call about the long calls borrow as above. On
transformers' server (CPU, tiny model) under 8 short calls a second and a burst of 40 long
prompts (put in the long lane by :class:`~dsclient.governor._lanes.RecentSizes`), long calls
at half the limit held the short calls 12-14 s at p99; paced, they ran 1 to 3 at a time, the
short calls' tail was 0.2 s, and the burst was done within the 20 s of arrivals.

**Borrowing stops where the KV cache does.** Where the server's KV cache is known
(``set_kv``: vLLM's ``cache_config_info``, SGLang's ``max_total_num_tokens``), each slot carries
the tokens its call may hold (``tokens=``: prompt + ``max_tokens``, in whole blocks), and a long
call beyond the lane's share is admitted only while the tokens of every call in flight, its own
included, fit the cache. Beyond it the server preempts: on a cache of 24 blocks of 128 tokens,
long calls of 5 blocks each started 8 at a time preempted one another 5-7 times a batch and the
batch took 1.2-1.6x as long as with 4 running. ``tokens`` is an upper bound (the output may
stop early), so this only ever lends less; calls within the share are never held by it.

**Batches.** The items of a batch (``map()``: ``slot(batch=key)``, one key per ``map()``) are
waited on as a whole, not one by one, and the batch runner starts its longest items first. A
batch's own short items do not count as short calls about for its long items: while no other
short call (someone's ``generate()``, or another batch's item) is waiting, running or has asked
for ``long_idle_borrow`` seconds, they borrow up to ``limit - 1`` beside them, the server's
batch less one where it is known, and as far as the KV cache holds them where that is known;
a batch's short item takes only a free slot (it reclaims no borrowed one). Held to the long
share beside the batch's own short items, a batch of 200 with 20 items of 512 tokens out ran
its long items 4 at a time of 8 on a vLLM, and starting them first gained nothing over input
order (0.97x in the median of six runs); on a server whose step is flat in its batch (10 ms +
0.2 ms a sequence, 16 seats, nothing published, issue 46) the 27 long items of a batch of 400
ran 8 at a time, and map() given the best order took 1.17x a plain semaphore's time; beside
only its own short items, at a limit of 24, it took 9.72-9.81 s against the best semaphore's
9.77-9.92 s (sorted longest first; three runs). Where the cache is not known nothing stops
long items that fill the server's batch from thrashing a small cache (on a vLLM of 24 blocks
they preempted one another 5-7 times a batch); a server that publishes its cache (vLLM's
``/metrics``) has it read before the first call. Calls that are not this batch's keep every
rule above, so a batch holds up neither the calls someone waits on nor another batch; and
while its long items hold borrowed seats, its short items queue in the server no deeper than
the seats left to short calls (``_shorts_past_server``).

**Growth.** A call's KV cache tokens grow as it answers: its prompt at first, one more a step, all
of them (prompt + ``max_tokens``) only at its end. Where the cache is known and its prompt is
(``prompt_tokens=``), a batch's long item is admitted, within the lane's share or beyond it, while
the cache holds it at every point before it ends: each long call of the batch in flight counted at
what it holds then (its prompt plus its time in flight over the pace: the batch's long calls' latest
time per output token, the calls being counted, once 8 have ended; before that the short calls', a
bound since a short call's time includes its prompt and its wait in the server's queue), and gone at
its end; the batch's other calls at their ``tokens``, as many as fill the server's batch beside the
long ones. Once 4 of the batch's long answers are in, a call's end is taken at the longest of its
latest 16 (at most its ``max_tokens``). Until the pace is known, every call counts whole. Where the
batch's short items run (so that slots free, and waiters are looked at, every few steps), its long
items also start one at a time, a long call's expected time over the server's batch less one apart:
started together, long calls reach their largest together, and the cache holds fewer of them. While
a long item waits for the cache, the batch's short items fill the limit, not the server's batch (no
slot that frees would start the long item). On a vLLM of 23 usable blocks of 128 tokens (8
sequences), a batch of 200 with about 20 items of 512 tokens out (5 blocks each) ran its long items
4 at a time in waves, preempting at the top of each wave; counted as they grow and started apart,
5-6 ran, and in 6 paired runs the batch took 0.74x-0.97x as long in input order and 0.70x-1.02x in
shape order (``docs/governor.md``). A call past the point at which it was expected to end counts
whole until it ends. Beyond 64 long calls in flight (the check walks them at each point) the share
rules apply instead.

**Urgency, not priority.** Among waiters, higher ``urgency`` is admitted first, FIFO within
equal urgency. It is deliberately not called ``priority``: vLLM's own request field ``priority``
(honoured with ``--scheduling-policy priority``) means the opposite, lower values run first.
The governor never reads or sets that field; the client passes it to the server untouched. A
caller who wants both sides to agree sends ``urgency=u`` here and ``priority=-u`` to vLLM.

**Groups.** ``group_caps={"batch": 0.5}`` lets requests tagged ``group="batch"`` hold at most
half of the slots, so interactive traffic keeps the other half under a batch load. Groups not
named in ``group_caps`` are not capped.

**Tenants: token-fair order.** A group is also a tenant (:mod:`dsclient.governor._fair`): when a
slot frees and calls of several groups wait, the call of the group with the lowest virtual token
counter (input + 2 x output tokens served, over its weight in ``group_weights``) goes next;
lanes, urgency and ``short_first`` order the waiters inside a group, and caps still apply. A
group alone gets every slot (nothing is reserved). Calls without a group are one tenant.

**Queue bound.** With ``max_queue=n``, a request that would have to wait while ``n`` others
already wait raises :class:`~dsclient._exceptions.Overloaded` with status 0 at once.

**Cancellation never leaks capacity.** A task cancelled (or timed out) while waiting leaves the
queue; one cancelled after being granted a slot but before it ran passes that slot to the next
waiter. A slot is released exactly once, whatever leaves the ``async with`` block.

The governor belongs to one event loop (asyncio or trio, through anyio) and is not thread-safe.
The uncontended path is O(1): no task, no event, no sorting, no yield (about 2 us per slot on
the reference machine). Like ``asyncio.Semaphore``, entering a free slot is not a checkpoint.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import math
import time
from collections import deque
from collections.abc import Awaitable, Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType, TracebackType
from typing import TYPE_CHECKING, Final

import anyio

from .._exceptions import Overloaded
from .._percentile import nearest_rank
from ._checks import check_int, check_share, floor_share
from ._fair import Fair, Tenant, TenantStats
from ._lanes import Lane

if TYPE_CHECKING:
    from ._control import ControlStats

__all__ = [
    "Governor",
    "GovernorStats",
    "LaneStats",
    "Slot",
    "compute_limit",
]

#: While short calls are about, long calls may borrow up to the batch less the shorts in flight
#: and a reserve of a quarter of the batch (at least 1) for the next short arrivals.
_SHORT_RESERVE_DIVISOR: Final = 4
#: Short calls' service time per unit of work is taken as the median of each run of this many
#: (non-overlapping windows: one sort per window, not per call).
_PACE_WINDOW: Final = 8
#: Growth: the long calls in flight beyond which the peak is not worked out (the check costs
#: their number squared); a batch's long items then keep to the rules of their share.
_GROWTH_MOST: Final = 64
#: Growth: the batch's long answers seen before the longest of them bounds the others.
_GROWTH_SEEN: Final = 4
#: Long calls borrow from a known batch only while the short calls' latest window takes less
#: than this times their quickest window's time per unit of work.
_PACE_SLOWED: Final = 2.0


def compute_limit(max_num_seqs: int, headroom: float) -> int:
    """The client's in-flight cap for a server that runs ``max_num_seqs`` sequences at once.

    ``limit = max(1, floor(headroom * max_num_seqs))``::

        compute_limit(8, 0.7)    # 5
        compute_limit(256, 0.7)  # 179
        compute_limit(8, 2.0)    # 16: keep the server's own queue fed

    Parameters:
        max_num_seqs: the server's batch size (vLLM ``--max-num-seqs``), >= 1.
        headroom: the cap as a share of it, in (0, 2]; above 1 oversubscribes the server.
    """
    check_int("max_num_seqs", max_num_seqs, 1)
    if not 0 < headroom <= 2:
        raise ValueError(f"headroom must be in (0, 2], got {headroom!r}")
    return floor_share(headroom, max_num_seqs)


@dataclass(frozen=True, kw_only=True)
class LaneStats:
    """One lane's counters.

    ``done`` counts slots released normally and ``failed`` those marked failed or left by an
    exception (cancellation included); requests cancelled before admission count in neither.
    ``p50``/``p95``/``p99`` are nearest-rank percentiles, in seconds, of the time from entering
    ``slot()`` (waiting included) to release, over the lane's last ``latency_window`` released
    slots, failures included (so timeouts show in p99); ``None`` before the first release.
    ``limit`` is the lane's cap: the whole limit for ``"short"``, the long share for ``"long"``.
    """

    in_flight: int
    waiting: int
    done: int
    failed: int
    p50: float | None
    p95: float | None
    p99: float | None
    limit: int


@dataclass(frozen=True, kw_only=True)
class GovernorStats:
    """A snapshot of a :class:`Governor`: totals, and one :class:`LaneStats` per lane.

    ``control`` (set by the client) is the limit controller's state: mode, why the limit last
    moved, the server's running / waiting as last seen, the learned capacity. ``kv_tokens`` is
    the server's KV cache as the governor lends it (:meth:`Governor.set_kv`; ``None``: not
    known), and ``kv_tokens_in_flight`` what the calls in flight may hold of it.
    """

    limit: int
    in_flight: int
    waiting: int
    lanes: Mapping[str, LaneStats]
    control: ControlStats | None = None
    kv_tokens: int | None = None
    kv_tokens_in_flight: int = 0
    #: Per tenant (group; ``None``: calls without one): weight, counter, in flight, waiting,
    #: tokens served and latency (:class:`~dsclient.governor._fair.TenantStats`).
    tenants: Mapping[str | None, TenantStats] = field(default_factory=lambda: MappingProxyType({}))

    def _repr_html_(self) -> str:  # notebooks show a table, not a dataclass repr
        from .._display import stats_html

        return stats_html(self)


class _Pace:
    """A lane's service time per unit of work (output token): the median of its latest window
    of :data:`_PACE_WINDOW` calls, and of its quickest window so far."""

    __slots__ = ("_window", "best", "latest")

    def __init__(self) -> None:
        self._window: list[float] = []
        self.best: float | None = None
        self.latest: float | None = None

    def add(self, per_work: float) -> bool:
        """Count one call; whether it closed a window (``latest`` is new)."""
        window = self._window
        window.append(per_work)
        if len(window) < _PACE_WINDOW:
            return False
        window.sort()
        median = window[_PACE_WINDOW // 2]
        window.clear()
        self.latest = median
        if self.best is None or median < self.best:
            self.best = median
        return True

    @property
    def slowed(self) -> bool:
        """The latest window took :data:`_PACE_SLOWED` times the quickest's time per work."""
        best, latest = self.best, self.latest
        return best is not None and latest is not None and latest > _PACE_SLOWED * best


class _LaneState:
    __slots__ = (
        "batch_in_flight",
        "batch_waiting",
        "cap",
        "done",
        "failed",
        "in_flight",
        "last_entry",
        "name",
        "own",
        "samples",
        "waiting",
    )

    def __init__(self, name: str, cap: int, window: int) -> None:
        self.name = name
        self.cap = cap
        self.in_flight = 0
        self.waiting = 0
        #: Of those, the items of a batch (see "Batches" in the module docstring).
        self.batch_in_flight = 0
        self.batch_waiting = 0
        #: The same per batch: its key to ``[in flight, waiting]`` (a key with neither leaves).
        self.own: dict[Hashable, list[int]] = {}
        self.done = 0
        self.failed = 0
        self.last_entry = -math.inf  # when a request not of a batch last asked for a slot
        # A bounded deque: appending is O(1) and old samples fall off; stats() sorts a copy.
        self.samples: deque[float] = deque(maxlen=window)

    def count_batch(self, key: Hashable, waiting: bool, n: int) -> None:
        """One item of the batch ``key`` more (``n`` 1) or less (-1) in flight or waiting."""
        counts = self.own.get(key)
        if counts is None:
            counts = self.own[key] = [0, 0]
        counts[waiting] += n
        if waiting:
            self.batch_waiting += n
        else:
            self.batch_in_flight += n
        if not (counts[0] or counts[1]):
            del self.own[key]

    def snapshot(self) -> LaneStats:
        ordered = sorted(self.samples)
        p50 = p95 = p99 = None
        if ordered:
            p50 = nearest_rank(ordered, 50)
            p95 = nearest_rank(ordered, 95)
            p99 = nearest_rank(ordered, 99)
        return LaneStats(
            in_flight=self.in_flight,
            waiting=self.waiting,
            done=self.done,
            failed=self.failed,
            p50=p50,
            p95=p95,
            p99=p99,
            limit=self.cap,
        )


class _GroupState:
    __slots__ = ("cap", "in_flight", "share")

    def __init__(self, share: float, cap: int) -> None:
        self.share = share
        self.cap = cap
        self.in_flight = 0


# Heap entries: (-urgency, arrival sequence, slot). The sequence is unique, so the slot itself
# is never compared, and equal urgencies come out in arrival order.
_Entry = tuple[int, int, "Slot"]


class _Queue:
    """Waiters of one (lane, capped group, tenant) class; all of them are blocked by the same
    caps, and share one virtual token counter (the tenant's)."""

    __slots__ = ("group", "heap", "lane", "live", "tenant")

    def __init__(self, lane: _LaneState, group: _GroupState | None, tenant: Tenant) -> None:
        self.lane = lane
        self.group = group
        self.tenant = tenant
        self.heap: list[_Entry] = []
        # Cancelled waiters stay in the heap until they reach the top (or a compaction); `live`
        # counts the others.
        self.live = 0

    def head(self) -> _Entry:
        heap = self.heap
        while heap[0][2]._cancelled:
            heapq.heappop(heap)
        return heap[0]


_NEW, _WAITING, _ACTIVE, _DONE = range(4)
_OUTCOMES = ("ok", "overloaded", "error", "cancelled")


class Slot:
    """One admission to a :class:`Governor`, used as ``async with governor.slot(...) as slot``.

    Attributes:
        lane: ``"short"`` or ``"long"``.
        urgency: higher is admitted first among waiters.
        group: the caller's group tag, or ``None``.
        batch: the batch (``map()``) the call is an item of, whose own latency nobody waits
            on: a key that tells one batch from another (``True``: one batch not told apart),
            or ``False`` (see "Batches" in the module docstring).
        tokens: the KV cache tokens the call may hold (prompt + ``max_tokens``, in whole
            blocks); 0: not known.
        queued_s: seconds spent waiting for admission (0.0 when admitted at once).
        work: what the attempt produced (output tokens), set before release; ``None``: unknown.
    """

    __slots__ = (
        "_admitted",
        "_cancelled",
        "_charged",
        "_event",
        "_governor",
        "_granted",
        "_group_state",
        "_lane_state",
        "_outcome",
        "_started",
        "_state",
        "_tenant",
        "batch",
        "group",
        "input_tokens",
        "lane",
        "max_tokens",
        "passed",
        "prompt_tokens",
        "queued_s",
        "tag",
        "tokens",
        "urgency",
        "work",
    )

    def __init__(
        self,
        governor: Governor,
        lane: Lane,
        urgency: int,
        group: str | None,
        lane_state: _LaneState,
        group_state: _GroupState | None,
        batch: Hashable = False,
        tokens: int = 0,
        prompt_tokens: int = 0,
        input_tokens: int = 0,
        max_tokens: int = 0,
    ) -> None:
        self.lane = lane
        self.urgency = urgency
        self.group = group
        self.batch = batch
        self.tokens = tokens
        #: The tenant's charge at admission: the prompt's tokens (the planner's count) and
        #: ``max_tokens`` (see :mod:`dsclient.governor._fair`); 0: not known.
        self.input_tokens = input_tokens
        self.max_tokens = max_tokens
        #: The call's prompt tokens (a bound), where its KV cache tokens grow from as it
        #: answers (0: not known; the call counts at ``tokens`` throughout).
        self.prompt_tokens = prompt_tokens
        self.queued_s = 0.0
        #: The caller's note for a ``pick`` function (a pool: the call's prefix blocks).
        self.tag: object = None
        #: Times a waiter admitted after it went first (``pick``); bounded by ``pick_window``.
        self.passed = 0
        #: What the attempt produced (the answer's output tokens), for the limit controller's
        #: throughput; ``None``: not known.
        self.work: float | None = None
        self._governor = governor
        self._lane_state = lane_state
        self._group_state = group_state
        self._state = _NEW
        self._outcome: str | None = None
        self._admitted = 0.0
        self._granted = False
        self._cancelled = False
        self._started = 0.0
        self._tenant: Tenant | None = None
        self._charged = 0.0  # what the tenant was charged at admission
        #: What the waiter awaits: a bare future of the running asyncio loop (one object, no
        #: Event and deque around it), or an ``anyio.Event`` on another backend (trio).
        self._event: asyncio.Future[None] | anyio.Event | None = None

    @property
    def admitted_at(self) -> float:
        """When the slot was taken, on the governor's clock (0.0 before)."""
        return self._admitted

    @property
    def failed(self) -> bool:
        """Whether the attempt was marked as not ``"ok"`` (an exception leaving also counts)."""
        return self._outcome not in (None, "ok")

    @property
    def outcome(self) -> str | None:
        """What :meth:`set_outcome` recorded (``None``: not yet)."""
        return self._outcome

    def fail(self) -> None:
        """Count this attempt as failed (``"error"``) when the slot is released."""
        self._outcome = "error"

    def set_outcome(self, outcome: str) -> None:
        """Record the attempt's outcome: ``"ok"``, ``"overloaded"``, ``"error"`` or
        ``"cancelled"``; the release passes it to ``on_release``."""
        if outcome not in _OUTCOMES:
            raise ValueError(f"outcome must be one of {', '.join(_OUTCOMES)}, got {outcome!r}")
        self._outcome = outcome

    async def __aenter__(self) -> Slot:
        if self._state != _NEW:
            raise RuntimeError("a Slot can be entered only once; call governor.slot() again")
        governor = self._governor
        self._started = started = governor._clock()
        if not self.batch:
            self._lane_state.last_entry = started
        tenant = self._tenant = governor._fair.arrive(self.group)
        if not governor._fair.held(tenant) and governor._admissible(
            self._lane_state, self._group_state, self.batch, self.tokens, self.prompt_tokens
        ):
            governor._take(self)
            self._state = _ACTIVE
            self._admitted = started
            return self
        # The wait is here, not in a coroutine of the governor's: one object fewer for every
        # call that waits (at thousands waiting, what they hold is walked by the collector).
        event = governor._enqueue(self)
        try:
            # A bare future costs one object per waiter where anyio.Event made three (its own,
            # asyncio's Event and that Event's future): at 20000 calls through 1024 slots, what
            # waiting calls held was about 40% of dsclient's CPU, through the garbage collector.
            # Cancellation is the same: anyio's scopes cancel the task, the future raises.
            await (event if isinstance(event, asyncio.Future) else event.wait())
        except BaseException:
            governor._abandon(self)
            raise
        self._state = _ACTIVE
        self.queued_s = self._admitted - started  # set when the governor granted the slot
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release(error=exc)

    def release(self, outcome: str | None = None, *, error: BaseException | None = None) -> None:
        """Give the slot back with the attempt's outcome; the governor passes it and the
        service time to ``on_release``. Only the first release of an admitted slot counts.

        Parameters:
            outcome: how the attempt went (as :meth:`set_outcome`); default: what was
                recorded, else ``"ok"``.
            error: what ended the attempt, if anything: with no failure recorded, it counts as
                ``"cancelled"`` (a cancellation) or ``"error"``.
        """
        if outcome is not None:
            self.set_outcome(outcome)
        if self._state == _ACTIVE:
            self._state = _DONE
            outcome = self._outcome
            if error is not None and outcome in (None, "ok"):
                cancelled = isinstance(error, anyio.get_cancelled_exc_class())
                outcome = "cancelled" if cancelled else "error"
            self._governor._release(self, outcome or "ok")

    def __repr__(self) -> str:
        batch = ", batch=True" if self.batch else ""
        return f"Slot(lane={self.lane!r}, urgency={self.urgency}, group={self.group!r}{batch})"


class Governor:
    """Caps the requests in flight, with a short and a long lane, urgency and group caps.

        governor = Governor(compute_limit(8, 0.7), group_caps={"batch": 0.5})  # 5 slots
        async with governor.slot(lane="long", group="batch") as slot:
            response = await send(request)
        governor.stats().lanes["long"].p99

    Parameters:
        limit: the most requests in flight at once, >= 1 (see :func:`compute_limit`).
        long_share: the long lane holds at most ``max(1, floor(long_share * limit))`` slots;
            in (0, 1], default 0.5. Short requests may use every slot.
        group_caps: group name to its cap as a share of the limit, each in (0, 1]; a group
            holds at most ``max(1, floor(share * limit))`` slots. Other groups are uncapped.
        group_weights: group (tenant) name to its weight, each > 0 (others weigh 1): while
            several groups wait, each is served tokens in proportion to its weight ("Tenants"
            above).
        long_idle_borrow: when no short request is waiting or in flight and none has asked for
            a slot for this many seconds, the long lane may borrow idle short slots, up to
            ``limit - 1`` (one stays free for the next short arrival), so that a batch of long
            requests is not held to the long share on an otherwise idle client. ``None`` turns
            borrowing off (the long share is then a hard ceiling). Default 1.0 s.
        long_pacing: without a known batch, pace the long lane beside short calls (see
            "Pacing" above): it starts at one slot and grows while the shorts keep their pace.
            The client's governors pace; default off.
        short_first: at equal urgency, admit waiting short requests before waiting long ones
            (a long one still goes first while none is in flight, so longs never starve).
            Default ``False``: arrival order across lanes. Measured once on the tiny CPU vLLM
            (docs/benchmarks.md) it lowered the online short p99 relative to unbounded
            (0.26-0.32x against 0.40-0.43x) but stretched the makespan, so it is opt-in.
        max_queue: the most requests waiting for a slot (>= 0); one more raises
            :class:`~dsclient._exceptions.Overloaded` with status 0. ``None``: unbounded.
        latency_window: recent releases per lane kept for the percentiles, >= 100.
        clock: seconds from a monotonic source, for ``queued_s`` and latencies.
        on_release: called as ``on_release(slot, outcome, service_s)`` when a slot is released
            (``service_s``: admission to release); it must not raise.
        pick: which waiter goes next among the first ``pick_window`` of the best urgency of
            a class: ``pick(waiters)`` returns an index into them (0: the head, arrival order);
            a pool of servers picks a call whose prefix the server with room holds. It must
            not raise; ``None`` (default): always the head.
        pick_window: how far past the head ``pick`` may look, and how often a waiter may be
            passed over before it goes next regardless.
    """

    __slots__ = (
        "_batch",
        "_clock",
        "_fair",
        "_groups",
        "_in_flight",
        "_kv_block",
        "_kv_tokens",
        "_lanes",
        "_limit",
        "_long",
        "_long_idle_borrow",
        "_long_outputs",
        "_long_pace",
        "_long_paced",
        "_long_share",
        "_long_started",
        "_max_queue",
        "_on_release",
        "_pick",
        "_pick_window",
        "_queue_index",
        "_queues",
        "_ramps",
        "_seq",
        "_short",
        "_short_first",
        "_short_pace",
        "_tokens",
        "_waiting",
    )

    def __init__(
        self,
        limit: int,
        *,
        long_share: float = 0.5,
        long_idle_borrow: float | None = 1.0,
        long_pacing: bool = False,
        short_first: bool = False,
        group_caps: Mapping[str, float] | None = None,
        group_weights: Mapping[str, float] | None = None,
        max_queue: int | None = None,
        latency_window: int = 1000,
        clock: Callable[[], float] = time.monotonic,
        on_release: Callable[[Slot, str, float], None] | None = None,
        pick: Callable[[Sequence[Slot]], int] | None = None,
        pick_window: int = 32,
    ) -> None:
        check_int("limit", limit, 1)
        check_int("pick_window", pick_window, 1)
        check_share("long_share", long_share)
        if long_idle_borrow is not None and not (
            isinstance(long_idle_borrow, (int, float)) and long_idle_borrow >= 0
        ):
            raise ValueError(
                f"long_idle_borrow must be >= 0 seconds or None, got {long_idle_borrow!r}"
            )
        if max_queue is not None:
            check_int("max_queue", max_queue, 0)
        check_int("latency_window", latency_window, 100)
        groups: dict[str, _GroupState] = {}
        for name, share in (group_caps or {}).items():
            check_share(f"group_caps[{name!r}]", share)
            groups[name] = _GroupState(share, floor_share(share, limit))
        self._limit = limit
        self._batch: int | None = None
        self._long_share = long_share
        self._max_queue = max_queue
        self._clock = clock
        self._on_release = on_release
        self._pick = pick
        self._pick_window = pick_window
        self._groups = groups
        #: Virtual token counters per tenant (group): the order among groups' waiters.
        self._fair = Fair(group_weights, latency_window=latency_window)
        self._lanes: dict[str, _LaneState] = {
            "short": _LaneState("short", limit, latency_window),
            "long": _LaneState("long", floor_share(long_share, limit), latency_window),
        }
        self._short = self._lanes["short"]
        self._long = self._lanes["long"]
        self._short_pace = _Pace()
        #: Without a known batch, with ``long_pacing``: the long lane's cap beside short calls
        #: (see "Pacing" in the module docstring): it starts at 1 and grows while the shorts
        #: keep their pace; ``None``: its share alone.
        self._long_paced: int | None = 1 if long_pacing else None
        self._long_idle_borrow = long_idle_borrow
        self._short_first = short_first
        #: The server's KV cache in tokens, and its block (``set_kv``); ``None``: not known.
        self._kv_tokens: int | None = None
        self._kv_block = 1
        #: The ``tokens`` of the slots in flight, summed.
        self._tokens = 0
        #: A batch's long items in flight whose prompt is known, and when each was admitted.
        self._ramps: dict[Slot, float] = {}
        #: The output tokens of the batch's latest long answers.
        self._long_outputs: deque[float] = deque(maxlen=16)
        self._long_started = -math.inf
        #: The batch's long calls' time per output token (where no short call gives it).
        self._long_pace = _Pace()
        # One queue per class of waiters that the same caps block and one counter orders:
        # lane x capped group x tenant, made as waiters of the class first arrive. Dispatch
        # looks at each queue's head only.
        self._queues: list[_Queue] = []
        self._queue_index: dict[tuple[_LaneState, str | None], _Queue] = {}
        self._in_flight = 0
        self._waiting = 0
        self._seq = itertools.count()

    # --- public ------------------------------------------------------------------------------

    @property
    def limit(self) -> int:
        """The most requests in flight at once."""
        return self._limit

    @property
    def in_flight(self) -> int:
        """Requests holding a slot now (granted waiters included)."""
        return self._in_flight

    @property
    def waiting(self) -> int:
        """Requests waiting for a slot now."""
        return self._waiting

    @property
    def long_in_flight(self) -> int:
        """Long-lane requests holding a slot now."""
        return self._long.in_flight

    @property
    def held_back(self) -> bool:
        """Whether the limit itself holds calls back: every slot is taken, short calls wait
        (they wait only on the limit and group caps), or long calls wait on a borrowing cap that
        a higher limit would raise. Long calls waiting on their lane's share, the server's KV
        cache or (a batch's) the server's batch, and a batch's short items waiting for the
        server's batch beside its waiting long ones, are not held back by the limit: a higher
        limit would not run them."""
        if self._in_flight >= self._limit:
            return True
        short = self._short
        if short.waiting and (
            short.waiting > short.batch_waiting or not self._shorts_past_server()
        ):
            return True
        long = self._long
        if not long.waiting:
            return False
        cap = self._lane_cap(long)
        if cap <= long.cap:
            return False
        if not (cap >= self._limit - 1 or self._batch is None or self._limit < self._batch):
            return False
        for queue in self._queues:
            if queue.lane is long and queue.live:
                head = queue.head()[2]
                if not self._past_server(long, head.batch, head.tokens, head.prompt_tokens):
                    return True
        return False

    def slot(
        self,
        *,
        lane: Lane = "short",
        urgency: int = 0,
        group: str | None = None,
        batch: Hashable = False,
        tokens: int = 0,
        prompt_tokens: int = 0,
        input_tokens: int = 0,
        max_tokens: int = 0,
    ) -> Slot:
        """A slot to enter with ``async with``; it waits there until admitted.

            async with governor.slot(lane="long", urgency=1) as slot:
                ...

        Parameters:
            lane: ``"short"`` or ``"long"`` (see :func:`choose_lane`).
            urgency: higher is admitted first among waiters; FIFO within equal urgency. Not
                vLLM's ``priority``, which runs lower values first.
            group: the tenant: capped when named in ``group_caps``, weighted by
                ``group_weights``; among groups, the lowest virtual token counter goes first.
            batch: the call is an item of a batch (``map()``): the batch's key (one per
                ``map()``; ``True``: a batch not told from others), see "Batches" in the
                module docstring. ``False``: a call someone waits on.
            tokens: the KV cache tokens the call may hold (its prompt + ``max_tokens``); 0:
                not known. See "Borrowing stops where the KV cache does".
            prompt_tokens: of those, its prompt's (a bound); 0: not known. A batch's long
                items are counted as they grow from it ("Growth").
            input_tokens, max_tokens: the prompt's tokens (an estimate is fine) and the most
                it may answer, charged to the group's counter at admission; 0: not known.
        """
        lane_state = self._lanes.get(lane)
        if lane_state is None:
            raise ValueError(f"lane must be 'short' or 'long', got {lane!r}")
        if isinstance(urgency, bool) or not isinstance(urgency, int):
            raise TypeError(f"urgency must be an int, got {type(urgency).__name__}")
        group_state = self._groups.get(group) if group is not None else None
        held = self._held(tokens)
        return Slot(
            self,
            lane,
            urgency,
            group,
            lane_state,
            group_state,
            batch,
            held,
            prompt_tokens,
            input_tokens,
            max_tokens,
        )

    def acquire(
        self,
        *,
        lane: Lane = "short",
        urgency: int = 0,
        group: str | None = None,
        batch: Hashable = False,
        tokens: int = 0,
        prompt_tokens: int = 0,
        input_tokens: int = 0,
        max_tokens: int = 0,
    ) -> Awaitable[Slot]:
        """A slot, once admitted (it waits until then); give it back with :meth:`Slot.release`.

            slot = await governor.acquire(lane="long", urgency=1)
            ...
            slot.release("ok")

        Parameters are those of :meth:`slot`.
        """
        # The slot's own entry, not a coroutine around it: one frame fewer on every call.
        slot = self.slot(
            lane=lane,
            urgency=urgency,
            group=group,
            batch=batch,
            tokens=tokens,
            prompt_tokens=prompt_tokens,
            input_tokens=input_tokens,
            max_tokens=max_tokens,
        )
        return slot.__aenter__()

    def admits(
        self,
        *,
        lane: Lane = "short",
        group: str | None = None,
        batch: Hashable = False,
        tokens: int = 0,
        prompt_tokens: int = 0,
    ) -> bool:
        """Whether a slot of ``lane`` and ``group`` would be admitted now, without waiting
        (a router asks this of each server's governor before it sends a call there)."""
        lane_state = self._lanes.get(lane)
        if lane_state is None:
            raise ValueError(f"lane must be 'short' or 'long', got {lane!r}")
        group_state = self._groups.get(group) if group is not None else None
        return self._admissible(lane_state, group_state, batch, self._held(tokens), prompt_tokens)

    @property
    def kv_tokens(self) -> int | None:
        """The server's KV cache in tokens, as :meth:`set_kv` last set it; ``None``: not
        known."""
        return self._kv_tokens

    def set_kv(self, tokens: int | None, *, block: int | None = None) -> None:
        """The server's KV cache: ``tokens`` it holds in all (``None``: not known) in blocks of
        ``block`` tokens. Long calls borrow beyond their share only as far as it holds them, and
        a batch's own short items stop holding its long ones back (see the module docstring)."""
        if tokens is not None:
            check_int("tokens", tokens, 1)
        if block is not None:
            check_int("block", block, 1)
        changed = tokens != self._kv_tokens
        self._kv_tokens = tokens
        self._kv_block = block or 1
        if changed:
            self._dispatch()

    def set_limit(self, limit: int, *, batch: int | None = None) -> None:
        """Change the cap now; lane and group caps follow their shares.

        Raising it admits waiters at once; lowering it cancels nothing, it only admits nobody
        until in-flight drops below the new cap. ``batch`` is the server's batch
        (``max_num_seqs``) when known: the long lane's share is taken of the smaller of the two,
        so that a limit above the batch (requests in transit, a short server queue) does not
        hand long requests more than their share of the sequences the server runs.
        """
        check_int("limit", limit, 1)
        if batch is not None:
            check_int("batch", batch, 1)
        self._limit = limit
        self._batch = batch
        self._lanes["short"].cap = limit
        self._lanes["long"].cap = floor_share(self._long_share, min(limit, batch or limit))
        if batch is not None:
            self._long_paced = None  # a known batch: borrowing follows the pace instead
        for group in self._groups.values():
            group.cap = floor_share(group.share, limit)
        self._dispatch()

    def stats(self, control: ControlStats | None = None) -> GovernorStats:
        """A frozen snapshot of the counters (sorts each lane's latency window: not per request)."""
        return GovernorStats(
            limit=self._limit,
            in_flight=self._in_flight,
            waiting=self._waiting,
            lanes=MappingProxyType({name: lane.snapshot() for name, lane in self._lanes.items()}),
            control=control,
            kv_tokens=self._kv_tokens,
            kv_tokens_in_flight=self._tokens,
            tenants=self._fair.stats(),
        )

    def __repr__(self) -> str:
        return (
            f"Governor(limit={self._limit}, in_flight={self._in_flight}, waiting={self._waiting})"
        )

    # --- internals (Slot calls these) --------------------------------------------------------

    def _held(self, tokens: int) -> int:
        """``tokens`` in the cache's whole blocks (as they are, where the cache is not known)."""
        if not tokens or self._kv_tokens is None:
            return tokens
        block = self._kv_block
        return -(-tokens // block) * block

    def _admissible(
        self,
        lane: _LaneState,
        group: _GroupState | None,
        batch: Hashable,
        tokens: int,
        prompt: int = 0,
    ) -> bool:
        # Dispatch runs after every change that frees capacity, so whenever this is true no
        # waiter could use the slot: a caller taking it at once jumps nobody who could go.
        return self._has_room(lane, batch, tokens, prompt) and (
            group is None or group.in_flight < group.cap
        )

    def _has_room(self, lane: _LaneState, batch: Hashable, tokens: int, prompt: int = 0) -> bool:
        if lane is self._short:
            if batch:
                # A batch's short item waits for a free slot: the long slots its batch
                # borrowed are the batch's longest items running first.
                return self._in_flight < self._limit and not self._shorts_past_server()
            # Long slots beyond the long share are borrowed: a short request reclaims them.
            long = self._long
            return lane.in_flight + min(long.in_flight, long.cap) < self._limit
        if self._in_flight >= self._limit or lane.in_flight >= self._lane_cap(lane, batch):
            return False
        return not self._past_server(lane, batch, tokens, prompt)

    def _shorts_past_server(self) -> bool:
        """Whether a batch's short items wait for the server's batch: while the batch's long
        items wait for a slot, its short items fill the server's batch and no more. Beyond it
        they would only queue in the server, and each long item admitted after them would
        queue behind them there (on a vLLM holding 7 long items, a batch whose short items
        filled the limit of 12 ran its long items 4-5 at a time, and took 1.13-1.17x as long).
        Not while the first of them waits for the cache ("Growth"): no slot that frees would
        start it, and held to the batch the server had no call queued when a sequence ended
        (a mixed batch in shape order ran 1.1-1.3x as long as in input order).

        Nor, while the batch's long items hold seats they borrowed, do its short items queue
        in the server deeper than the seats left to short calls: those seats alone turn over,
        so a call queued behind the batch's short items there waits for all of them, a
        ``generate()`` beside the batch included. On a server of 16 seats running 15 of a
        batch's long items, the batch's short items filled a limit of 24, and a call every
        0.25 s beside it took 1.2-7 s at p99 in input order (0.2 s in shape order)."""
        size = self._batch
        long = self._long
        if size is None:
            return False
        if long.in_flight > long.cap and self._in_flight >= 2 * size - long.in_flight:
            return True
        if not long.batch_waiting or self._in_flight < size:
            return False
        for queue in self._queues:
            if queue.lane is long and queue.live:
                head = queue.head()[2]
                if (
                    self._grows(head.batch, head.prompt_tokens)
                    and long.in_flight < size - 1
                    and self._past_cache_as_they_grow(long, head.tokens, head.prompt_tokens)
                ):
                    return False
        return True

    def _past_server(self, long: _LaneState, batch: Hashable, tokens: int, prompt: int = 0) -> bool:
        """Whether one more long call would pass what the server holds: beyond the lane's
        share, its KV cache or (a batch's item) its batch less one; a batch's item whose prompt
        is known, the cache as its long calls grow ("Growth"). A higher limit would not run
        such a call (:attr:`held_back`)."""
        if self._grows(batch, prompt):
            return self._past_cache_as_they_grow(long, tokens, prompt)
        if long.in_flight < long.cap:
            return False  # within the share: never held by the server's size
        # A batch's long items borrow the server's batch less one, not the limit's excess over
        # it: beyond it they would only queue in the server, where nothing can be reordered,
        # and the batch's short items keep a sequence to fill.
        size = self._batch
        if batch and size is not None and long.in_flight >= size - 1:
            return True
        # Beyond its share a long call borrows, and only as far as the KV cache holds it.
        kv = self._kv_tokens
        return kv is not None and self._tokens + tokens > kv

    def _grows(self, batch: Hashable, prompt: int) -> bool:
        """Whether a long call is admitted as the batch's long calls grow ("Growth"): a
        batch's item whose prompt is known, on a server whose KV cache is, while the check
        (quadratic in them) has at most ``_GROWTH_MOST`` calls to count."""
        return (
            bool(batch)
            and prompt > 0
            and self._kv_tokens is not None
            and len(self._ramps) <= _GROWTH_MOST
        )

    def _past_cache_as_they_grow(self, long: _LaneState, tokens: int, prompt: int) -> bool:
        """A batch's long item of ``prompt`` tokens that may hold ``tokens``: whether it would
        pass the server's KV cache before it ends, or start too close after the last one
        (see "Growth" in the module docstring)."""
        if not long.in_flight:
            return False  # one long call always runs
        size = self._batch
        if size is not None and long.in_flight >= size - 1:
            return True
        kv = self._kv_tokens
        assert kv is not None
        block = self._kv_block
        # The sequences the server runs (where its batch is not known, the limit).
        seats = self._limit if size is None else size
        ramps = self._ramps
        others = self._tokens - sum(slot.tokens for slot in ramps)
        others_n = self._in_flight - len(ramps)
        each = others / others_n if others_n else block
        # The batch's short items fill every sequence its long items leave, each with what one
        # holds now; a batch of long items alone leaves them empty.
        short = self._short
        shorts = short.batch_in_flight or short.batch_waiting
        fill = max(others, (seats - len(ramps) - 1) * each) if shorts else others
        if self._tokens - others + tokens + fill <= kv:
            return False  # every call at its whole size fits
        # Seconds per output token: the batch's long calls' own, else a short call's (a bound:
        # its time includes its prompt and its wait in the server's queue). Taken from the
        # shorts while long calls' answers were in, on a vLLM of 23 blocks the pace was 1.6-2.1x
        # the long calls' own: the check saw the running long calls as younger than they were,
        # and once the batch's short items had ended ran its long ones 4.2-4.6 at a time with
        # the cache 56-61% full (4.7-5.3 and up to 70% on their own pace).
        pace = self._long_pace.latest or self._short_pace.latest
        if not pace:
            return True  # how fast the calls grow is not known yet
        outputs = self._long_outputs
        most = max(outputs) if len(outputs) >= _GROWTH_SEEN else None
        last = tokens if most is None else min(tokens, prompt + most)
        own = last - prompt  # the tokens it will answer
        now = self._clock()
        apart = pace * own / max(1, seats - 1)
        if short.batch_in_flight and now - self._long_started < apart:
            return True  # staggered: the batch's short items end (and dispatch) meanwhile
        # Each long call in flight: (tokens to its end, tokens now, tokens at its end); one
        # that has passed its expected end holds all it may until it ends.
        grown: list[tuple[float, float, float]] = []
        for slot, start in ramps.items():
            end: float = (
                slot.tokens if most is None else min(slot.tokens, slot.prompt_tokens + most)
            )
            at = slot.prompt_tokens + (now - start) / pace
            grown.append((math.inf, slot.tokens, slot.tokens) if at >= end else (end - at, at, end))
        # The cache is fullest just before one of the calls ends: at each such point, the
        # calls still running at their size then, this one included, and short calls filling
        # the rest of the seats.
        for point in sorted({left for left, _, _ in grown if left < own} | {own}):
            total = -(-min(prompt + point, last) // block) * block
            alive = 0
            for left, at, end in grown:
                if left >= point:
                    alive += 1
                    total += -(-min(at + point, end) // block) * block
            if total + (max(others, (seats - alive - 1) * each) if shorts else others) > kv:
                return True
        return False

    def _lane_cap(self, lane: _LaneState, batch: Hashable = False) -> int:
        """The lane's cap now, for a long call of ``batch`` (``False``: none): the long share,
        more while short calls leave room (see "Borrowing" in the module docstring), or
        ``limit - 1`` while shorts are idle."""
        if lane is not self._long:
            return lane.cap
        paced = self._long_paced
        cap = lane.cap if paced is None or paced >= lane.cap else paced
        if self._long_idle_borrow is None:
            return cap
        short = self._short
        # Only short calls someone waits on count here: a batch's own short items do not
        # hold its long ones back, another batch's do (see "Batches"); nor do a batch's short
        # items hold back a long call someone waits on.
        if batch:
            in_flight, waiting = short.own.get(batch, (0, 0))
        else:
            in_flight, waiting = short.batch_in_flight, short.batch_waiting
        if short.waiting > waiting:
            return cap
        calls = short.in_flight > in_flight
        if calls or self._clock() - short.last_entry < self._long_idle_borrow:
            if self._batch is None:
                return cap
            if self._short_pace.slowed:
                # Borrowing has slowed the shorts down (their time per token is twice their
                # best): the long calls keep to their share. On a CPU vLLM under a burst of
                # long prompts, longs holding 20 of a batch of 32 beside the shorts made the
                # short p95 1.1-1.3 s; held to 10, 0.7-1.0 s, with long calls no slower.
                return lane.cap
            # Shorts are about, and the server's batch is known: long calls may use what the
            # batch has beyond the shorts in flight and a reserve kept free for the next ones.
            # Held to the share alone, long calls left 3 of 8 sequences idle under 8 shorts a
            # second and the burst took 1.2x as long.
            size = min(self._limit, self._batch)
            reserve = max(1, size // _SHORT_RESERVE_DIVISOR)
            return max(lane.cap, size - short.in_flight - reserve)
        return max(lane.cap, self._limit - 1)

    def _take(self, slot: Slot) -> None:
        self._charge(slot)
        self._in_flight += 1
        self._tokens += slot.tokens
        if slot.prompt_tokens and slot.batch and slot._lane_state is self._long:
            self._ramps[slot] = self._long_started = self._clock()
        slot._lane_state.in_flight += 1
        if slot.batch:
            slot._lane_state.count_batch(slot.batch, False, 1)
        if slot._group_state is not None:
            slot._group_state.in_flight += 1

    def _untake(self, slot: Slot) -> None:
        tenant = slot._tenant
        assert tenant is not None
        tenant.in_flight -= 1
        self._in_flight -= 1
        self._tokens -= slot.tokens
        if slot.batch and slot.prompt_tokens:
            self._ramps.pop(slot, None)
        slot._lane_state.in_flight -= 1
        if slot.batch:
            slot._lane_state.count_batch(slot.batch, False, -1)
        if slot._group_state is not None:
            slot._group_state.in_flight -= 1

    # --- tenants (dsclient.governor._fair): the slot's charge and the order among groups ---

    @property
    def fair(self) -> Fair:
        """The tenants' virtual token counters (the shared budget syncs them across processes)."""
        return self._fair

    def sync_fair(
        self,
        counters: Mapping[str | None, float],
        waiting_elsewhere: Sequence[str | None] = (),
        active_elsewhere: Sequence[str | None] = (),
    ) -> None:
        """The shared counters as read from Redis; waiters a tenant held back may go now."""
        self._fair.absorb(counters, waiting_elsewhere, active_elsewhere)
        if self._waiting:
            self._dispatch()

    def unsync_fair(self) -> None:
        """The shared counters are out of reach: order this process's tenants alone."""
        self._fair.forget_remote()
        if self._waiting:
            self._dispatch()

    @property
    def held_by_fairness(self) -> int:
        """Calls waiting because their tenant waits for one served less in another process
        (not demand this process can use now)."""
        fair = self._fair
        return sum(q.live for q in self._queues if q.live and fair.held(q.tenant))

    def _charge(self, slot: Slot) -> None:
        """Admitted: its tenant is charged the call's expected tokens now."""
        tenant = slot._tenant
        assert tenant is not None
        tenant.in_flight += 1
        slot._charged = self._fair.charge(tenant, slot.input_tokens, slot.max_tokens)

    def _settle(self, slot: Slot, outcome: str, now: float) -> None:
        """Ended: its tenant's charge follows the output the answer reported."""
        tenant = slot._tenant
        assert tenant is not None
        fair = self._fair
        fair.settle(
            tenant,
            slot._charged,
            slot.input_tokens,
            slot.work,
            slot.max_tokens,
            ok=outcome == "ok",
            latency=now - slot._started,
        )
        fair.leave(tenant)

    def _queue_for(self, slot: Slot) -> _Queue:
        key = (slot._lane_state, slot.group)
        queue = self._queue_index.get(key)
        if queue is None:
            tenant = slot._tenant
            assert tenant is not None
            queue = self._queue_index[key] = _Queue(slot._lane_state, slot._group_state, tenant)
            self._queues.append(queue)
        return queue

    def _enqueue(self, slot: Slot) -> asyncio.Future[None] | anyio.Event:
        """Put ``slot`` in its queue (:meth:`Slot.__aenter__` then waits on what this returns:
        a future of the running asyncio loop, else an ``anyio.Event``), or raise
        :class:`~dsclient._exceptions.Overloaded` when ``max_queue`` waiters are already in."""
        if self._max_queue is not None and self._waiting >= self._max_queue:
            tenant = slot._tenant
            assert tenant is not None
            self._fair.leave(tenant)  # it arrived, and leaves without waiting
            raise Overloaded(
                0,
                message=(
                    f"client queue is full: {self._waiting} requests already wait for a slot "
                    f"(max_queue={self._max_queue}, limit={self._limit})"
                ),
            )
        queue = self._queue_for(slot)
        loop = asyncio._get_running_loop()
        event: asyncio.Future[None] | anyio.Event
        event = slot._event = loop.create_future() if loop is not None else anyio.Event()
        heapq.heappush(queue.heap, (-slot.urgency, next(self._seq), slot))
        queue.live += 1
        queue.tenant.waiting += 1
        slot._lane_state.waiting += 1
        if slot.batch:
            slot._lane_state.count_batch(slot.batch, True, 1)
        self._waiting += 1
        slot._state = _WAITING
        return event

    def _abandon(self, slot: Slot) -> None:
        """A waiter left (cancelled, timed out) before it ran."""
        if slot._granted:
            # Granted, then cancelled before running: the slot goes to the next waiter as if
            # never taken, so neither capacity nor the wake-up is lost.
            slot._state = _DONE
            self._untake(slot)
            tenant = slot._tenant
            assert tenant is not None
            self._fair.refund(tenant, slot._charged)
            self._fair.leave(tenant)
            self._dispatch()
        else:
            self._withdraw(slot, self._queue_for(slot))
            if slot.batch and self._waiting:
                self._dispatch()  # a batch's long item gone may let its short items in

    def _withdraw(self, slot: Slot, queue: _Queue) -> None:
        slot._cancelled = True
        slot._state = _DONE
        queue.live -= 1
        queue.tenant.waiting -= 1
        self._fair.leave(queue.tenant)
        slot._lane_state.waiting -= 1
        if slot.batch:
            slot._lane_state.count_batch(slot.batch, True, -1)
        self._waiting -= 1
        # Removing from the middle of a heap is O(n), so the entry stays as a tombstone. Drop
        # them all when the queue holds no live waiter, and compact when they dominate, so that
        # thousands of timed-out waiters leave nothing behind.
        if queue.live == 0:
            queue.heap.clear()
        elif len(queue.heap) > 2 * queue.live + 32:
            queue.heap = [entry for entry in queue.heap if not entry[2]._cancelled]
            heapq.heapify(queue.heap)

    def _release(self, slot: Slot, outcome: str) -> None:
        self._untake(slot)
        lane = slot._lane_state
        if outcome == "ok":
            lane.done += 1
        else:
            lane.failed += 1
        now = self._clock()
        lane.samples.append(now - slot._started)
        self._settle(slot, outcome, now)
        if (
            slot.prompt_tokens
            and slot.batch
            and lane is self._long
            and outcome == "ok"
            and slot.work
        ):
            self._long_outputs.append(slot.work)
            self._long_pace.add((now - slot._admitted) / slot.work)
        if lane is self._short and outcome == "ok":
            work = slot.work
            per_work = (now - slot._admitted) / (work if work and work > 0 else 1.0)
            if self._short_pace.add(per_work) and self._long_paced is not None:
                self._pace_long()
        if self._waiting:
            self._dispatch()
        if self._on_release is not None:
            self._on_release(slot, outcome, now - slot._admitted)

    def _pace_long(self) -> None:
        """A window of short calls closed, on a server whose batch is unknown: halve the long
        lane's cap if the shorts have slowed (twice their quickest window's time per token),
        else, if the long lane was full, give it one slot more, up to its share (see
        "Pacing")."""
        long = self._long
        paced = self._long_paced
        assert paced is not None  # called only while pacing
        if self._short_pace.slowed:
            self._long_paced = max(1, paced // 2)
        elif long.in_flight >= paced and paced < long.cap:
            self._long_paced = paced + 1

    def _pop(self, queue: _Queue) -> Slot:
        """The waiter of ``queue`` to admit: its head, or with ``pick`` the one ``pick`` chooses
        among the first ``pick_window`` waiters of the head's urgency (arrival order). A waiter
        passed over ``pick_window`` times goes next whatever ``pick`` says, so none starves."""
        heap = queue.heap
        pick = self._pick
        if pick is None or queue.live < 2:
            return heapq.heappop(heap)[2]
        head = queue.head()
        if head[2].passed >= self._pick_window:
            return heapq.heappop(heap)[2]
        dead = len(heap) - queue.live
        window = [
            entry
            for entry in heapq.nsmallest(self._pick_window + dead, heap)
            if not entry[2]._cancelled and entry[0] == head[0]
        ][: self._pick_window]
        index = pick([entry[2] for entry in window])
        if not 0 < index < len(window):
            return heapq.heappop(heap)[2]
        chosen = window[index]
        for entry in window[:index]:
            entry[2].passed += 1
        heap.remove(chosen)
        heapq.heapify(heap)
        return chosen[2]

    def _dispatch(self) -> None:
        """Admit waiters, best (tenant's counter, urgency, arrival) first, while any of them
        fits its caps.

        The tenant (group) with the lowest virtual token counter goes first (see "Tenants");
        inside it, with ``short_first``, at equal urgency a waiting short request goes before a
        waiting long one (shortest job first), except that a long request goes first while no
        long request is in flight, so the long lane never starves.
        """
        fair = self._fair
        while self._waiting:
            best: _Queue | None = None
            best_key: tuple[float, int, int, int] | None = None
            for queue in self._queues:
                # A queue whose lane or group is full is skipped, not waited on: no
                # head-of-line blocking across lanes or groups.
                if not queue.live:
                    continue
                entry = queue.head()
                waiter = entry[2]
                if not self._has_room(
                    queue.lane, waiter.batch, waiter.tokens, waiter.prompt_tokens
                ):
                    continue
                if queue.group is not None and queue.group.in_flight >= queue.group.cap:
                    continue
                if fair.held(queue.tenant):
                    continue
                if queue.lane is self._short or not self._short_first:
                    rank = 0
                else:
                    rank = 1 if queue.lane.in_flight else -1
                key = (queue.tenant.counter, entry[0], rank, entry[1])
                if best_key is None or key < best_key:
                    best, best_key = queue, key
            if best is None:
                return
            slot = self._pop(best)
            best.live -= 1
            if not best.live:
                best.heap.clear()  # only tombstones are left
            best.tenant.waiting -= 1
            slot._lane_state.waiting -= 1
            if slot.batch:
                slot._lane_state.count_batch(slot.batch, True, -1)
            self._waiting -= 1
            slot._granted = True
            # Admitted now, not when its task next runs: the slot counts in flight from here,
            # and the limit controller matches admissions to what is in flight at its ticks.
            slot._admitted = self._clock()
            self._take(slot)
            event = slot._event
            assert event is not None
            if isinstance(event, asyncio.Future):
                if not event.done():  # done: cancelled already; the waiter hands the slot on
                    event.set_result(None)
            else:
                event.set()
