"""A FastAPI service in front of a vLLM server, through ONE shared ``dsclient.AsyncClient``.

    pip install . fastapi uvicorn  # in your copy of dsclient (no PyPI release yet)
    DSCLIENT_URL=http://127.0.0.1:8000 uvicorn examples.fastapi_app:app --port 9000
    curl -s localhost:9000/generate -H 'content-type: application/json' \\
         -d '{"prompt": "The capital of France is", "max_tokens": 16}'

The client is made once, in the app's lifespan, and closed on shutdown. Shared, its governor sees
every call the app makes, so however many users arrive at once the server gets a full batch and a
short queue, and the rest wait in the client where they can be ordered. A client per request would
have a governor each, none of which holds anything back, and would reconnect every time.

``DSCLIENT_URL`` names the server (default ``http://127.0.0.1:8000``, where ``dsclient serve``
and ``vllm serve`` listen by default).
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Annotated

from fastapi import Depends, FastAPI, HTTPException, Request
from pydantic import BaseModel, Field

import dsclient

DEFAULT_URL = "http://127.0.0.1:8000"


class GenerateRequest(BaseModel):
    prompt: str = Field(min_length=1)
    max_tokens: int = Field(default=64, ge=1)


class GenerateResponse(BaseModel):
    text: str
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    latency_s: float


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    # Read at start-up, not import: the same module serves any server.
    url = os.environ.get("DSCLIENT_URL", DEFAULT_URL)
    async with dsclient.AsyncClient(url, timeout=120) as client:  # discovers the server's limits
        app.state.client = client
        yield
    # Leaving the block closed its connections and stopped its load poller.


app = FastAPI(title="dsclient example", lifespan=lifespan)


def get_client(request: Request) -> dsclient.AsyncClient:
    client: dsclient.AsyncClient = request.app.state.client
    return client


Client = Annotated[dsclient.AsyncClient, Depends(get_client)]


@app.post("/generate")
async def generate(body: GenerateRequest, client: Client) -> GenerateResponse:
    try:
        result = await client.generate(body.prompt, max_tokens=body.max_tokens)
    except dsclient.ContextOverflow as exc:  # the caller's prompt cannot fit: their error
        raise HTTPException(status_code=422, detail=str(exc)) from exc
    except dsclient.Overloaded as exc:  # retries spent: pass the back-pressure on
        headers = {"Retry-After": str(round(exc.retry_after))} if exc.retry_after else None
        raise HTTPException(status_code=503, detail=str(exc), headers=headers) from exc
    except dsclient.TimeoutError as exc:
        raise HTTPException(status_code=504, detail=str(exc)) from exc
    except dsclient.DSClientError as exc:  # the model server failed
        raise HTTPException(status_code=502, detail=str(exc)) from exc
    return GenerateResponse(
        text=result.text,
        finish_reason=result.finish_reason,
        prompt_tokens=result.usage.prompt_tokens,
        completion_tokens=result.usage.completion_tokens,
        latency_s=result.latency_s,
    )
