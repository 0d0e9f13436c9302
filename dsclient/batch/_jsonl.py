"""The JSONL store of a batch: one line per finished item, safe against ``kill -9``.

    store = JsonlStore("results.jsonl")
    done = store.open(resume=True)        # {item id: offset of its success line}
    store.append(index, item_id, result)  # written and flushed before map() yields it
    store.close()

Durability: every line is one ``write`` followed by a flush, so a killed process loses at most
the line it was writing, which :meth:`JsonlStore.open` cuts off (a torn last line has no
newline). ``os.fsync`` runs at most once a second and on close: measured here at about 330 us
per call against 2.5 us per flushed line, so syncing every line would cost more than the rest of
the client's per-request work; a power loss may lose the last second of lines, which a resume
then recomputes.

Item ids: an item's own ``"id"`` or ``"custom_id"`` when it has one (they must be unique, as in
OpenAI's batch files), else ``"<index>-<sha256 of the item's canonical JSON, 12 hex>"``. The
derived id is stable across re-reads of the same input; the index in it tells identical items
apart, and the hash makes an edited item (or a shifted input) run again instead of being
matched to another item's answer.

The line shape is a :class:`RecordFormat`: :data:`MAP_RECORDS` (map()'s own, below) here, and
the OpenAI batch-output shape in the command line.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import IO, Any, Protocol

from .._exceptions import RequestRefused, parse_json
from .._models import ChatResult, CompletionResult, Failure, Result, Usage

__all__ = [
    "MAP_RECORDS",
    "JsonlStore",
    "MapRecords",
    "RecordFormat",
    "derive_id",
    "explicit_id",
    "item_id",
    "scan_records",
    "valid_length",
]

logger = logging.getLogger("dsclient")

FSYNC_INTERVAL_S = 1.0
_TAIL_CHUNK = 64 * 1024


# -- ids ---------------------------------------------------------------------------------------
def explicit_id(item: Any) -> str | None:
    """The id an item carries itself (``"id"``, else ``"custom_id"``), as a str; else ``None``."""
    if isinstance(item, Mapping):
        for key in ("id", "custom_id"):
            value = item.get(key)
            if isinstance(value, (str, int)) and not isinstance(value, bool):
                return str(value)
    return None


def derive_id(item: Any, index: int) -> str:
    """``"<index>-<12 hex of sha256(canonical JSON)>"``: stable for the same input, in order.

    >>> derive_id("Hello", 0)
    '0-c25bf945aaff'
    """
    canonical = json.dumps(
        item, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str
    )
    digest = hashlib.sha256(canonical.encode("utf-8", "surrogatepass")).hexdigest()
    return f"{index}-{digest[:12]}"


def item_id(item: Any, index: int) -> str:
    """The item's own id when it has one, else :func:`derive_id`."""
    own = explicit_id(item)
    return own if own is not None else derive_id(item, index)


# -- line shapes -------------------------------------------------------------------------------
class RecordFormat(Protocol):
    """How an outcome becomes a JSON line, and how a line is read back."""

    def encode(self, index: int, item_id: str, outcome: Result | Failure) -> dict[str, Any]:
        """The JSON object written for ``outcome``."""
        ...

    def identify(self, record: Mapping[str, Any]) -> tuple[str, bool] | None:
        """``(item id, succeeded)`` of a line read back, or ``None`` if it is not a record."""
        ...

    def rebuild(self, record: Mapping[str, Any], index: int) -> Result:
        """The result a success line stands for (``index`` is the item's index in this run)."""
        ...


def error_fields(error: BaseException) -> dict[str, Any]:
    """``{"type", "message"}`` of an error, with ``"status"`` when the server refused it."""
    fields: dict[str, Any] = {"type": type(error).__name__, "message": str(error)}
    if isinstance(error, RequestRefused):
        fields["status"] = error.status
    return fields


