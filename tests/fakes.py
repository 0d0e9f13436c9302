"""A scripted OpenAI-compatible server for unit tests, behind ``httpx.MockTransport``."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from dsclient._http import httpx

Handler = Callable[[httpx.Request], httpx.Response]


def completion_body(
    text: str = "hello", finish: str = "length", prompt_tokens: int = 3, completion_tokens: int = 2
) -> dict[str, Any]:
    return {
        "id": "cmpl-1",
        "object": "text_completion",
        "created": 1,
        "model": "tiny",
        "choices": [{"index": 0, "text": text, "finish_reason": finish, "logprobs": None}],
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        },
    }


def chat_body(text: str = "hi there", finish: str = "stop") -> dict[str, Any]:
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "created": 1,
        "model": "tiny",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "finish_reason": finish,
                "logprobs": None,
            }
        ],
        "usage": {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8},
    }


@dataclass
class FakeServer:
    """Serves /v1/models and answers generation calls from a script of responses.

    ``script`` entries are used in order for POSTs to the generation endpoints (the last one
    repeats); each is a Response, a callable taking the request, or an exception to raise.
    """

    models: list[str] = field(default_factory=lambda: ["tiny"])
    max_model_len: int = 2048
    script: list[Any] = field(default_factory=list)
    tokenize: Callable[[dict[str, Any]], int] | None = None
    requests: list[httpx.Request] = field(default_factory=list)
    bodies: list[dict[str, Any]] = field(default_factory=list)

    def __call__(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if path == "/v1/models" and request.method == "GET":
            return httpx.Response(
                200,
                json={
                    "object": "list",
                    "data": [
                        {
                            "id": m,
                            "object": "model",
                            "owned_by": "vllm",
                            "max_model_len": self.max_model_len,
                        }
                        for m in self.models
                    ],
                },
            )
        if path == "/tokenize" and self.tokenize is not None:
            return httpx.Response(
                200,
                json={
                    "count": self.tokenize(json.loads(request.content)),
                    "max_model_len": self.max_model_len,
                },
            )
        if path in ("/v1/completions", "/v1/chat/completions"):
            self.requests.append(request)
            self.bodies.append(json.loads(request.content))
            if not self.script:
                body = completion_body() if path == "/v1/completions" else chat_body()
                return httpx.Response(200, json=body)
            step = self.script.pop(0) if len(self.script) > 1 else self.script[0]
            if isinstance(step, BaseException):
                raise step
            if callable(step) and not isinstance(step, httpx.Response):
                return step(request)
            return step
        return httpx.Response(404, json={"detail": "Not Found"})

    @property
    def transport(self) -> httpx.MockTransport:
        return httpx.MockTransport(self)


class RecordedSleep:
    """An injectable ``sleep`` that records the delays instead of waiting."""

    def __init__(self) -> None:
        self.delays: list[float] = []

    async def __call__(self, seconds: float) -> None:
        self.delays.append(seconds)
