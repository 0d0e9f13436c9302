"""The async client: validation, discovery, token budget, governor and retries around httpx."""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import dataclasses
import json
import logging
import os
import random
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal, TypeVar

import anyio
import httpx
import sniffio
import tenacity

from ._discovery import DEFAULT_MAX_NUM_SEQS, ServerInfo, discover
from ._exceptions import (
    DSClientError,
    MalformedResponse,
    TimeoutError,
    error_from_response,
    translate_transport_error,
)
from ._governor import Governor, GovernorStats, choose_lane, compute_limit, default_long_threshold
from ._models import ChatResult, CompletionResult, Failure, Result, Usage
from ._retry import Retry, RetryBudget, compute_backoff, describe, is_retryable, retry_after_of
from ._streaming import delta_of, iter_sse_data
from ._tokens import (
    TokenCounter,
    count_exact,
    needs_exact_count,
    plan_from_estimate,
    plan_max_tokens,
)

if TYPE_CHECKING:
    from ._batch import BatchResults
    from ._governor import Slot

__all__ = ["USE_DEFAULT", "AsyncClient", "Stream"]

logger = logging.getLogger("dsclient")

Messages = Sequence[Mapping[str, Any]]
Prompt = str | Messages
T = TypeVar("T")


class _UseDefault:
    """Sentinel: "use the client's default" (``None`` means "turn it off")."""

    _instance: _UseDefault | None = None

    def __new__(cls) -> _UseDefault:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "USE_DEFAULT"


USE_DEFAULT: Any = _UseDefault()


class _Secret:
    """Holds the API key so that no repr, log line or traceback local shows it."""

    __slots__ = ("_value",)

    def __init__(self, value: str) -> None:
        self._value = value

    def reveal(self) -> str:
        return self._value

    def __repr__(self) -> str:
        return "'***'"

    __str__ = __repr__


def _deadline(seconds: float | None) -> contextlib.AbstractAsyncContextManager[Any]:
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
    """``anyio.fail_after`` as an async context manager, for :func:`_deadline`."""

    __slots__ = ("_scope",)

    def __init__(self, seconds: float) -> None:
        self._scope = anyio.fail_after(seconds)

    async def __aenter__(self) -> None:
        self._scope.__enter__()

    async def __aexit__(self, *exc_info: Any) -> bool | None:
        return self._scope.__exit__(*exc_info)


_HAS_ASYNCIO_TIMEOUT = sys.version_info >= (3, 11)


def _root_url(base_url: str) -> str:
    """``http://h:8000/v1/`` → ``http://h:8000``; validates the scheme."""
    if not isinstance(base_url, str):
        raise TypeError(
            f"base_url must be a str or a launched Server, got {type(base_url).__name__}"
        )
    url = base_url.strip().rstrip("/")
    parsed = httpx.URL(url) if "://" in url else None
    if parsed is None or parsed.scheme not in ("http", "https") or not parsed.host:
        raise ValueError(
            f"base_url must be an http(s) URL like 'http://127.0.0.1:8000', got {base_url!r}"
        )
    if url.endswith("/v1"):
        url = url[: -len("/v1")]
    return url


def _check_messages(messages: Any) -> None:
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise TypeError(
            f"messages must be a list of {{'role', 'content'}} dicts, got {type(messages).__name__}"
        )
    if not messages:
        raise ValueError("messages is empty; give at least one {'role': ..., 'content': ...}")
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or "role" not in m:
            raise TypeError(
                f"messages[{i}] must be a dict with 'role' and 'content', got {m!r:.80}"
            )


def _check_prompt(prompt: Any) -> None:
    if not isinstance(prompt, str):
        raise TypeError(f"prompt must be a str, got {type(prompt).__name__}")
    if not prompt:
        raise ValueError("prompt is empty")


def _check_max_tokens(max_tokens: Any) -> None:
    if max_tokens is None:
        return
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int):
        raise TypeError(f"max_tokens must be an int, got {type(max_tokens).__name__}")
    if max_tokens <= 0:
        raise ValueError(f"max_tokens must be > 0, got {max_tokens}")


Lane = Literal["short", "long"]


