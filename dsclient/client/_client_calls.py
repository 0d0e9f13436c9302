"""One call of :class:`~dsclient.AsyncClient` from its plan to its result: the timeout around
it, degradation on deadline, the attempts (``dsclient.client._pipeline``), the result, the
observers.

:class:`CallsMixin` is part of :class:`~dsclient.AsyncClient`: ``generate``, ``chat``,
``map()``, streams and ``dsclient map`` all come through :meth:`CallsMixin._request` or
:meth:`CallsMixin._open_stream`; the client (``dsclient.client._client``) sets every attribute
declared
here.
"""

from __future__ import annotations

import builtins
import contextlib
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal

import anyio

from .._exceptions import TimeoutError
from .._http import httpx
from .._models import Result
from .._observe import CallRecord, Observer
from ..governor._backend import Backend
from ..governor._endpoint import Endpoint
from ..governor._pool import NoServerError
from ._degrade import Degrade, Pace, predict_s
from ._pipeline import Call, RequestPath, WouldMiss
from ._request import USE_DEFAULT, Deadlines, Plan, Prompt, UseDefault, build_result
from ._tokens import TokenCounter, plan_max_tokens

if TYPE_CHECKING:
    from ..governor._backend import Lease

__all__ = ["CallsMixin"]

logger = logging.getLogger("dsclient")


