"""Error translation: every context-overflow wording, refusals, overload hints."""

from __future__ import annotations

import builtins
import json

import pytest

import dsclient
from dsclient._exceptions import (
    ContextOverflow,
    Overloaded,
    RequestRefused,
    ServerFault,
    context_overflow_from_response,
    error_from_response,
)
from dsclient._http import httpx
from dsclient.client._retry import is_retryable


def _openai_error(message: str, code: int = 400) -> str:
    return json.dumps(
        {"error": {"message": message, "type": "BadRequestError", "param": None, "code": code}}
    )


# (status, body, prompt_tokens, requested_tokens, context_length) — wordings from ENVIRONMENT.md
OVERFLOWS = [
    pytest.param(
        400,
        _openai_error(
            "This model's maximum context length is 2048 tokens. However, your prompt contains at least "
            "2049 input tokens, which exceeds this limit even without any output tokens. Please reduce "
            "the length of the input prompt. (parameter=input_tokens, value=2049)"
        ),
        2049,
        None,
        2048,
        id="vllm-0.32-prompt",
    ),
    pytest.param(
        400,
        _openai_error(
            "This model's maximum context length is 2048 tokens. However, your prompt contains 18000 "
            "characters (more than 12288 characters, which is the upper bound for 2048 input tokens). "
            "Please reduce the length of the input prompt. (parameter=input_text, value=18000)"
        ),
        None,
        None,
        2048,
        id="vllm-0.32-characters",
    ),
    pytest.param(
        400,
        _openai_error(
            "This model's maximum context length is 2048 tokens. However, you requested 1900 output "
            "tokens and your prompt contains at least 1200 input tokens, for a total of at least 3100 "
            "tokens. Please reduce the length of the input prompt or the number of requested output "
            "tokens. (parameter=input_tokens, value=1200)"
        ),
        1200,
        1900,
        2048,
        id="vllm-2026",
    ),
    pytest.param(
        400,
        _openai_error(
            "'max_tokens' or 'max_completion_tokens' is too large: 1900. This model's maximum context "
            "length is 2048 tokens and your request has 1200 input tokens (1900 > 2048 - 1200). "
            "(parameter=max_tokens, value=1900)"
        ),
        1200,
        1900,
        2048,
        id="vllm-2025",
    ),
    pytest.param(
        400,
        _openai_error(
            "This model's maximum context length is 2048 tokens. However, you requested 3100 tokens "
            "(1200 in the messages, 1900 in the completion). Please reduce the length of the messages "
            "or completion."
        ),
        1200,
        1900,
        2048,
        id="vllm-0.4-0.6",
    ),
    pytest.param(
        400,
        _openai_error(
            "You passed 1200 input tokens and requested 1900 output tokens. However, the model's "
            "context length is only 2048 tokens, resulting in a maximum input length of 148 tokens. "
            "Please reduce the length of the input prompt."
        ),
        1200,
        1900,
        2048,
        id="vllm-renderer",
    ),
    pytest.param(
        400,
        _openai_error(
            "The decoder prompt (length 2300) is longer than the maximum model length of 2048."
        ),
        2300,
        None,
        2048,
        id="vllm-engine",
    ),
    pytest.param(
        422,
        json.dumps(
            {
                "error": "`inputs` tokens + `max_new_tokens` must be <= 2048. "
                "Given: 1200 `inputs` tokens and 1900 `max_new_tokens`",
                "error_type": "validation",
            }
        ),
        1200,
        1900,
        2048,
        id="tgi-total",
    ),
    pytest.param(
        422,
        json.dumps(
            {
                "error": "`inputs` must have less than 2047 tokens. Given: 2300",
                "error_type": "validation",
            }
        ),
        2300,
        None,
        2047,
        id="tgi-inputs",
    ),
    pytest.param(
        400,
        json.dumps(
            {
                "error": {
                    "code": 400,
                    "type": "exceed_context_size_error",
                    "message": "the request exceeds the available context size, try increasing it",
                    "n_prompt_tokens": 2300,
                    "n_ctx": 2048,
                }
            }
        ),
        2300,
        None,
        2048,
        id="llamacpp",
    ),
]


@pytest.mark.parametrize(("status", "body", "prompt", "requested", "ctx"), OVERFLOWS)
def test_every_overflow_wording_is_recognised(status, body, prompt, requested, ctx):
    err = error_from_response(httpx.Response(status, text=body))
    assert isinstance(err, ContextOverflow)
    assert (err.prompt_tokens, err.requested_tokens, err.context_length) == (prompt, requested, ctx)
    assert err.status == status
    assert err.body == body
    assert str(ctx) in str(err)


def test_other_400_is_a_plain_refusal():
    body = _openai_error("temperature must be non-negative")
    err = error_from_response(httpx.Response(400, text=body))
    assert type(err) is RequestRefused
    assert err.status == 400
    assert err.message == "temperature must be non-negative"
    assert "HTTP 400" in str(err)