class MapRecords:
    """map()'s own line shape, one flat object per item::

        {"index": 0, "id": "0-185f8db32271", "ok": true, "kind": "completion", "text": "...",
         "finish_reason": "length", "usage": {"prompt_tokens": 3, "completion_tokens": 8},
         "latency_s": 0.21, "queued_s": 0.0, "attempts": 1, "max_tokens": 8, "lane": "short",
         "response_id": "cmpl-...", "model": "tiny", "created": 1733130000}
        {"index": 1, "id": "1-...", "ok": false,
         "error": {"type": "Overloaded", "message": "...", "status": 503}, "attempts": 3}

    A result rebuilt from a line has the stored fields; its ``raw`` is rebuilt from them too
    (id, model, text, finish_reason, usage: no logprobs or other extras).
    """

    def encode(self, index: int, item_id: str, outcome: Result | Failure) -> dict[str, Any]:
        if isinstance(outcome, Failure):
            return {
                "index": index,
                "id": item_id,
                "ok": False,
                "error": error_fields(outcome.error),
                "attempts": outcome.attempts,
            }
        raw = outcome._raw_data
        return {
            "index": index,
            "id": item_id,
            "ok": True,
            "kind": "chat" if isinstance(outcome, ChatResult) else "completion",
            "text": outcome.text,
            "finish_reason": outcome.finish_reason,
            "usage": {
                "prompt_tokens": outcome.usage.prompt_tokens,
                "completion_tokens": outcome.usage.completion_tokens,
            },
            "latency_s": round(outcome.latency_s, 6),
            "queued_s": round(outcome.queued_s, 6),
            "attempts": outcome.attempts,
            "max_tokens": outcome.max_tokens,
            "lane": outcome.lane,
            "server": outcome.server,
            "degraded": outcome.degraded,
            "response_id": raw.get("id"),
            "model": raw.get("model"),
            "created": raw.get("created"),
        }

    def identify(self, record: Mapping[str, Any]) -> tuple[str, bool] | None:
        rid, ok = record.get("id"), record.get("ok")
        if not isinstance(rid, str) or not isinstance(ok, bool):
            return None
        return rid, ok and isinstance(record.get("text"), str)

    def rebuild(self, record: Mapping[str, Any], index: int) -> Result:
        # A line that identify() took as a success has its text; any other field of the wrong
        # type (a hand-edited or foreign file) falls back to its default rather than failing the
        # resume: ``"usage": 5`` raised AttributeError, ``"latency_s": "x"`` a pydantic
        # ValidationError (found by tests/test_fuzz.py).
        kind = "chat" if record.get("kind") == "chat" else "completion"
        prompt_tokens, completion_tokens = _usage_of(record)
        max_tokens = _count(record.get("max_tokens"))
        cls = ChatResult if kind == "chat" else CompletionResult
        return cls._rebuilt(
            raw_from_fields(kind, record),
            text=record["text"],
            finish_reason=_text(record.get("finish_reason")),
            usage=Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens),
            latency_s=_seconds(record.get("latency_s")),
            queued_s=_seconds(record.get("queued_s")),
            attempts=_count(record.get("attempts")) or 1,
            max_tokens=max_tokens or None,
            lane=_text(record.get("lane")) or "short",
            index=index,
            server=_text(record.get("server")),
            degraded=_text(record.get("degraded")),
        )


