"""Retry policy: which failures to retry, how long to wait, and how many retries to allow.

Everything here is pure (no network, no sleeping); the request path
(:class:`~dsclient.client._pipeline.RequestPath`) asks and sleeps.
"""

from __future__ import annotations

import math
import random
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from .._exceptions import (
    ConnectionError,
    Overloaded,
    RequestRefused,
    ServerFault,
    TimeoutError,
)
from .._retry_after import parse_retry_after

__all__ = [
    "RETRYABLE_STATUSES",
    "Retry",
    "RetryBudget",
    "compute_backoff",
    "is_retryable",
    "parse_retry_after",
]

#: Statuses worth another try: timeouts, conflicts, rate limits and the server's own failures.
RETRYABLE_STATUSES = frozenset({408, 409, 429, 500, 502, 503, 504})


@dataclass(frozen=True, kw_only=True)
class Retry:
    """How a client retries failed requests.

    ==========================================  =============================================
    ``Retry()``                                  4 attempts, 0.5 s base, 8 s cap, full jitter
    ``Retry(attempts=1)``                        never retry
    ``Retry(base=0.1, cap=2.0)``                 faster backoff for a local server
    ``Retry(budget_ratio=0.2, budget_floor=3)``  retries may be 20% of recent requests
    ``Retry(overload_attempts=4)``               give up on a refusing server as on any error
    ``Retry(outage_retries=0)``                  a call dies with the server it was on
    ==========================================  =============================================

    Parameters:
        attempts: total tries per call, the first included (>= 1).
        base: the first backoff cap in seconds; attempt ``n`` waits up to ``base * 2**(n-1)``.
        cap: no single wait is longer than this, a server's ``Retry-After`` included.
        budget_ratio: retries allowed, as a share of the requests in the last ``budget_window``
            seconds (see :class:`RetryBudget`).
        budget_floor: retries always allowed per window, so a lone request is still retried.
        budget_window: the sliding window of the budget, in seconds.
        overload_attempts: total tries per call while the server refuses it for load (429 /
            503) under an adaptive limit (``attempts`` if that is more). Such a refusal is
            congestion, not a failure: it has cut the limit, and the retry waits for a slot
            under the cut limit, so these retries add no load and spend no budget. vLLM's
            ``--max-num-queued-reqs`` refuses every request over its queue at once; four tries
            lost requests in a burst. ``attempts=1`` still turns every retry off.
        outage_retries: retries a call gets, beyond ``attempts`` and outside the budget, when
            its connection failed because the server went away (an outage that a failed
            health probe confirmed): one per outage it lives through, each after waiting for
            the server to answer again (bounded by the call's timeout and the client's
            ``outage_wait``). The calls in flight when a server dies are victims of one outage,
            not evidence of a failing server; the budget is for live servers.
    """

    attempts: int = 4
    base: float = 0.5
    cap: float = 8.0
    budget_ratio: float = 0.1
    budget_floor: int = 10
    budget_window: float = 10.0
    overload_attempts: int = 12
    outage_retries: int = 8

    def __post_init__(self) -> None:
        if not isinstance(self.attempts, int) or self.attempts < 1:
            raise ValueError(f"Retry.attempts must be an int >= 1, got {self.attempts!r}")
        if not isinstance(self.overload_attempts, int) or self.overload_attempts < 1:
            raise ValueError(
                f"Retry.overload_attempts must be an int >= 1, got {self.overload_attempts!r}"
            )
        if (
            isinstance(self.outage_retries, bool)
            or not isinstance(self.outage_retries, int)
            or self.outage_retries < 0
        ):
            raise ValueError(
                f"Retry.outage_retries must be an int >= 0, got {self.outage_retries!r}"
            )
        if not (isinstance(self.base, (int, float)) and 0 < self.base < math.inf):
            raise ValueError(f"Retry.base must be finite seconds > 0, got {self.base!r}")
        # A cap of +inf would let a server's Retry-After park a call for as long as it says.
        if not (isinstance(self.cap, (int, float)) and self.base <= self.cap < math.inf):
            raise ValueError(
                f"Retry.cap must be a finite number of seconds >= base ({self.base}), "
                f"got {self.cap!r}"
            )
        if not 0 <= self.budget_ratio <= 1:
            raise ValueError(f"Retry.budget_ratio must be in [0, 1], got {self.budget_ratio!r}")
        if self.budget_floor < 0:
            raise ValueError(f"Retry.budget_floor must be >= 0, got {self.budget_floor!r}")
        if not self.budget_window > 0:
            raise ValueError(f"Retry.budget_window must be > 0, got {self.budget_window!r}")

    @property
    def load_attempts(self) -> int:
        """Total tries for a call the server keeps refusing for load under an adaptive limit."""
        return max(self.attempts, self.overload_attempts)


