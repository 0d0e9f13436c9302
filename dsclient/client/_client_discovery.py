"""What the client learns about its servers before and between calls: discovery (once, again
after an unanswered ``/v1/models``, for each server of the client's backend), and the token
budget that planning a call needs (exact counts, the calibrated estimate, ``max_tokens`` and the
lane).

:class:`DiscoveryMixin` is half of :class:`~dsclient.AsyncClient`: the client's wiring and public
calls are in ``dsclient.client._client``, which sets every attribute declared here. Discovery is
written once, for a backend of one server or several
(:class:`~dsclient.governor._backend.Backend`); the one rule that differs is written as such: a
model a server does not list is tried anyway where no other server could take it, and skipped at
that server where others might.
"""

from __future__ import annotations

import dataclasses
import logging
import random
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal

import anyio

from .._exceptions import ConnectionError, DSClientError
from .._http import httpx
from ..governor._backend import Backend, rediscover_backoff
from ..governor._endpoint import Endpoint, fetch_load
from ..governor._lanes import Lane, choose_lane, default_long_threshold
from ._discovery import ServerInfo, discover
from ._request import Plan, Prompt, check_messages, check_prompt
from ._retry import Retry
from ._tokens import (
    CALIBRATION_TEXT,
    TokenCounter,
    count_exact,
    lane_is_uncertain,
    needs_exact_count,
    plan_from_estimate,
    plan_max_tokens,
)

if TYPE_CHECKING:
    from ._pipeline import RequestPath

__all__ = ["DiscoveryMixin"]

logger = logging.getLogger("dsclient")


