"""The server's own priority: what dsclient puts in a request's ``priority`` field, and when.

Pure. vLLM (``--scheduling-policy priority``) runs lower values first and preempts running
requests of a higher value for a lower one; SGLang (``--enable-priority-scheduling``) runs higher
values first unless ``--schedule-low-priority-values-first``. dsclient sends each call's place
in its own order, so that the server, too, can put a short request ahead of long ones already
queued there::

    rank = lane_rank - 2 x urgency       # short lane 0, long lane 1; urgency: higher is sooner

    server_priority("short", 0, "lower-first")    # 0
    server_priority("long", 0, "lower-first")     # 1
    server_priority("short", 1, "lower-first")    # -2: urgency comes before the lane
    server_priority("long", 0, "higher-first")    # -1

When it is sent (``ServerInfo.priority``, decided by discovery): where the server is known to
take the field. vLLM's V1 engine (0.10 and later, the version read from ``/version``) accepts a
priority on a first-come server and ignores it, so sending it there costs nothing; vLLM's older
V0 engine refused a non-zero priority unless the server ran the priority policy, and SGLang
refuses one unless priority scheduling is on. Whether the server *honours* it
(``ServerInfo.priority_honoured``) comes from the launch record, vLLM's dev-mode
``/server_info``, SGLang's ``/server_info``, or the caller (``AsyncClient(server_priority=)``).
A ``priority`` the caller puts in the request itself is sent as it is.

**Tenants' weights, where asked** (``AsyncClient(group_priority=True)``): the call's group
(tenant) comes first, ranked by its weight in ``group_weights`` (the heaviest 0), then lane and
urgency as above::

    ranks = weight_ranks({"chat": 3, "batch": 1})     # {"chat": 0, "batch": 1}; others: 1
    server_priority("long", 0, "lower-first", ranks["chat"])   # 1
    server_priority("short", 0, "lower-first", ranks["batch"]) # 1000

A server that runs priorities then serves the heavier tenant's queued requests first; it is not
fair (a lighter tenant waits while a heavier one has requests queued there), which is why it is
off unless asked: the client's own order is the fair one.
"""

from __future__ import annotations

from collections.abc import Mapping

from .._server_info import PriorityOrder

__all__ = ["GROUP_STEP", "PriorityOrder", "server_priority", "weight_ranks", "with_priority"]

#: How far apart two tenants' weight ranks put their priorities (lane and urgency fit between).
GROUP_STEP = 1000


def weight_ranks(weights: Mapping[str, float]) -> dict[str | None, int]:
    """Each named group's rank by weight, the heaviest 0; ``None`` (and any group not named,
    which weighs 1) ranks where a weight of 1 does."""
    levels = sorted({*weights.values(), 1.0}, reverse=True)
    ranks: dict[str | None, int] = {name: levels.index(w) for name, w in weights.items()}
    ranks[None] = levels.index(1.0)
    return ranks


def server_priority(lane: str, urgency: int, order: PriorityOrder, group_rank: int = 0) -> int:
    """The ``priority`` value that puts this call where dsclient's own order puts it (with
    ``group_rank``, after the calls of heavier tenants)."""
    rank = GROUP_STEP * group_rank + (1 if lane == "long" else 0) - 2 * urgency
    return rank if order == "lower-first" else -rank


def with_priority(
    body: dict[str, object],
    lane: str,
    urgency: int,
    order: PriorityOrder | None,
    group_rank: int = 0,
) -> dict[str, object]:
    """``body`` with the server's ``priority`` added (a copy), or as it is: no order known, or
    a ``priority`` the caller set already."""
    if order is None or "priority" in body:
        return body
    return {**body, "priority": server_priority(lane, urgency, order, group_rank)}
