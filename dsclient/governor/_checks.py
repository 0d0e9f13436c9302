"""The governor's argument checks, and its one rounding rule for a share of some slots.

    floor_share(0.5, 5)    # 2: half of 5 slots, never less than 1
    floor_share(0.57, 100) # 57, although 0.57 * 100 is 56.99999999999999

Pure. The governor (caps, lane and group shares) and the lane policy (the long threshold as a
share of the context) read the same rule, so a share means the same number of slots in both.
"""

from __future__ import annotations

import math
from typing import Final

__all__ = ["check_int", "check_share", "floor_share"]

# floor(share * n) must not lose a slot to binary rounding: 0.57 * 100 is 56.99999999999999.
_EPS: Final = 1e-9


def floor_share(share: float, n: int) -> int:
    """``max(1, floor(share x n))``, robust to binary rounding."""
    return max(1, math.floor(share * n + _EPS))


def check_share(name: str, share: float) -> None:
    """Raise ``ValueError`` naming ``name`` unless ``share`` is in (0, 1]."""
    # `not (0 < x <= 1)` also rejects NaN.
    if not 0 < share <= 1:
        raise ValueError(f"{name} must be in (0, 1], got {share!r}")


def check_int(name: str, value: object, minimum: int) -> None:
    """Raise ``TypeError`` unless ``value`` is an int (not a bool), ``ValueError`` below
    ``minimum``; both name ``name``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value!r}")
