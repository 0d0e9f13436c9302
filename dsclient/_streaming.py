"""Reading a server's answer without trusting its size: a whole body under a byte cap, or a stream
of server-sent events whose every line and event is capped (the stream itself may be long).

    data = await read_json(response, limit=MAX_BODY_BYTES)          # one JSON answer
    async for event in sse_events(response, limit=MAX_BODY_BYTES):  # a stream
        text, finish = delta_of(event)

A server that answered a completion with a 512 MiB body grew the client by about 2 GiB before
anything stopped it (``response.content`` holds the bytes, ``json.loads`` the text and the
objects). Here nothing past the cap is read: the call ends in
:class:`~dsclient._exceptions.ResponseTooLarge`. httpx's ``aiter_lines`` buffers a whole line
however long, so streams are split into lines here, over ``aiter_bytes``.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from json import JSONDecoder
from typing import Any

from ._exceptions import (
    ERROR_BODY_BYTES,
    MalformedResponse,
    ResponseTooLarge,
    decode_text,
    parse_json,
    translate_request_error,
)
from ._http import httpx

#: One decoder for every answer (``json.loads`` makes one per call).
_DECODE = JSONDecoder().decode

__all__ = [
    "MAX_BODY_BYTES",
    "delta_of",
    "iter_lines",
    "iter_sse_data",
    "read_body",
    "read_json",
    "read_prefix",
    "sse_events",
]

#: The most bytes of one answer read (and of one line or event of a stream). A completion is
#: kilobytes: 32k tokens of text are about 128 KiB, and 4k tokens with 20 top logprobs each about
#: 5 MiB. 16 MiB leaves room for that, and bounds what a broken or hostile server can cost.
MAX_BODY_BYTES = 16 * 2**20

_EOL = re.compile(rb"\r\n|\r|\n")


# -- whole bodies ------------------------------------------------------------------------------
async def read_body(
    response: httpx.Response, *, limit: int = MAX_BODY_BYTES, what: str = "response body"
) -> bytes:
    """The body, decoded from its ``Content-Encoding``; never more than ``limit`` bytes of it.

    Raises:
        ResponseTooLarge: the body (or its declared ``Content-Length``) is over ``limit``.
        MalformedResponse: it does not decode (``gzip`` over plain bytes).
        TransportError: the connection failed while reading.
    """
    declared = response.headers.get("content-length", "")
    # isascii: "²".isdigit() is true too, and int("²") raises ValueError.
    if declared.isascii() and declared.isdigit() and (len(declared) > 15 or int(declared) > limit):
        raise ResponseTooLarge(f"{what} (Content-Length: {declared[:20]})", limit=limit)
    chunks: list[bytes] = []
    size = 0
    try:
        async for chunk in _body_chunks(response):
            size += len(chunk)
            if size > limit:
                head = decode_text((chunks[0] if chunks else chunk)[:2000])
                raise ResponseTooLarge(what, limit=limit, body=head)
            chunks.append(chunk)
    except httpx.RequestError as exc:
        raise translate_request_error(exc) from exc
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)  # one chunk: no copy


def _body_chunks(response: httpx.Response) -> AsyncIterator[bytes]:
    """The body's bytes: the transport's stream itself where there is nothing to decode (no
    ``Content-Encoding``, a response not yet read), else httpx's decoding ``aiter_bytes``.
    httpx's own path (raw, decode, re-chunk) costs about a tenth of a ``generate()`` call."""
    stream = response.stream
    if (
        "content-encoding" not in response.headers
        and not hasattr(response, "_content")
        and isinstance(stream, httpx.AsyncByteStream)
    ):
        return stream.__aiter__()
    return response.aiter_bytes()


async def read_prefix(response: httpx.Response, limit: int = ERROR_BODY_BYTES) -> bytes:
    """At most ``limit`` bytes from the start of the body, for an error message. Never raises:
    a read that fails gives what came before it."""
    buffer = bytearray()
    try:
        async for chunk in response.aiter_bytes():
            buffer += chunk[: limit - len(buffer)]
            if len(buffer) >= limit:
                break
    except httpx.HTTPError:
        pass
    return bytes(buffer)


async def read_json(response: httpx.Response, *, limit: int = MAX_BODY_BYTES) -> dict[str, Any]:
    """The body as a JSON object, read under ``limit`` bytes.

    Raises:
        MalformedResponse: not JSON, or JSON but not an object (``ResponseTooLarge`` over the cap).
        TransportError: the connection failed while reading.
    """
    content = await read_body(response, limit=limit)
    return json_object(content, response.status_code)


def json_object(content: bytes, status: int) -> dict[str, Any]:
    """A body read whole (the answer's HTTP ``status``), as a JSON object.

    Raises:
        MalformedResponse: not JSON, or JSON but not an object.
    """
    try:
        # JSON is UTF-8 (RFC 8259): decoded as such, without json.loads' sniffing for UTF-16.
        data = _DECODE(content.decode("utf-8"))
    except (ValueError, RecursionError) as exc:  # RecursionError: see parse_json
        raise MalformedResponse(
            f"server answered HTTP {status} with a body that is not JSON",
            body=decode_text(content[:4000]),
        ) from exc
    if not isinstance(data, dict):
        raise MalformedResponse(
            "server answered with JSON that is not an object", body=decode_text(content[:4000])
        )
    return data


