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
"""

from __future__ import annotations

from .._server_info import PriorityOrder

__all__ = ["PriorityOrder", "server_priority", "with_priority"]


def server_priority(lane: str, urgency: int, order: PriorityOrder) -> int:
    """The ``priority`` value that puts this call where dsclient's own order puts it."""
    rank = (1 if lane == "long" else 0) - 2 * urgency
    return rank if order == "lower-first" else -rank


def with_priority(
    body: dict[str, object], lane: str, urgency: int, order: PriorityOrder | None
) -> dict[str, object]:
    """``body`` with the server's ``priority`` added (a copy), or as it is: no order known, or
    a ``priority`` the caller set already."""
    if order is None or "priority" in body:
        return body
    return {**body, "priority": server_priority(lane, urgency, order)}
