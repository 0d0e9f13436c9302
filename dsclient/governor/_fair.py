"""Token-fair order among tenants: the Virtual Token Counter of Sheng et al. (OSDI 2024).

    fair = Fair({"chat": 3, "batch": 1})
    chat = fair.arrive("chat")                   # a call of "chat" enters (lifted if it was idle)
    charged = fair.charge(chat, 900, 256)        # admitted: its estimate is counted at once
    fair.settle(chat, charged, 900, 31, ok=True, latency=0.8)  # ended: corrected from usage
    fair.counter("chat")                          # (900 + 2 x 31) / 3

A tenant is a call's ``group=``. Each tenant has a counter of the service it was given: its calls'
input tokens plus twice their output tokens (VTC's weights; decoding a token costs the server
more than reading one), over the tenant's weight. When the governor has a free slot and calls of
several tenants wait, the waiting call of the tenant with the lowest counter goes next; inside a
tenant, lanes and urgency keep their meaning. Nothing is reserved: a tenant alone gets every slot
the governor allows (work conserving), and a tenant's share grows only while others wait.

**Charged as it is known.** At admission a call is charged its input tokens (the planner's count)
and its expected output: ``max_tokens`` times the fraction of ``max_tokens`` the tenant's recent
answers used (all of it until one is in). At its end the charge is corrected from the answer's
``usage`` (output tokens); a call that fails keeps what it was charged, a call granted a slot and
cancelled before it ran is refunded.

**Lifted from idle.** A tenant that has no call waiting or in flight is idle; when a call of it
arrives, its counter is lifted to the lowest counter of the active tenants (or, when none is
active, to the level the last one left at), so a tenant cannot bank service while it sends
nothing and then take the server for as long as it saved. This is VTC's rule; with it the
service two tenants that stay backlogged receive differs by at most about twice the largest
call's cost (``tests/test_fair.py`` checks it on a simulated server).

**Across processes** (:meth:`take_pending`, :meth:`absorb`): the client's shared budget adds what
this process charged to counters held in Redis at every sync and reads everyone's back; a tenant
whose counter is beyond the lowest counter of a tenant waiting in another process by more than
the largest call's cost is held back (:meth:`held`) until the others catch up.

Pure: no clock, no I/O. The governor (:mod:`dsclient.governor._governor`) calls it as waiters
arrive, are admitted and end.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Final

from .._percentile import nearest_rank

__all__ = ["INPUT_WEIGHT", "OUTPUT_WEIGHT", "Fair", "TenantStats", "check_weights"]

#: Service units per input token and per output token (VTC's defaults, w_p = 1 and w_q = 2).
INPUT_WEIGHT: Final = 1.0
OUTPUT_WEIGHT: Final = 2.0
#: How fast the expected share of ``max_tokens`` follows a tenant's answers (an EWMA's weight).
_RATIO_ALPHA: Final = 0.2


def check_weights(weights: Mapping[str, float] | None) -> dict[str, float]:
    """``weights`` as a plain dict, or ``ValueError`` naming the tenant whose weight is not a
    finite number above 0 (``TypeError`` for a name that is not a string)."""
    checked: dict[str, float] = {}
    for name, weight in (weights or {}).items():
        if not isinstance(name, str) or not name:
            raise TypeError(f"group_weights keys must be non-empty strings, got {name!r}")
        if isinstance(weight, bool) or not isinstance(weight, (int, float)):
            raise TypeError(f"group_weights[{name!r}] must be a number, got {weight!r}")
        if not (0 < weight < math.inf):
            raise ValueError(f"group_weights[{name!r}] must be > 0 and finite, got {weight!r}")
        checked[name] = float(weight)
    return checked


@dataclass(frozen=True, kw_only=True)
class TenantStats:
    """One tenant's share of a governor (``client.stats().tenants[name]``).

    ``counter`` is its virtual token counter (service over weight; the lowest waiting one goes
    next). ``input_tokens`` and ``output_tokens`` are what its ended calls were served (output
    from the answers' ``usage``); ``p50``/``p99``, seconds from asking for a slot to the end,
    over its latest calls (``None`` before the first).
    """

    weight: float
    counter: float
    in_flight: int
    waiting: int
    done: int
    failed: int
    input_tokens: int
    output_tokens: int
    p50: float | None
    p99: float | None


class Tenant:
    """One tenant's state (the governor keeps a reference on each of its slots)."""

    __slots__ = (
        "active",
        "counter",
        "done",
        "failed",
        "in_flight",
        "input_tokens",
        "name",
        "output_tokens",
        "ratio",
        "samples",
        "waiting",
        "weight",
    )

    def __init__(self, name: str | None, weight: float, counter: float, window: int) -> None:
        self.name = name
        self.weight = weight
        self.counter = counter
        #: Calls waiting or in flight (0: idle).
        self.active = 0
        self.in_flight = 0
        self.waiting = 0
        self.done = 0
        self.failed = 0
        self.input_tokens = 0
        self.output_tokens = 0
        #: The share of ``max_tokens`` its answers use (expected output at admission).
        self.ratio = 1.0
        self.samples: deque[float] = deque(maxlen=window)

    def snapshot(self) -> TenantStats:
        ordered = sorted(self.samples)
        return TenantStats(
            weight=self.weight,
            counter=self.counter,
            in_flight=self.in_flight,
            waiting=self.waiting,
            done=self.done,
            failed=self.failed,
            input_tokens=self.input_tokens,
            output_tokens=self.output_tokens,
            p50=nearest_rank(ordered, 50) if ordered else None,
            p99=nearest_rank(ordered, 99) if ordered else None,
        )


class Fair:
    """Virtual token counters per tenant: who goes next, charged as calls run.

    Parameters:
        weights: tenant (group name) to its weight, each > 0; others weigh 1. A tenant of
            weight 3 is served three times the tokens of one of weight 1 while both wait.
        input_weight, output_weight: service units per input and per output token.
        latency_window: the latest calls per tenant kept for its percentiles.
    """

    __slots__ = (
        "_elsewhere",
        "_floor",
        "_input_weight",
        "_output_weight",
        "_pending",
        "_remote",
        "_tenants",
        "_weights",
        "_window",
        "largest",
    )

    def __init__(
        self,
        weights: Mapping[str, float] | None = None,
        *,
        input_weight: float = INPUT_WEIGHT,
        output_weight: float = OUTPUT_WEIGHT,
        latency_window: int = 1000,
    ) -> None:
        self._weights = check_weights(weights)
        self._input_weight = input_weight
        self._output_weight = output_weight
        self._window = latency_window
        self._tenants: dict[str | None, Tenant] = {}
        #: Where an idle tenant is lifted to when no tenant is active: the lowest active
        #: counter as the last active tenant left.
        self._floor = 0.0
        #: Counter changes since the last :meth:`take_pending` (for the shared counters).
        self._pending: dict[str | None, float] = {}
        #: Tenants waiting in other processes, and their counters (:meth:`absorb`).
        self._remote: dict[str | None, float] = {}
        #: Tenants with calls waiting or in flight in other processes (never lifted here).
        self._elsewhere: frozenset[str | None] = frozenset()
        #: The largest cost charged for one call, in service units: VTC's bound, and the slack
        #: past which a tenant is held back for one waiting elsewhere.
        self.largest = 0.0

    # -- tenants ---------------------------------------------------------------------------
    def tenant(self, name: str | None) -> Tenant:
        """The state of tenant ``name`` (``None``: calls with no group), made on first use."""
        tenant = self._tenants.get(name)
        if tenant is None:
            weight = self._weights.get(name, 1.0) if name is not None else 1.0
            tenant = self._tenants[name] = Tenant(name, weight, self._floor, self._window)
        return tenant

    def counter(self, name: str | None) -> float:
        """Tenant ``name``'s counter (service over weight)."""
        return self.tenant(name).counter

    def arrive(self, name: str | None) -> Tenant:
        """A call of ``name`` asks for a slot; an idle tenant is lifted first (see the module)."""
        tenant = self.tenant(name)
        if not tenant.active and name not in self._elsewhere:
            tenants = self._tenants
            low = min(
                (t.counter for t in tenants.values() if t.active or t.name in self._elsewhere),
                default=None,
            )
            level = self._floor if low is None else low
            if tenant.counter < level:
                self._add(tenant, level - tenant.counter)
        tenant.active += 1
        return tenant

    def leave(self, tenant: Tenant) -> None:
        """One of ``tenant``'s calls is gone (ended, or left the queue)."""
        tenant.active -= 1
        if not tenant.active:
            others = [t.counter for t in self._tenants.values() if t.active]
            self._floor = max(self._floor, min(others, default=tenant.counter))

    # -- charges ---------------------------------------------------------------------------
    def expected(self, tenant: Tenant, input_tokens: int, max_tokens: int) -> float:
        """The service units a call is charged at admission (at least 1: a call whose tokens
        are not known counts as one unit, so the order is then fair in calls)."""
        output = max_tokens * tenant.ratio
        return max(1.0, self._input_weight * input_tokens + self._output_weight * output)

    def charge(self, tenant: Tenant, input_tokens: int, max_tokens: int) -> float:
        """Admitted: count the call's expected service now; returns what was charged."""
        cost = self.expected(tenant, input_tokens, max_tokens)
        self.largest = max(self.largest, cost)
        self._add(tenant, cost / tenant.weight)
        return cost

    def refund(self, tenant: Tenant, charged: float) -> None:
        """A call granted a slot left before it ran: take its charge back."""
        self._add(tenant, -charged / tenant.weight)

    def settle(
        self,
        tenant: Tenant,
        charged: float,
        input_tokens: int,
        output_tokens: float | None,
        max_tokens: int = 0,
        *,
        ok: bool,
        latency: float,
    ) -> None:
        """A call ended: correct its charge from the output the answer reports (``None``: not
        known, the estimate stands), and count it in the tenant's stats."""
        tenant.samples.append(latency)
        if not ok:
            tenant.failed += 1
            return
        tenant.done += 1
        tenant.input_tokens += input_tokens
        if output_tokens is None:
            return
        tenant.output_tokens += int(output_tokens)
        if max_tokens > 0:
            used = min(1.0, output_tokens / max_tokens)
            tenant.ratio += _RATIO_ALPHA * (used - tenant.ratio)
        actual = max(1.0, self._input_weight * input_tokens + self._output_weight * output_tokens)
        self.largest = max(self.largest, actual)
        self._add(tenant, (actual - charged) / tenant.weight)

    def _add(self, tenant: Tenant, amount: float) -> None:
        tenant.counter += amount
        name = tenant.name
        self._pending[name] = self._pending.get(name, 0.0) + amount

    # -- across processes ------------------------------------------------------------------
    def take_pending(self) -> dict[str | None, float]:
        """The counter changes since the last call (to add to the shared counters)."""
        pending, self._pending = self._pending, {}
        return pending

    def restore_pending(self, deltas: Mapping[str | None, float]) -> None:
        """Changes taken by :meth:`take_pending` that did not reach the shared counters."""
        for name, delta in deltas.items():
            self._pending[name] = self._pending.get(name, 0.0) + delta

    def absorb(
        self,
        counters: Mapping[str | None, float],
        waiting_elsewhere: Iterable[str | None] = (),
        active_elsewhere: Iterable[str | None] = (),
    ) -> None:
        """The shared counters as a sync read them (this process's changes up to
        :meth:`take_pending` included), the tenants that wait in other processes and those
        with calls waiting or in flight there (a tenant active elsewhere is not idle: it is
        not lifted when it arrives here)."""
        for name, value in counters.items():
            tenant = self.tenant(name)
            tenant.counter = value + self._pending.get(name, 0.0)
        self._remote = {name: self.tenant(name).counter for name in waiting_elsewhere}
        self._elsewhere = frozenset(active_elsewhere)

    def forget_remote(self) -> None:
        """The shared counters are out of reach: order this process's tenants alone."""
        self._remote = {}
        self._elsewhere = frozenset()

    def held(self, tenant: Tenant) -> bool:
        """Whether ``tenant`` waits for a tenant waiting in another process whose counter is
        lower than its own by more than the largest call's cost."""
        remote = self._remote
        if not remote:
            return False
        low = min((c for name, c in remote.items() if name != tenant.name), default=math.inf)
        return tenant.counter > low + max(1.0, self.largest)

    # -- reading ---------------------------------------------------------------------------
    @property
    def names(self) -> list[str | None]:
        return list(self._tenants)

    def active_names(self) -> list[str | None]:
        """Tenants with a call waiting or in flight."""
        return [name for name, t in self._tenants.items() if t.active]

    def waiting_names(self) -> list[str | None]:
        """Tenants with a call waiting."""
        return [name for name, t in self._tenants.items() if t.waiting]

    def stats(self) -> Mapping[str | None, TenantStats]:
        """A frozen snapshot of every tenant seen."""
        return MappingProxyType({name: t.snapshot() for name, t in self._tenants.items()})
