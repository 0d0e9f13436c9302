"""A call before and after the wire: what it will send (:class:`Plan`), its deadline, and the
server's answer made into a result (:func:`build_result`, the one place that does it).

No I/O here: the client plans (``dsclient.client._client``), the request path sends
(``dsclient.client._pipeline``), and both use these. The checks of a call's arguments and
:data:`USE_DEFAULT` are the core's (``dsclient._arguments``, shared with the batch runner) and
are importable from here too.
"""

from __future__ import annotations

import asyncio
import builtins
import collections
import contextlib
import json
import sys
from typing import Any, Literal

import anyio
import sniffio

from .._arguments import (
    USE_DEFAULT,
    Messages,
    Prompt,
    UseDefault,
    check_max_tokens,
    check_messages,
    check_prompt,
)
from .._exceptions import MalformedResponse
from .._models import ChatResult, CompletionResult, Result, Usage
from ..governor._lanes import Lane

__all__ = [
    "USE_DEFAULT",
    "Deadlines",
    "Messages",
    "Plan",
    "Prompt",
    "UseDefault",
    "build_result",
    "check_max_tokens",
    "check_messages",
    "check_prompt",
    "deadline",
]


def deadline(seconds: float | None) -> contextlib.AbstractAsyncContextManager[Any]:
    """An async scope that raises the builtin ``TimeoutError`` after ``seconds`` (``None``:
    never).

    On asyncio (3.11+) this is ``asyncio.timeout``, which costs a few microseconds; anyio's
    ``fail_after`` (used on trio and older Pythons) costs about 25 us a call here, which was
    the largest share of the client's own CPU per request.
    """
    if seconds is None:
        return contextlib.nullcontext()
    if _HAS_ASYNCIO_TIMEOUT and sniffio.current_async_library() == "asyncio":
        return asyncio.timeout(seconds)  # type: ignore[attr-defined,no-any-return]
    return _AnyioDeadline(seconds)


class _AnyioDeadline:
    """``anyio.fail_after`` as an async context manager, for :func:`deadline`."""

    __slots__ = ("_scope",)

    def __init__(self, seconds: float) -> None:
        self._scope = anyio.fail_after(seconds)

    async def __aenter__(self) -> None:
        self._scope.__enter__()

    async def __aexit__(self, *exc_info: Any) -> bool | None:
        return self._scope.__exit__(*exc_info)


_HAS_ASYNCIO_TIMEOUT = sys.version_info >= (3, 11)

_ENTERED, _EXPIRING, _LEFT = range(3)
#: The most distinct numbers of seconds :class:`Deadlines` keeps a line for; calls given
#: others get ``asyncio.timeout`` (a client's calls share a timeout or two).
_MAX_LINES = 8


class Deadlines:
    """Timeouts for the calls of one client, on one timer for all of them.

        deadlines = Deadlines()
        async with deadlines.after(30.0):  # the builtin TimeoutError after 30 s (None: never)
            ...

    ``asyncio.timeout`` puts a timer per call on the loop's heap, ordered by comparisons in
    Python: with 20,000 calls under way at once (most of them waiting for a slot, each under
    its timeout) a call's timer cost about 50 us of CPU, more than the rest of the call. Calls
    given the same number of seconds expire in the order they started, so each such number
    keeps a first-in first-out line, and the loop holds one timer, for the earliest of them.
    What a block sees is ``asyncio.timeout``'s: at the deadline its task is cancelled, and that
    cancellation leaves the block as ``TimeoutError``; a cancellation from elsewhere stays one.
    Under trio and on Python 3.10 this is :func:`deadline`.
    """

    __slots__ = ("_lines", "_loop", "_timer", "_timer_at")

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lines: dict[float, _Line] = {}
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = float("inf")

    def after(self, seconds: float | None) -> contextlib.AbstractAsyncContextManager[Any]:
        """A scope whose block may last ``seconds`` (``None``: no bound)."""
        if seconds is None:
            return contextlib.nullcontext()
        if not _HAS_ASYNCIO_TIMEOUT or sniffio.thread_local.name not in (None, "asyncio"):
            return deadline(seconds)
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # trio without sniffio's marker: let deadline() tell
            return deadline(seconds)
        if loop is not self._loop:  # a client used on a new loop: the old one's lines go
            self._loop, self._lines, self._timer, self._timer_at = loop, {}, None, float("inf")
        line = self._lines.get(seconds)
        if line is None:
            if len(self._lines) >= _MAX_LINES:  # make room: drop the lines no call is in
                for idle in [k for k, v in self._lines.items() if not v.live and not v.queue]:
                    del self._lines[idle]
            if len(self._lines) >= _MAX_LINES:
                return asyncio.timeout(seconds)  # type: ignore[attr-defined,no-any-return]
            line = self._lines[seconds] = _Line()
        return _Scope(self, line, loop.time() + seconds)

    def _leave(self, line: _Line) -> None:
        """Tidy ``line`` after a scope left it (:meth:`_Scope.__aexit__` calls this only when
        the scope was its head, or the line has grown past its live calls)."""
        queue = line.queue
        while queue and queue[0].state == _LEFT:
            queue.popleft()
        # A call that runs long holds the head: drop the calls behind it that have left,
        # once they outnumber the live ones, so that the line stays as long as the calls under
        # way, not as those of the last ``seconds``.
        if len(queue) > 2 * line.live + 64:
            line.queue = collections.deque(s for s in queue if s.state != _LEFT)

    def _arm(self, when: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        assert self._loop is not None
        self._timer = self._loop.call_at(when, self._fire)
        self._timer_at = when

    def _fire(self) -> None:
        """The timer: cancel every call past its deadline; arm for the next one."""
        self._timer, self._timer_at = None, float("inf")
        assert self._loop is not None
        now = self._loop.time()
        earliest = float("inf")
        for line in self._lines.values():
            queue = line.queue
            while queue and (queue[0].state == _LEFT or queue[0].when <= now):
                scope = queue.popleft()
                if scope.state == _ENTERED:
                    scope.state = _EXPIRING
                    scope.task.cancel()
            if queue and queue[0].when < earliest:
                earliest = queue[0].when
        if earliest != float("inf"):
            self._arm(earliest)


class _Line:
    """The calls under way given one number of seconds, in the order they started."""

    __slots__ = ("live", "queue")

    def __init__(self) -> None:
        self.queue: collections.deque[_Scope] = collections.deque()
        self.live = 0


class _Scope:
    """One block under :meth:`Deadlines.after` (``asyncio.Timeout``'s states and exit)."""

    __slots__ = ("cancelling", "line", "owner", "state", "task", "when")

    def __init__(self, owner: Deadlines, line: _Line, when: float) -> None:
        self.owner = owner
        self.line = line
        self.when = when
        self.state = _ENTERED
        self.cancelling = 0
        self.task: asyncio.Task[Any]

    async def __aenter__(self) -> None:
        task = asyncio.current_task()
        if task is None:  # pragma: no cover - a coroutine awaited outside any task
            raise RuntimeError("a deadline must be used inside a task")
        self.task = task
        self.cancelling = task.cancelling()  # type: ignore[attr-defined]
        # Joining the line, inline: a call less on every call.
        owner, line = self.owner, self.line
        line.queue.append(self)
        line.live += 1
        if self.when < owner._timer_at:
            owner._arm(self.when)

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: Any
    ) -> None:
        expired = self.state == _EXPIRING
        self.state = _LEFT
        line = self.line
        line.live -= 1
        queue = line.queue
        if (queue and queue[0].state == _LEFT) or len(queue) > 2 * line.live + 64:
            self.owner._leave(line)  # only when there is something to tidy
        if (
            expired
            and self.task.uncancel() <= self.cancelling  # type: ignore[attr-defined]
            and exc_type is asyncio.CancelledError
        ):
            raise builtins.TimeoutError from exc


