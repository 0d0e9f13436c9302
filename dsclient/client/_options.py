"""The client's arguments read and checked, each with an error that names it and what it got:
the servers ``base_url`` names (:func:`servers_of`), the keyword options (:func:`check_options`),
the API key kept out of every repr (:class:`Secret`). Pure: no I/O.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

from .._urls import root_url
from ..governor._routing import RoutingPolicy
from ..governor._shared import redact_url
from ._degrade import Degrade

__all__ = ["Secret", "check_options", "handle_tokenizer", "servers_of"]


def check_options(
    *,
    model: Any,
    timeout: Any,
    max_num_seqs: Any,
    max_model_len: Any,
    max_queue: Any,
    long_threshold: Any,
    limit: Any,
    max_limit: Any,
    default_max_tokens: Any,
    adaptive: Any,
    latency_target: Any,
    scrape_interval: Any,
    outage_wait: Any,
    max_response_bytes: Any,
    servers: int,
    shared: Any,
    shared_key: Any,
    degrade: Any,
    routing: Any,
) -> None:
    """Check :class:`~dsclient.AsyncClient`'s options (``servers``: how many URLs it got)."""
    if model is not None and not isinstance(model, str):
        raise TypeError(f"model must be a str, got {type(model).__name__}")
    if timeout is not None and not (isinstance(timeout, (int, float)) and timeout > 0):
        raise ValueError(f"timeout must be a positive number of seconds or None, got {timeout!r}")
    for name, value in (
        ("max_num_seqs", max_num_seqs),
        ("max_model_len", max_model_len),
        ("max_queue", max_queue),
        ("long_threshold", long_threshold),
        ("limit", limit),
        ("max_limit", max_limit),
    ):
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, int) or value < 1
        ):
            raise ValueError(f"{name} must be an int >= 1 or None, got {value!r}")
    if not isinstance(default_max_tokens, int) or default_max_tokens < 1:
        raise ValueError(f"default_max_tokens must be an int >= 1, got {default_max_tokens!r}")
    if not isinstance(adaptive, bool):
        raise TypeError(f"adaptive must be a bool, got {type(adaptive).__name__}")
    if latency_target is not None and not (
        isinstance(latency_target, (int, float)) and latency_target > 0
    ):
        raise ValueError(
            f"latency_target must be a positive number of seconds or None, got {latency_target!r}"
        )
    if not (isinstance(scrape_interval, (int, float)) and 0.05 <= scrape_interval <= 60):
        raise ValueError(
            f"scrape_interval must be between 0.05 and 60 seconds, got {scrape_interval!r}"
        )
    if outage_wait is not None and not (
        isinstance(outage_wait, (int, float))
        and not isinstance(outage_wait, bool)
        and outage_wait > 0
    ):
        raise ValueError(
            f"outage_wait must be a positive number of seconds or None, got {outage_wait!r}"
        )
    if (
        isinstance(max_response_bytes, bool)
        or not isinstance(max_response_bytes, int)
        or max_response_bytes < 1
    ):
        raise ValueError(
            f"max_response_bytes must be an int >= 1 (bytes), got {max_response_bytes!r}"
        )
    if shared is not None and servers > 1:
        raise ValueError(
            "shared= works with one server URL per client; with several servers, give each "
            "server its own client and shared_key, or drop shared="
        )
    if degrade is not None and not isinstance(degrade, Degrade):
        raise TypeError(f"degrade must be a Degrade or None, got {type(degrade).__name__}")
    if routing is not None and not isinstance(routing, RoutingPolicy):
        raise TypeError(f"routing must be a RoutingPolicy, got {type(routing).__name__}")
    if shared is not None and not (
        isinstance(shared, str) and shared.startswith(("redis://", "rediss://", "unix://"))
    ):
        raise ValueError(
            "shared must be a Redis URL (redis://, rediss:// or unix://) or None, got "
            + (redact_url(shared) if isinstance(shared, str) else type(shared).__name__)
        )
    if not (isinstance(shared_key, str) and shared_key and "{" not in shared_key):
        raise ValueError(f"shared_key must be a non-empty str without braces, got {shared_key!r}")


class Secret:
    """Holds the API key so that no repr, log line or traceback local shows it."""

    __slots__ = ("_value",)

    def __init__(self, value: str) -> None:
        self._value = value

    def reveal(self) -> str:
        return self._value

    def __repr__(self) -> str:
        return "'***'"

    __str__ = __repr__


def handle_tokenizer(handle: Any) -> str | None:
    """The launched model's own ``tokenizer.json``, when the handle's model is a local folder
    and the optional ``tokenizers`` package is there to read it (else ``None``: tiktoken,
    calibrated against the server's ``/tokenize``)."""
    model_path = getattr(handle, "model_path", None) if handle is not None else None
    if not isinstance(model_path, str):
        return None
    candidate = Path(model_path) / "tokenizer.json"
    if not candidate.is_file() or importlib.util.find_spec("tokenizers") is None:
        return None
    return str(candidate)


def servers_of(base_url: Any) -> list[tuple[str, Any]]:
    """``(root URL, launched handle or None)`` for each server ``base_url`` names: a URL, a
    launched ``Server``, a ``ServerGroup`` (its replicas), or a list or tuple of those."""
    if isinstance(base_url, str):
        return [(root_url(base_url), None)]
    members = getattr(base_url, "servers", None)
    if members is not None and not isinstance(base_url, (list, tuple)):
        base_url = list(members)  # a launched ServerGroup
    elif hasattr(base_url, "url"):
        return [(root_url(base_url.url), base_url)]  # a launched Server
    if not isinstance(base_url, (list, tuple)):
        raise TypeError(
            "base_url must be a URL, a list of URLs or a launched Server, got "
            f"{type(base_url).__name__}"
        )
    if not base_url:
        raise ValueError("base_url is an empty list; give at least one server URL")
    found: list[tuple[str, Any]] = []
    for item in base_url:
        if isinstance(item, str):
            found.append((root_url(item), None))
        elif hasattr(item, "url") and isinstance(item.url, str):
            found.append((root_url(item.url), item))
        else:
            raise TypeError(
                f"each server must be a URL or a launched Server, got {type(item).__name__}"
            )
    urls = [url for url, _ in found]
    if len(set(urls)) != len(urls):
        dupes = sorted({u for u in urls if urls.count(u) > 1})
        raise ValueError(f"a server is named twice: {', '.join(dupes)}")
    return found