@pytest.mark.parametrize("status", [500, 502, 504])
def test_a_5xx_is_a_server_error_not_a_refusal(status):
    # Issue 45: a 500 read "RequestRefused: server refused the request"; it is the server's
    # failure. Still a RequestRefused (every error status is), so status and body are kept.
    err = error_from_response(httpx.Response(status, text=_openai_error("CUDA out of memory")))
    assert type(err) is ServerFault and isinstance(err, RequestRefused)
    assert str(err) == f"server error: HTTP {status}: CUDA out of memory"
    assert "refused" not in str(err)
    assert err.status == status and "CUDA" in err.body
    assert is_retryable(err)


def test_a_4xx_stays_a_refusal_and_a_503_an_overload():
    assert type(error_from_response(httpx.Response(404, text="no"))) is RequestRefused
    assert not is_retryable(error_from_response(httpx.Response(404, text="no")))
    assert type(error_from_response(httpx.Response(503, text="busy"))) is Overloaded


def test_timeout_and_connection_errors_are_the_builtins_too():
    # Issue 45: `except TimeoutError` missed dsclient.TimeoutError, as asyncio's and aiohttp's
    # are not missed.
    with pytest.raises(builtins.TimeoutError):
        raise dsclient.TimeoutError("call did not finish within its timeout of 5 s")
    with pytest.raises(builtins.ConnectionError):
        raise dsclient.ConnectionError("nothing listens on 127.0.0.1:8001")
    with pytest.raises(OSError):
        raise dsclient.ConnectionError("nothing listens on 127.0.0.1:8001")
    err = dsclient.ConnectionError("nothing listens on 127.0.0.1:8001")
    assert str(err) == "nothing listens on 127.0.0.1:8001" and err.args == (str(err),)
    assert isinstance(err, dsclient.TransportError) and isinstance(err, dsclient.DSClientError)


@pytest.mark.anyio
async def test_a_read_timeout_inside_a_call_keeps_its_words():
    # dsclient.TimeoutError is a builtin TimeoutError now: the call's deadline handler must not
    # take one raised from inside (a read timeout) for its own expiry.
    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/completions"):
            raise httpx.ReadTimeout("no byte for 1 s", request=request)
        return httpx.Response(404)

    client = dsclient.AsyncClient(
        "http://h:1",
        transport=httpx.MockTransport(handler),
        model="m",
        max_num_seqs=2,
        max_model_len=64,
        retry=dsclient.Retry(attempts=1),
    )
    async with client:
        with pytest.raises(dsclient.TimeoutError) as info:
            await client.generate("hi", max_tokens=4, timeout=30)
    assert "within its timeout of 30" not in str(info.value)


def test_overflow_only_for_client_error_statuses():
    body = _openai_error("This model's maximum context length is 2048 tokens.")
    assert context_overflow_from_response(500, body) is None


@pytest.mark.parametrize("status", [429, 503])
def test_overloaded_keeps_retry_after(status):
    err = error_from_response(httpx.Response(status, headers={"Retry-After": "3"}, text="busy"))
    assert isinstance(err, Overloaded)
    assert err.retry_after == 3.0
    assert err.body == "busy"


def test_vllm_503_message_is_extracted():
    body = json.dumps(
        {
            "error": {
                "message": "The engine is currently busy and cannot accept new "
                "requests. Please try again later or on a different instance.",
                "type": "Service Unavailable",
                "param": None,
                "code": 503,
            }
        }
    )
    err = error_from_response(httpx.Response(503, text=body))
    assert isinstance(err, Overloaded)
    assert err.retry_after is None
    assert "engine is currently busy" in str(err)


def test_precheck_overflow_message_has_no_http():
    err = ContextOverflow(
        "prompt has 2300 tokens; model context is 2048", prompt_tokens=2300, context_length=2048
    )
    assert str(err) == "prompt has 2300 tokens; model context is 2048"


# --- hostile error bodies (each found by tests/test_fuzz.py unless said otherwise) ---------------
def test_json_nested_past_the_recursion_limit_is_a_plain_refusal():
    # Found: json.loads raises RecursionError (not ValueError) on 50 000 "[", out of
    # _server_message and so out of error_from_response.
    error = error_from_response(httpx.Response(400, content=b"[" * 50_000))
    assert type(error) is RequestRefused and error.status == 400
    assert len(error.body) == 4000


def test_a_count_of_thousands_of_digits_is_no_count():
    # Found: int() of more than 4300 digits raises ValueError from context_overflow_from_response.
    message = f"This model's maximum context length is 2048 tokens. However, your prompt contains at least {'9' * 5000} input tokens"
    overflow = context_overflow_from_response(400, _openai_error(message))
    assert isinstance(overflow, ContextOverflow)
    assert overflow.context_length == 2048 and overflow.prompt_tokens is None


