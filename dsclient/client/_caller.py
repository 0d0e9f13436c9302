"""One call from its plan to its result: :class:`Caller`.

    caller = Caller(path, planner, url="http://127.0.0.1:8000")
    result = await caller.request("completion", "Once upon a time", 32, 0, None, None, {})

The caller puts the call's timeout around it, degrades it (``dsclient.client._degrade``) rather
than miss that timeout where the call says so, runs its attempts on the request path
(``dsclient.client._pipeline``), builds its result, and tells the observers about it: its
:meth:`Caller.record` is the one place a :class:`~dsclient._observe.CallRecord` is built, for
``generate`` / ``chat``, ``map()``, streams and the calls of other SDKs
(``dsclient.client._transport``) alike.

:class:`~dsclient.AsyncClient` holds one; :meth:`Caller.request` and :meth:`Caller.open_stream`
are the internal entry points that calls, streams, ``map()`` and ``dsclient map`` go through.
"""

from __future__ import annotations

import builtins
import contextlib
import logging
import time
from collections.abc import Callable, Hashable
from typing import Any, Literal, Protocol

import anyio

from .._exceptions import TimeoutError
from .._models import Result
from .._observe import CallRecord, Observer
from ..governor._admission import Admission
from ..governor._pool import NoServerError
from ._degrade import Degrade, Pace, predict_s
from ._pipeline import Answer, Call, RequestPath, WouldMiss
from ._request import USE_DEFAULT, Deadlines, Plan, Prompt, UseDefault, build_result
from ._silence import Silence

__all__ = ["Caller", "Planning"]

logger = logging.getLogger("dsclient")


class Planning(Protocol):
    """What the caller asks of a planner (:class:`~dsclient.client._planner.Planner`)."""

    #: The model its calls name (``None``: the server's only one).
    model: str | None

    async def plan(
        self,
        kind: Literal["completion", "chat"],
        prompt: Prompt,
        max_tokens: int | None,
        sampling: dict[str, Any],
    ) -> Plan:
        """The body, ``max_tokens`` and lane of a call."""
        ...

    def refit(self, plan: Plan, max_model_len: int) -> int:
        """``plan``'s ``max_tokens`` cut to the room a context of ``max_model_len`` leaves."""
        ...


