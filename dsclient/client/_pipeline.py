"""The request path, one attempt at a time: a slot, one send, the slot back with its outcome.

    path = RequestPath(http, backend, retry, budget, sleep=anyio.sleep, rng=random.Random())
    call = path.new_call(Admission("short", model="tiny"))
    answer = await path.send_json("/v1/completions", body, call)
    answer.data, answer.attempts, answer.queued_s, answer.server

Each attempt takes its own slot from the backend (:mod:`dsclient.governor._backend`: one
server's governor, or a pool's line and the server its router chose), sends once, and releases
the slot with what happened (``ok``, ``overloaded``, ``error``, ``cancelled``); the governor
passes that and the attempt's service time to the limit controller. A retry's backoff sleeps
*outside* any slot, so a sleeping call holds no capacity and service times never include sleeps.
Retries follow :class:`~dsclient.client._retry.Retry` (after a first failure, tenacity's
``AsyncRetrying`` drives the loop: :meth:`RequestPath._retry_loop`); a retry spends one token of
the retry budget, and only a retry that happens spends one.

One exception: under an adaptive limit, a refusal for load (429 / 503) is congestion, not a
failure. It is retried without a token, up to ``Retry.overload_attempts`` tries rather than
``Retry.attempts``. The refusal has just cut the limit, and the retry takes a slot again under
that cut limit, so these retries cannot add load beyond what the controller allows: they are the
queue moving back to the client, as intended. A server that refuses everything still sees a
bounded number of tries per call, paced by backoff and by a limit that keeps shrinking towards 1.
(vLLM's ``--max-num-queued-reqs`` answers 503 the moment its queue is full; charging those to
the budget, or giving them four tries, lost requests in a burst.)

A server that stops answering (a connection fails or drops) is marked down in :attr:`reach` (with
a pool: it leaves the rotation, and the call goes to another server at once);
every attempt first waits at that gate, so calls wait on the client while one of them probes
``/health`` (:class:`~dsclient.governor._health.Reachability`), instead of spending attempts and the
budget on a dead server. Any answer opens the gate again. The calls whose connections died with
the server (in flight when it was killed) are victims of the same outage: once a failed probe has
confirmed it, they wait at the gate with the rest and then try again, outside the budget and the
attempt count (``Retry.outage_retries``). A dropped connection on a server whose first probe
answers at once is an ordinary failure: it spends the budget like any other.
"""

from __future__ import annotations

import functools
import logging
import random
import re
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from json import JSONEncoder
from json import encoder as json_encoder
from typing import Any, Final, TypeVar

import anyio
from tenacity import AsyncRetrying, RetryCallState

from .._exceptions import (
    ConnectionError,
    DSClientError,
    Overloaded,
    RequestRefused,
    error_from_response,
    redact,
    translate_request_error,
)
from .._http import AiohttpTransport, RawHeaders, Read, httpx
from .._streaming import MAX_BODY_BYTES, json_object, read_body, read_json, read_prefix
from ..governor._admission import Admission
from ..governor._backend import Backend, Lease, SingleServer
from ..governor._endpoint import Endpoint
from ..governor._load import LOAD_HEADER, LOAD_HEADER_FORMAT
from ._priority import with_priority
from ._retry import Retry, RetryBudget, compute_backoff, describe, is_retryable, retry_after_of

__all__ = ["Answer", "Call", "RequestPath", "WouldMiss", "completion_tokens", "outcome_of"]

logger = logging.getLogger("dsclient")
T = TypeVar("T")


class WouldMiss(Exception):
    """A call still waits for its first slot at the time it gave itself (``miss_at``): waiting
    longer would miss its deadline. Internal: the client degrades the call and sends it again
    (``dsclient.client._degrade``)."""

    def __init__(self, waited_s: float) -> None:
        super().__init__(f"waited {waited_s:.2f} s for a slot")
        self.waited_s = waited_s


