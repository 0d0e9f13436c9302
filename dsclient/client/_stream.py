"""A streaming call: :class:`Stream`, opened under a slot it holds until the last event."""

from __future__ import annotations

import builtins
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import anyio

from .._exceptions import DSClientError, TimeoutError, translate_transport_error
from .._http import httpx
from .._streaming import delta_of, sse_events
from ..governor._lanes import Lane
from ._pipeline import outcome_of
from ._request import Prompt, deadline

if TYPE_CHECKING:
    from ..governor._backend import Lease
    from ._caller import Caller

__all__ = ["Stream"]


class Stream:
    """A streaming call: ``async with`` opens it, ``async for`` yields text deltas.

    After (or during) iteration: ``text`` (all deltas so far), ``ttft_s`` (seconds from the call
    to the first token), ``finish_reason``, ``attempts``, ``lane``, ``max_tokens``.

    The call's timeout covers the whole stream, from ``async with`` to the last event: a server
    that stops sending, or trickles a byte at a time (which no per-read timeout catches), ends
    the iteration with :class:`~dsclient.TimeoutError` once it runs out.

    ``client.stream(...)`` builds one over the client's :class:`~dsclient.client._caller.Caller`,
    which plans and opens it and hears how it ended.
    """

    def __init__(
        self,
        caller: Caller,
        prompt: Prompt,
        max_tokens: int | None,
        urgency: int,
        group: str | None,
        timeout: float | None,
        sampling: dict[str, Any],
    ) -> None:
        self._caller = caller
        self._prompt = prompt
        self._max_tokens = max_tokens
        self._urgency = urgency
        self._group = group
        self._timeout = timeout
        self._sampling = sampling
        self._slot: Lease | None = None
        self._response: httpx.Response | None = None
        self._events: AsyncIterator[dict[str, Any]] | None = None
        self.ttft_s: float | None = None
        self.finish_reason: str | None = None
        self.attempts = 0
        self.lane: Lane = "short"
        self.max_tokens: int | None = None
        self.server: str | None = None
        self._start = 0.0
        self._ends_at: float | None = None  # on the event loop's clock (anyio.current_time)
        self._chunks: list[str] = []

    async def __aenter__(self) -> Stream:
        caller = self._caller
        self._start = caller.clock()
        if self._timeout is not None:
            self._ends_at = anyio.current_time() + self._timeout
        try:
            async with deadline(self._timeout):
                plan, opened = await caller.open_stream(
                    self._prompt, self._max_tokens, self._urgency, self._group, self._sampling
                )
        except TimeoutError:  # dsclient's, from inside: it says what ran out
            raise
        except builtins.TimeoutError as exc:
            raise TimeoutError(
                f"stream did not open within its timeout of {self._timeout} s"
            ) from exc
        response = opened.response
        assert response is not None  # an open stream
        self.lane, self.max_tokens, self.attempts = plan.lane, plan.max_tokens, opened.attempts
        self.server = opened.server
        self._response, self._slot = response, opened.slot
        self._events = sse_events(response, limit=caller.path.max_body_bytes)
        return self

    def __aiter__(self) -> AsyncIterator[str]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[str]:
        events = self._events
        if events is None:
            raise RuntimeError("use the stream inside 'async with client.stream(...) as s:'")
        ends_at = self._ends_at
        try:
            while True:
                # Each read waits at most for what is left of the call's timeout. The scope
                # holds the read only, never the yield: the consumer's own awaits stay outside.
                left = None if ends_at is None else max(0.0, ends_at - anyio.current_time())
                try:
                    async with deadline(left):
                        event = await anext(events)
                except StopAsyncIteration:
                    return
                except TimeoutError:  # dsclient's, from inside: it says what ran out
                    raise
                except builtins.TimeoutError as exc:
                    raise TimeoutError(
                        f"stream did not finish within its timeout of {self._timeout} s"
                    ) from exc
                except DSClientError as exc:
                    self._caller.path.redact_error(exc)  # the server may echo the key
                    raise
                delta, finish = delta_of(event)
                if finish is not None:
                    self.finish_reason = finish
                if delta:
                    if self.ttft_s is None:
                        self.ttft_s = self._caller.clock() - self._start
                    self._chunks.append(delta)
                    yield delta
        except httpx.TransportError as exc:
            raise translate_transport_error(exc) from exc

    async def _release(self, exc: BaseException | None) -> None:
        if self._response is not None:
            await self._response.aclose()
            self._response = None
        caller = self._caller
        if self._slot is not None and caller.observers:
            caller.record(
                "stream",
                server=self.server,
                lane=self.lane,
                group=self._group,
                error=exc,
                latency_s=self.latency_s,
                queued_s=self._slot.queued_s,
                attempts=self.attempts,
                completion_tokens=len(self._chunks),
            )
        if self._slot is not None:
            slot, self._slot = self._slot, None
            slot.release(outcome_of(exc) if isinstance(exc, DSClientError) else None, error=exc)

    async def __aexit__(self, et: Any, ev: Any, tb: Any) -> None:
        with anyio.CancelScope(shield=True):
            await self._release(ev)

    @property
    def text(self) -> str:
        """All deltas received so far."""
        return "".join(self._chunks)

    @property
    def latency_s(self) -> float:
        return self._caller.clock() - self._start
