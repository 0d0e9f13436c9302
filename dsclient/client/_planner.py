"""What a call needs to know before it is sent: :class:`Planner`.

    planner = Planner(http, backend, TokenCounter(None), retry=Retry(), rng=random.Random())
    plan = await planner.plan("completion", "Once upon a time", 32, {})
    plan.lane, plan.max_tokens                          # ("short", 32)

The planner discovers the servers of a :class:`~dsclient.governor._backend.Backend` (once, and
again after an unanswered ``/v1/models``, with a backoff), keeps the token estimate calibrated
against the server's ``/tokenize``, asks for exact counts where the estimate could change what is
sent, and turns a prompt into a :class:`~dsclient.client._request.Plan` (the body, its
``max_tokens`` and its lane). Discovery is written once, for a backend of one server or several;
the one rule that differs is written as such: a model a server does not list is tried anyway
where no other server could take it, and skipped at that server where others might.

:class:`~dsclient.AsyncClient` holds one and passes it its own readiness (``ready``: discovery,
then the client's background tasks); built alone, the planner's readiness is discovery only.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import random
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Literal

import anyio

from .._exceptions import ConnectionError, DSClientError
from .._http import httpx
from ..governor._backend import Backend, rediscover_backoff
from ..governor._endpoint import Endpoint, fetch_load
from ..governor._lanes import Lane, RecentSizes, choose_lane, default_long_threshold
from ._discovery import ServerInfo, discover
from ._request import Plan, Prompt
from ._retry import Retry
from ._tokens import (
    BYTES_PER_TOKEN,
    CALIBRATION_TEXT,
    TokenCounter,
    count_exact,
    lane_is_uncertain,
    needs_exact_count,
    plan_from_estimate,
    plan_max_tokens,
)

__all__ = ["Planner"]

logger = logging.getLogger("dsclient")


class Planner:
    """Discovery, the token budget and each call's plan (see the module).

    Parameters:
        http: the connections discovery and ``/tokenize`` use.
        backend: the servers (one, or a pool).
        tokens: the local token counter, calibrated here.
        model: the model to ask for; ``None``: the one every server serves (set by discovery).
        max_num_seqs, max_model_len, server_priority: what the caller knows better than
            discovery (see :class:`~dsclient.AsyncClient`).
        long_threshold: estimated tokens above which a call takes the long lane; default a
            quarter of the context, or where it is unknown, relative to the calls sent
            (:attr:`sizes`).
        default_max_tokens: ``max_tokens`` planned when a call gives none.
        handle_facts: per server root URL, limits a launched ``Server`` handle knows.
        retry: its ``attempts`` bound the tries for a ``/v1/models`` that does not answer.
        rng, sleep: the backoff's jitter source and sleep.
        ready: what :meth:`plan` and :meth:`count_tokens` await before planning; default
            :meth:`discovered` (the client passes its own, which also starts its background).
    """

    def __init__(
        self,
        http: httpx.AsyncClient,
        backend: Backend,
        tokens: TokenCounter,
        *,
        model: str | None = None,
        max_num_seqs: int | None = None,
        max_model_len: int | None = None,
        server_priority: bool | None = None,
        long_threshold: int | None = None,
        default_max_tokens: int = 256,
        handle_facts: Mapping[str, Mapping[str, int]] | None = None,
        retry: Retry | None = None,
        rng: random.Random | None = None,
        sleep: Callable[[float], Awaitable[None]] = anyio.sleep,
        ready: Callable[[], Awaitable[ServerInfo]] | None = None,
    ) -> None:
        self.backend = backend
        self.tokens = tokens
        self.model = model
        self.long_threshold = long_threshold
        #: Where the context is unknown (and no ``long_threshold`` given): what is long,
        #: relative to the calls sent (:class:`~dsclient.governor._lanes.RecentSizes`).
        self.sizes = RecentSizes()
        #: The default threshold of the context last planned for: ``(max_model_len, tokens)``.
        self._threshold_for: tuple[int | None, int] = (None, default_long_threshold(None))
        self.default_max_tokens = default_max_tokens
        self.ready: Callable[[], Awaitable[ServerInfo]] = ready or self.discovered
        self._http = http
        self._max_num_seqs = max_num_seqs
        self._max_model_len = max_model_len
        self._server_priority = server_priority
        self._handle_facts = handle_facts or {}
        self._attempts = (retry or Retry()).attempts
        self._rng = rng or random.Random()
        self._sleep = sleep
        self._discover_lock = anyio.Lock()
        self._tokenize_limiter = anyio.CapacityLimiter(8)

    # -- discovery ---------------------------------------------------------------------------
    def info(self) -> ServerInfo | None:
        """What discovery found, the servers as one for planning (with several: the first that
        serves the model, with the smallest context of those that do)."""
        return self.backend.info(self.model)

    async def discover(self, *, refresh: bool = False) -> ServerInfo:
        """Discover the servers (once; cached): see :meth:`AsyncClient.discover
        <dsclient.AsyncClient.discover>`."""
        info = self.info()
        if info is not None and not refresh:
            return info
        async with self._discover_lock:
            info = self.info()
            if info is not None and not refresh:
                return info
            return await self._discover_locked(refresh=refresh)

    async def discovered(self) -> ServerInfo:
        """What a call can be planned with: discovery once, again when it was incomplete and
        the backoff says it is due, and, while the model is unknown, until ``/v1/models``
        answers."""
        info = self.info()
        if info is None:
            info = await self.discover()
        if not info.complete:
            info = await self.rediscover()
            if not info.complete and self.model is None:
                info = await self._wait_for_listing()
        return info

    def _unlisted(self) -> Literal["warn", "raise"]:
        """What discovery does with a model a server does not list: try it anyway where no
        other server could take its calls (a server may load models on demand), refuse it at
        that server where another may list it."""
        return "raise" if len(self.backend.endpoints) > 1 else "warn"

    async def _discover_locked(self, *, refresh: bool = False) -> ServerInfo:
        """Discover every server not yet (or not completely) discovered, at the same time. The
        model is the one asked for, or the one every server serves; a server that does not
        serve it stays for the models it does serve."""
        backend = self.backend
        todo = [e for e in backend.endpoints if refresh or e.info is None or not e.info.complete]
        if len(todo) == 1:  # no task group for one: its errors leave as they are
            await self._discover_endpoint(todo[0])
        else:
            async with anyio.create_task_group() as group:
                for endpoint in todo:
                    group.start_soon(self._discover_endpoint, endpoint)
        if self.model is None:
            found = {e.info.model for e in backend.endpoints if e.info and e.info.complete}
            found.discard(None)
            if len(found) > 1:
                listing = ", ".join(
                    f"{e.url}: {e.info.model!r}" for e in backend.endpoints if e.info is not None
                )
                raise ValueError(
                    f"the servers serve different models ({listing}); choose one with model="
                )
            if found:
                self.model = found.pop()
        info = backend.info(self.model)
        assert info is not None  # every server has been discovered, if not completely
        every = all(e.info is not None and e.info.complete for e in backend.endpoints)
        unlisted = self._unlisted() == "raise"
        if unlisted and self.model is not None and every and not backend.serving(self.model):
            served = sorted({m for e in backend.endpoints if e.info for m in e.info.models})
            raise ValueError(
                f"model {self.model!r} is not served by any of the {len(backend.endpoints)} "
                f"servers; they serve: {', '.join(map(repr, served)) or '(none)'}"
            )
        if info.has_tokenize and self.tokens.samples == 0:
            await self._calibrate()
        if len(backend.endpoints) > 1:
            logger.info(
                "dsclient: %d servers for model %s, %d serve it, limit %d in all",
                len(backend.endpoints),
                self.model,
                len(backend.serving(self.model)),
                backend.limit_for(self.model),
            )
        return info

    async def _discover_endpoint(self, endpoint: Endpoint) -> None:
        """One server: discover, scrape once, seed its controller; the backend then follows it
        (:meth:`Backend.discovered <dsclient.governor._backend.Backend.discovered>`: a server
        whose ``/v1/models`` did not answer is asked again later)."""
        url = endpoint.url
        unlisted = self._unlisted()
        try:
            info = await discover(
                self._http,
                url,
                model=self.model,
                max_num_seqs=self._max_num_seqs,
                priority=self._server_priority,
                max_model_len=self._max_model_len,
                unlisted=unlisted,  # "raise": the other servers may list it; route it to those
            )
        except ValueError:
            if unlisted == "warn" or self.model is None:
                raise  # several models served here, and none chosen
            try:  # it serves other models: keep what it serves, for calls that ask for them
                info = await discover(self._http, url, max_model_len=self._max_model_len)
            except ValueError as exc:
                logger.warning("dsclient: %s does not serve model %r: %s", url, self.model, exc)
                info = ServerInfo(url=url, kind="unknown", sources={"model": str(exc)})
        info = self._with_handle_facts(info, url)
        load = None
        if info.kind not in ("ollama", "unknown"):
            load = await fetch_load(self._http, url, model=info.model, timeout=2.0, kind=info.kind)
        endpoint.seed(info, load)
        self.backend.discovered(endpoint)
        control = endpoint.controller
        logger.info(
            "dsclient: %s at %s, model %s, max_num_seqs %s (%s), limit %d (%s, up to %d)",
            info.kind,
            url,
            info.model,
            info.max_num_seqs,
            info.sources.get("max_num_seqs", "?"),
            endpoint.governor.limit,
            control.mode,
            control.ceiling,
        )

    async def rediscover_endpoint(self, endpoint: Endpoint) -> None:
        """The backend's health loop found an undiscovered server answering: discover it."""
        async with self._discover_lock:
            if endpoint.info is None or not endpoint.info.complete:
                await self._discover_endpoint(endpoint)

    async def rediscover(self, *, now: bool = False) -> ServerInfo:
        """Discovery again, if the last one was incomplete and the backend says it is due (or
        ``now``); concurrent callers share one."""
        async with self._discover_lock:
            info = self.info()
            if info is not None and (
                info.complete or (not now and not self.backend.rediscover_due())
            ):
                return info
            return await self._discover_locked()

    async def _wait_for_listing(self) -> ServerInfo:
        """The model is unknown because ``/v1/models`` did not answer: a call must not go out
        without one. Ask again until it answers: while nothing at all answers, wait for the
        server like an outage (``outage_wait``); while it answers but not ``/v1/models``, give it
        ``Retry.attempts`` tries with backoff, then fail. Bounded by the call's own timeout."""
        backend = self.backend
        reach = backend.reach
        tries = 0
        while True:
            info = self.info()
            why = info.sources.get("/v1/models") if info is not None else None
            if info is not None and info.kind == "unknown" and not await backend.probe_all():
                reach.mark_down(why or "discovery: nothing answered")
                await reach.wait_up()
            else:
                tries += 1
                if tries > self._attempts:
                    said = f" ({'it ' if why.startswith('answered') else ''}{why})" if why else ""
                    foreign = why is not None and ("not JSON" in why or "HTTP 404" in why)
                    raise ConnectionError(
                        f"{backend.endpoints[0].url}/v1/models gave no model list in "
                        f"{tries - 1} tries{said}, so the model to ask for is unknown; "
                        + ("is this an OpenAI-compatible server's URL? " if foreign else "")
                        + "pass model= to AsyncClient to send without the list"
                    )
                if tries > 1:
                    await self._sleep(rediscover_backoff(tries - 1, self._rng))
            info = await self.rediscover(now=True)
            if info.complete or self.model is not None:
                return info

    async def _calibrate(self) -> None:
        """One exact count of a fixed sample text fits the local estimate to the served model."""
        try:
            exact = await self.count_exact(CALIBRATION_TEXT)
        except DSClientError as exc:  # a server that refuses the sample must not break discovery
            logger.debug("dsclient: token calibration failed: %r", exc)
            return
        if exact is not None:
            local = self.tokens.count(CALIBRATION_TEXT)
            self.tokens.learn(local, exact)
            logger.debug(
                "dsclient: calibrated token estimate: sample %d local, %d served (x%.2f)",
                local,
                exact,
                self.tokens.correction,
            )

    def _with_handle_facts(self, info: ServerInfo, url: str) -> ServerInfo:
        """Fill what discovery could not find from the launched ``Server`` handle, if any."""
        updates: dict[str, Any] = {}
        sources = dict(info.sources)
        for key, value in self._handle_facts.get(url, {}).items():
            if sources.get(key) in (None, "default") or getattr(info, key) is None:
                updates[key] = value
                sources[key] = "launched Server handle"
        if not updates:
            return info
        return dataclasses.replace(info, sources=sources, **updates)

    # -- token budget ------------------------------------------------------------------------
    async def count_tokens(self, prompt: Prompt, *, exact: bool = True) -> int:
        """Tokens in a prompt or message list (checked by the caller): see
        :meth:`AsyncClient.count_tokens <dsclient.AsyncClient.count_tokens>`."""
        info = await self.ready()
        local = self.tokens.count_any(prompt)
        if exact and info.has_tokenize:
            counted = await self.count_exact(prompt)
            if counted is not None:
                self.tokens.learn(local, counted)
                return counted
        return self.tokens.estimate_from(local)

    def _tokenize_url(self) -> str:
        """Where exact counts are asked: the first server that serves the model, is in rotation
        and has ``/tokenize``; else the first server."""
        backend = self.backend
        for endpoint in backend.serving(self.model):
            info = endpoint.info
            if info is not None and info.has_tokenize and backend.in_rotation(endpoint):
                return endpoint.url
        return backend.endpoints[0].url

    async def count_exact(self, prompt: Prompt) -> int | None:
        """The server's own count of ``prompt`` (``/tokenize``), or ``None`` without one."""
        async with self._tokenize_limiter:
            return await count_exact(
                self._http,
                self._tokenize_url(),
                model=self.model,
                prompt=prompt if isinstance(prompt, str) else None,
                messages=None if isinstance(prompt, str) else [dict(m) for m in prompt],
                timeout=10.0,
            )

    # -- the plan ----------------------------------------------------------------------------
    def refit(self, plan: Plan, max_model_len: int) -> int:
        """The ``max_tokens`` ``plan`` may send to a server of context ``max_model_len`` (a
        call degraded to another model)."""
        return plan_max_tokens(
            prompt_tokens=plan.prompt_tokens,
            requested=plan.max_tokens,
            default=self.default_max_tokens,
            max_model_len=max_model_len,
            margin=self.tokens.margin,
        )

    def is_long(self, tokens: int) -> bool:
        """Whether a call of about ``tokens`` (prompt + ``max_tokens``) takes the long lane, as
        far as it can be told before planning (a batch's start order asks, from the prompt's
        bytes)."""
        if self.long_threshold is not None:
            return tokens > self.long_threshold
        info = self.info()
        ctx = info.max_model_len if info is not None else None
        if ctx is None:
            return tokens > self.sizes.threshold
        return tokens > self._default_threshold(ctx)

    def read_size(self, tokens: int) -> None:
        """A batch has read an item of about ``tokens`` (prompt bytes / 4 + ``max_tokens``, the
        measure of :class:`~dsclient.governor._lanes.RecentSizes`): where the context is not
        known, it counts among the recent sizes before the item is planned. A batch started
        longest first otherwise plans its long items before any short one is seen, under the
        fallback threshold (1024 tokens), and they take the short lane: on a server that says
        no context, 27 items of 300 tokens out went first and an interactive call beside the
        batch waited 4.5 s at p99 (0.3-0.7 s in input order, where short items come first)."""
        if self.long_threshold is None:
            info = self.info()
            if info is None or info.max_model_len is None:
                self.sizes.lane_of(tokens)

    def _default_threshold(self, ctx: int | None) -> int:
        """:func:`~dsclient.governor._lanes.default_long_threshold` of ``ctx``, kept for the
        context last asked about (checking it and taking its share on every call cost more
        than the rest of choosing the lane)."""
        known, threshold = self._threshold_for
        if ctx != known:
            threshold = default_long_threshold(ctx)
            self._threshold_for = (ctx, threshold)
        return threshold

    async def plan(
        self,
        kind: Literal["completion", "chat"],
        prompt: Prompt,
        max_tokens: int | None,
        sampling: dict[str, Any],
    ) -> Plan:
        """The body to send for ``prompt``, its ``max_tokens`` (cut to the room the context
        leaves) and its lane: counting the prompt exactly only where the estimate's error could
        change either."""
        info = await self.ready()
        ctx = info.max_model_len
        tokens = self.tokens
        wanted = max_tokens if max_tokens is not None else self.default_max_tokens
        margin = tokens.margin
        threshold = self.long_threshold or self._default_threshold(ctx)
        # Cheapest first: a byte bound (no tokenizer). When even that fits the context and the
        # short lane, counting cannot change what is sent or where, so a short prompt never pays
        # for tiktoken or /tokenize.
        upper = tokens.upper_bound(prompt)
        lane: Lane
        if (
            upper is not None
            and upper + wanted <= threshold
            and not needs_exact_count(
                estimate=upper, error_bound=0, wanted=wanted, max_model_len=ctx, margin=margin
            )
        ):
            send = wanted
            lane = "short"
            prompt_tokens = upper
            # The bytes bound the count; what the call holds in the KV cache is about a
            # quarter of them.
            held = math.ceil(upper / BYTES_PER_TOKEN) + send
        else:
            m = tokens.measure(prompt)
            prompt_tokens = m.estimate
            # The lane, like a context overflow, is an outcome the estimate's error can change:
            # count exactly when its bound straddles the threshold.
            if needs_exact_count(
                estimate=m.estimate,
                error_bound=m.error_bound,
                wanted=wanted,
                max_model_len=ctx,
                margin=margin,
            ) or lane_is_uncertain(
                estimate=m.estimate, error_bound=m.error_bound, wanted=wanted, threshold=threshold
            ):
                counted = await self.count_exact(prompt) if info.has_tokenize else None
                if counted is not None:
                    tokens.learn(m.local, counted)
                    prompt_tokens = counted
                    send = plan_max_tokens(
                        prompt_tokens=counted,
                        requested=max_tokens,
                        default=self.default_max_tokens,
                        max_model_len=ctx,
                        margin=margin,
                    )
                else:
                    send = plan_from_estimate(
                        estimate=m.estimate,
                        error_bound=m.error_bound,
                        requested=max_tokens,
                        default=self.default_max_tokens,
                        max_model_len=ctx,
                        margin=margin,
                    )
            else:
                send = wanted
            lane = choose_lane(estimated_total_tokens=prompt_tokens + send, threshold=threshold)
            held = prompt_tokens + send
        if ctx is None and self.long_threshold is None:
            # No context to take a quarter of: long is what is large beside the other calls.
            size = math.ceil(upper / BYTES_PER_TOKEN) if upper is not None else prompt_tokens
            lane = self.sizes.lane_of(size + send)
        body: dict[str, Any] = {"model": self.model} if self.model is not None else {}
        if kind == "completion":
            body["prompt"] = prompt
        else:
            body["messages"] = [dict(m) for m in prompt if not isinstance(m, str)]
        body["max_tokens"] = send
        body.update(sampling)
        return Plan(kind, body, lane, send, prompt_tokens, held)
