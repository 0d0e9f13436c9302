"""The server's wait hint: ``retry-after-ms`` (milliseconds) or ``Retry-After`` (seconds or a date).

Pure, and imports nothing from dsclient: :mod:`dsclient._exceptions` reads the hint into the
error it builds, and :mod:`dsclient.client._retry` re-exports the parser for the retry policy.

    >>> parse_retry_after(None, "2")
    2.0
    >>> parse_retry_after("1500", "2")  # the millisecond header wins
    1.5
"""

from __future__ import annotations

import email.utils
import math
import time

from ._http import httpx

__all__ = ["parse_retry_after", "parse_retry_after_header"]


def parse_retry_after(
    retry_after_ms: str | None, retry_after: str | None, *, now: float | None = None
) -> float | None:
    """Seconds to wait from ``retry-after-ms`` (milliseconds) or ``Retry-After`` (seconds or an
    HTTP date); ``None`` when neither is present or parseable.

    Parameters:
        retry_after_ms: the ``retry-after-ms`` header (OpenAI's), taken first when valid.
        retry_after: the ``Retry-After`` header: seconds, or an HTTP date (a past date is 0).
        now: the wall-clock time an HTTP date is measured from (default ``time.time()``).
    """
    if retry_after_ms:
        try:
            ms = float(retry_after_ms)
        except ValueError:
            ms = math.nan
        if math.isfinite(ms) and ms >= 0:
            return ms / 1000.0
    if not retry_after:
        return None
    value = retry_after.strip()
    try:
        seconds = float(value)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(value)
            seconds = when.timestamp() - (time.time() if now is None else now)
        # OverflowError: a year or zone offset of 20 digits ("Mon, 01 Jan 99999999999999999999
        # 00:00:00 GMT") overflowed a C long inside the date parser (found by tests/test_fuzz.py).
        except (TypeError, ValueError, IndexError, OverflowError, AttributeError):
            return None
        return max(0.0, seconds) if math.isfinite(seconds) else None
    return seconds if math.isfinite(seconds) and seconds >= 0 else None


def parse_retry_after_header(headers: httpx.Headers) -> float | None:
    """Seconds the server asked us to wait, from ``retry-after-ms`` or ``Retry-After``."""
    return parse_retry_after(headers.get("retry-after-ms"), headers.get("retry-after"))