def body_encoder() -> Callable[[Any], str]:
    """``encode(body)``: JSON as httpx encodes a request's ``json=`` (compact, UTF-8, no NaN,
    a circular reference refused), with its encoder made once.

        encode = body_encoder()
        encode({"prompt": "Hi", "max_tokens": 8})   # '{"prompt":"Hi","max_tokens":8}'

    ``JSONEncoder.encode`` makes a C encoder (and a closure) on every call: half the cost of
    encoding a body (``json.dumps`` with arguments also makes the ``JSONEncoder``). Here the C
    encoder is made once, where Python has one, with its own record of the containers being
    encoded (the circular check), emptied when an encoding fails part way. One per request path:
    a client's calls run on one loop, so one encoding is never under way beside another.
    """
    python = JSONEncoder(ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    make = getattr(json_encoder, "c_make_encoder", None)
    if make is None:  # pragma: no cover - CPython has the C encoder
        return python.encode
    markers: dict[int, Any] = {}
    encoder = make(
        markers, python.default, json_encoder.encode_basestring, None, ":", ",", False, False, False
    )

    def encode(body: Any) -> str:
        try:
            return "".join(encoder(body, 0))
        except BaseException:
            markers.clear()  # what the encoding left part way
            raise

    return encode


#: The header that names a call's tenant (its group) to a gateway in front of the server:
#: llm-d's flow control keys its fairness queues by it.
FAIRNESS_HEADER: Final = "x-gateway-inference-fairness-id"
FAIRNESS_HEADER_RAW: Final = FAIRNESS_HEADER.encode()
#: The request header that asks vLLM for its load on the answer (``_load.LOAD_HEADER_FORMAT``).
_ASK_LOAD_RAW = ((LOAD_HEADER_FORMAT.encode(), b"TEXT"),)
#: ``usage.completion_tokens`` in a raw JSON answer (at its end, where OpenAI-shaped answers put
#: ``usage``), read without parsing the body another SDK will parse.
_COMPLETION_TOKENS = re.compile(rb'"completion_tokens"\s*:\s*(\d{1,9})\b')


def completion_tokens(data: Any) -> float | None:
    """The output tokens an OpenAI-shaped answer reports (``usage.completion_tokens``): the work
    the limit controller's throughput counts. Where the server reports none (transformers'
    server answers 0), a quarter of the characters of the first choice's text stands in;
    ``None`` if there is neither."""
    usage = data.get("usage") if isinstance(data, dict) else None
    tokens = usage.get("completion_tokens") if isinstance(usage, dict) else None
    if not isinstance(tokens, bool) and isinstance(tokens, int) and 0 < tokens < 2**31:
        return float(tokens)
    choices = data.get("choices") if isinstance(data, dict) else None
    first = choices[0] if isinstance(choices, list) and choices else None
    if not isinstance(first, dict):
        return None
    message = first.get("message")
    text = first.get("text") if "text" in first else None
    if text is None and isinstance(message, dict):
        text = message.get("content")
    return max(1.0, len(text) / 4) if isinstance(text, str) and text else None


def outcome_of(exc: BaseException) -> str:
    """The governor's name for how an attempt failed: ``"overloaded"`` when the server refused
    for load (429 / 503), else ``"error"``."""
    return "overloaded" if isinstance(exc, Overloaded) and exc.status != 0 else "error"


class RequestPath:
    """Sends planned requests to a backend's servers, attempt by attempt, under its governors.

    Parameters:
        http: the shared ``httpx.AsyncClient`` (auth headers, transport).
        backend: where attempts go (:class:`~dsclient.governor._backend.Backend`: one server, or
            a pool); an :class:`~dsclient.governor._endpoint.Endpoint` stands for a backend of
            that one server, whose health probe is :meth:`probe_url`.
        retry: the retry policy; budget: the retry budget shared by every call of the client.
        sleep, rng: injectable for tests (backoff sleeps, jitter).
        max_body_bytes: the most bytes of an answer read (default :data:`MAX_BODY_BYTES`,
            16 MiB); a longer one ends the call in ``ResponseTooLarge``, unread and not retried.
            Streams apply it to each line and event
            (:func:`~dsclient._streaming.sse_events`).
        outage_wait: seconds calls wait for a server that stopped answering (see
            :class:`~dsclient.governor._health.Reachability`); ``None``: only their own timeouts.
            Used only where ``backend`` is an ``Endpoint`` (a backend has its own).
    """

    def __init__(
        self,
        http: httpx.AsyncClient,
        backend: Backend | Endpoint,
        retry: Retry,
        budget: RetryBudget,
        *,
        sleep: Callable[[float], Awaitable[None]],
        rng: random.Random,
        max_body_bytes: int = MAX_BODY_BYTES,
        outage_wait: float | None = 300.0,
    ) -> None:
        if isinstance(max_body_bytes, bool) or not isinstance(max_body_bytes, int):
            raise TypeError(f"max_body_bytes must be an int, got {type(max_body_bytes).__name__}")
        if max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be >= 1, got {max_body_bytes}")
        self.max_body_bytes = max_body_bytes
        #: Each tenant's rank by weight, sent in the server's ``priority`` (``group_priority``
        #: of the client); ``None``: lane and urgency alone.
        self.group_ranks: Mapping[str | None, int] | None = None
        self._http = http
        #: What :meth:`_post` puts on every request (read from ``http`` on first use), the URLs
        #: it has parsed, and the transport it hands the parts to directly (``None``: none).
        self._headers: RawHeaders | None = None
        self._headers_load: RawHeaders = ()
        self._timeouts: dict[str, float | None] = {}
        self._urls: dict[str, httpx.URL] = {}
        self._direct: AiohttpTransport | None = None
        self._encode = body_encoder()
        #: Where each attempt goes: its slot, its server, its server's health.
        self.backend: Backend = (
            SingleServer(
                backend, probe=self.probe_url, sleep=sleep, rng=rng, outage_wait=outage_wait
            )
            if isinstance(backend, Endpoint)
            else backend
        )
        #: The server requests are built for (:meth:`_aim` re-aims them at the one chosen).
        self._first = self.backend.endpoints[0]
        self._retry = retry
        self._budget = budget
        self._sleep = sleep
        self._rng = rng
        #: Whether the server answers at all (with a pool: whether any does); attempts wait at
        #: its gate while it does not.
        self.reach = self.backend.reach

    def new_call(self, admission: Admission) -> Call:
        """The state the attempts of one call share (its admission, the time it queued, the
        servers it failed on), for a caller that reads it after the call ends another way than
        by returning (its deadline: ``Call.cut``)."""
        return Call(self._first, admission)

    async def probe_url(self, root: str) -> bool:
        """Whether the server at ``root`` answers: any answer to ``GET /health`` but a 5xx (a
        server without the route answers 404, which is an answer). Only the status is read: the
        body, whatever its size, never is."""
        url = root + "/health"
        try:
            async with self._http.stream("GET", url, timeout=5.0) as response:
                return response.status_code < 500
        except httpx.HTTPError:
            return False

    # -- one attempt -----------------------------------------------------------------------------
    async def _open(
        self, root: str, path: str, body: dict[str, Any], *, fairness: str | None = None
    ) -> httpx.Response:
        """One streaming POST, open once its status is known to be fine."""
        try:
            response = await self._post(root + path, body, fairness=fairness)
        except httpx.RequestError as exc:
            raise translate_request_error(exc) from exc
        assert not isinstance(response, Read)  # nothing asked it to read
        if response.status_code >= 400:
            try:
                prefix = await read_prefix(response)
            finally:
                await response.aclose()
            error = error_from_response(response, prefix)
            self.redact_error(error)
            raise error
        return response

    def redact_error(self, exc: DSClientError) -> None:
        """Keep the API key out of an error whose text came from the server (an echo of the
        request's headers): the errors end up in logs and in results files."""
        scheme, _, token = self._http.headers.get("authorization", "").partition(" ")
        secret = token.strip() or scheme.strip()
        if len(secret) >= 6:  # replacing a word-sized "key" would garble the message instead
            redact(exc, secret)

    # -- where an attempt goes ------------------------------------------------------------------
    async def _take(self, call: Call) -> Lease:
        """A slot for one attempt from the backend, and the server it goes to (``call.endpoint``).
        The first attempt of a call that may degrade waits for it only until ``call.miss_at``."""
        miss_at, call.miss_at = call.miss_at, None
        if miss_at is not None:
            # The first attempt of a call that may degrade waits for its slot only until then.
            began = anyio.current_time()
            with anyio.move_on_after(max(0.0, miss_at - began)):
                return await self._take(call)
            raise WouldMiss(anyio.current_time() - began)
        backend = self.backend
        slot = await backend.acquire(call.admission, avoid=call.avoid)
        call.endpoint = backend.server_of(slot)
        call.queued_s += slot.queued_s
        return slot

    async def _gate(self, call: Call) -> None:
        """Wait, on the client, while the server (with a pool: every server for the call's
        model) does not answer."""
        backend = self.backend
        model = call.admission.model
        if not backend.gate_is_open(model):
            await backend.gate(model)

    # -- attempts ------------------------------------------------------------------------------
    def send_json(
        self, path: str, body: dict[str, Any], call: Call, *, miss_at: float | None = None
    ) -> Coroutine[Any, Any, Answer]:
        """POST ``body`` until it succeeds or may not be retried; the answer's JSON is
        ``Answer.data``.

        ``call`` comes from :meth:`new_call`, with the call's admission (the body's model,
        and the prompt's text as the prefix a pool's router matches against the prefixes each
        server probably holds in its cache). With ``miss_at`` (on ``anyio.current_time()``), a
        first attempt still waiting for a slot then raises :class:`WouldMiss` instead (nothing
        was sent).

        What it gives is the attempts' own coroutine, to await: a coroutine around it was one
        more object that each call held while it waited for its slot.
        """
        call.miss_at = miss_at
        return self._attempts(call, path, RequestPath._json_once, path, body, None)

    async def open_stream(self, path: str, body: dict[str, Any], call: Call) -> Answer:
        """Open a streaming response under a slot: ``Answer.response`` open, ``Answer.slot``
        held.

        Retried only while nothing has been received. The caller holds the slot while it
        reads, and must ``answer.slot.release(...)`` when done.
        """
        return await self._attempts(call, path, RequestPath._stream_once, path, body, None)

    async def send_raw(self, request: httpx.Request, call: Call, *, stream: bool) -> Answer:
        """Send a caller's request attempt by attempt, as :meth:`send_json` does, and give back
        the server's answer instead of raising for its status (``dsclient/client/_transport.py``
        hands it to another SDK, which maps statuses to its own errors).

        ``request`` is built once by the caller (URL, headers, body: see
        :meth:`GovernedTransport <dsclient.client._transport.GovernedTransport>`) and sent as it
        is by every attempt, straight to the shared client's transport (:meth:`_exchange`); with
        a pool, an attempt the router sends to another server gets a copy aimed at that server.
        A 2xx body is read under the cap and its slot released; with ``stream`` the response
        comes back open and the caller holds ``Answer.slot`` until it is done. A refusal that
        may not be retried (or whose retries are spent) comes back as the last answer, its body
        read (at most ``ERROR_BODY_BYTES``, the API key blanked out) and ``Answer.error`` set.

        Raises:
            DSClientError: what has no answer: a transport failure, the outage gate giving up,
                a body over the cap, the client's own full queue (``Overloaded(0)``).
        """
        refused: list[tuple[DSClientError, Answer]] = []
        try:
            return await self._attempts(
                call, request.url.path, RequestPath._raw_once, request, stream, refused
            )
        except RequestRefused as exc:
            if not refused or refused[0][0] is not exc:
                raise
            answer = refused[0][1]
            answer.attempts, answer.queued_s = exc.attempts, call.queued_s
            answer.server = call.endpoint.url
            answer.error = exc
            return answer

    # -- the attempt skeleton, and the three kinds of send -------------------------------------
    async def _attempts(
        self, call: Call, label: str, once: Send, first: Any, second: Any, third: Any
    ) -> Answer:
        """Attempts of ``once`` until one succeeds or the call may not go on; the answer, with
        the call's ``attempts``, ``queued_s`` and ``server``.

        Every attempt first passes the outage gate (:attr:`reach`): at once while the server
        answers; a gate that gave up on the server raises ``ConnectionError``, which is not
        retried (no attempt was made, and the gate already waited). The first attempt runs
        here (:meth:`_attempt`'s steps, inline), and the retry loop (:meth:`_retry_loop`, with
        its partial) is built only after a failure: a call that succeeds at once, nearly every
        call, makes a few objects fewer (at hundreds in flight their allocation and garbage
        collection were a tenth of the call's CPU). Inline, the first attempt's coroutine is
        not one more object that each call holds while it waits for its slot.

        ``first``, ``second`` and ``third`` are what ``once`` takes after the call (a JSON
        send: path, body and ``None``): named, not ``*args``, whose tuple (it holds the body)
        was one more object for the collector in every waiting call.
        """
        backend = self.backend
        backend.wake()
        self._budget.record_request()
        model = call.admission.model
        if not backend.gate_is_open(model):
            await backend.gate(model)
        try:
            if call.miss_at is None:
                slot = await backend.acquire(call.admission, avoid=call.avoid)
                server = call.endpoint = backend.server_of(slot)
                call.queued_s += slot.queued_s
            else:
                slot = await self._take(call)
                server = call.endpoint
            try:
                answer = await once(self, server, slot, call, first, second, third)
            except BaseException as exc:
                self._release_failed(slot, exc, call)
                raise
            backend.settle(slot, None, model)
            if answer.slot is None:
                slot.release()
            attempts = 1
        except DSClientError as failed:
            if self._retry.attempts <= 1 or not is_retryable(failed):
                raise
            retry = functools.partial(self._attempt, call, once, (first, second, third))
            answer, attempts = await self._retry_loop(retry, failed, label, call)
        answer.attempts, answer.queued_s = attempts, call.queued_s
        answer.server = call.endpoint.url
        return answer

    async def _attempt(self, call: Call, once: Send, args: tuple[Any, ...]) -> Answer:
        """One attempt: a slot from the backend, one send (``once``), the slot back with its
        outcome; a send that hands its slot on (``Answer.slot``: an open stream) keeps it.
        (:meth:`_attempts` runs the first attempt's steps itself; this is every retry.)"""
        if call.miss_at is None:  # _take's common case, inline
            backend = self.backend
            slot = await backend.acquire(call.admission, avoid=call.avoid)
            server = call.endpoint = backend.server_of(slot)
            call.queued_s += slot.queued_s
        else:
            slot = await self._take(call)
            server = call.endpoint
        try:
            answer = await once(self, server, slot, call, *args)
        except BaseException as exc:
            self._release_failed(slot, exc, call)
            raise
        self.backend.settle(slot, None, call.admission.model)
        if answer.slot is None:
            slot.release()
        return answer

    async def _json_once(
        self,
        server: Endpoint,
        slot: Lease,
        call: Call,
        path: str,
        body: dict[str, Any],
        _: None,
    ) -> Answer:
        """One POST of a JSON body, with the server's priority: check the status, read the body
        under the cap, parse JSON; the answer's JSON, its completion tokens as the slot's work.
        Raises dsclient errors only. Where the server publishes no queue, the request asks for
        its load on the answer (vLLM's ``endpoint-load-metrics``), and the server reads it.
        (One coroutine, not one around another: one less a call.)"""
        body = _prioritised(body, server, call.admission, self.group_ranks)
        wants = server.ask_load_header()
        limit = self.max_body_bytes
        try:
            response = await self._post(
                server.url + path,
                body,
                ask_load=wants,
                read_up_to=limit,
                fairness=call.admission.group,
            )
        except httpx.RequestError as exc:
            raise translate_request_error(exc) from exc
        data: dict[str, Any]
        try:
            if isinstance(response, Read):  # a 2xx read whole by the transport, under the cap
                if wants:
                    server.observe_answer(response.headers.get(LOAD_HEADER))
                data = json_object(response.content, response.status_code)
            else:
                try:
                    if response.status_code >= 400:
                        raise error_from_response(response, await read_prefix(response))
                    if wants:
                        server.observe_answer(response.headers.get(LOAD_HEADER))
                    data = await read_json(response, limit=limit)
                finally:
                    await response.aclose()
        except DSClientError as exc:
            self.redact_error(exc)
            raise
        slot.work = completion_tokens(data)
        return Answer(None, None, None, data)

    async def _stream_once(
        self,
        server: Endpoint,
        slot: Lease,
        call: Call,
        path: str,
        body: dict[str, Any],
        _: None,
    ) -> Answer:
        """One streaming POST, open once its status is known to be fine; its slot handed on."""
        sent = _prioritised(body, server, call.admission, self.group_ranks)
        opened = await self._open(server.url, path, sent, fairness=call.admission.group)
        return Answer(opened, None, slot)

    async def _raw_once(
        self,
        server: Endpoint,
        slot: Lease,
        call: Call,
        request: httpx.Request,
        stream: bool,
        refused: list[tuple[DSClientError, Answer]],
    ) -> Answer:
        """One send of a caller's request; a refusal is kept in ``refused`` (the last one comes
        back as the answer when it may not be retried) and raised."""
        group = call.admission.group
        if group is not None and FAIRNESS_HEADER not in request.headers:
            request.headers[FAIRNESS_HEADER] = group
        response, body = await self._exchange(self._aim(request, call), stream)
        if body is None:  # an open stream: its slot handed on
            return Answer(response, None, slot)
        if response.status_code >= 400:
            error = error_from_response(response, body)
            self.redact_error(error)
            refused[:] = [(error, Answer(response, self._redact_bytes(body), None))]
            raise error
        server.observe_answer(response.headers.get(LOAD_HEADER))
        found = _COMPLETION_TOKENS.search(body, max(0, len(body) - 512))
        slot.work = float(found[1]) if found is not None else None
        return Answer(response, body, None)

    def _aim(self, request: httpx.Request, call: Call) -> httpx.Request:
        """``request`` as built (for the first server), or a copy aimed at the server the router
        chose for this attempt: same method, path, headers (``Host`` changed) and body."""
        root = call.endpoint.url
        first = self._first.url
        if root == first:
            return request
        url = str(request.url)
        if not url.startswith(first):  # pragma: no cover - the transport builds it from `first`
            return request
        target = httpx.URL(root + url[len(first) :])
        headers = request.headers.copy()
        headers["Host"] = target.netloc.decode("ascii")
        return httpx.Request(
            request.method,
            target,
            headers=headers,
            content=request.content,
            extensions=request.extensions,
        )

    def _release_failed(self, slot: Lease, exc: BaseException, call: Call) -> None:
        """Give back the slot of an attempt that failed, with its outcome. The backend hears
        of it (a pool's breaker may take the server out of rotation). A connection that failed
        sends the call's next attempt to another server in rotation at once, or, where there is
        none, marks the servers down: later attempts wait at the gate until a probe says one
        answers (at once, if it does), and the call remembers which outage it failed in (see
        :meth:`_retry_loop`)."""
        if isinstance(exc, DSClientError):
            endpoint = call.endpoint
            exc.server = endpoint.url  # the call's record names the server that failed
            call.avoid = call.avoid | {endpoint.url}
            call.mode = endpoint.controller.mode
            others = self.backend.settle(slot, exc, call.admission.model)
            if isinstance(exc, ConnectionError):
                if others:
                    call.failover = True
                else:
                    call.outage = self.reach.mark_down(str(exc))
            slot.release(outcome_of(exc))
        else:  # cancelled in flight (the call's deadline): the caller may name this server
            call.cut = call.endpoint
            slot.release(error=exc)

    def _post(
        self,
        url: str,
        body: dict[str, Any],
        *,
        ask_load: bool = False,
        read_up_to: int | None = None,
        fairness: str | None = None,
    ) -> Awaitable[httpx.Response | Read]:
        """POST ``body`` as JSON to ``url``, the answer open: what ``http.post(url, json=body)``
        sends (the client's headers, JSON as httpx encodes it, the client's timeouts), without
        its per-request merging of headers, cookies and URLs. The client's headers are read once
        (dsclient never changes them).

        Over dsclient's default transport (:class:`~dsclient._http.AiohttpTransport`, on
        asyncio) the parts go to it as they are (:meth:`AiohttpTransport.post
        <dsclient._http.AiohttpTransport.post>`), which with ``read_up_to`` reads a 2xx answer
        of a declared length within it and gives back a :class:`~dsclient._http.Read`. Any other
        transport (``MockTransport``, httpx2's pool, trio) gets an ``httpx.Request``
        (:meth:`_send`), and every answer comes back open.

        What it gives is the transport's own awaitable (one coroutine less per call): the
        caller translates the ``httpx.RequestError`` it may raise. ``fairness``: the call's
        tenant (group), sent as ``x-gateway-inference-fairness-id`` for a gateway in front
        (llm-d's flow control keys its queues by it); a server ignores it.
        """
        headers = self._headers
        if headers is None:
            http = self._http
            self._timeouts = http.timeout.as_dict()
            base = (*http.headers.raw, (b"Content-Type", b"application/json"))
            headers = self._headers = base
            self._headers_load = (*base, *_ASK_LOAD_RAW)
            if not http._mounts and isinstance(http._transport, AiohttpTransport):
                self._direct = http._transport
        if ask_load:
            headers = self._headers_load
        if fairness is not None:
            headers = (*headers, (FAIRNESS_HEADER_RAW, fairness.encode()))
        content = self._encode(body).encode()
        direct = self._direct
        if direct is not None and direct.direct:
            if self._http.is_closed:
                raise RuntimeError("Cannot send a request, as the client has been closed.")
            return direct.post(url, headers, content, self._timeouts, read_up_to=read_up_to)
        target = self._urls.get(url)
        if target is None:
            if len(self._urls) >= 256:  # never more than a few per server; bound it anyway
                self._urls.clear()
            target = self._urls[url] = httpx.URL(url)
        request = httpx.Request(
            "POST", target, headers=headers, content=content, extensions={"timeout": self._timeouts}
        )
        return self._send(request)

    async def _send(self, request: httpx.Request) -> httpx.Response:
        """One request, straight to the shared client's transport; the answer comes back open.

        Not through the client's ``send``: the request is complete (headers merged, body
        encoded), and the client's per-send machinery (auth flow, redirects, cookie-jar passes
        that look up every header by name) cost more than the rest of a ``generate()`` call
        (callgrind, ``python -m benchmarks instructions --source openai``). The transport is the
        one the client would pick (``_transport_for_url``: its mounts and proxies).
        """
        http = self._http
        if http.is_closed:
            raise RuntimeError("Cannot send a request, as the client has been closed.")
        try:
            response = await http._transport_for_url(request.url).handle_async_request(request)
        except httpx.RequestError as exc:
            raise translate_request_error(exc) from exc
        response.request = request
        return response

    async def _exchange(
        self, request: httpx.Request, stream: bool
    ) -> tuple[httpx.Response, bytes | None]:
        """One send of a caller's request: the answer and its body (``None``: an open stream).

        The request goes to the shared client's transport directly (:meth:`_send`): for the
        dozen headers an SDK sends, the client's merge and per-send machinery cost about 1.1 M
        instructions a request. The request names its server: a router that moves attempts
        between servers must build one per server.
        """
        response = await self._send(request)
        if stream and response.status_code < 400:
            return response, None
        try:
            if response.status_code >= 400:
                return response, await read_prefix(response)
            return response, await read_body(response, limit=self.max_body_bytes)
        except DSClientError as exc:
            self.redact_error(exc)
            raise
        finally:
            await response.aclose()

    def _redact_bytes(self, body: bytes) -> bytes:
        """:meth:`redact_error` for a body handed back as it came (a server may echo the key)."""
        scheme, _, token = self._http.headers.get("authorization", "").partition(" ")
        secret = (token.strip() or scheme.strip()).encode()
        return body.replace(secret, b"***") if len(secret) >= 6 else body

    async def _retry_loop(
        self, op: Callable[[], Awaitable[T]], failure: DSClientError, label: str, call: Call
    ) -> tuple[T, int]:
        """Retry ``op`` after ``failure`` (retryable) until it succeeds or may not go on:
        ``(result, attempts)``, ``attempts`` counting the first.

        tenacity's ``AsyncRetrying`` drives the loop, with the rules of :class:`_RetryRules`
        as its strategies. It is built here, after the first failure, so a call that succeeds
        at once builds none of it; that first attempt enters tenacity as attempt 1, failed.
        Every later attempt first passes the outage gate (a gate that gives up raises
        ``ConnectionError``, which is not retried: no attempt was made, and the gate waited).
        The last failure ends the call as it came, its ``attempts`` set (tenacity re-raises
        the exception itself when ``retry`` says no; there is no ``RetryError``).
        """
        rules = _RetryRules(self, label, call)
        retrying = AsyncRetrying(
            retry=rules.retry, wait=rules.wait, before_sleep=rules.log, sleep=rules.sleep
        )
        async for attempt in retrying:
            state = attempt.retry_state
            attempts = state.attempt_number
            if attempts == 1:  # made before tenacity was built
                state.set_exception((type(failure), failure, failure.__traceback__))
                continue
            try:
                await self._gate(call)
            except DSClientError as gone:
                gone.attempts = attempts - 1
                raise
            with attempt:
                return await op(), attempts
        raise AssertionError("unreachable: tenacity returns or re-raises")  # pragma: no cover


class _RetryRules:
    """The retry rules of one call, as the strategies of tenacity's ``AsyncRetrying``.

    ``retry`` decides, per failed attempt, whether the call tries again:

    1. A failure that is not retryable (or not a dsclient error: a cancellation) ends the call.
    2. A connection that failed in an outage (the server went away, and a health probe
       confirmed it) is not the call's fault: ``retry`` waits at the gate for the server
       (bounded by the call's deadline and by ``outage_wait``; the gate then raises
       ``ConnectionError``), and the call tries again at once, spending neither the budget nor
       one of ``Retry.attempts`` (at most ``Retry.outage_retries`` times). With a pool, a
       connection that failed while other servers are in rotation goes to one of them at once,
       the same way.
    3. Any other retryable failure is a try: at most ``Retry.attempts`` tries in all
       (``overload_attempts`` for congestion, see the module docstring), each retry spending
       one budget token (none for congestion).

    ``wait`` is the full-jitter backoff of a try (:func:`~dsclient.client._retry.compute_backoff`,
    a server's ``Retry-After`` first), ``log`` says so, and ``sleep`` sleeps it outside any
    slot; an outage retry does not sleep. tenacity's ``stop`` is left at ``stop_never``: it asks
    ``wait`` before ``stop``, and the limit on tries must be checked before a budget token is
    spent and before the backoff draws its jitter from the client's random source, so the limit
    lives in ``retry``, whose "no" re-raises the failure itself.
    """

    __slots__ = ("_allowed", "_call", "_failure", "_free", "_label", "_path", "_tries", "_victim")

    def __init__(self, path: RequestPath, label: str, call: Call) -> None:
        self._path = path
        self._label = label
        self._call = call
        self._free = 0  # outage retries made
        self._victim = False  # whether the retry decided last is an outage retry
        self._tries = 0  # tries made, outage retries not counted (when the last one failed)
        self._allowed = 0  # tries the call may take, given how its last one failed
        self._failure: DSClientError | None = None  # the failure a try is retried after

    async def retry(self, state: RetryCallState) -> bool:
        """Whether the attempt that just failed (``state.outcome``) is tried again."""
        exc = state.outcome.exception() if state.outcome is not None else None
        if not isinstance(exc, DSClientError):  # cancelled in flight, or a bug: as it came
            return False
        attempts = state.attempt_number
        if not is_retryable(exc):
            exc.attempts = attempts
            return False
        path, call = self._path, self._call
        outage_retries = path._retry.outage_retries
        outage, call.outage = call.outage, None
        failover, call.failover = call.failover, False
        victim = False
        if failover and self._free < outage_retries:
            # Several servers: the one this attempt was on is out of rotation (its connection
            # failed), others are in: go to one of them now, as a victim would.
            victim = True
            logger.info(
                "dsclient: %s lost its connection to %s; trying another server now "
                "(outside the retry budget)",
                self._label,
                call.endpoint.url,
            )
        elif outage is not None:
            try:
                await path._gate(call)
            except DSClientError as gone:
                gone.attempts = attempts
                raise
            victim = path.reach.confirmed(outage) and self._free < outage_retries
            if victim:
                logger.info(
                    "dsclient: %s lost its connection in an outage of %s; trying again now "
                    "that it answers (outside the retry budget)",
                    self._label,
                    path.reach.label,
                )
        self._victim = victim
        if victim:
            self._free += 1
            return True
        self._failure = exc
        tries = self._tries = attempts - self._free
        congestion = self._is_congestion(exc)
        allowed = self._allowed = path._retry.load_attempts if congestion else path._retry.attempts
        if tries >= allowed or not (congestion or self._spend(exc)):
            exc.attempts = attempts
            return False
        return True

    def _is_congestion(self, exc: BaseException) -> bool:
        """A load refusal under an adaptive limit (see the module docstring)."""
        call = self._call
        mode = call.mode if call.mode is not None else call.endpoint.controller.mode
        return outcome_of(exc) == "overloaded" and mode != "fixed"

    def _spend(self, exc: BaseException) -> bool:
        """Take one token for a retry that is about to happen."""
        if self._path._budget.try_spend():
            return True
        logger.warning("dsclient: retry budget spent; not retrying %s", describe(exc))
        return False

    def wait(self, state: RetryCallState) -> float:
        """Seconds to back off before the next try (none before an outage retry)."""
        if self._victim:
            return 0.0
        retry = self._path._retry
        return compute_backoff(
            self._tries,
            base=retry.base,
            cap=retry.cap,
            retry_after=retry_after_of(self._failure) if self._failure is not None else None,
            rng=self._path._rng,
        )

    def log(self, state: RetryCallState) -> None:
        """Say which try failed and when the next one goes (not for an outage retry)."""
        if self._victim or self._failure is None:
            return
        logger.info(
            "dsclient: %s failed with %s; retry %d/%d in %.2fs",
            self._label,
            describe(self._failure),
            self._tries + 1,
            self._allowed,
            state.upcoming_sleep,
        )

    async def sleep(self, seconds: float) -> None:
        """The client's sleep, outside any slot; an outage retry goes at once."""
        if not self._victim:
            await self._path._sleep(float(seconds))


_AVOID_NONE: frozenset[str] = frozenset()


class Call:
    """What the attempts of one call share: its :class:`~dsclient.governor._admission.Admission`
    (lane, urgency, group; model and prefix for the backend's router), the time queued for
    slots, the outage its last connection failed in, the server of its last attempt (before the
    first: the backend's first server), the servers it failed on, whether it may fail over at
    once, and ``cut``: the server of the attempt in flight when the call was cancelled (by its
    deadline), ``None`` if none was."""

    __slots__ = (
        "admission",
        "avoid",
        "cut",
        "endpoint",
        "failover",
        "miss_at",
        "mode",
        "outage",
        "queued_s",
    )

    def __init__(self, endpoint: Endpoint, admission: Admission) -> None:
        self.admission = admission
        self.queued_s = 0.0
        self.outage: int | None = None
        self.endpoint = endpoint
        self.cut: Endpoint | None = None
        self.avoid: frozenset[str] = _AVOID_NONE
        self.failover = False
        self.mode: str | None = None
        self.miss_at: float | None = None


class Answer:
    """What one call's attempts give back, whichever kind of send made them: the JSON ``data``
    (:meth:`RequestPath.send_json`), or the server's ``response`` with its ``content``
    (``None`` for an open stream, whose ``slot`` the caller then holds); the ``attempts`` made,
    the seconds ``queued_s`` waiting for slots, the ``server`` that answered, and for a refusal
    :meth:`RequestPath.send_raw` hands back the ``error`` dsclient would have raised (observers
    count it)."""

    __slots__ = ("attempts", "content", "data", "error", "queued_s", "response", "server", "slot")

    def __init__(
        self,
        response: httpx.Response | None,
        content: bytes | None,
        slot: Lease | None,
        data: dict[str, Any] | None = None,
    ) -> None:
        self.response = response
        self.content = content
        self.slot = slot
        self.data = data
        self.attempts = 1
        self.queued_s = 0.0
        self.server = ""
        self.error: RequestRefused | None = None


def _prioritised(
    body: dict[str, Any],
    server: Endpoint,
    admission: Admission,
    group_ranks: Mapping[str | None, int] | None = None,
) -> dict[str, Any]:
    """``body`` with the server's own ``priority`` for the call's lane and urgency (with
    ``group_ranks``, its tenant's rank by weight first), in the order that server takes
    (:func:`~dsclient.client._priority.with_priority`)."""
    info = server.info
    order = info.priority if info is not None else None
    if order is None:  # the common case, without the call: the body as it is
        return body
    rank = 0
    if group_ranks is not None:
        rank = group_ranks.get(admission.group, group_ranks[None])
    return with_priority(body, admission.lane, admission.urgency, order, rank)


#: One kind of send, as :meth:`RequestPath._attempt` runs it:
#: ``once(path, server, slot, call, first, second, third)``, the method of the class
#: (``RequestPath._json_once``) rather than of the path: a bound method made per call was one
#: more object each call held.
Send = Callable[..., Awaitable[Answer]]