# -- streams -----------------------------------------------------------------------------------
async def iter_lines(
    chunks: AsyncIterator[bytes], *, limit: int = MAX_BODY_BYTES
) -> AsyncIterator[str]:
    """Split bytes into lines at ``\\r\\n``, ``\\n`` or ``\\r`` (as SSE does), wherever the chunks
    are cut; a line is never buffered past ``limit`` bytes.

    UTF-8 is decoded per line (a line ending never falls inside a multi-byte character), with
    invalid bytes replaced.

    Raises:
        ResponseTooLarge: a line is longer than ``limit`` bytes.
    """
    pending = bytearray()
    skip_lf = False  # the last chunk ended in "\r": a "\n" that starts the next one belongs to it
    async for chunk in chunks:
        if not chunk:
            continue
        pos = 1 if skip_lf and chunk[0] == 0x0A else 0
        for match in _EOL.finditer(chunk, pos):
            end = match.start()
            if len(pending) + end - pos > limit:
                raise _line_too_long(pending, chunk[pos:end], limit)
            if pending:
                pending += chunk[pos:end]
                line = bytes(pending)
                pending.clear()
            else:
                line = chunk[pos:end]
            yield line.decode("utf-8", "replace")
            pos = match.end()
        skip_lf = chunk[-1] == 0x0D
        if len(pending) + len(chunk) - pos > limit:
            raise _line_too_long(pending, chunk[pos:], limit)
        pending += chunk[pos:]
    if pending:
        yield pending.decode("utf-8", "replace")


def _line_too_long(pending: bytearray, more: bytes, limit: int) -> ResponseTooLarge:
    head = bytes(pending[:2000]) if pending else more[:2000]
    return ResponseTooLarge("one line of the stream", limit=limit, body=decode_text(head))


async def iter_sse_data(
    lines: AsyncIterator[str], *, limit: int = MAX_BODY_BYTES
) -> AsyncIterator[dict[str, Any]]:
    """Yield the JSON object of each ``data:`` event until ``data: [DONE]``.

    Multi-line ``data:`` fields are joined with newlines, as the SSE spec says; comments
    (``:``) and other fields are ignored. One event holds at most ``limit`` characters of data.

    Raises:
        MalformedResponse: an event is not a JSON object, or reports an error.
        ResponseTooLarge: one event's data is over ``limit``.
    """
    buffer: list[str] = []
    size = 0
    first = True
    async for raw in lines:
        line = raw.rstrip("\r")
        if first:
            line, first = line.removeprefix("\ufeff"), False  # the spec allows a leading BOM
        if line == "":
            if buffer:
                payload = "\n".join(buffer)
                buffer.clear()
                size = 0
                if payload.strip() == "[DONE]":
                    return
                yield _decode(payload)
            continue
        if line.startswith(":"):
            continue
        field, _, value = line.partition(":")
        if field == "data":
            value = value[1:] if value.startswith(" ") else value
            size += len(value) + 1
            if size > limit:
                raise ResponseTooLarge("one event of the stream", limit=limit, body=buffer[0])
            buffer.append(value)
    if buffer:  # a body that ends without the final blank line
        payload = "\n".join(buffer)
        if payload.strip() != "[DONE]":
            yield _decode(payload)


async def _bytes_of(response: httpx.Response) -> AsyncIterator[bytes]:
    try:
        async for chunk in response.aiter_bytes():
            yield chunk
    except httpx.RequestError as exc:
        raise translate_request_error(exc) from exc


def sse_events(
    response: httpx.Response, *, limit: int = MAX_BODY_BYTES
) -> AsyncIterator[dict[str, Any]]:
    """The events of a streaming response, no line or event over ``limit`` bytes.

    Raises what :func:`iter_sse_data` and :func:`iter_lines` raise, and
    :class:`~dsclient._exceptions.TransportError` (or ``MalformedResponse`` for a body that does
    not decode) when reading fails: never an httpx exception.
    """
    return iter_sse_data(iter_lines(_bytes_of(response), limit=limit), limit=limit)


def _decode(payload: str) -> dict[str, Any]:
    try:
        event = parse_json(payload)
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
    """The text delta and finish reason of one completions or chat-completions chunk.

    A chunk without choices (a usage-only last chunk) gives ``("", None)``; a chat chunk without
    content (the role, a tool call) gives ``""``.

    Raises:
        MalformedResponse: the chunk's choices, text or finish reason are of the wrong type (a
            ``choices`` of ``5`` raised ``TypeError`` here before; found by ``tests/test_fuzz.py``).
    """
    choices = event.get("choices")
    if not choices:
        return "", None
    choice = choices[0] if isinstance(choices, list) else None
    if not isinstance(choice, dict):
        raise MalformedResponse("stream event's choices are not a list of objects")
    text = choice.get("text")
    if text is None:
        delta = choice.get("delta")
        if delta is not None and not isinstance(delta, dict):
            raise MalformedResponse("stream event's delta is not an object")
        text = (delta or {}).get("content")
        text = "" if text is None else text
    finish = choice.get("finish_reason")
    if not isinstance(text, str) or not (finish is None or isinstance(finish, str)):
        raise MalformedResponse(
            f"stream event's text or finish_reason is not a string: {text!r:.80}, {finish!r:.80}"
        )
    return text, finish