class DiscoveryMixin:
    """Discovery and the token budget of :class:`~dsclient.AsyncClient` (see the module)."""

    _http: httpx.AsyncClient
    _endpoint: Endpoint
    _endpoints: tuple[Endpoint, ...]
    _backend: Backend
    _path: RequestPath
    _model: str | None
    _explicit_max_num_seqs: int | None
    _server_priority: bool | None
    _explicit_max_model_len: int | None
    _handle_facts: dict[str, dict[str, int]]
    _tokens: TokenCounter
    _tokenize_limiter: anyio.CapacityLimiter
    _discover_lock: anyio.Lock
    _retry: Retry
    _rng: random.Random
    _clock: Callable[[], float]
    _sleep: Callable[[float], Any]
    _closed: bool
    _long_threshold: int | None
    _default_max_tokens: int

    if TYPE_CHECKING:  # the client's: discovery, then its background tasks

        async def _ready(self) -> ServerInfo: ...

    def _limit_now(self) -> int:
        return self._backend.limit_for(self._model)

    # -- discovery ---------------------------------------------------------------------------
    async def discover(self, *, refresh: bool = False) -> ServerInfo:
        """Find the server's kind, model, context and ``max_num_seqs`` (once; cached).

        Also scrapes ``/metrics`` once (whether the limit can follow the server's queue) and,
        where the server has ``/tokenize``, calibrates the local token estimate on a sample text.
        A discovery that got no answer from ``/v1/models`` (``server.complete`` is false) is not
        final: later calls ask again, with a backoff (0.5 s doubling to 30 s, jittered), and a
        call that needs the model to send waits for the answer.
        """
        info = self._info()
        if info is not None and not refresh:
            return info
        async with self._discover_lock:
            info = self._info()
            if info is not None and not refresh:
                return info
            return await self._discover_locked(refresh=refresh)

    def _info(self) -> ServerInfo | None:
        """What discovery found, the servers as one for planning (with several: the first that
        serves the model, with the smallest context of those that do)."""
        return self._backend.info(self._model)

    def _unlisted(self) -> Literal["warn", "raise"]:
        """What discovery does with a model a server does not list: try it anyway where no
        other server could take its calls (a server may load models on demand), refuse it at
        that server where another may list it."""
        return "raise" if len(self._backend.endpoints) > 1 else "warn"

    async def _discover_locked(self, *, refresh: bool = False) -> ServerInfo:
        """Discover every server not yet (or not completely) discovered, at the same time. The
        model is the one asked for, or the one every server serves; a server that does not
        serve it stays for the models it does serve."""
        backend = self._backend
        todo = [e for e in backend.endpoints if refresh or e.info is None or not e.info.complete]
        if len(todo) == 1:  # no task group for one: its errors leave as they are
            await self._discover_endpoint(todo[0])
        else:
            async with anyio.create_task_group() as group:
                for endpoint in todo:
                    group.start_soon(self._discover_endpoint, endpoint)
        if self._model is None:
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
                self._model = found.pop()
        info = backend.info(self._model)
        assert info is not None  # every server has been discovered, if not completely
        every = all(e.info is not None and e.info.complete for e in backend.endpoints)
        unlisted = self._unlisted() == "raise"
        if unlisted and self._model is not None and every and not backend.serving(self._model):
            served = sorted({m for e in backend.endpoints if e.info for m in e.info.models})
            raise ValueError(
                f"model {self._model!r} is not served by any of the {len(backend.endpoints)} "
                f"servers; they serve: {', '.join(map(repr, served)) or '(none)'}"
            )
        if info.has_tokenize and self._tokens.samples == 0:
            await self._calibrate()
        if len(backend.endpoints) > 1:
            logger.info(
                "dsclient: %d servers for model %s, %d serve it, limit %d in all",
                len(backend.endpoints),
                self._model,
                len(backend.serving(self._model)),
                self._limit_now(),
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
                model=self._model,
                max_num_seqs=self._explicit_max_num_seqs,
                priority=self._server_priority,
                max_model_len=self._explicit_max_model_len,
                unlisted=unlisted,  # "raise": the other servers may list it; route it to those
            )
        except ValueError:
            if unlisted == "warn" or self._model is None:
                raise  # several models served here, and none chosen
            try:  # it serves other models: keep what it serves, for calls that ask for them
                info = await discover(self._http, url, max_model_len=self._explicit_max_model_len)
            except ValueError as exc:
                logger.warning("dsclient: %s does not serve model %r: %s", url, self._model, exc)
                info = ServerInfo(url=url, kind="unknown", sources={"model": str(exc)})
        info = self._with_handle_facts(info, url)
        load = None
        if info.kind not in ("ollama", "unknown"):
            load = await fetch_load(self._http, url, model=info.model, timeout=2.0, kind=info.kind)
        endpoint.seed(info, load)
        self._backend.discovered(endpoint)
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

    async def _rediscover_endpoint(self, endpoint: Endpoint) -> None:
        """The backend's health loop found an undiscovered server answering: discover it."""
        async with self._discover_lock:
            if endpoint.info is None or not endpoint.info.complete:
                await self._discover_endpoint(endpoint)

    async def _rediscover(self, *, now: bool = False) -> ServerInfo:
        """Discovery again, if the last one was incomplete and the backend says it is due (or
        ``now``); concurrent callers share one."""
        async with self._discover_lock:
            info = self._info()
            if info is not None and (
                info.complete or (not now and not self._backend.rediscover_due())
            ):
                return info
            return await self._discover_locked()

    async def _wait_for_listing(self) -> ServerInfo:
        """The model is unknown because ``/v1/models`` did not answer: a call must not go out
        without one. Ask again until it answers: while nothing at all answers, wait for the
        server like an outage (``outage_wait``); while it answers but not ``/v1/models``, give it
        ``Retry.attempts`` tries with backoff, then fail. Bounded by the call's own timeout."""
        backend = self._backend
        reach = backend.reach
        tries = 0
        while True:
            info = self._info()
            if info is not None and info.kind == "unknown" and not await backend.probe_all():
                reach.mark_down("discovery: nothing answered")
                await reach.wait_up()
            else:
                tries += 1
                if tries > self._retry.attempts:
                    raise ConnectionError(
                        f"{self._endpoint.url}/v1/models did not answer in {tries - 1} tries, so "
                        "the model to ask for is unknown; pass model= to AsyncClient to send "
                        "without it"
                    )
                if tries > 1:
                    await self._sleep(rediscover_backoff(tries - 1, self._rng))
            info = await self._rediscover(now=True)
            if info.complete or self._model is not None:
                return info

    async def _calibrate(self) -> None:
        """One exact count of a fixed sample text fits the local estimate to the served model."""
        try:
            exact = await self._count_exact(CALIBRATION_TEXT)
        except DSClientError as exc:  # a server that refuses the sample must not break discovery
            logger.debug("dsclient: token calibration failed: %r", exc)
            return
        if exact is not None:
            local = self._tokens.count(CALIBRATION_TEXT)
            self._tokens.learn(local, exact)
            logger.debug(
                "dsclient: calibrated token estimate: sample %d local, %d served (x%.2f)",
                local,
                exact,
                self._tokens.correction,
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
        """Tokens in a prompt or message list: exact via the server's ``/tokenize`` when it
        has one and ``exact`` is true, else the local (corrected) estimate."""
        if isinstance(prompt, str):
            check_prompt(prompt)
        else:
            check_messages(prompt)
        info = await self._ready()
        local = self._tokens.count_any(prompt)
        if exact and info.has_tokenize:
            counted = await self._count_exact(prompt)
            if counted is not None:
                self._tokens.learn(local, counted)
                return counted
        return self._tokens.estimate_from(local)

    def _tokenize_url(self) -> str:
        """Where exact counts are asked: the first server that serves the model, is in rotation
        and has ``/tokenize``; else the first server."""
        backend = self._backend
        for endpoint in backend.serving(self._model):
            info = endpoint.info
            if info is not None and info.has_tokenize and backend.in_rotation(endpoint):
                return endpoint.url
        return self._endpoint.url

    async def _probe_url(self, url: str) -> bool:
        return await self._path.probe_url(url)

    async def _count_exact(self, prompt: Prompt) -> int | None:
        async with self._tokenize_limiter:
            return await count_exact(
                self._http,
                self._tokenize_url(),
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
    ) -> Plan:
        info = await self._ready()
        ctx = info.max_model_len
        tokens = self._tokens
        wanted = max_tokens if max_tokens is not None else self._default_max_tokens
        margin = tokens.margin
        threshold = self._long_threshold or default_long_threshold(ctx)
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
        return Plan(kind, body, lane, send, prompt_tokens)
