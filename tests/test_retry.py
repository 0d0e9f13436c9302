"""The retry policy as pure functions: backoff, Retry-After, what is retryable, the budget."""

from __future__ import annotations

import email.utils
import random

import pytest

from dsclient._exceptions import (
    ConnectionError,
    ContextOverflow,
    Overloaded,
    RequestRefused,
    TimeoutError,
)
from dsclient.client._retry import (
    Retry,
    RetryBudget,
    compute_backoff,
    is_retryable,
    parse_retry_after,
)


def test_backoff_is_full_jitter_under_an_exponential_cap():
    rng = random.Random(42)
    for attempt in range(1, 10):
        ceiling = min(8.0, 0.5 * 2 ** (attempt - 1))
        waits = [compute_backoff(attempt, base=0.5, cap=8.0, rng=rng) for _ in range(200)]
        assert all(0.0 <= w <= ceiling for w in waits)
        # full jitter spreads over the whole range, not just near the ceiling
        assert min(waits) < 0.2 * ceiling and max(waits) > 0.8 * ceiling


def test_backoff_is_reproducible_with_a_seed():
    a = [compute_backoff(n, base=0.5, cap=8.0, rng=random.Random(7)) for n in range(1, 6)]
    b = [compute_backoff(n, base=0.5, cap=8.0, rng=random.Random(7)) for n in range(1, 6)]
    assert a == b


def test_retry_after_wins_but_is_capped():
    assert compute_backoff(1, base=0.5, cap=8.0, retry_after=3.0) == 3.0
    assert compute_backoff(1, base=0.5, cap=8.0, retry_after=120.0) == 8.0
    assert compute_backoff(1, base=0.5, cap=8.0, retry_after=-1.0) == 0.0


def test_backoff_survives_huge_attempts():
    assert 0 <= compute_backoff(10_000, base=0.5, cap=8.0, rng=random.Random(1)) <= 8.0
    with pytest.raises(ValueError, match="1-based"):
        compute_backoff(0, base=0.5, cap=8.0)


@pytest.mark.parametrize(
    ("ms", "header", "expected"),
    [
        ("1500", None, 1.5),
        (None, "2", 2.0),
        (None, "0.25", 0.25),
        ("250", "9", 0.25),
        (None, None, None),
        (None, "soon", None),
        ("x", "4", 4.0),
        (None, "-3", None),
    ],
)
def test_parse_retry_after(ms, header, expected):
    assert parse_retry_after(ms, header) == expected


def test_parse_retry_after_http_date():
    now = 1_700_000_000.0
    date = email.utils.formatdate(now + 30, usegmt=True)
    assert parse_retry_after(None, date, now=now) == pytest.approx(30.0, abs=1.0)
    past = email.utils.formatdate(now - 30, usegmt=True)
    assert parse_retry_after(None, past, now=now) == 0.0


@pytest.mark.parametrize("status", [408, 409, 429, 500, 502, 503, 504])
def test_retryable_statuses(status):
    err = Overloaded(status) if status in (429, 503) else RequestRefused(status)
    assert is_retryable(err)


@pytest.mark.parametrize("status", [400, 401, 403, 404, 405, 413, 415, 422, 501])
def test_other_statuses_are_not_retried(status):
    assert not is_retryable(RequestRefused(status))


def test_transport_failures_are_retried_but_not_overflow_or_own_queue():
    assert is_retryable(TimeoutError("t"))
    assert is_retryable(ConnectionError("c"))
    assert not is_retryable(ContextOverflow("too long", status=400))
    assert not is_retryable(Overloaded(0, message="client queue full"))
    assert not is_retryable(ValueError("bug"))


def test_budget_floor_lets_a_lone_request_retry():
    now = [0.0]
    budget = RetryBudget(ratio=0.1, floor=3, window=10.0, clock=lambda: now[0])
    budget.record_request()
    assert [budget.try_spend() for _ in range(4)] == [True, True, True, False]


def test_budget_bounds_retries_to_a_share_of_requests():
    now = [0.0]
    budget = RetryBudget(ratio=0.1, floor=2, window=10.0, clock=lambda: now[0])
    for _ in range(1000):
        budget.record_request()
    allowed = sum(budget.try_spend() for _ in range(1000))
    assert allowed == 2 + 100
    now[0] = 11.0  # the window slides: old requests and retries no longer count
    assert budget.try_spend()


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"attempts": 0}, "attempts"),
        ({"base": 0}, "base"),
        ({"cap": 0.1}, "cap"),
        ({"budget_ratio": 2}, "budget_ratio"),
        ({"budget_floor": -1}, "budget_floor"),
        ({"budget_window": 0}, "budget_window"),
    ],
)
def test_retry_config_validation_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        Retry(**kwargs)


# --- hostile Retry-After values (found by tests/test_fuzz.py unless said otherwise) ---------------
@pytest.mark.parametrize(
    "header",
    [
        "Mon, 01 Jan 99999999999999999999 00:00:00 GMT",  # OverflowError: int too large for C long
        "Mon, 01 Jan 2024 00:00:00 +99999999999999999999999",  # OverflowError in the zone offset
        "Mon, 01 Jan 2147483648 00:00:00 GMT",  # OverflowError: signed integer > maximum
        "Mon, 01 Jan 10000 00:00:00 GMT",  # ValueError: year out of range (caught before)
    ],
)
def test_retry_after_dates_out_of_range_are_no_hint(header):
    assert parse_retry_after(None, header) is None


@pytest.mark.parametrize(
    ("hint", "expected"),
    [(float("inf"), 8.0), (1e300, 8.0), (-float("inf"), 0.0), (-5.0, 0.0), (8.0, 8.0)],
)
def test_a_hint_never_waits_past_the_cap_or_below_zero(hint, expected):
    assert compute_backoff(3, base=0.5, cap=8.0, retry_after=hint) == expected


def test_a_nan_hint_is_no_hint():
    # min(cap, nan) happened to give the cap; a NaN hint now falls back to the jittered backoff.
    wait = compute_backoff(1, base=0.5, cap=8.0, retry_after=float("nan"), rng=random.Random(0))
    assert 0.0 <= wait <= 0.5


@pytest.mark.parametrize("cap", [float("inf"), float("nan")])
def test_the_cap_must_be_finite(cap):
    # Retry(cap=inf) was accepted, and then a server's Retry-After could park a call for a year.
    with pytest.raises(ValueError, match="Retry.cap"):
        Retry(cap=cap)
