"""The nearest-rank percentile, the one rule dsclient's own latency summaries use.

    nearest_rank([0.1, 0.2, 0.3, 0.4], 50)  # 0.2
    nearest_rank([0.1, 0.2, 0.3, 0.4], 99)  # 0.4

Nearest rank (the ``ceil(p/100 x n)``-th smallest value) always answers with a latency that was
measured, never one interpolated between two: a p99 over a handful of calls is the slowest
call, not a number no call took. The governor's lane stats, the limit controller's service
time and a batch's summary all read it; the bench command interpolates like numpy instead
(``dsclient.cli.bench.policy.percentile``), to compare with other tools.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["nearest_rank"]


def nearest_rank(ordered: Sequence[float], percent: int) -> float:
    """The ``percent``-th nearest-rank percentile of ``ordered``.

    Parameters:
        ordered: the values, sorted ascending; at least one (the caller decides what an empty
            series means).
        percent: in [0, 100]; 0 gives the smallest value, as 1 does.
    """
    # (p x n + 99) // 100 is ceil(p x n / 100) in integers: 95% of 100 samples is rank 95, with
    # no float to round up to 96.
    return ordered[max(1, (percent * len(ordered) + 99) // 100) - 1]
