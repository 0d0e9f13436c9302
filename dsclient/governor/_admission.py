"""Admission: who a call is, as a backend admits its attempts. One value from the client down.

    admission = Admission("short", urgency=0, group="tenant-a", model="tiny", prefix=prompt)
    slot = await backend.acquire(admission)           # every attempt of the call, the same

The governor orders its queue by ``lane``, ``urgency`` and ``group``; a pool of servers also
routes by ``model`` (which servers serve it) and ``prefix`` (what their caches probably hold).
The client builds one per call (:mod:`dsclient.client._caller`, and the SDK transport); the
request path (:mod:`dsclient.client._pipeline`) hands it to the backend unchanged, attempt after
attempt.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import TYPE_CHECKING, NamedTuple

from ._lanes import Lane

if TYPE_CHECKING:
    from ._governor import Governor, Slot

__all__ = ["Admission", "slot_for"]


class Admission(NamedTuple):
    """One call's place in the governor's queue and, with a pool, in its router.

    Attributes:
        lane: ``"short"`` or ``"long"`` (:func:`~dsclient.governor._lanes.choose_lane`).
        urgency: higher goes first within the lane (the caller's ``urgency=``).
        group: the fairness group (the caller's ``group=``); ``None``: the default group.
        model: the model the call names (a pool routes to a server that serves it); ``None``:
            the server's only model.
        prefix: the text a pool's router matches against the prefixes each server probably
            holds in its cache (``None``: no affinity).
        batch: the batch (``map()``) the call is an item of, as a key that tells one batch
            from another (``False``: none): the governor lets the batch's long items borrow
            beside its own short ones, not beside another's ("Batches" in
            :mod:`dsclient.governor._governor`).
        tokens: the KV cache tokens the call may hold, its prompt + ``max_tokens`` (0: not
            known); long calls borrow only as far as the server's cache holds them.
        prompt_tokens: of those, the prompt's (a bound; 0: not known): a batch's long items are
            counted as they grow from it.
        input_tokens: the prompt's tokens as the planner counted or estimated them (0: not
            known), and ``max_tokens``, what the call may answer: the group's (tenant's) charge
            at admission (:mod:`dsclient.governor._fair`).
    """

    lane: Lane
    urgency: int = 0
    group: str | None = None
    model: str | None = None
    prefix: str | None = None
    batch: Hashable = False
    tokens: int = 0
    prompt_tokens: int = 0
    input_tokens: int = 0
    max_tokens: int = 0


def slot_for(governor: Governor, admission: Admission) -> Slot:
    """A slot of ``governor`` for a call of ``admission`` (a server's, a pool's front queue)."""
    return governor.slot(
        lane=admission.lane,
        urgency=admission.urgency,
        group=admission.group,
        batch=admission.batch,
        tokens=admission.tokens,
        prompt_tokens=admission.prompt_tokens,
        input_tokens=admission.input_tokens,
        max_tokens=admission.max_tokens,
    )
