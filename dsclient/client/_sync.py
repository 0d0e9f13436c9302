"""A synchronous facade over :class:`AsyncClient` for scripts and notebooks.

The async client runs on an event loop in a background thread (an anyio blocking portal), so
``Client`` works the same in a plain script and inside a Jupyter cell, where the notebook's own
loop is already running in the caller's thread and ``asyncio.run`` would fail.
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import (
    AsyncIterable,
    Awaitable,
    Callable,
    Iterable,
    Iterator,
    Mapping,
    Sequence,
)
from contextlib import AbstractContextManager, ExitStack
from typing import TYPE_CHECKING, Any, Literal

from anyio.from_thread import BlockingPortal, start_blocking_portal

from .._models import ChatResult, CompletionResult, Failure, Result
from .._streaming import MAX_BODY_BYTES
from ..batch._batch import BatchResults
from ..governor._endpoint import ServerView
from ..governor._governor import GovernorStats
from ._client import USE_DEFAULT, AsyncClient, Messages, Prompt, Stream
from ._discovery import ServerInfo

if TYPE_CHECKING:
    import openai

    from .._http import httpx
    from ..batch._batch import OnError
    from ..batch._jsonl import JsonlStore
    from ..governor._routing import RoutingPolicy
    from ._client import UseDefault
    from ._degrade import Degrade
    from ._retry import Retry

__all__ = ["Client", "SyncStream"]

#: The locals of ``Client.__init__`` that are not AsyncClient options.
_NOT_OPTIONS = frozenset({"self", "base_url", "__class__"})


class Client:
    """The synchronous client: same constructor and methods as :class:`AsyncClient`.

        with dsclient.Client("http://127.0.0.1:8000") as client:
            print(client.generate("Hello", max_tokens=8).text)

    Works inside Jupyter cells (the event loop lives in a background thread). The parameters
    are :class:`AsyncClient`'s, with the same defaults (a test keeps the two in step).
    """

    def __init__(
        self,
        base_url: str | Sequence[str] | Any,
        *,
        model: str | None = None,
        api_key: str | None = None,
        timeout: float | None = 600.0,
        outage_wait: float | None = 300.0,
        max_response_bytes: int = MAX_BODY_BYTES,
        retry: Retry | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
        http_stack: str = "aiohttp",
        max_num_seqs: int | None = None,
        server_priority: bool | None = None,
        headroom: float = 0.7,
        adaptive: bool = True,
        limit: int | None = None,
        max_limit: int | None = None,
        latency_target: float | None = None,
        scrape_interval: float = 0.25,
        max_model_len: int | None = None,
        max_queue: int | None = None,
        long_threshold: int | None = None,
        long_share: float = 0.5,
        long_idle_borrow: float | None = 1.0,
        short_first: bool = False,
        group_caps: Mapping[str, float] | None = None,
        default_max_tokens: int = 256,
        tokenizer: Any = None,
        headers: Mapping[str, str] | None = None,
        shared: str | None = None,
        shared_key: str = "dsclient",
        routing: RoutingPolicy | None = None,
        degrade: Degrade | None = None,
        sleep: Callable[[float], Awaitable[None]] | None = None,
        rng: random.Random | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        # Every keyword parameter, read before any other local exists: the list above is the
        # only place the names are written, so it cannot drift from what is passed through.
        kwargs = {name: value for name, value in locals().items() if name not in _NOT_OPTIONS}
        self._stack = ExitStack()
        portal_cm: AbstractContextManager[BlockingPortal] = start_blocking_portal("asyncio")
        self._portal = self._stack.enter_context(portal_cm)
        try:
            self._async: AsyncClient = self._portal.call(_make_client, base_url, kwargs)
        except BaseException:
            self._stack.close()
            raise
        self._closed = False

    # lifecycle
    def __enter__(self) -> Client:
        """Discover the server (its model, context and limits); a failure closes the client."""
        try:
            self.discover()
        except BaseException:
            self.close()  # the connections and the portal's thread: __exit__ will not run
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        """Close the client (:meth:`close`)."""
        self.close()

    def close(self) -> None:
        """Close connections and stop the background loop."""
        if self._closed:
            return
        self._closed = True
        try:
            self._portal.call(self._async.aclose)
        finally:
            self._stack.close()

    def __del__(self) -> None:  # pragma: no cover - best effort at interpreter exit
        try:
            if not getattr(self, "_closed", True):
                self.close()
        except Exception:  # noqa: S110 - nothing to do about it in a finalizer
            pass

    def __repr__(self) -> str:
        return repr(self._async).replace("AsyncClient(", "Client(", 1)

    # observable state
    @property
    def url(self) -> str:
        return self._async.url

    @property
    def urls(self) -> tuple[str, ...]:
        """Every server's root URL, in the order given."""
        return self._async.urls

    @property
    def servers(self) -> tuple[ServerView, ...]:
        """Each server as seen now (see :attr:`AsyncClient.servers`)."""
        return self._async.servers

    @property
    def model(self) -> str | None:
        return self._async.model

    @property
    def server(self) -> ServerInfo | None:
        return self._async.server

    @property
    def limit(self) -> int:
        return self._async.limit

    @property
    def in_flight(self) -> int:
        return self._async.in_flight

    @property
    def aclient(self) -> AsyncClient:
        """The underlying async client (runs on the facade's background loop)."""
        return self._async

    def stats(self) -> GovernorStats:
        return self._async.stats()

    # calls
    def discover(self, *, refresh: bool = False) -> ServerInfo:
        return self._portal.call(lambda: self._async.discover(refresh=refresh))

    def count_tokens(self, prompt: Prompt, *, exact: bool = True) -> int:
        return self._portal.call(lambda: self._async.count_tokens(prompt, exact=exact))

    def generate(
        self, prompt: str, *, max_tokens: int | None = None, **kwargs: Any
    ) -> CompletionResult:
        """See :meth:`AsyncClient.generate`."""
        return self._portal.call(
            lambda: self._async.generate(prompt, max_tokens=max_tokens, **kwargs)
        )

    def chat(
        self, messages: Messages, *, max_tokens: int | None = None, **kwargs: Any
    ) -> ChatResult:
        """See :meth:`AsyncClient.chat`."""
        return self._portal.call(
            lambda: self._async.chat(messages, max_tokens=max_tokens, **kwargs)
        )

    def stream(
        self,
        prompt: Prompt,
        *,
        max_tokens: int | None = None,
        timeout: Any = USE_DEFAULT,
        **kwargs: Any,
    ) -> SyncStream:
        """See :meth:`AsyncClient.stream`; iterate with a plain ``for``."""
        inner = self._async.stream(prompt, max_tokens=max_tokens, timeout=timeout, **kwargs)
        return SyncStream(self._portal, inner)

    def map(
        self,
        items: Iterable[Any] | AsyncIterable[Any],
        *,
        ordered: bool = True,
        on_error: OnError = "return",
        progress: bool | Mapping[str, Any] | None = None,
        output: str | os.PathLike[str] | JsonlStore | None = None,
        resume: bool = False,
        max_tokens: int | None = None,
        urgency: int = 0,
        group: str | None = None,
        timeout: float | UseDefault | None = USE_DEFAULT,
        order: Literal["shape", "input"] = "shape",
        **sampling: Any,
    ) -> BatchResults:
        """Run every item; results in input order. Works inside a Jupyter cell too.

            results = client.map(["Hello", "Bonjour"], max_tokens=16, output="out.jsonl")

        Parameters are those of :meth:`AsyncClient.map` (:func:`dsclient.batch._batch.run_map`).
        """
        return self._portal.call(
            lambda: self._async.map(
                items,
                ordered=ordered,
                on_error=on_error,
                progress=progress,
                output=output,
                resume=resume,
                max_tokens=max_tokens,
                urgency=urgency,
                group=group,
                timeout=timeout,
                order=order,
                **sampling,
            )
        )

    def imap(
        self,
        items: Iterable[Any] | AsyncIterable[Any],
        *,
        on_error: OnError = "return",
        progress: bool | Mapping[str, Any] | None = None,
        output: str | os.PathLike[str] | JsonlStore | None = None,
        resume: bool = False,
        max_tokens: int | None = None,
        urgency: int = 0,
        group: str | None = None,
        timeout: float | UseDefault | None = USE_DEFAULT,
        order: Literal["shape", "input"] = "shape",
        **sampling: Any,
    ) -> Iterator[tuple[int, Result | Failure]]:
        """A plain iterator of ``(index, result)`` in completion order.

            for index, result in client.imap(prompts, output="out.jsonl"):
                ...

        Parameters are those of :meth:`AsyncClient.imap` (:func:`dsclient.batch._batch.iter_map`).
        """
        from ..batch._batch import iter_map_blocking

        return iter_map_blocking(
            self._portal,
            self._async.imap,
            items,
            on_error=on_error,
            progress=progress,
            output=output,
            resume=resume,
            max_tokens=max_tokens,
            urgency=urgency,
            group=group,
            timeout=timeout,
            order=order,
            **sampling,
        )

    def openai(
        self,
        *,
        urgency: int = 0,
        group: str | None = None,
        overflow: Literal["refuse", "cut"] = "refuse",
        **kwargs: Any,
    ) -> openai.OpenAI:
        """An ``openai.OpenAI`` whose requests go through this client's governor.

            sdk = client.openai()
            r = sdk.chat.completions.create(model="tiny", messages=msgs, max_tokens=16)

        See :meth:`AsyncClient.openai` (same parameters); the requests run on this client's
        background loop, so it works from any thread and inside Jupyter cells.
        """
        from ._transport import sync_openai

        transport = self._async._governed(urgency=urgency, group=group, overflow=overflow)
        sdk: openai.OpenAI = sync_openai(self._portal, transport, **kwargs)
        return sdk

    def httpx(
        self,
        *,
        urgency: int = 0,
        group: str | None = None,
        overflow: Literal["refuse", "cut"] = "refuse",
        **kwargs: Any,
    ) -> httpx.Client:
        """An ``httpx.Client`` whose inference requests go through this client's governor
        (``ChatOpenAI(http_client=client.httpx())``). See :meth:`AsyncClient.httpx`.

            r = client.httpx().post("/v1/completions", json={"model": "tiny", "prompt": "Hi"})
        """
        from ._transport import sync_httpx

        transport = self._async._governed(urgency=urgency, group=group, overflow=overflow)
        return sync_httpx(self._portal, transport, **kwargs)


class SyncStream:
    """``with client.stream(...) as s: for delta in s: ...`` for the synchronous client."""

    def __init__(self, portal: BlockingPortal, inner: Stream) -> None:
        self._portal = portal
        self._inner = inner
        self._iter: Any = None

    def __enter__(self) -> SyncStream:
        self._portal.call(self._inner.__aenter__)
        self._iter = self._inner.__aiter__()
        return self

    def __exit__(self, et: Any, ev: Any, tb: Any) -> None:
        self._portal.call(self._inner.__aexit__, et, ev, tb)

    def __iter__(self) -> Iterator[str]:
        if self._iter is None:
            raise RuntimeError("use the stream inside 'with client.stream(...) as s:'")
        while True:
            try:
                yield self._portal.call(self._iter.__anext__)
            except StopAsyncIteration:
                return

    def __getattr__(self, name: str) -> Any:  # text, ttft_s, finish_reason, ...
        return getattr(self._inner, name)


async def _make_client(base_url: Any, kwargs: dict[str, Any]) -> AsyncClient:
    return AsyncClient(base_url, **kwargs)