class Plan:
    """What one call will send: endpoint, body, lane and the governor's options.

    ``prompt_tokens`` is a bound the context check can trust (for a short prompt, its bytes);
    ``kv_tokens`` is the governor's estimate of what the call holds in the server's KV cache
    (prompt + ``max_tokens``; default ``prompt_tokens + max_tokens``).
    """

    __slots__ = ("body", "kind", "kv_tokens", "lane", "max_tokens", "path", "prompt_tokens")

    def __init__(
        self,
        kind: Literal["completion", "chat"],
        body: dict[str, Any],
        lane: Lane,
        max_tokens: int,
        prompt_tokens: int,
        kv_tokens: int | None = None,
    ) -> None:
        self.kind = kind
        self.path = "/v1/completions" if kind == "completion" else "/v1/chat/completions"
        self.body = body
        self.lane = lane
        self.max_tokens = max_tokens
        self.prompt_tokens = prompt_tokens
        self.kv_tokens = prompt_tokens + max_tokens if kv_tokens is None else kv_tokens


def build_result(
    kind: Literal["completion", "chat"],
    data: dict[str, Any],
    latency: float,
    queued: float,
    attempts: int,
    plan: Plan,
    index: int | None,
    server: str | None = None,
    degraded: str | None = None,
) -> Result:
    # The fields are checked here by hand and the models built with ``_trusted`` (what
    # ``model_construct`` does, minus its per-field loop): pydantic's validation of the two
    # models was a tenth of the client's own CPU per request, ``model_construct`` a twentieth.
    try:
        choice = data["choices"][0]
        text = choice["text"] if kind == "completion" else choice["message"].get("content") or ""
        finish = choice.get("finish_reason")
        usage_data = data.get("usage") or {}
        prompt_tokens = usage_data.get("prompt_tokens") or 0
        completion_tokens = usage_data.get("completion_tokens") or 0
        if not isinstance(text, str):
            raise TypeError(f"text is {type(text).__name__}, not str")
        if finish is not None and not isinstance(finish, str):
            raise TypeError(f"finish_reason is {type(finish).__name__}, not str")
        if not isinstance(prompt_tokens, int) or not isinstance(completion_tokens, int):
            raise TypeError("usage token counts are not integers")
    except (KeyError, IndexError, TypeError, AttributeError) as exc:
        raise MalformedResponse(
            f"server's answer lacks the fields of a {kind} response ({type(exc).__name__}: {exc})",
            body=json.dumps(data)[:2000],
        ) from exc
    cls = CompletionResult if kind == "completion" else ChatResult
    return cls._trusted(
        text=text,
        finish_reason=finish,
        usage=Usage._trusted(prompt_tokens, completion_tokens),
        latency_s=latency,
        queued_s=queued,
        attempts=attempts,
        max_tokens=plan.max_tokens,
        lane=plan.lane,
        index=index,
        raw_data=data,
        server=server,
        degraded=degraded,
    )
