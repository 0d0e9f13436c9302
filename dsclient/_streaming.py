"""Server-sent events: turn an OpenAI-style SSE body into text deltas."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from ._exceptions import MalformedResponse

__all__ = ["delta_of", "iter_sse_data"]


async def iter_sse_data(lines: AsyncIterator[str]) -> AsyncIterator[dict[str, Any]]:
    """Yield the JSON object of each ``data:`` event until ``data: [DONE]``.

    Multi-line ``data:`` fields are joined with newlines, as the SSE spec says; comments
    (``:``) and other fields are ignored.
    """
    buffer: list[str] = []
    async for raw in lines:
        line = raw.rstrip("\r")
        if line == "":
            if buffer:
                payload = "\n".join(buffer)
                buffer.clear()
                if payload.strip() == "[DONE]":
                    return
                yield _decode(payload)
            continue
        if line.startswith(":"):
            continue
        field, _, value = line.partition(":")
        if field == "data":
            buffer.append(value[1:] if value.startswith(" ") else value)
    if buffer:  # a body that ends without the final blank line
        payload = "\n".join(buffer)
        if payload.strip() != "[DONE]":
            yield _decode(payload)


def _decode(payload: str) -> dict[str, Any]:
    try:
        event = json.loads(payload)
    except ValueError as exc:
        raise MalformedResponse("stream event is not JSON", body=payload) from exc
    if not isinstance(event, dict):
        raise MalformedResponse("stream event is not a JSON object", body=payload)
    if "error" in event and not event.get("choices"):
        # vLLM reports errors raised mid-stream as a data event with an "error" object.
        err = event["error"]
        msg = err.get("message") if isinstance(err, dict) else str(err)
        raise MalformedResponse(f"server reported an error mid-stream: {msg}", body=payload)
    return event


def delta_of(event: dict[str, Any]) -> tuple[str, str | None]:
    """The text delta and finish reason of one completions or chat-completions chunk."""
    choices = event.get("choices") or []
    if not choices:
        return "", None
    choice = choices[0]
    text = choice.get("text")
    if text is None:
        delta = choice.get("delta") or {}
        text = delta.get("content") or ""
    return str(text), choice.get("finish_reason")
