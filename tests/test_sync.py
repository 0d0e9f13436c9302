"""The synchronous facade, in a script and inside a running event loop (a Jupyter cell)."""

from __future__ import annotations

import asyncio

import httpx

import dsclient

from .fakes import FakeServer, chat_body, completion_body


def test_sync_client_generate_chat_stream():
    fake = FakeServer(script=[httpx.Response(200, json=completion_body("abc"))])
    with dsclient.Client("http://127.0.0.1:8000", transport=fake.transport) as client:
        assert client.generate("x", max_tokens=3).text == "abc"
        assert client.server is not None and client.model == "tiny"
        # floor(0.7 x 8): the default max_num_seqs, as the fake server states none
        assert client.limit == 5 == client.aclient.limit
    fake = FakeServer(script=[httpx.Response(200, json=chat_body("hey"))])
    with dsclient.Client("http://127.0.0.1:8000", transport=fake.transport) as client:
        assert client.chat([{"role": "user", "content": "hi"}], max_tokens=3).text == "hey"
    sse = (
        'data: {"choices": [{"text": "a", "finish_reason": null}]}\n\n'
        'data: {"choices": [{"text": "b", "finish_reason": "stop"}]}\n\ndata: [DONE]\n\n'
    )
    fake = FakeServer(script=[httpx.Response(200, text=sse)])
    with dsclient.Client("http://127.0.0.1:8000", transport=fake.transport) as client:
        with client.stream("x", max_tokens=2) as s:
            assert list(s) == ["a", "b"]
        assert s.finish_reason == "stop"
        assert client.in_flight == 0


def test_sync_client_inside_a_running_event_loop():
    """Jupyter runs cells inside an already running asyncio loop in the same thread."""
    fake = FakeServer(script=[httpx.Response(200, json=completion_body("from-cell"))])

    async def cell():
        # synchronous code in a cell, while the notebook's loop is running
        asyncio.get_running_loop()
        with dsclient.Client("http://127.0.0.1:8000", transport=fake.transport) as client:
            return client.generate("x", max_tokens=2).text

    assert asyncio.run(cell()) == "from-cell"


def test_sync_errors_propagate():
    fake = FakeServer(script=[httpx.Response(404, json={"error": {"message": "no such route"}})])
    with dsclient.Client("http://127.0.0.1:8000", transport=fake.transport) as client:
        try:
            client.generate("x", max_tokens=1)
        except dsclient.RequestRefused as exc:
            assert exc.status == 404
        else:
            raise AssertionError("expected RequestRefused")
