"""Lanes: a call is ``"short"`` or ``"long"`` by its tokens; the governor holds the long ones to
a share of the slots.

    threshold = default_long_threshold(info.max_model_len)              # 512 for a 2048 context
    lane = choose_lane(estimated_total_tokens=1256, threshold=threshold)  # "long"

Pure: the client chooses a call's lane here from its planned tokens; the governor
(:mod:`dsclient.governor._governor`) admits by it, and the server's own priority
(:mod:`dsclient.client._priority`) ranks the long lane after the short one. One definition of
:data:`Lane` for all three.
"""

from __future__ import annotations

from typing import Final, Literal

from ._checks import check_int, floor_share

__all__ = [
    "LONG_THRESHOLD_FALLBACK",
    "LONG_THRESHOLD_SHARE",
    "Lane",
    "choose_lane",
    "default_long_threshold",
]

#: The lane a call takes through the governor.
Lane = Literal["short", "long"]

#: ``default_long_threshold`` as a share of the context, and its value when the context is unknown.
LONG_THRESHOLD_SHARE: Final = 0.25
LONG_THRESHOLD_FALLBACK: Final = 1024


def default_long_threshold(max_model_len: int | None) -> int:
    """Total tokens (prompt + output) above which a request takes the long lane.

    A quarter of the context, or 1024 tokens when the context is unknown::

        default_long_threshold(2048)  # 512
        default_long_threshold(None)  # 1024

    Why a quarter: on the reference server (2048-token context) short requests were small
    prompts + 64 tokens out (~100-200 tokens) and long ones ~1000-token prompts + 256 out
    (~1250). 512 sits near their geometric mean (~450), far from both, and a request using a
    quarter of the context costs several short ones. 1024 is that rule for a 4096 context, the
    smallest common one, so an unknown context errs towards the short lane.

    Parameters:
        max_model_len: the model's context length in tokens (>= 1), or ``None`` if unknown.
    """
    if max_model_len is None:
        return LONG_THRESHOLD_FALLBACK
    check_int("max_model_len", max_model_len, 1)
    return floor_share(LONG_THRESHOLD_SHARE, max_model_len)


def choose_lane(*, estimated_total_tokens: int, threshold: int) -> Lane:
    """The lane for a request: ``"long"`` when its tokens exceed ``threshold``, else ``"short"``.

        choose_lane(estimated_total_tokens=1256, threshold=512)  # "long"
        choose_lane(estimated_total_tokens=512, threshold=512)   # "short"

    Parameters:
        estimated_total_tokens: prompt tokens plus ``max_tokens`` (an estimate is fine), >= 0.
        threshold: see :func:`default_long_threshold`, >= 1.
    """
    check_int("estimated_total_tokens", estimated_total_tokens, 0)
    check_int("threshold", threshold, 1)
    return "long" if estimated_total_tokens > threshold else "short"