class _Plan:
    """What one call will send: endpoint, body, lane and the governor's options."""

    __slots__ = ("body", "kind", "lane", "max_tokens", "path", "prompt_tokens")

    def __init__(
        self,
        kind: Literal["completion", "chat"],
        body: dict[str, Any],
        lane: Lane,
        max_tokens: int,
        prompt_tokens: int,
    ) -> None:
        self.kind = kind
        self.path = "/v1/completions" if kind == "completion" else "/v1/chat/completions"
        self.body = body
        self.lane = lane
        self.max_tokens = max_tokens
        self.prompt_tokens = prompt_tokens


class AsyncClient:
    """An async client for an OpenAI-compatible LLM server that governs its own concurrency.

        async with dsclient.AsyncClient("http://127.0.0.1:8000") as client:
            result = await client.generate("Once upon a time", max_tokens=32)
            print(result.text, result.latency_s)

    Parameters:
        base_url: the server's URL, with or without ``/v1``, or a launched ``Server`` handle.
        model: the model to ask for; ``None`` takes the server's only model.
        api_key: bearer token; falls back to ``DSCLIENT_API_KEY``, then ``OPENAI_API_KEY``.
        timeout: seconds for a whole call, waiting for a slot and retries included.
        retry: the retry policy (:class:`dsclient.Retry`); ``Retry(attempts=1)`` turns it off.
        transport: any ``httpx.AsyncBaseTransport`` (tests pass ``httpx.MockTransport``).
        max_num_seqs: the server's batch size, if you know it better than discovery.
        headroom: in-flight cap as a share of ``max_num_seqs`` (0 < headroom <= 2; default 0.7).
        max_model_len: the model's context, if you know it better than discovery.
        max_queue: bound on calls waiting in the client; beyond it calls fail with
            :class:`dsclient.Overloaded` at once. ``None`` (default) waits.
        long_threshold: estimated prompt + max_tokens above which a call takes the long lane;
            default a quarter of the context.
        long_share: the share of the cap the long lane may hold (default 0.5).
        long_idle_borrow: seconds without short traffic after which long calls may borrow
            idle short slots (all but one); ``None`` makes the long share a hard ceiling.
        short_first: at equal urgency, admit waiting short calls before waiting long ones (a
            long one still goes first while none is running). Default ``False``: arrival order.
        group_caps: caps per traffic group as shares of the cap, e.g. ``{"batch": 0.5}``.
        default_max_tokens: ``max_tokens`` sent when a call gives none, cut to the room left.
        tokenizer: a ``tokenizer.json`` path, a tiktoken encoding name or a ``str -> int``
            callable for local token estimates.
        sleep, rng, clock: injectable for tests (retry sleeps, jitter source, latency clock).
    """

    def __init__(
        self,
        base_url: Any,
        *,
        model: str | None = None,
        api_key: str | None = None,
        timeout: float | None = 600.0,
        retry: Retry | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
        max_num_seqs: int | None = None,
        headroom: float = 0.7,
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
        sleep: Callable[[float], Awaitable[None]] | None = None,
        rng: random.Random | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        handle = None
        if not isinstance(base_url, str) and hasattr(base_url, "url"):
            handle = base_url  # a launched dsclient.launcher.Server
            base_url = handle.url
            model = model if model is not None else getattr(handle, "model", None)
            # The handle's limits back up discovery, which normally finds the launcher's record
            # for this url (and reports it as such); they are not "explicit" settings.
        self._url = _root_url(base_url)
        if model is not None and not isinstance(model, str):
            raise TypeError(f"model must be a str, got {type(model).__name__}")
        if timeout is not None and not (isinstance(timeout, (int, float)) and timeout > 0):
            raise ValueError(
                f"timeout must be a positive number of seconds or None, got {timeout!r}"
            )
        for name, value in (
            ("max_num_seqs", max_num_seqs),
            ("max_model_len", max_model_len),
            ("max_queue", max_queue),
            ("long_threshold", long_threshold),
        ):
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int) or value < 1
            ):
                raise ValueError(f"{name} must be an int >= 1 or None, got {value!r}")
        if not isinstance(default_max_tokens, int) or default_max_tokens < 1:
            raise ValueError(f"default_max_tokens must be an int >= 1, got {default_max_tokens!r}")
        key = api_key or os.environ.get("DSCLIENT_API_KEY") or os.environ.get("OPENAI_API_KEY")
        self._api_key = _Secret(key) if key else None
        self._model = model
        self._timeout = float(timeout) if timeout is not None else None
        self._retry = retry if retry is not None else Retry()
        self._budget = RetryBudget(
            ratio=self._retry.budget_ratio,
            floor=self._retry.budget_floor,
            window=self._retry.budget_window,
        )
        self._headroom = headroom
        self._explicit_max_num_seqs = max_num_seqs
        self._explicit_max_model_len = max_model_len
        self._long_threshold = long_threshold
        self._default_max_tokens = default_max_tokens
        self._sleep = sleep or anyio.sleep
        self._rng = rng or random.Random()
        self._clock = clock
        # Until discovery runs, the cap uses the explicit value or a cautious single slot's worth.
        self._governor = Governor(
            limit=compute_limit(max_num_seqs or DEFAULT_MAX_NUM_SEQS, headroom),
            long_share=long_share,
            long_idle_borrow=long_idle_borrow,
            short_first=short_first,
            max_queue=max_queue,
            group_caps=group_caps,
            clock=clock,
        )
        self._tokens = TokenCounter(tokenizer)
        request_headers = {"User-Agent": "dsclient/0.1"}
        request_headers.update(headers or {})
        if self._api_key is not None:
            request_headers["Authorization"] = f"Bearer {self._api_key.reveal()}"
        # The governor is the only concurrency limit: the pool must never be the tighter one,
        # so it is unbounded; keep-alive connections cover a large cap without reconnects.
        self._http = httpx.AsyncClient(
            transport=transport,
            headers=request_headers,
            timeout=httpx.Timeout(self._timeout, connect=min(self._timeout or 10.0, 10.0)),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=512),
        )
        self._server: ServerInfo | None = None
        self._discover_lock = anyio.Lock()
        self._tokenize_limiter = anyio.CapacityLimiter(8)
        self._closed = False
        self._handle_facts = {
            key: value
            for key in ("max_num_seqs", "max_model_len")
            if handle is not None and isinstance(value := getattr(handle, key, None), int)
        }

    # -- lifecycle ---------------------------------------------------------------------------
    async def __aenter__(self) -> AsyncClient:
        await self.discover()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close the connections. The client cannot be used afterwards."""
        self._closed = True
        await self._http.aclose()

    def __repr__(self) -> str:
        return (
            f"AsyncClient(url={self._url!r}, model={self._model!r}, limit={self.limit}, "
            f"in_flight={self.in_flight}, api_key={'***' if self._api_key else None})"
        )

    # -- observable state --------------------------------------------------------------------
    @property
    def url(self) -> str:
        """The server's root URL (without ``/v1``)."""
        return self._url

    @property
    def model(self) -> str | None:
        return self._model

    @property
    def server(self) -> ServerInfo | None:
        """What discovery found (``None`` before it ran); see :meth:`discover`."""
        return self._server

    @property
    def limit(self) -> int:
        """The in-flight cap: ``max(1, floor(headroom * max_num_seqs))``."""
        return self._governor.limit

    @property
    def in_flight(self) -> int:
        return self._governor.in_flight

    def stats(self) -> GovernorStats:
        """Per-lane in flight, waiting, done, failed and sliding-window latency percentiles."""
        return self._governor.stats()

    # -- discovery ---------------------------------------------------------------------------
    async def discover(self, *, refresh: bool = False) -> ServerInfo:
        """Find the server's kind, model, context and ``max_num_seqs`` (once; cached)."""
        if self._server is not None and not refresh:
            return self._server
        async with self._discover_lock:
            if self._server is not None and not refresh:
                return self._server
            info = await discover(
                self._http,
                self._url,
                model=self._model,
                max_num_seqs=self._explicit_max_num_seqs,
                max_model_len=self._explicit_max_model_len,
            )
            info = self._with_handle_facts(info)
            self._server = info
            self._model = info.model if info.model is not None else self._model
            self._governor.set_limit(compute_limit(info.max_num_seqs, self._headroom))
            logger.info(
                "dsclient: %s at %s, model %s, max_num_seqs %s (%s), cap %d",
                info.kind,
                self._url,
                info.model,
                info.max_num_seqs,
                info.sources.get("max_num_seqs", "?"),
                self._governor.limit,
            )
            return info

    def _with_handle_facts(self, info: ServerInfo) -> ServerInfo:
        """Fill what discovery could not find from the launched ``Server`` handle, if any."""
        updates: dict[str, Any] = {}
        sources = dict(info.sources)
        for key, value in self._handle_facts.items():
            if sources.get(key) in (None, "default") or getattr(info, key) is None:
                updates[key] = value
                sources[key] = "launched Server handle"
        if not updates:
            return info
        return dataclasses.replace(info, sources=sources, **updates)

    async def _ready(self) -> ServerInfo:
        if self._closed:
            raise RuntimeError("this AsyncClient is closed")
        return self._server if self._server is not None else await self.discover()

    # -- token budget ------------------------------------------------------------------------
    async def count_tokens(self, prompt: Prompt, *, exact: bool = True) -> int:
        """Tokens in a prompt or message list: exact via the server's ``/tokenize`` when it
        has one and ``exact`` is true, else the local (corrected) estimate."""
        if isinstance(prompt, str):
            _check_prompt(prompt)
        else:
            _check_messages(prompt)
        info = await self._ready()
        local = self._tokens.count_any(prompt)
        if exact and info.has_tokenize:
            counted = await self._count_exact(prompt)
            if counted is not None:
                self._tokens.learn(local, counted)
                return counted
        return self._tokens.estimate_from(local)

    async def _count_exact(self, prompt: Prompt) -> int | None:
        async with self._tokenize_limiter:
            return await count_exact(
                self._http,
                self._url,
                model=self._model,
                prompt=prompt if isinstance(prompt, str) else None,
                messages=None if isinstance(prompt, str) else [dict(m) for m in prompt],
                timeout=10.0,
            )

    async def _plan(
        self,
        kind: Literal["completion", "chat"],
        prompt: Prompt,
        max_tokens: int | None,
        sampling: dict[str, Any],
    ) -> _Plan:
        info = await self._ready()
        ctx = info.max_model_len
        tokens = self._tokens
        wanted = max_tokens if max_tokens is not None else self._default_max_tokens
        margin = tokens.margin
        threshold = self._long_threshold or default_long_threshold(ctx)
        # Cheapest first: a byte bound (no tokenizer). When even that fits, counting cannot
        # change what is sent, so a short prompt never pays for tiktoken or /tokenize.
        upper = tokens.upper_bound(prompt)
        lane: Lane
        if upper is not None and not needs_exact_count(
            estimate=upper, error_bound=0, wanted=wanted, max_model_len=ctx, margin=margin
        ):
            send = wanted
            if upper + send <= threshold:
                lane = "short"
                prompt_tokens = upper
            else:
                prompt_tokens = tokens.estimate(prompt)
                lane = choose_lane(estimated_total_tokens=prompt_tokens + send, threshold=threshold)
        else:
            m = tokens.measure(prompt)
            prompt_tokens = m.estimate
            if needs_exact_count(
                estimate=m.estimate,
                error_bound=m.error_bound,
                wanted=wanted,
                max_model_len=ctx,
                margin=margin,
            ):
                counted = await self._count_exact(prompt) if info.has_tokenize else None
                if counted is not None:
                    tokens.learn(m.local, counted)
                    prompt_tokens = counted
                    send = plan_max_tokens(
                        prompt_tokens=counted,
                        requested=max_tokens,
                        default=self._default_max_tokens,
                        max_model_len=ctx,
                        margin=margin,
                    )
                else:
                    send = plan_from_estimate(
                        estimate=m.estimate,
                        error_bound=m.error_bound,
                        requested=max_tokens,
                        default=self._default_max_tokens,
                        max_model_len=ctx,
                        margin=margin,
                    )
            else:
                send = wanted
            lane = choose_lane(estimated_total_tokens=prompt_tokens + send, threshold=threshold)
        body: dict[str, Any] = {"model": self._model} if self._model is not None else {}
        if kind == "completion":
            body["prompt"] = prompt
        else:
            body["messages"] = [dict(m) for m in prompt if not isinstance(m, str)]
        body["max_tokens"] = send
        body.update(sampling)
        return _Plan(kind, body, lane, send, prompt_tokens)

    # -- public calls ------------------------------------------------------------------------
    async def generate(
        self,
        prompt: str,
        *,
        max_tokens: int | None = None,
        urgency: int = 0,
        group: str | None = None,
        timeout: Any = USE_DEFAULT,
        **sampling: Any,
    ) -> CompletionResult:
        """Complete ``prompt`` with the completions endpoint.

            result = await client.generate("The capital of France is", max_tokens=8)

        Parameters:
            prompt: the text to continue.
            max_tokens: the most tokens to generate; cut to the room the context leaves.
                ``None`` sends the client's default (cut likewise).
            urgency: higher is admitted first among waiting calls (client side only; vLLM's own
                ``priority`` field, where lower runs first, can still be passed in ``sampling``).
            group: the traffic group, for ``group_caps``.
            timeout: seconds for this call (default: the client's).
            sampling: anything else goes into the request body as given (``temperature``,
                vLLM's ``ignore_eos``, ``top_k``, ``min_tokens``, ...).
        """
        _check_prompt(prompt)
        _check_max_tokens(max_tokens)
        result = await self._call(
            "completion", prompt, max_tokens, urgency, group, timeout, sampling
        )
        assert isinstance(result, CompletionResult)
        return result

    async def chat(
        self,
        messages: Messages,
        *,
        max_tokens: int | None = None,
        urgency: int = 0,
        group: str | None = None,
        timeout: Any = USE_DEFAULT,
        **sampling: Any,
    ) -> ChatResult:
        """Answer a conversation with the chat completions endpoint.

            result = await client.chat([{"role": "user", "content": "Hi"}], max_tokens=16)

        Parameters are those of :meth:`generate`, with ``messages`` in OpenAI's shape.
        """
        _check_messages(messages)
        _check_max_tokens(max_tokens)
        result = await self._call("chat", messages, max_tokens, urgency, group, timeout, sampling)
        assert isinstance(result, ChatResult)
        return result

    def stream(
        self,
        prompt: Prompt,
        *,
        max_tokens: int | None = None,
        urgency: int = 0,
        group: str | None = None,
        timeout: Any = USE_DEFAULT,
        **sampling: Any,
    ) -> Stream:
        """Stream text deltas over SSE: a string prompt uses completions, a list uses chat.

            async with client.stream("Once upon a time", max_tokens=64) as s:
                async for delta in s:
                    print(delta, end="")
            print(s.ttft_s, s.finish_reason)

        Leaving the block early closes the response and gives the connection and the slot back.
        """
        if isinstance(prompt, str):
            _check_prompt(prompt)
        else:
            _check_messages(prompt)
        _check_max_tokens(max_tokens)
        return Stream(self, prompt, max_tokens, urgency, group, self._timeout_of(timeout), sampling)

    async def map(self, items: Any, **kwargs: Any) -> BatchResults:
        """Run a batch; results come back in input order. See :func:`dsclient._batch.run_map`.

        results = await client.map(["Hello", "Bonjour"], max_tokens=16)
        """
        from ._batch import run_map

        return await run_map(self, items, **kwargs)

    def imap(self, items: Any, **kwargs: Any) -> AsyncIterator[tuple[int, Result | Failure]]:
        """Yield ``(index, result)`` as each item finishes. See :func:`dsclient._batch.iter_map`.

        async for index, result in client.imap(prompts, output="out.jsonl"):
            ...
        """
        from ._batch import iter_map

        return iter_map(self, items, **kwargs)

    def _timeout_of(self, timeout: Any) -> float | None:
        if timeout is USE_DEFAULT:
            return self._timeout
        if timeout is not None and not (isinstance(timeout, (int, float)) and timeout > 0):
            raise ValueError(
                f"timeout must be a positive number of seconds or None, got {timeout!r}"
            )
        return float(timeout) if timeout is not None else None

    # -- the request path --------------------------------------------------------------------
    async def _call(
        self,
        kind: Literal["completion", "chat"],
        prompt: Prompt,
        max_tokens: int | None,
        urgency: int,
        group: str | None,
        timeout: Any,
        sampling: dict[str, Any],
        *,
        index: int | None = None,
    ) -> Result:
        limit_s = self._timeout_of(timeout)
        start = self._clock()
        try:
            async with _deadline(limit_s):
                plan = await self._plan(kind, prompt, max_tokens, sampling)
                async with self._governor.slot(
                    lane=plan.lane, urgency=urgency, group=group
                ) as slot:
                    data, attempts = await self._with_retries(
                        lambda: self._post_json(plan.path, plan.body), slot, plan.path
                    )
        except builtins.TimeoutError as exc:
            raise TimeoutError(f"call did not finish within its timeout of {limit_s} s") from exc
        latency = self._clock() - start
        return _build_result(kind, data, latency, slot.queued_s, attempts, plan, index)

    async def _post_json(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """One attempt: POST, check the status, parse JSON. Raises dsclient errors only."""
        try:
            response = await self._http.post(self._url + path, json=body)
        except httpx.TransportError as exc:
            raise translate_transport_error(exc) from exc
        if response.status_code >= 400:
            raise error_from_response(response)
        try:
            data = json.loads(response.content)
        except ValueError as exc:
            raise MalformedResponse(
                f"server answered HTTP {response.status_code} with a body that is not JSON",
                body=response.text,
            ) from exc
        if not isinstance(data, dict):
            raise MalformedResponse(
                "server answered with JSON that is not an object", body=response.text
            )
        return data

    async def _with_retries(
        self, op: Callable[[], Awaitable[T]], slot: Slot | None, label: str
    ) -> tuple[T, int]:
        """Run ``op`` once; only if that fails retryably, hand over to :meth:`_retry_loop`.

        The common path (success at once) builds no retry machinery.
        """
        self._budget.record_request()
        try:
            return await op(), 1
        except DSClientError as first:
            if self._retry.attempts <= 1 or not self._should_retry(first):
                if slot is not None:
                    slot.fail()
                raise
            failure: DSClientError = first
        return await self._retry_loop(op, failure, slot, label)

    def _should_retry(self, exc: BaseException) -> bool:
        if not is_retryable(exc):
            return False
        if not self._budget.try_spend():
            logger.warning("dsclient: retry budget spent; not retrying %s", describe(exc))
            return False
        return True

    async def _retry_loop(
        self,
        op: Callable[[], Awaitable[T]],
        first: DSClientError,
        slot: Slot | None,
        label: str,
    ) -> tuple[T, int]:
        retry = self._retry
        delay = compute_backoff(
            1, base=retry.base, cap=retry.cap, retry_after=retry_after_of(first), rng=self._rng
        )
        logger.info(
            "dsclient: %s failed with %s; retry 2/%d in %.2fs",
            label,
            describe(first),
            retry.attempts,
            delay,
        )
        await self._sleep(delay)

        def wait(state: tenacity.RetryCallState) -> float:
            exc = state.outcome.exception() if state.outcome is not None else None
            seconds = compute_backoff(
                state.attempt_number + 1,
                base=retry.base,
                cap=retry.cap,
                retry_after=retry_after_of(exc) if exc else None,
                rng=self._rng,
            )
            logger.info(
                "dsclient: %s failed with %s; retry %d/%d in %.2fs",
                label,
                describe(exc) if exc else "?",
                state.attempt_number + 2,
                retry.attempts,
                seconds,
            )
            return seconds

        attempts = 1
        retrying = tenacity.AsyncRetrying(
            stop=tenacity.stop_after_attempt(retry.attempts - 1),
            wait=wait,
            retry=tenacity.retry_if_exception(self._should_retry),
            sleep=self._sleep,
            reraise=True,
        )
        try:
            async for attempt in retrying:
                with attempt:
                    attempts += 1
                    result = await op()
        except DSClientError as exc:
            exc.attempts = attempts
            if slot is not None:
                slot.fail()
            raise
        return result, attempts


def _build_result(
    kind: Literal["completion", "chat"],
    data: dict[str, Any],
    latency: float,
    queued: float,
    attempts: int,
    plan: _Plan,
    index: int | None,
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
    )


class Stream:
    """A streaming call: ``async with`` opens it, ``async for`` yields text deltas.

    After (or during) iteration: ``text`` (all deltas so far), ``ttft_s`` (seconds from the call
    to the first token), ``finish_reason``, ``attempts``, ``lane``, ``max_tokens``.
    """

    def __init__(
        self,
        client: AsyncClient,
        prompt: Prompt,
        max_tokens: int | None,
        urgency: int,
        group: str | None,
        timeout: float | None,
        sampling: dict[str, Any],
    ) -> None:
        self._client = client
        self._prompt = prompt
        self._max_tokens = max_tokens
        self._urgency = urgency
        self._group = group
        self._timeout = timeout
        self._sampling = sampling
        self._slot_cm: Any = None
        self._response: httpx.Response | None = None
        self._events: AsyncIterator[dict[str, Any]] | None = None
        self.ttft_s: float | None = None
        self.finish_reason: str | None = None
        self.attempts = 0
        self.lane: Lane = "short"
        self.max_tokens: int | None = None
        self._start = 0.0
        self._chunks: list[str] = []

    async def __aenter__(self) -> Stream:
        client = self._client
        self._start = client._clock()
        try:
            async with _deadline(self._timeout):
                kind: Literal["completion", "chat"] = (
                    "completion" if isinstance(self._prompt, str) else "chat"
                )
                plan = await client._plan(
                    kind, self._prompt, self._max_tokens, dict(self._sampling)
                )
                self.lane, self.max_tokens = plan.lane, plan.max_tokens
                body = dict(plan.body, stream=True)
                self._slot_cm = client._governor.slot(
                    lane=plan.lane, urgency=self._urgency, group=self._group
                )
                await self._slot_cm.__aenter__()
                try:
                    await self._open(plan.path, body)
                except BaseException as exc:
                    await self._release(exc)
                    raise
        except builtins.TimeoutError as exc:
            raise TimeoutError(
                f"stream did not open within its timeout of {self._timeout} s"
            ) from exc
        return self

    async def _open(self, path: str, body: dict[str, Any]) -> None:
        """Open the response; retried only while nothing has been received."""
        client = self._client

        async def attempt() -> None:
            self.attempts += 1
            request = client._http.build_request("POST", client._url + path, json=body)
            try:
                response = await client._http.send(request, stream=True)
            except httpx.TransportError as exc:
                raise translate_transport_error(exc) from exc
            if response.status_code >= 400:
                try:
                    await response.aread()
                except httpx.TransportError:
                    pass
                finally:
                    await response.aclose()
                raise error_from_response(response)
            self._response = response
            self._events = iter_sse_data(response.aiter_lines())

        await client._with_retries(attempt, None, path)

    def __aiter__(self) -> AsyncIterator[str]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[str]:
        if self._events is None:
            raise RuntimeError("use the stream inside 'async with client.stream(...) as s:'")
        try:
            async for event in self._events:
                delta, finish = delta_of(event)
                if finish is not None:
                    self.finish_reason = finish
                if delta:
                    if self.ttft_s is None:
                        self.ttft_s = self._client._clock() - self._start
                    self._chunks.append(delta)
                    yield delta
        except httpx.TransportError as exc:
            raise translate_transport_error(exc) from exc

    async def _release(self, exc: BaseException | None) -> None:
        if self._response is not None:
            await self._response.aclose()
            self._response = None
        if self._slot_cm is not None:
            cm, self._slot_cm = self._slot_cm, None
            if exc is not None:
                await cm.__aexit__(type(exc), exc, exc.__traceback__)
            else:
                await cm.__aexit__(None, None, None)

    async def __aexit__(self, et: Any, ev: Any, tb: Any) -> None:
        with anyio.CancelScope(shield=True):
            await self._release(ev)

    @property
    def text(self) -> str:
        """All deltas received so far."""
        return "".join(self._chunks)

    @property
    def latency_s(self) -> float:
        return self._client._clock() - self._start