class CallsMixin:
    """The request path of :class:`~dsclient.AsyncClient` (see the module)."""

    _endpoint: Endpoint
    _backend: Backend
    _path: RequestPath
    _degrade: Degrade | None
    _pace: Pace
    _tokens: TokenCounter
    _default_max_tokens: int
    _observers: list[Observer]
    _clock: Callable[[], float]
    #: The calls' timeouts, on one timer (made on the first call).
    _deadlines: Deadlines | None = None

    if TYPE_CHECKING:  # defined by the client and by DiscoveryMixin

        def _timeout_of(self, timeout: float | UseDefault | None) -> float | None: ...

        async def _plan(
            self,
            kind: Literal["completion", "chat"],
            prompt: Prompt,
            max_tokens: int | None,
            sampling: dict[str, Any],
        ) -> Plan: ...

    # -- the request path --------------------------------------------------------------------
    async def _request(
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
        degrade: Degrade | UseDefault | None = USE_DEFAULT,
    ) -> Result:
        """The one internal entry point of a call (``generate``, ``chat``, ``map()``): plan,
        then attempts under the governor (see :mod:`dsclient.client._pipeline`), within the timeout;
        degraded (``dsclient.client._degrade``) rather than miss it, when the call says so."""
        limit_s = self._timeout_of(timeout)
        option = self._degrade if isinstance(degrade, UseDefault) else degrade
        if option is not None and not isinstance(option, Degrade):
            raise TypeError(f"degrade must be a Degrade or None, got {type(option).__name__}")
        start = self._clock()
        plan: Plan | None = None
        call: Call | None = None
        degraded: str | None = None
        try:
            try:
                async with self._deadline(limit_s):
                    plan = await self._plan(kind, prompt, max_tokens, sampling)
                    prefix = self._backend.prefix_of(prompt)
                    miss_at = None
                    if option is not None and limit_s is not None:
                        pace = self._pace.per_token(plan.body.get("model"))
                        need = predict_s(pace, plan.max_tokens, limit_s)
                        left = limit_s - (self._clock() - start)
                        if pace is not None and need > left:
                            plan, degraded = self._degraded(
                                plan, option, f"about {need:.1f} s needed, {left:.1f} s left"
                            )
                        else:
                            miss_at = anyio.current_time() + max(0.0, left - need)
                    call = self._path.new_call(plan.body.get("model"), prefix)
                    try:
                        data, attempts, queued, server = await self._path.send_json(
                            plan.path,
                            plan.body,
                            lane=plan.lane,
                            urgency=urgency,
                            group=group,
                            miss_at=miss_at,
                            call=call,
                        )
                    except WouldMiss as late:
                        assert option is not None and limit_s is not None
                        left = limit_s - (self._clock() - start)
                        plan, degraded = self._degraded(
                            plan,
                            option,
                            f"waited {late.waited_s:.1f} s for a slot, {left:.1f} s left",
                        )
                        call = self._path.new_call(plan.body.get("model"), prefix)
                        data, attempts, queued, server = await self._path.send_json(
                            plan.path,
                            plan.body,
                            lane=plan.lane,
                            urgency=urgency,
                            group=group,
                            call=call,
                        )
            except builtins.TimeoutError as exc:
                expired = TimeoutError(f"call did not finish within its timeout of {limit_s} s")
                if call is not None and call.cut is not None:
                    expired.server = call.cut.url  # cut in flight there: its record names it
                raise expired from exc
            latency = self._clock() - start
            result = build_result(
                kind, data, latency, queued, attempts, plan, index, server, degraded
            )
            self._pace.observe(
                plan.body.get("model"), latency - queued, result.usage.completion_tokens
            )
        except Exception as exc:
            if self._observers:
                self._observe_failure(kind, plan, group, exc, start)
            raise
        if self._observers:
            self._notify(
                CallRecord(
                    kind=kind,
                    server=server,
                    lane=result.lane,
                    group=group,
                    error=None,
                    status=None,
                    latency_s=result.latency_s,
                    queued_s=result.queued_s,
                    attempts=result.attempts,
                    prompt_tokens=result.usage.prompt_tokens,
                    completion_tokens=result.usage.completion_tokens,
                )
            )
        return result

    def _deadline(self, seconds: float | None) -> contextlib.AbstractAsyncContextManager[Any]:
        """A scope for one call of ``seconds`` (``None``: no bound) on the client's
        :class:`~dsclient.client._request.Deadlines`: the builtin ``TimeoutError`` after them."""
        deadlines = self._deadlines
        if deadlines is None:
            deadlines = self._deadlines = Deadlines()
        return deadlines.after(seconds)

    def _degraded(self, plan: Plan, option: Degrade, why: str) -> tuple[Plan, str]:
        """``plan`` changed as ``option`` says, and the words the result carries about it."""
        body = dict(plan.body)
        changes: list[str] = []
        max_tokens = plan.max_tokens
        if option.model is not None and option.model != body.get("model"):
            serving = self._backend.serving(option.model)
            contexts = [e.info.max_model_len for e in serving if e.info and e.info.max_model_len]
            if not serving:
                raise NoServerError(
                    f"cannot degrade to model {option.model!r}: no server of this client serves it"
                )
            if contexts:
                max_tokens = plan_max_tokens(
                    prompt_tokens=plan.prompt_tokens,
                    requested=max_tokens,
                    default=self._default_max_tokens,
                    max_model_len=min(contexts),
                    margin=self._tokens.margin,
                )
            changes.append(f"model {body.get('model')!r} -> {option.model!r}")
            body["model"] = option.model
        if option.max_tokens is not None and option.max_tokens < max_tokens:
            max_tokens = option.max_tokens
        if max_tokens != plan.max_tokens:
            changes.append(f"max_tokens {plan.max_tokens} -> {max_tokens}")
            body["max_tokens"] = max_tokens
        if not changes:
            changes.append("nothing left to give up")
        degraded = Plan(plan.kind, body, plan.lane, max_tokens, plan.prompt_tokens)
        text = ", ".join(changes) + ": " + why
        logger.info("dsclient: call degraded: %s", text)
        return degraded, text

    def _observe_failure(
        self,
        kind: Literal["completion", "chat", "stream"],
        plan: Plan | None,
        group: str | None,
        exc: Exception,
        start: float,
    ) -> None:
        attempts = getattr(exc, "attempts", 1)
        # The server whose attempt failed, or was in flight when the timeout cut the call. The
        # first server stands in where the call reached none: the client's own queue, a timeout
        # while waiting for a slot or between attempts, discovery, the outage gate.
        server = getattr(exc, "server", None)
        self._notify(
            CallRecord(
                kind=kind,
                server=server if isinstance(server, str) else self._endpoint.url,
                lane=plan.lane if plan is not None else None,
                group=group,
                error=type(exc).__name__,
                status=getattr(exc, "status", None) or None,
                latency_s=self._clock() - start,
                queued_s=None,
                attempts=attempts if isinstance(attempts, int) else 1,
                prompt_tokens=None,
                completion_tokens=None,
            )
        )

    def _notify(self, record: CallRecord) -> None:
        for observer in self._observers:
            try:
                observer(record)
            except Exception:  # an observer's bug must not fail the call
                logger.exception("dsclient: an observer raised; ignoring it")

    async def _open_stream(
        self,
        prompt: Prompt,
        max_tokens: int | None,
        urgency: int,
        group: str | None,
        sampling: dict[str, Any],
    ) -> tuple[Plan, httpx.Response, Lease, int, str]:
        """The entry point of a stream: plan, then open it under a slot the caller holds."""
        kind: Literal["completion", "chat"] = "completion" if isinstance(prompt, str) else "chat"
        plan = await self._plan(kind, prompt, max_tokens, dict(sampling))
        body = dict(plan.body, stream=True)
        response, slot, attempts, _, server = await self._path.open_stream(
            plan.path,
            body,
            lane=plan.lane,
            urgency=urgency,
            group=group,
            prefix=self._backend.prefix_of(prompt),
        )
        return plan, response, slot, attempts, server
