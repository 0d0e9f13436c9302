"""Requests from other SDKs, read and planned before they are governed: the per-call options
(headers ``x-dsclient-urgency`` / ``-group`` / ``-overflow`` or ``extra_body={"dsclient": ...}``),
the prompt and ``max_tokens`` found in the body, the client's planning (lane, fit), and the
refusals dsclient answers itself. Used by :mod:`dsclient.client._transport`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Final, Literal

from .._exceptions import ContextOverflow, parse_json
from .._http import httpx
from ..governor._admission import Admission
from ..governor._lanes import choose_lane, default_long_threshold

if TYPE_CHECKING:
    from ..governor._lanes import Lane
    from ._planner import Planner

__all__ = [
    "GROUP",
    "OVERFLOW",
    "URGENCY",
    "Governed",
    "Overflow",
    "parse_options",
    "plan_request",
    "refusal",
    "usage_of",
]

Overflow = Literal["refuse", "cut"]

URGENCY: Final = "x-dsclient-urgency"
GROUP: Final = "x-dsclient-group"
OVERFLOW: Final = "x-dsclient-overflow"
_DECODER: Final = json.JSONDecoder()


# -- options (pure) -----------------------------------------------------------------------------
def parse_options(
    headers: Mapping[str, str],
    field: Any,
    *,
    urgency: int,
    group: str | None,
    overflow: Overflow,
) -> tuple[int, str | None, Overflow]:
    """The call's ``(urgency, group, overflow)`` from its headers and its body's ``"dsclient"``
    field, over the transport's defaults; the body wins.

        parse_options({"x-dsclient-urgency": "3"}, None, urgency=0, group=None,
                      overflow="refuse")                     # (3, None, "refuse")
        parse_options({}, {"group": "batch", "overflow": "cut"}, urgency=0, group=None,
                      overflow="refuse")                     # (0, "batch", "cut")

    Parameters:
        headers: the request's headers (case-insensitive lookup, as ``httpx.Headers``).
        field: the body's ``"dsclient"`` value, or ``None``.
        urgency, group, overflow: the defaults (the transport's).

    Raises:
        ValueError: a value of the wrong kind (a programmer mistake: not sent, not retried).
    """
    values: dict[str, Any] = {}
    for name, key in ((URGENCY, "urgency"), (GROUP, "group"), (OVERFLOW, "overflow")):
        raw = headers.get(name)
        if raw is not None:
            values[key] = raw.strip()
    if field is not None:
        if not isinstance(field, Mapping):
            raise ValueError(f'the body\'s "dsclient" field must be an object, got {field!r:.80}')
        unknown = set(field) - {"urgency", "group", "overflow"}
        if unknown:
            raise ValueError(
                f'unknown keys in the body\'s "dsclient" field: {sorted(unknown)}; '
                "known: urgency, group, overflow"
            )
        values.update(field)
    if "urgency" in values:
        value = values["urgency"]
        try:
            if isinstance(value, (bool, float)):
                raise TypeError
            urgency = int(value)
        except (TypeError, ValueError):
            raise ValueError(f"urgency must be an integer, got {value!r:.80}") from None
    if "group" in values:
        value = values["group"]
        if value is not None and (not isinstance(value, str) or not value):
            raise ValueError(f"group must be a non-empty string or null, got {value!r:.80}")
        group = value
    if "overflow" in values:
        value = values["overflow"]
        if value not in ("refuse", "cut"):
            raise ValueError(f"overflow must be 'refuse' or 'cut', got {value!r:.80}")
        overflow = value
    return urgency, group, overflow


def _requested(kind: str, body: Mapping[str, Any]) -> tuple[str, int | None]:
    """The body's output-token field and its value (``None``: absent or not a positive int)."""
    names = ("max_completion_tokens", "max_tokens") if kind == "chat" else ("max_tokens",)
    for name in names:
        if name in body:
            value = body[name]
            ok = isinstance(value, int) and not isinstance(value, bool) and value > 0
            return name, value if ok else None
    return names[-1], None


def _prompt_of(kind: str, body: Mapping[str, Any]) -> str | list[Mapping[str, Any]] | None:
    """What :meth:`Planner.plan <dsclient.client._planner.Planner.plan>` can plan: a prompt
    string or a message list, else None (token ids, batches of prompts: sent as written, in the
    short lane)."""
    if kind == "chat":
        messages = body.get("messages")
        if (
            isinstance(messages, list)
            and messages
            and all(isinstance(m, Mapping) and "role" in m for m in messages)
        ):
            return messages
        return None
    prompt = body.get("prompt") if kind == "completion" else body.get("input")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if isinstance(prompt, str) and prompt:
        return prompt
    if kind == "embedding" and isinstance(prompt, list) and all(isinstance(p, str) for p in prompt):
        return "\n".join(prompt) or None
    return None


def refusal(status: int, message: str, *, why: str, param: str | None) -> httpx.Response:
    """The client's own refusal, in the OpenAI error shape the SDKs parse."""
    error_type = "RateLimitError" if status == 429 else "BadRequestError"
    return httpx.Response(
        status,
        headers={"x-dsclient-refused": why},
        json={"error": {"message": message, "type": error_type, "param": param, "code": status}},
    )


def overflow_message(*, prompt_tokens: int, requested: int, context: int, field: str) -> str:
    """The refusal's text: the counts, the room left, and how to get a cut instead."""
    room = max(0, context - prompt_tokens)
    return (
        f"dsclient: {field}={requested} cannot fit: the prompt has {prompt_tokens} tokens and "
        f"the model's context is {context} tokens, which leaves room for {room} output tokens "
        f"({prompt_tokens} + {requested} > {context}). Ask for at most {room}, or let dsclient "
        f'cut it (header "x-dsclient-overflow: cut", or extra_body={{"dsclient": '
        f'{{"overflow": "cut"}}}}).'
    )


def usage_of(body: bytes) -> tuple[int | None, int | None]:
    """``(prompt_tokens, completion_tokens)`` from the last ``"usage"`` object of an answer (a
    JSON body, or the end of an SSE stream), without parsing the rest of it.

        usage_of(b'{"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":2}}')  # (5, 2)
        usage_of(b'{"choices":[]}')                                                   # (None, None)

    A ``"usage"`` inside a string cannot match: its quotes are escaped there. Anything that is
    not an object of integers gives ``None`` for the count it lacks.
    """
    at = body.rfind(b'"usage"')
    if at < 0:
        return None, None
    colon = body.find(b":", at + 7)
    if colon < 0:
        return None, None
    try:
        value, _ = _DECODER.raw_decode(body[colon + 1 :].decode("utf-8", "replace").lstrip())
    except (ValueError, RecursionError):
        return None, None
    if not isinstance(value, dict):
        return None, None
    counts = [value.get("prompt_tokens"), value.get("completion_tokens")]
    ok = [n if isinstance(n, int) and not isinstance(n, bool) and n >= 0 else None for n in counts]
    return ok[0], ok[1]


# -- planning ---------------------------------------------------------------------------------
class Governed:
    """What one inference request will send: the body's bytes, whether it streams, and its
    :class:`~dsclient.governor._admission.Admission` (lane, urgency, group; the body's model and
    the prompt's text, for a pool's router)."""

    __slots__ = ("admission", "content", "stream")

    def __init__(self, content: bytes, admission: Admission, stream: bool) -> None:
        self.content = content
        self.admission = admission
        self.stream = stream


async def plan_request(
    planner: Planner,
    kind: str,
    content: bytes,
    headers: Mapping[str, str],
    defaults: tuple[int, str | None, Overflow],
) -> Governed | httpx.Response:
    """Plan one inference request with ``planner``, or answer it with the client's refusal."""
    try:
        body = parse_json(content)
    except ValueError:
        body = None
    if not isinstance(body, dict):  # not ours to judge: the server answers it
        urgency, group, _ = parse_options(
            headers, None, urgency=defaults[0], group=defaults[1], overflow=defaults[2]
        )
        return Governed(content, Admission("short", urgency, group), False)
    changed = "dsclient" in body
    field = body.pop("dsclient", None)
    urgency, group, overflow = parse_options(
        headers, field, urgency=defaults[0], group=defaults[1], overflow=defaults[2]
    )
    stream = body.get("stream") is True
    prompt = _prompt_of(kind, body)
    lane: Lane = "short"
    counted = sent = 0  # the prompt's tokens and max_tokens, for the tenant's charge
    if prompt is not None and kind == "embedding":
        info = await planner.ready()
        threshold = planner.long_threshold or default_long_threshold(info.max_model_len)
        upper = planner.tokens.upper_bound(prompt) or 0
        if upper > threshold:
            estimate = planner.tokens.estimate(prompt)
            lane = choose_lane(estimated_total_tokens=estimate, threshold=threshold)
    elif prompt is not None:
        field, requested = _requested(kind, body)
        plan_kind: Literal["completion", "chat"] = "chat" if kind == "chat" else "completion"
        try:
            plan = await planner.plan(plan_kind, prompt, requested, {})
        except ContextOverflow as exc:
            return _overflow_refusal(exc, requested, field)
        lane = plan.lane
        counted, sent = max(0, plan.kv_tokens - plan.max_tokens), plan.max_tokens
        if requested is not None and plan.max_tokens < requested:
            if overflow == "cut":
                body[field] = plan.max_tokens
                changed = True
            else:
                refusal = await _check_fit(planner, prompt, requested, field)
                if refusal is not None:
                    return refusal
    if changed:
        content = json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode()
    model = body.get("model")
    prefix = planner.backend.prefix_of(prompt) if prompt is not None else None
    named = model if isinstance(model, str) else None
    admission = Admission(
        lane, urgency, group, named, prefix, input_tokens=counted, max_tokens=sent
    )
    return Governed(content, admission, stream)


async def _check_fit(
    planner: Planner, prompt: str | list[Mapping[str, Any]], requested: int, field: str
) -> httpx.Response | None:
    """The planner would cut ``requested``: refuse when the server's own count says it cannot
    fit (the margin not counted), else let the request go as written."""
    info = await planner.ready()
    ctx = info.max_model_len
    counted = await planner.count_exact(prompt) if info.has_tokenize else None
    if counted is None or ctx is None or counted + requested <= ctx:
        return None
    message = overflow_message(prompt_tokens=counted, requested=requested, context=ctx, field=field)
    return refusal(400, message, why="context", param=field)


def _overflow_refusal(exc: ContextOverflow, requested: int | None, field: str) -> httpx.Response:
    """The prompt alone cannot fit (dsclient counted it, or ``/tokenize`` refused it)."""
    if exc.prompt_tokens is not None and exc.context_length is not None:
        message = overflow_message(
            prompt_tokens=exc.prompt_tokens,
            requested=requested if requested is not None else 1,
            context=exc.context_length,
            field=field,
        )
    else:
        message = f"dsclient: the prompt cannot fit the model's context: {exc}"
    return refusal(400, message, why="context", param="messages")


# -- the async transport ------------------------------------------------------------------------
