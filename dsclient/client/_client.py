"""The async client: validation and lifecycle, wiring a planner and a caller to httpx.

The client composes objects that each have one job: the servers behind one interface
(:class:`~dsclient.governor._backend.Backend`: one server, or a pool; the per-server state in
:class:`~dsclient.governor._endpoint.Endpoint`), the per-attempt path (slot, send once, release
with the outcome, retry outside the slot) in :mod:`dsclient.client._pipeline`, the
:class:`~dsclient.client._planner.Planner` (discovery, tokens, each call's plan) and the
:class:`~dsclient.client._caller.Caller` (timeout, degradation, attempts, result, observers).
:meth:`Caller.request <dsclient.client._caller.Caller.request>` and :meth:`Caller.open_stream
<dsclient.client._caller.Caller.open_stream>` are the internal entry points that calls, streams,
``map()`` and ``dsclient map`` go through.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import time
from collections.abc import (
    AsyncIterable,
    AsyncIterator,
    Awaitable,
    Callable,
    Iterable,
    Mapping,
    Sequence,
)
from typing import TYPE_CHECKING, Any, Literal

import anyio
import sniffio

from .._http import READ_TIMEOUT_S, httpx, transport_for
from .._models import ChatResult, CompletionResult, Failure, Result
from .._observe import Observer
from .._streaming import MAX_BODY_BYTES
from ..batch._batch import BatchResults, OnError, iter_map, run_map
from ..batch._jsonl import JsonlStore
from ..governor._backend import Backend, SingleServer
from ..governor._endpoint import ControlOptions, Endpoint, ServerView
from ..governor._fair import check_weights
from ..governor._governor import GovernorStats, compute_limit
from ..governor._health import Reachability
from ..governor._pool import ServerPool
from ..governor._routing import Router, RoutingPolicy
from ..governor._shared import SharedBudget
from ._caller import Caller
from ._degrade import Degrade
from ._discovery import DEFAULT_MAX_NUM_SEQS, ServerInfo
from ._options import Secret, check_options, handle_tokenizer, servers_of
from ._pipeline import RequestPath
from ._planner import Planner
from ._priority import weight_ranks
from ._request import (
    USE_DEFAULT,
    Messages,
    Prompt,
    UseDefault,
    check_max_tokens,
    check_messages,
    check_prompt,
)
from ._retry import Retry, RetryBudget
from ._stream import Stream
from ._tokens import (
    TokenCounter,
)

if TYPE_CHECKING:
    import openai

    from ._transport import GovernedTransport


__all__ = ["USE_DEFAULT", "AsyncClient", "Messages", "Prompt", "Stream", "UseDefault"]

logger = logging.getLogger("dsclient")


#: Seconds one attempt may take to connect (a retryable failure past it); the call's deadline
#: still bounds the whole call.
_CONNECT_TIMEOUT_S = 10.0


class AsyncClient:
    """An async client for an OpenAI-compatible LLM server that governs its own concurrency.

        async with dsclient.AsyncClient("http://127.0.0.1:8000") as client:
            result = await client.generate("Once upon a time", max_tokens=32)
            print(result.text, result.latency_s)

    The in-flight limit starts at ``floor(headroom x max_num_seqs)`` and then follows the
    server: it grows while calls wait here and the server's own queue is short, and shrinks
    when that queue grows, on 429 / 503, and when a ``latency_target`` is missed (see
    the guide "The governor"). Where the server publishes no queue, it finds the point past which
    more in flight buys no throughput (up to ``max_limit``).

    Several servers (replicas, or servers of other models) go in a list, and each attempt goes
    to one of them (the guide "Several servers"):

    ```python
    async with dsclient.AsyncClient(["http://a:8000", "http://b:8000"]) as client:
        result = await client.generate("Once upon a time", max_tokens=32)
        print(result.server, [s.limit for s in client.servers])
    ```

    Parameters:
        base_url: the server's URL, with or without ``/v1``, or a launched ``Server`` handle;
            or a list of them (or a launched ``ServerGroup``): discovery, the learned capacity
            and the closed-loop limit are then per server, and a router chooses the server of
            each attempt by load and prefix, fails over from a server that stops answering,
            and skips those that do not serve the model.
        model: the model to ask for; ``None`` takes the server's only model.
        api_key: bearer token; falls back to ``DSCLIENT_API_KEY``, then ``OPENAI_API_KEY``.
        timeout: seconds for a whole call, waiting for a slot and retries included.
        outage_wait: seconds calls wait, on the client, for a server that stopped answering
            (killed, restarting) before they fail with :class:`dsclient.ConnectionError`
            (default 300; ``None``: only ``timeout`` bounds the wait).
        max_response_bytes: the largest answer (or stream line) read; a longer one fails with
            :class:`dsclient.ResponseTooLarge` (default 16 MiB: a completion is kilobytes).
        retry: the retry policy (:class:`dsclient.Retry`); ``Retry(attempts=1)`` turns it off.
        transport: any ``httpx.AsyncBaseTransport``, of the ``httpx2`` package or of ``httpx``
            (tests pass ``httpx.MockTransport``); default: ``http_stack``'s.
        http_stack: how requests are sent when no ``transport`` is given: ``"aiohttp"``
            (default: the client's own calls over dsclient's own HTTP/1.1 connections, streams
            and other SDKs' requests over aiohttp's pool under httpx2's API; httpx2's own pool
            under trio) or ``"httpx2"`` (its own pool for everything, several times the CPU per
            request at hundreds in flight: the guide "The HTTP stack").
        max_num_seqs: the server's batch size, if you know it better than discovery.
        server_priority: whether the server reorders by the request field ``priority``
            (vLLM ``--scheduling-policy priority``, SGLang ``--enable-priority-scheduling``):
            ``True`` sends each call's lane and urgency there, ``False`` never sends it,
            ``None`` (default) sends it where discovery knows the server takes it.
        headroom: where the limit starts, as a share of ``max_num_seqs`` (0 < headroom <= 2;
            default 0.7); with ``adaptive=False`` it is the limit for good.
        adaptive: let the limit follow the server (default). ``False`` keeps it where it starts.
        limit: a fixed in-flight limit (implies ``adaptive=False``).
        max_limit: the most the adaptive limit may reach; default ``max(64, 4 x max_num_seqs)``
            with a queue signal, ``max(1024, 4 x max_num_seqs)`` without one.
        latency_target: seconds; when the p99 of recent attempts' service times passes 120% of
            it the limit halves, and it does not grow while the p99 is above it.
        scrape_interval: seconds between two scrapes of the server's ``/metrics`` while there is
            traffic (default 0.25); nothing is scraped while the client is idle.
        max_model_len: the model's context, if you know it better than discovery.
        max_queue: bound on calls waiting in the client; beyond it calls fail with
            :class:`dsclient.Overloaded` at once. ``None`` (default) waits.
        long_threshold: estimated prompt + max_tokens above which a call takes the long lane;
            default a quarter of the context, or where the server does not say its context,
            4x the usual recent call (256 to 1024 tokens; see the guide "The governor").
        long_share: the share of the limit the long lane may hold (default 0.5).
        long_idle_borrow: seconds without short traffic after which long calls may borrow
            idle short slots (short calls reclaim them); ``None`` makes the long share a hard
            ceiling.
        short_first: at equal urgency, admit waiting short calls before waiting long ones (a
            long one still goes first while none is running). Default ``False``: arrival order.
        group_caps: caps per traffic group as shares of the limit, e.g. ``{"batch": 0.5}``.
        group_weights: each group's (tenant's) weight in the token-fair order, e.g.
            ``{"chat": 3, "batch": 1}``; groups not named weigh 1. While calls of several groups
            wait, the one whose group was served the fewest tokens over its weight goes next;
            a group alone gets every slot (the guide "Tenants").
        group_priority: also send the group's rank by weight in the server's ``priority``
            field (heaviest first), where the server takes one. Default ``False``: the fair
            order is the client's; the server keeps its own.
        default_max_tokens: ``max_tokens`` sent when a call gives none, cut to the room left.
        tokenizer: a ``tokenizer.json`` path, a tiktoken encoding name or a ``str -> int``
            callable for local token estimates; default: the launched model's own tokenizer,
            else tiktoken calibrated against the server's ``/tokenize`` at discovery.
        shared: a Redis URL (``redis://host:6379/0``; ``rediss://`` for TLS; a password in it
            never shows in logs or reprs): every client of the same server and ``shared_key``
            shares one in-flight limit, leased from Redis (the guide "Many processes, one
            budget"; needs the ``redis`` extra). ``None`` (default): this client's own limit.
        shared_key: the key prefix in Redis, so that several budgets can share one Redis.
        routing: the router's policy for several servers (:class:`dsclient.RoutingPolicy`:
            weights, breaker, prefix blocks); default ``RoutingPolicy()``.
        degrade: what calls with a timeout give up rather than miss it
            (:class:`dsclient.Degrade`: another model, a smaller ``max_tokens``); the result's
            ``degraded`` says what changed. Default ``None``: nothing (calls may override).
        sleep, rng, clock: injectable for tests (retry sleeps, jitter source, latency clock).
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
        group_weights: Mapping[str, float] | None = None,
        group_priority: bool = False,
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
        servers = servers_of(base_url)
        url, handle = servers[0]
        if model is None:
            # A launched handle names its model. Its limits back up discovery, which normally
            # finds the launcher's record for its url (and reports it as such); they are not
            # "explicit" settings.
            named = {getattr(h, "model", None) for _, h in servers}
            if len(named) == 1 and all(h is not None for _, h in servers):
                model = named.pop()
        check_options(
            model=model,
            timeout=timeout,
            max_num_seqs=max_num_seqs,
            max_model_len=max_model_len,
            max_queue=max_queue,
            long_threshold=long_threshold,
            limit=limit,
            max_limit=max_limit,
            default_max_tokens=default_max_tokens,
            adaptive=adaptive,
            latency_target=latency_target,
            scrape_interval=scrape_interval,
            outage_wait=outage_wait,
            max_response_bytes=max_response_bytes,
            servers=len(servers),
            shared=shared,
            shared_key=shared_key,
            degrade=degrade,
            routing=routing,
        )
        key = api_key or os.environ.get("DSCLIENT_API_KEY") or os.environ.get("OPENAI_API_KEY")
        self._api_key = Secret(key) if key else None
        self._retry = retry if retry is not None else Retry()
        self._budget = RetryBudget(
            ratio=self._retry.budget_ratio,
            floor=self._retry.budget_floor,
            window=self._retry.budget_window,
        )
        if server_priority is not None and not isinstance(server_priority, bool):
            raise TypeError(f"server_priority must be a bool or None, got {server_priority!r}")
        self._clock = clock
        # Until discovery runs, the limit uses the explicit value or the default guess.
        options = ControlOptions(
            headroom=headroom,
            adaptive=adaptive,
            limit=limit,
            max_limit=max_limit,
            latency_target=float(latency_target) if latency_target is not None else None,
            scrape_interval=float(scrape_interval),
        )
        weights = check_weights(group_weights)
        governor_options = {
            "long_share": long_share,
            "long_idle_borrow": long_idle_borrow,
            "long_pacing": True,
            "short_first": short_first,
            "max_queue": max_queue,
            "group_caps": group_caps,
            "group_weights": weights,
        }
        start = limit or compute_limit(max_num_seqs or DEFAULT_MAX_NUM_SEQS, headroom)
        self._endpoints = tuple(
            Endpoint(root, options, governor_options, start=start, clock=clock)
            for root, _ in servers
        )
        self._endpoint = self._endpoints[0]
        self._shared: SharedBudget | None = None
        if shared is not None:
            self._shared = SharedBudget(Secret(shared), key=shared_key, server_url=url)
            self._endpoint.use_shared(self._shared)
        tokens = TokenCounter(tokenizer if tokenizer is not None else handle_tokenizer(handle))
        request_headers = {"User-Agent": "dsclient/0.1"}
        request_headers.update(headers or {})
        if self._api_key is not None:
            request_headers["Authorization"] = f"Bearer {self._api_key.reveal()}"
        # The governor is the only concurrency limit: the pool must never be the tighter one,
        # so it is unbounded; keep-alive connections cover a large limit without reconnects.
        # Each call's deadline (its own timeout, or the client's) bounds the whole call. A read
        # waits at most READ_TIMEOUT_S for the next byte, as long as a whole completion may take
        # to come back: a read timeout of the client's timeout cut every attempt of a call whose
        # own timeout was longer (or None) short. Connecting stays bounded per attempt.
        self._http = httpx.AsyncClient(
            transport=transport_for(http_stack, transport),
            headers=request_headers,
            timeout=httpx.Timeout(None, connect=_CONNECT_TIMEOUT_S, read=READ_TIMEOUT_S),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=512),
        )
        self._sleep = sleep or anyio.sleep
        self._rng = rng or random.Random()
        # Where attempts go: the one server, or a pool of them with a router. Everything past
        # this point (the request path, discovery, the views) goes through this one interface.
        self._backend: Backend
        if len(self._endpoints) > 1:
            self._backend = ServerPool(
                self._endpoints,
                Router(routing, clock=clock, rng=self._rng),
                governor_options,
                probe=self._probe_url,
                sleep=self._sleep,
                rng=self._rng,
                clock=clock,
                outage_wait=outage_wait,
            )
        else:
            self._backend = SingleServer(
                self._endpoint,
                probe=self._probe_url,
                sleep=self._sleep,
                rng=self._rng,
                clock=clock,
                outage_wait=outage_wait,
            )
        self._path = RequestPath(
            self._http,
            self._backend,
            self._retry,
            self._budget,
            sleep=self._sleep,
            rng=self._rng,
            max_body_bytes=max_response_bytes,
        )
        if not isinstance(group_priority, bool):
            raise TypeError(f"group_priority must be a bool, got {group_priority!r}")
        if group_priority:
            self._path.group_ranks = weight_ranks(weights)
        handle_facts = {
            root: {
                key: value
                for key in ("max_num_seqs", "max_model_len")
                if isinstance(value := getattr(h, key, None), int)
            }
            for root, h in servers
            if h is not None
        }
        #: What each call sends and where (discovery, tokens, the plan); its readiness is the
        #: client's, which also starts the background tasks.
        self._planner = Planner(
            self._http,
            self._backend,
            tokens,
            model=model,
            max_num_seqs=max_num_seqs,
            max_model_len=max_model_len,
            server_priority=server_priority,
            long_threshold=long_threshold,
            default_max_tokens=default_max_tokens,
            handle_facts=handle_facts,
            retry=self._retry,
            rng=self._rng,
            sleep=self._sleep,
            ready=self._ready,
        )
        #: Each call from its plan to its result and record.
        self._caller = Caller(
            self._path,
            self._planner,
            url=self._endpoint.url,
            timeout=float(timeout) if timeout is not None else None,
            degrade=degrade,
            clock=clock,
        )
        self._join_lock = anyio.Lock()
        self._closed = False
        self._poller_scope: anyio.CancelScope | None = None
        self._poller_task: asyncio.Task[None] | None = None
        self._task_group: Any = None

    # -- lifecycle ---------------------------------------------------------------------------
    async def __aenter__(self) -> AsyncClient:
        """Discover the server (its model, context and limits) and start the load poller.

        A failed discovery closes what was opened before it raises.
        """
        try:
            await self.discover()
        except BaseException:
            # Nothing may stay open after a failed enter (several models and none chosen, a bad
            # URL, a cancelled discovery): __aexit__ will not run.
            with anyio.CancelScope(shield=True):
                await self.aclose()
            raise
        if self._shared is not None:
            await self._shared.first_lease(self._endpoint)  # a block before the first call
        if self._needs_poller():
            group = anyio.create_task_group()
            await group.__aenter__()
            self._task_group = group
            group.start_soon(self._run_poller)
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        """Close the client (:meth:`aclose`) and stop its background work."""
        await self.aclose()
        group, self._task_group = self._task_group, None
        if group is not None:
            group.cancel_scope.cancel()
            await group.__aexit__(None, None, None)

    async def aclose(self) -> None:
        """Close the connections and stop the load poller. The client cannot be used afterwards."""
        self._closed = True
        if self._poller_scope is not None:
            self._poller_scope.cancel()
        task, self._poller_task = self._poller_task, None
        if task is not None and not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._shared is not None:
            with anyio.CancelScope(shield=True):
                await self._shared.aclose()  # the leases go back now, not in LEASE_S
        await self._http.aclose()

    async def discover(self, *, refresh: bool = False) -> ServerInfo:
        """Find the server's kind, model, context and ``max_num_seqs`` (once; cached).

        Also scrapes ``/metrics`` once (whether the limit can follow the server's queue) and,
        where the server has ``/tokenize``, calibrates the local token estimate on a sample text.
        A discovery that got no answer from ``/v1/models`` (``server.complete`` is false) is not
        final: later calls ask again, with a backoff (0.5 s doubling to 30 s, jittered), and a
        call that needs the model to send waits for the answer.
        """
        return await self._planner.discover(refresh=refresh)

    async def _probe_url(self, url: str) -> bool:
        return await self._path.probe_url(url)

    def _needs_poller(self) -> bool:
        """Whether a background task has work: scraping an adaptive limit's server, syncing a
        shared budget, or probing the servers of a pool that leave the rotation."""
        return self._backend.needs_background() or self._shared is not None

    async def _run_poller(self) -> None:
        with anyio.CancelScope() as scope:
            self._poller_scope = scope
            shared = self._shared
            if shared is None:
                await self._backend.run(self._http, self._planner.rediscover_endpoint)
                return
            async with anyio.create_task_group() as group:
                group.start_soon(shared.run, self._endpoint)
                group.start_soon(self._backend.run, self._http, self._planner.rediscover_endpoint)

    def _ensure_poller(self) -> None:
        """Outside ``async with`` (a client used bare, or the sync ``Client``), start the poller as
        an asyncio task on first use; on trio the limit then moves on outcomes only."""
        if (
            self._poller_scope is not None
            or self._poller_task is not None
            or self._closed
            or not self._needs_poller()
        ):
            return
        if sniffio.current_async_library() != "asyncio":
            return
        self._poller_task = asyncio.get_running_loop().create_task(self._run_poller())

    async def _ready(self) -> ServerInfo:
        if self._closed:
            raise RuntimeError("this AsyncClient is closed")
        planner = self._planner
        info = planner.info()
        if info is None or not info.complete:
            info = await planner.discovered()
        if self._poller_scope is None and self._poller_task is None:
            shared = self._shared
            if shared is not None and shared.last is None and not shared.state.failures:
                # Used without `async with` (or through the sync Client): the first lease now.
                async with self._join_lock:
                    if shared.last is None and not shared.state.failures:
                        await shared.first_lease(self._endpoint)
            self._ensure_poller()
        return info

    def __repr__(self) -> str:
        urls = self.urls
        where = f"urls={list(urls)!r}" if len(urls) > 1 else f"url={self.url!r}"
        return (
            f"AsyncClient({where}, model={self._planner.model!r}, limit={self.limit}, "
            f"in_flight={self.in_flight}, api_key={'***' if self._api_key else None}"
            + (f", shared={self._shared.display_url!r}" if self._shared is not None else "")
            + ")"
        )

    # -- observable state --------------------------------------------------------------------
    @property
    def url(self) -> str:
        """The server's root URL (without ``/v1``); with several servers, the first one's."""
        return self._endpoint.url

    @property
    def urls(self) -> tuple[str, ...]:
        """Every server's root URL, in the order given."""
        return tuple(e.url for e in self._endpoints)

    @property
    def model(self) -> str | None:
        return self._planner.model

    @property
    def server(self) -> ServerInfo | None:
        """What discovery found (``None`` before it ran), updated when the metrics teach
        ``max_num_seqs`` (``server.sources["max_num_seqs"]`` then says so). With several
        servers: the first server that serves the model, with the smallest context among them
        (each server's own is in :attr:`servers`)."""
        return self._planner.info()

    @property
    def limit(self) -> int:
        """The in-flight limit now: ``floor(headroom x max_num_seqs)`` right after discovery,
        then wherever the controller moved it. Under ``shared=`` it is the shared limit of all
        clients (this one holds a share of it), or this client's own while Redis is away."""
        shared = self._shared
        if shared is not None and self._endpoint.shared_active and shared.limit is not None:
            return shared.limit
        # With a pool: those in rotation serving it.
        return self._backend.limit_for(self._planner.model)

    @property
    def in_flight(self) -> int:
        return self._backend.in_flight

    @property
    def reachability(self) -> Reachability:
        """Whether the server answers: ``down``, ``outages``, ``last_outage_s`` (see
        the guide "Faults and limits"). While it is down, calls wait here for it."""
        return self._path.reach

    @property
    def servers(self) -> tuple[ServerView, ...]:
        """Each server as seen now: URL, :class:`ServerInfo`, limit, in flight, load as last
        scraped and its age, health and per-lane stats (:class:`~dsclient.ServerView`)."""
        return tuple(e.view() for e in self._backend.endpoints)

    def on_limit_raise(self, callback: Callable[[], None]) -> Callable[[], None]:
        """Call ``callback()`` (no arguments, on the event loop) whenever the in-flight limit
        rises (any server's, with several), e.g. to start more workers; returns a function that
        removes it."""
        removers = [e.on_raise(callback) for e in self._endpoints]

        def remove() -> None:
            for remover in removers:
                remover()

        return remove

    def add_observer(self, observer: Observer) -> Callable[[], None]:
        """Call ``observer(record)`` with a :class:`~dsclient.CallRecord` for every finished
        call (see :mod:`dsclient._observe`); returns a function that removes it. An observer
        that raises is logged and ignored."""
        observers = self._caller.observers
        observers.append(observer)

        def remove() -> None:
            # By identity: list.remove compares with ==, which an observer may define.
            for i, known in enumerate(observers):
                if known is observer:
                    del observers[i]
                    return

        return remove

    def stats(self) -> GovernorStats:
        """Per-lane in flight, waiting, done, failed and latency percentiles, and ``control``:
        the limit's mode, why it last moved, the server's running / waiting as last seen and the
        learned capacity."""
        # With several servers: the calls of the client's model as they wait and run (the
        # pool's front queue), against the sum of the limits; each server's own in .servers.
        return self._backend.stats(self._planner.model)

    # -- public calls ------------------------------------------------------------------------
    async def generate(
        self,
        prompt: str,
        *,
        max_tokens: int | None = None,
        urgency: int = 0,
        group: str | None = None,
        timeout: float | UseDefault | None = USE_DEFAULT,
        degrade: Degrade | UseDefault | None = USE_DEFAULT,
        **sampling: Any,
    ) -> CompletionResult:
        """Complete ``prompt`` with the completions endpoint.

            result = await client.generate("The capital of France is", max_tokens=8)

        Parameters:
            prompt: the text to continue.
            max_tokens: the most tokens to generate; cut to the room the context leaves.
                ``None`` sends the client's default (cut likewise).
            urgency: higher is admitted first among waiting calls; where the server takes a
                ``priority`` field (``client.server.priority``), it is sent there too, with the
                lane (see ``dsclient.client._priority``). A ``priority`` passed in ``sampling``
                is sent as it is.
            group: the traffic group, for ``group_caps``.
            timeout: seconds for this call (default: the client's).
            degrade: what to give up rather than miss the timeout (:class:`dsclient.Degrade`;
                default: the client's; ``None``: nothing).
            sampling: anything else goes into the request body as given (``temperature``,
                vLLM's ``ignore_eos``, ``top_k``, ``min_tokens``, ...).
        """
        check_prompt(prompt)
        check_max_tokens(max_tokens)
        result = await self._caller.request(
            "completion", prompt, max_tokens, urgency, group, timeout, sampling, degrade=degrade
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
        timeout: float | UseDefault | None = USE_DEFAULT,
        degrade: Degrade | UseDefault | None = USE_DEFAULT,
        **sampling: Any,
    ) -> ChatResult:
        """Answer a conversation with the chat completions endpoint.

            result = await client.chat([{"role": "user", "content": "Hi"}], max_tokens=16)

        Parameters are those of :meth:`generate`, with ``messages`` in OpenAI's shape.
        """
        check_messages(messages)
        check_max_tokens(max_tokens)
        result = await self._caller.request(
            "chat", messages, max_tokens, urgency, group, timeout, sampling, degrade=degrade
        )
        assert isinstance(result, ChatResult)
        return result

    async def count_tokens(self, prompt: Prompt, *, exact: bool = True) -> int:
        """Tokens in a prompt or message list: exact via the server's ``/tokenize`` when it
        has one and ``exact`` is true, else the local (corrected) estimate."""
        if isinstance(prompt, str):
            check_prompt(prompt)
        else:
            check_messages(prompt)
        return await self._planner.count_tokens(prompt, exact=exact)

    def stream(
        self,
        prompt: Prompt,
        *,
        max_tokens: int | None = None,
        urgency: int = 0,
        group: str | None = None,
        timeout: float | UseDefault | None = USE_DEFAULT,
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
            check_prompt(prompt)
        else:
            check_messages(prompt)
        check_max_tokens(max_tokens)
        caller = self._caller
        return Stream(
            caller, prompt, max_tokens, urgency, group, caller.timeout_of(timeout), sampling
        )

    async def map(
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
        """Run every item; results come back in input order, one per item, never dropped.

            results = await client.map(["Hello", "Bonjour"], max_tokens=16, output="out.jsonl")

        Parameters are those of :func:`dsclient.batch._batch.run_map` (the guide "Batch jobs"):
        items are prompts, message lists or request dicts; ``output`` a JSONL file that
        ``resume=True`` continues (a second run sends only what is missing or failed; without it,
        an existing file is an error, never overwritten); ``on_error="raise"`` stops at the first
        failure; ``sampling`` goes into every request body. ``order="shape"`` (default) starts
        items that share a prefix together and the longest first, within a window of the input;
        ``order="input"`` starts them as read.
        """
        return await run_map(
            self,
            items,
            caller=self._caller,
            planner=self._planner,
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
    ) -> AsyncIterator[tuple[int, Result | Failure]]:
        """Yield ``(index, result)`` as each item finishes (completion order). Parameters are
        those of :meth:`map`, without ``ordered``; see :func:`dsclient.batch._batch.iter_map`.

            async for index, result in client.imap(prompts, output="out.jsonl"):
                ...
        """
        return iter_map(
            self,
            items,
            caller=self._caller,
            planner=self._planner,
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

    # -- other SDKs over this client (dsclient/client/_transport.py) ------------------------
    def openai(
        self,
        *,
        urgency: int = 0,
        group: str | None = None,
        overflow: Literal["refuse", "cut"] = "refuse",
        **kwargs: Any,
    ) -> openai.AsyncOpenAI:
        """An ``openai.AsyncOpenAI`` whose requests go through this client's governor.

            sdk = client.openai()
            r = await sdk.chat.completions.create(model="tiny", messages=msgs, max_tokens=16)

        Same limit, lanes, retries (openai's own are off), outage wait and response cap as
        :meth:`generate`; errors come back as openai's own types. Per call, headers
        ``x-dsclient-urgency`` / ``-group`` / ``-overflow`` (or ``extra_body={"dsclient": {...}}``)
        override the defaults here. See the guide "Already using the openai SDK?".

        Parameters:
            urgency, group: defaults for calls that do not say (see :meth:`generate`).
            overflow: ``"refuse"`` (default) answers a ``max_tokens`` that cannot fit with a
                ``BadRequestError`` before sending; ``"cut"`` cuts it to the room left.
            kwargs: passed to ``openai.AsyncOpenAI`` (``default_headers``, ``timeout``, ...).
        """
        from ._transport import async_openai

        transport = self._governed(urgency=urgency, group=group, overflow=overflow)
        sdk: openai.AsyncOpenAI = async_openai(transport, **kwargs)
        return sdk

    def httpx(
        self,
        *,
        urgency: int = 0,
        group: str | None = None,
        overflow: Literal["refuse", "cut"] = "refuse",
        **kwargs: Any,
    ) -> httpx.AsyncClient:
        """An ``httpx.AsyncClient`` whose inference requests go through this client's governor,
        for libraries that take one (``ChatOpenAI(http_async_client=...)``, LlamaIndex).

            llm = ChatOpenAI(base_url=client.url + "/v1", api_key="EMPTY", model="tiny",
                             max_retries=0, http_async_client=client.httpx())

        ``/v1/completions``, ``/v1/chat/completions`` and ``/v1/embeddings`` are governed; other
        requests pass through. Parameters are those of :meth:`openai`; ``kwargs`` go to
        ``httpx.AsyncClient``.
        """
        from ._transport import async_httpx

        transport = self._governed(urgency=urgency, group=group, overflow=overflow)
        return async_httpx(transport, **kwargs)

    def _governed(
        self, *, urgency: int, group: str | None, overflow: Literal["refuse", "cut"]
    ) -> GovernedTransport:
        """The governed transport over this client's caller, planner and connections: what
        :meth:`openai` and :meth:`httpx` (and the sync ``Client``'s) are built on."""
        from ._transport import GovernedTransport

        return GovernedTransport(
            self._caller,
            self._planner,
            self._http,
            keyed=self._api_key is not None,
            urgency=urgency,
            group=group,
            overflow=overflow,
        )
