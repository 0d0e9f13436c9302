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

from collections import deque
from typing import Final, Literal

from ._checks import check_int, floor_share

__all__ = [
    "LONG_THRESHOLD_FALLBACK",
    "LONG_THRESHOLD_FLOOR",
    "LONG_THRESHOLD_SHARE",
    "RELATIVE_LONG",
    "Lane",
    "RecentSizes",
    "choose_lane",
    "default_long_threshold",
]

#: The lane a call takes through the governor.
Lane = Literal["short", "long"]

#: ``default_long_threshold`` as a share of the context, and its value when the context is unknown.
LONG_THRESHOLD_SHARE: Final = 0.25
LONG_THRESHOLD_FALLBACK: Final = 1024
#: Where the context is unknown: a call is long at this many times the size of the usual
#: recent short call (the first quartile's), and never at :data:`LONG_THRESHOLD_FLOOR` tokens
#: or fewer.
RELATIVE_LONG: Final = 4
LONG_THRESHOLD_FLOOR: Final = 256
#: The recent short calls :class:`RecentSizes` keeps, how many it needs before it judges, and
#: how often (in calls) it takes their quartile again once its window is full.
_SIZES_WINDOW: Final = 256
_SIZES_MIN: Final = 4
_SIZES_EVERY: Final = 16


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


class RecentSizes:
    """The long lane's threshold for a server whose context is unknown, from the calls
    themselves: :data:`RELATIVE_LONG` times the first quartile of the sizes of the last
    :data:`_SIZES_WINDOW` short calls, at least :data:`LONG_THRESHOLD_FLOOR` and at most
    :data:`LONG_THRESHOLD_FALLBACK`.

        sizes = RecentSizes()
        for _ in range(4):
            sizes.lane_of(60)      # "short": 4 calls of 60 tokens seen
        sizes.lane_of(730)         # "long": above 4 x 60 (and the floor of 256)

    Without the context, :func:`default_long_threshold` is 1024 tokens, and on a server that
    does not say its context (transformers' server, a gateway) a burst of 900-token prompts
    among 60-token questions took the short lane and ran beside them. What is long is relative
    to what the client sends: a call many times the size of the usual one costs the server as
    many of them. Only calls judged short count towards the usual size, so a burst of long
    calls (40 at once, after 4 questions) cannot make itself the usual size; calls that grow
    slowly move it with them. The rule can only lower the threshold below the fallback, never
    raise it: a batch of calls of one size stays in the short lane. Until :data:`_SIZES_MIN`
    calls have been judged short, the fallback holds. ``size`` is any measure of a call's tokens
    (prompt and output) that is the same for every call: the planner uses the prompt's bytes / 4
    plus ``max_tokens``, which costs no tokenizer.
    """

    __slots__ = ("_count", "_sizes", "threshold")

    def __init__(self) -> None:
        self._sizes: deque[int] = deque(maxlen=_SIZES_WINDOW)
        self._count = 0
        #: Sizes above this take the long lane.
        self.threshold: int = LONG_THRESHOLD_FALLBACK

    def lane_of(self, size: int) -> Lane:
        """The lane of a call of ``size`` tokens; a short one counts among the recent ones."""
        if size > self.threshold:
            return "long"
        sizes = self._sizes
        sizes.append(size)
        self._count += 1
        n = len(sizes)
        if n >= _SIZES_MIN and (n < _SIZES_WINDOW or self._count % _SIZES_EVERY == 0):
            usual = sorted(sizes)[n // 4]
            relative = max(LONG_THRESHOLD_FLOOR, RELATIVE_LONG * usual)
            self.threshold = min(LONG_THRESHOLD_FALLBACK, relative)
        return "short"