def _count(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0


#: The most seconds a results file's duration field is believed (a year): JSON integers have no
#: bound, and ``math.isfinite(10**400)`` raises ``OverflowError`` (found by tests/test_fuzz.py).
_MOST_SECONDS = 365 * 86400.0


def _seconds(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return 0.0
    if isinstance(value, int) and not 0 <= value <= _MOST_SECONDS:
        return 0.0
    return float(value) if math.isfinite(value) and value >= 0 else 0.0


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def _usage_of(record: Mapping[str, Any]) -> tuple[int, int]:
    usage = record.get("usage")
    if not isinstance(usage, Mapping):
        return 0, 0
    return _count(usage.get("prompt_tokens")), _count(usage.get("completion_tokens"))


def raw_from_fields(kind: str, record: Mapping[str, Any]) -> dict[str, Any]:
    """An OpenAI-shaped response body rebuilt from a stored line's fields."""
    prompt_tokens, completion_tokens = _usage_of(record)
    choice: dict[str, Any] = {"index": 0, "finish_reason": _text(record.get("finish_reason"))}
    if kind == "chat":
        choice["message"] = {"role": "assistant", "content": record.get("text")}
    else:
        choice["text"] = record.get("text")
    return {
        "id": _text(record.get("response_id")) or f"resumed-{record.get('id')}",
        "object": "chat.completion" if kind == "chat" else "text_completion",
        "created": _count(record.get("created")),
        "model": _text(record.get("model")) or "",
        "choices": [choice],
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        },
    }


MAP_RECORDS: RecordFormat = MapRecords()


# -- reading back ------------------------------------------------------------------------------
def valid_length(tail: bytes, size: int) -> int:
    """How many bytes of a file of ``size`` bytes, ending with ``tail``, are whole lines.

    Everything after the last newline is a torn line (a killed writer) and is cut.

    >>> valid_length(b'{"a": 1}\\n{"b', 12)
    9
    """
    cut = tail.rfind(b"\n")
    if cut < 0:
        return size - len(tail)  # no newline in the tail: the caller reads a larger tail
    return size - len(tail) + cut + 1


def scan_records(
    lines: Iterable[tuple[int, bytes]], fmt: RecordFormat
) -> tuple[dict[str, int], int, int]:
    """``({id: offset of its last success line}, failure lines, unreadable lines)``.

    ``lines`` are ``(offset, raw line)``. A success anywhere wins over failures of the same id.
    """
    done: dict[str, int] = {}
    failed = bad = 0
    for offset, raw in lines:
        if not raw.strip():
            continue
        try:
            record = parse_json(raw)
            found = fmt.identify(record) if isinstance(record, dict) else None
        except ValueError:  # not JSON, not UTF-8, or nested past the decoder's recursion limit
            found = None
        if found is None:
            bad += 1
            continue
        rid, ok = found
        if ok:
            done[rid] = offset
        else:
            failed += 1
    return done, failed, bad


def _numbered_lines(f: IO[bytes]) -> Iterator[tuple[int, bytes]]:
    offset = 0
    for raw in f:
        yield offset, raw
        offset += len(raw)


class JsonlStore:
    """An append-only JSONL file of batch outcomes; see the module docstring.

    Parameters:
        path: the file.
        fmt: the line shape (default :data:`MAP_RECORDS`).
        fsync_interval: seconds between ``os.fsync`` calls (``None``: only on close).
        clock: injectable for tests.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        fmt: RecordFormat = MAP_RECORDS,
        fsync_interval: float | None = FSYNC_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.path = Path(path)
        self.fmt = fmt
        self._fsync_interval = fsync_interval
        self._clock = clock
        self._out: IO[bytes] | None = None
        self._reader: IO[bytes] | None = None
        self._last_sync = 0.0
        self.repaired_bytes = 0
        self.previous_failures = 0
        self.unreadable_lines = 0

    def __repr__(self) -> str:
        return f"JsonlStore({str(self.path)!r})"

    def open(self, *, resume: bool) -> dict[str, int]:
        """Open for appending; with ``resume``, repair a torn tail and return what succeeded.

        Without ``resume`` the file must be new or empty, so two runs never mix in one file.
        """
        if not resume and self.path.exists() and self.path.stat().st_size > 0:
            raise FileExistsError(
                f"{self.path} already holds results; pass resume=True to continue that batch "
                "(skip what succeeded, retry what failed), or choose another file"
            )
        done: dict[str, int] = {}
        if self.path.exists():
            self.repaired_bytes = self._repair()
            with self.path.open("rb") as f:
                done, self.previous_failures, self.unreadable_lines = scan_records(
                    _numbered_lines(f), self.fmt
                )
            if self.unreadable_lines:
                logger.warning(
                    "dsclient: %s has %d unreadable lines; they are ignored",
                    self.path,
                    self.unreadable_lines,
                )
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._out = self.path.open("ab")
        self._last_sync = self._clock()
        return done

    def _repair(self) -> int:
        """Cut a torn last line; returns the bytes cut."""
        size = self.path.stat().st_size
        if size == 0:
            return 0
        with self.path.open("r+b") as f:
            chunk = _TAIL_CHUNK
            while True:
                start = max(0, size - chunk)
                f.seek(start)
                tail = f.read(size - start)
                keep = valid_length(tail, size)
                if tail.rfind(b"\n") >= 0 or start == 0:
                    break
                chunk *= 4
            if keep < size:
                f.truncate(keep)
                f.flush()
                os.fsync(f.fileno())
                logger.warning(
                    "dsclient: cut a torn last line (%d bytes) from %s", size - keep, self.path
                )
        return size - keep

    def append(self, index: int, item_id: str, outcome: Result | Failure) -> None:
        """Write one line and flush it (``fsync`` at most every ``fsync_interval`` seconds)."""
        out = self._out
        if out is None:
            raise RuntimeError("JsonlStore.append() before open()")
        record = self.fmt.encode(index, item_id, outcome)
        out.write(json.dumps(record, ensure_ascii=False).encode("utf-8", "surrogatepass") + b"\n")
        out.flush()
        if self._fsync_interval is not None:
            now = self._clock()
            if now - self._last_sync >= self._fsync_interval:
                os.fsync(out.fileno())
                self._last_sync = now

    def load(self, offset: int, index: int) -> Result:
        """The result stored in the success line at ``offset``."""
        if self._reader is None:
            self._reader = self.path.open("rb")
        self._reader.seek(offset)
        record = json.loads(self._reader.readline())
        return self.fmt.rebuild(record, index)

    def close(self) -> None:
        """Flush, fsync and close."""
        if self._reader is not None:
            self._reader.close()
            self._reader = None
        if self._out is not None:
            out, self._out = self._out, None
            try:
                out.flush()
                os.fsync(out.fileno())
            finally:
                out.close()