@pytest.mark.parametrize("charset", ["rot13", "hex", "idna", "utf-16", "no-such-codec"])
def test_a_charset_no_decoder_takes_is_ignored(charset):
    # Found: response.text follows the charset, and rot13 raised TypeError, hex AssertionError,
    # idna and utf-16 UnicodeError. JSON is UTF-8 (RFC 8259); so are error messages read here.
    response = httpx.Response(
        503,
        content=_openai_error("The engine is currently busy").encode(),
        headers={"content-type": f"application/json; charset={charset}"},
    )
    error = error_from_response(response)
    assert isinstance(error, Overloaded) and error.message == "The engine is currently busy"


def test_only_a_bounded_prefix_of_an_error_body_is_looked_at():
    from dsclient._exceptions import ERROR_BODY_BYTES

    long_message = "x" * 30_000  # the body is under ERROR_BODY_BYTES: its message is read, cut
    error = error_from_response(httpx.Response(500, json={"error": {"message": long_message}}))
    assert len(error.message) == 4000 and len(error.body) == 4000 and len(str(error)) < 4100
    # Over it, the body is cut before parsing: no JSON left, the message is the text's start.
    error = error_from_response(httpx.Response(500, json={"error": {"message": "x" * 100_000}}))
    assert error.message.startswith('{"error":') and len(error.message) == 500
    # What error_from_response is given to read is cut to ERROR_BODY_BYTES before parsing.
    error = error_from_response(httpx.Response(500), b"y" * (ERROR_BODY_BYTES * 4))
    assert error.body == "y" * 4000


def test_redact_takes_a_secret_out_of_message_and_body():
    from dsclient._exceptions import redact

    error = RequestRefused(401, body="Authorization: Bearer sk-1234567")
    redact(error, "sk-1234567")
    assert "sk-1234567" not in f"{error} {error!r} {error.body} {error.message}"
    assert error.body == "Authorization: Bearer ***"


# -- pickling: process pools and Ray send errors between processes ---------------------------------
def _samples() -> dict[type, BaseException]:
    from pathlib import Path

    from dsclient.launcher import LaunchError, ServerStartError, VllmFlagsError

    return {
        dsclient.DSClientError: dsclient.DSClientError("plain"),
        dsclient.NoServerError: dsclient.NoServerError(
            "no server of this client serves model 'big'; they serve: 'tiny'"
        ),
        dsclient.TransportError: dsclient.TransportError("no answer"),
        dsclient.TimeoutError: dsclient.TimeoutError("call did not finish within 5 s"),
        dsclient.ConnectionError: dsclient.ConnectionError("connection refused"),
        dsclient.ServerError: dsclient.ServerError("odd"),
        dsclient.MalformedResponse: dsclient.MalformedResponse("not JSON", body="<html>"),
        dsclient.ResponseTooLarge: dsclient.ResponseTooLarge("answer", limit=2**20, body="x" * 9),
        dsclient.RequestRefused: dsclient.RequestRefused(
            418, '{"error": {"message": "teapot"}}', retry_after=1.5
        ),
        dsclient.Overloaded: dsclient.Overloaded(503, "busy", retry_after=2.0),
        dsclient.ServerFault: dsclient.ServerFault(500, '{"error": {"message": "boom"}}'),
        dsclient.ContextOverflow: dsclient.ContextOverflow(
            "prompt has 2300 tokens; model context is 2048",
            prompt_tokens=2300,
            requested_tokens=16,
            context_length=2048,
        ),
        LaunchError: LaunchError("port 8000 is taken"),
        VllmFlagsError: VllmFlagsError(
            "unrecognized arguments: --bogus", argv=("vllm", "--bogus"), python="/usr/bin/python3"
        ),
        ServerStartError: ServerStartError(
            "vLLM exited", log_tail="boom\n", log_path=Path("/tmp/x.log"), returncode=1
        ),
    }


def _exported_exceptions() -> set[type]:
    import dsclient.launcher

    found = set()
    for module in (dsclient, dsclient.launcher):
        for name in module.__all__:
            value = getattr(module, name)
            if isinstance(value, type) and issubclass(value, BaseException):
                found.add(value)
    return found


def test_every_exported_exception_has_a_pickle_sample():
    assert _exported_exceptions() == set(_samples())


@pytest.mark.parametrize(
    "cls", sorted(_samples(), key=lambda c: c.__name__), ids=lambda c: c.__name__
)
def test_every_exported_exception_pickles_whole(cls):
    import pickle

    original = _samples()[cls]
    original.attempts = 3  # set by the request path on failed calls
    original.server = "http://b:8000"  # likewise: the server the last attempt failed at
    for protocol in (2, pickle.HIGHEST_PROTOCOL):
        copy = pickle.loads(pickle.dumps(original, protocol=protocol))
        assert type(copy) is cls
        assert str(copy) == str(original) and copy.args == original.args
        assert vars(copy) == vars(original)
        assert copy.attempts == 3 and copy.server == "http://b:8000"