class Caller:
    """The timeout, degradation, attempts, result and record of each call (see the module).

    Parameters:
        path: the request path the attempts take (its backend chooses their servers).
        planner: plans each call.
        url: the server a failure that reached none is recorded against (the first one).
        timeout: seconds for a call that gives none (``None``: no bound).
        degrade: what a call with a timeout gives up rather than miss it, when it gives nothing.
        clock: the latency clock.
    """

    def __init__(
        self,
        path: RequestPath,
        planner: Planning,
        *,
        url: str,
        timeout: float | None = None,
        degrade: Degrade | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.path = path
        self.backend = path.backend
        self.planner = planner
        self.url = url
        self.timeout = timeout
        self.degrade = degrade
        self.clock = clock
        #: Whom :meth:`record` tells about each finished call (empty: no record is built).
        self.observers: list[Observer] = []
        self._pace = Pace()
        #: The calls' timeouts, on one timer (it finds its loop on the first call).
        self._deadlines = Deadlines()
        #: Says once when the calls out have had nothing back for a minute (a hung server).
        backend = self.backend
        self.silence = Silence(url, in_flight=lambda: backend.in_flight)

    def timeout_of(self, timeout: float | UseDefault | None) -> float | None:
        """A call's timeout in seconds: its own, checked, or the default (``USE_DEFAULT``)."""
        if isinstance(timeout, UseDefault):
            return self.timeout
        if timeout is not None and not (isinstance(timeout, (int, float)) and timeout > 0):
            raise ValueError(
                f"timeout must be a positive number of seconds or None, got {timeout!r}"
            )
        return float(timeout) if timeout is not None else None

    def long_in_flight(self) -> int:
        """Long-lane calls of the client's model holding a slot now."""
        return self.backend.long_in_flight(self.planner.model)

    # -- the request path --------------------------------------------------------------------
    async def request(
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
        batch: Hashable = False,
        degrade: Degrade | UseDefault | None = USE_DEFAULT,
    ) -> Result:
        """One call (``generate``, ``chat``, ``map()``): plan, then attempts under the governor
        (see :mod:`dsclient.client._pipeline`), within the timeout; degraded
        (``dsclient.client._degrade``) rather than miss it, when the call says so."""
        limit_s = self.timeout if isinstance(timeout, UseDefault) else self.timeout_of(timeout)
        option = self.degrade if isinstance(degrade, UseDefault) else degrade
        if option is not None and not isinstance(option, Degrade):
            raise TypeError(f"degrade must be a Degrade or None, got {type(option).__name__}")
        start = self.clock()
        path = self.path
        # An item of a map(): the governor's "Batches", keyed by its map where it says which.
        batch = batch or index is not None
        plan: Plan | None = None
        call: Call | None = None
        degraded: str | None = None
        silence = self.silence
        silence.sent()
        back = False  # whether the server gave anything back (an answer or an error)
        try:
            try:
                async with self._deadlines.after(limit_s):  # self.deadline(), one call less
                    plan = await self.planner.plan(kind, prompt, max_tokens, sampling)
                    prefix = self.backend.prefix_of(prompt)
                    miss_at = None
                    if option is not None and limit_s is not None:
                        pace = self._pace.per_token(plan.body.get("model"))
                        need = predict_s(pace, plan.max_tokens, limit_s)
                        left = limit_s - (self.clock() - start)
                        if pace is not None and need > left:
                            plan, degraded = self.degraded(
                                plan, option, f"about {need:.1f} s needed, {left:.1f} s left"
                            )
                        else:
                            miss_at = anyio.current_time() + max(0.0, left - need)
                    call = path.new_call(_admission(plan, urgency, group, prefix, batch))
                    try:
                        answer = await path.send_json(plan.path, plan.body, call, miss_at=miss_at)
                    except WouldMiss as late:
                        assert option is not None and limit_s is not None
                        left = limit_s - (self.clock() - start)
                        plan, degraded = self.degraded(
                            plan,
                            option,
                            f"waited {late.waited_s:.1f} s for a slot, {left:.1f} s left",
                        )
                        call = path.new_call(_admission(plan, urgency, group, prefix, batch))
                        answer = await path.send_json(plan.path, plan.body, call)
            except TimeoutError:  # dsclient's, from inside (a read timeout): it says what
                raise
            except builtins.TimeoutError as exc:  # the call's own deadline
                expired = TimeoutError(f"call did not finish within its timeout of {limit_s} s")
                if call is not None and call.cut is not None:
                    expired.server = call.cut.url  # cut in flight there: its record names it
                raise expired from exc
            latency = self.clock() - start
            server = answer.server
            data = answer.data
            assert data is not None  # send_json's answer
            result = build_result(
                kind,
                data,
                latency,
                answer.queued_s,
                answer.attempts,
                plan,
                index,
                server,
                degraded,
            )
            self._pace.observe(
                plan.body.get("model"), latency - answer.queued_s, result.usage.completion_tokens
            )
            back = True
        except Exception as exc:
            back = not isinstance(exc, builtins.TimeoutError)  # a timeout is more silence
            if self.observers:
                self.record(
                    kind,
                    lane=plan.lane if plan is not None else None,
                    group=group,
                    error=exc,
                    latency_s=self.clock() - start,
                )
            raise
        finally:
            silence.ended(back)
        if self.observers:
            self.record(
                kind,
                server=server,
                lane=result.lane,
                group=group,
                latency_s=result.latency_s,
                queued_s=result.queued_s,
                attempts=result.attempts,
                prompt_tokens=result.usage.prompt_tokens,
                completion_tokens=result.usage.completion_tokens,
            )
        return result

    def deadline(self, seconds: float | None) -> contextlib.AbstractAsyncContextManager[Any]:
        """A scope for one call of ``seconds`` (``None``: no bound) on the caller's
        :class:`~dsclient.client._request.Deadlines`: the builtin ``TimeoutError`` after them."""
        return self._deadlines.after(seconds)

    def degraded(self, plan: Plan, option: Degrade, why: str) -> tuple[Plan, str]:
        """``plan`` changed as ``option`` says, and the words the result carries about it."""
        body = dict(plan.body)
        changes: list[str] = []
        max_tokens = plan.max_tokens
        if option.model is not None and option.model != body.get("model"):
            serving = self.backend.serving(option.model)
            contexts = [e.info.max_model_len for e in serving if e.info and e.info.max_model_len]
            if not serving:
                raise NoServerError(
                    f"cannot degrade to model {option.model!r}: no server of this client serves it"
                )
            if contexts:
                max_tokens = self.planner.refit(plan, min(contexts))
            changes.append(f"model {body.get('model')!r} -> {option.model!r}")
            body["model"] = option.model
        if option.max_tokens is not None and option.max_tokens < max_tokens:
            max_tokens = option.max_tokens
        if max_tokens != plan.max_tokens:
            changes.append(f"max_tokens {plan.max_tokens} -> {max_tokens}")
            body["max_tokens"] = max_tokens
        if not changes:
            changes.append("nothing left to give up")
        held = plan.kv_tokens - plan.max_tokens + max_tokens
        degraded = Plan(plan.kind, body, plan.lane, max_tokens, plan.prompt_tokens, held)
        text = ", ".join(changes) + ": " + why
        logger.info("dsclient: call degraded: %s", text)
        return degraded, text

    async def open_stream(
        self,
        prompt: Prompt,
        max_tokens: int | None,
        urgency: int,
        group: str | None,
        sampling: dict[str, Any],
    ) -> tuple[Plan, Answer]:
        """The entry point of a stream: plan, then open it under a slot the caller holds
        (``Answer.slot``; ``Answer.response`` is open)."""
        kind: Literal["completion", "chat"] = "completion" if isinstance(prompt, str) else "chat"
        plan = await self.planner.plan(kind, prompt, max_tokens, dict(sampling))
        body = dict(plan.body, stream=True)
        prefix = self.backend.prefix_of(prompt)
        call = self.path.new_call(_admission(plan, urgency, group, prefix, False))
        return plan, await self.path.open_stream(plan.path, body, call)

    # -- observers ---------------------------------------------------------------------------
    def record(
        self,
        kind: Literal["completion", "chat", "stream", "embedding"],
        *,
        lane: str | None,
        group: str | None,
        latency_s: float,
        error: BaseException | str | None = None,
        status: int | None = None,
        server: str | None = None,
        attempts: int | None = None,
        queued_s: float | None = None,
        prompt_tokens: int | None = None,
        completion_tokens: int | None = None,
    ) -> None:
        """Tell every observer about one finished call: the one builder of a
        :class:`~dsclient._observe.CallRecord`. Callers check :attr:`observers` first, so that
        nobody listening costs nothing.

        Parameters:
            error: what the call failed with (``None``: it did not), or its name where there is
                no exception (a refusal the client answered itself).
            status: the failure's HTTP status; default the error's ``status`` (0: none).
            server: the server that answered, or whose attempt failed; default the error's
                ``server``, else :attr:`url` (a call that reached none: the client's own queue,
                a timeout while waiting for a slot, discovery, the outage gate).
            attempts: default the error's ``attempts``, else 1.
        """
        name: str | None = None
        if error is not None:
            if isinstance(error, str):
                name = error
            else:
                name = type(error).__name__
                if status is None:
                    status = getattr(error, "status", None) or None
            if server is None:
                failed_at = getattr(error, "server", None)
                server = failed_at if isinstance(failed_at, str) else None
            if attempts is None:
                tried = getattr(error, "attempts", 1)
                attempts = tried if isinstance(tried, int) else 1
        record = CallRecord(
            kind=kind,
            server=server or self.url,
            lane=lane,
            group=group,
            error=name,
            status=status,
            latency_s=latency_s,
            queued_s=queued_s,
            attempts=attempts if attempts is not None else 1,
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
        )
        for observer in self.observers:
            try:
                observer(record)
            except Exception:  # an observer's bug must not fail the call
                logger.exception("dsclient: an observer raised; ignoring it")


def _admission(
    plan: Plan, urgency: int, group: str | None, prefix: str | None, batch: Hashable
) -> Admission:
    """The governor's view of one call as ``plan`` sends it (its lane and KV cache tokens; its
    prompt's tokens, as held less ``max_tokens``, and ``max_tokens``, for its tenant's charge)."""
    model = plan.body.get("model")
    return Admission(
        plan.lane,
        urgency,
        group,
        model,
        prefix,
        batch,
        plan.kv_tokens,
        plan.prompt_tokens,
        max(0, plan.kv_tokens - plan.max_tokens),
        plan.max_tokens,
    )