def compute_backoff(
    attempt: int,
    *,
    base: float,
    cap: float,
    retry_after: float | None = None,
    rng: random.Random | None = None,
) -> float:
    """Seconds to wait after failed attempt ``attempt`` (1-based): exponential, full jitter.

    ``wait = uniform(0, min(cap, base * 2**(attempt - 1)))``; a server hint wins over the jitter:
    ``wait = min(cap, max(0, retry_after))`` when ``retry_after`` is given (a NaN hint is none).

        >>> compute_backoff(1, base=0.5, cap=8.0, rng=random.Random(0))  # in [0, 0.5]
        0.42...
    """
    if attempt < 1:
        raise ValueError(f"attempt is 1-based, got {attempt}")
    if retry_after is not None and not math.isnan(retry_after):
        # A server cannot park the client: a wait of hours, or +inf, is cut to ``cap``.
        return max(0.0, min(cap, retry_after))
    # 2**attempt overflows float for absurd attempts; clamp the exponent first.
    ceiling = min(cap, base * math.pow(2.0, min(attempt - 1, 60)))
    return (rng or random).uniform(0.0, ceiling)


def is_retryable(exc: BaseException) -> bool:
    """Whether a failed attempt may be tried again (budget permitting)."""
    if isinstance(exc, (TimeoutError, ConnectionError)):
        return True
    if isinstance(exc, Overloaded):
        # The client's own queue bound (status 0) is a decision, not a server hiccup.
        return exc.status != 0
    if isinstance(exc, RequestRefused):
        return exc.status in RETRYABLE_STATUSES and type(exc) in (RequestRefused, ServerFault)
    return False


def retry_after_of(exc: BaseException) -> float | None:
    """The server's wait hint carried by an exception, if any."""
    return exc.retry_after if isinstance(exc, RequestRefused) else None


@dataclass
class RetryBudget:
    """Keeps retries to a bounded share of recent requests, so a failing server is not hammered.

    Rule: within the last ``window`` seconds, a retry is allowed while
    ``retries < floor + int(ratio * requests)``. Each first attempt counts as a request; each
    allowed retry counts as a retry. With the defaults (floor 10, ratio 0.1) a lone caller still
    gets its retries, while 1000 failing calls a window produce at most ~110 retries, not 3000.
    """

    ratio: float = 0.1
    floor: int = 10
    window: float = 10.0
    clock: Callable[[], float] = time.monotonic
    _requests: deque[float] = field(default_factory=deque, repr=False)
    _retries: deque[float] = field(default_factory=deque, repr=False)

    def _trim(self, now: float) -> None:
        horizon = now - self.window
        for q in (self._requests, self._retries):
            while q and q[0] < horizon:
                q.popleft()

    def record_request(self) -> None:
        """Count a first attempt."""
        now = self.clock()
        self._requests.append(now)
        if len(self._requests) > 4096:  # keep the deque small on hot paths
            self._trim(now)

    def try_spend(self) -> bool:
        """Take one retry from the budget; ``False`` when the budget is spent."""
        now = self.clock()
        self._trim(now)
        if len(self._retries) < self.floor + int(self.ratio * len(self._requests)):
            self._retries.append(now)
            return True
        return False


def describe(exc: BaseException) -> str:
    """A short label of a failure for logs (never includes headers, so never a secret)."""
    if isinstance(exc, RequestRefused):
        return f"HTTP {exc.status}"
    return type(exc).__name__
