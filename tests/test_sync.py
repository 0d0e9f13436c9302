"""The synchronous facade, in a script and inside a running event loop (a Jupyter cell)."""

from __future__ import annotations

import asyncio
import inspect

import dsclient
from dsclient._http import httpx

from .fakes import FakeServer, chat_body, completion_body


def test_sync_client_generate_chat_stream():
    fake = FakeServer(script=[httpx.Response(200, json=completion_body("abc"))])
    with dsclient.Client("http://127.0.0.1:8000", transport=fake.transport) as client:
        assert client.generate("x", max_tokens=3).text == "abc"
        assert client.server is not None and client.model == "tiny"
        # floor(0.7 x 8): the default max_num_seqs, as the fake server states none
        # The fake server states no batch: the limit starts at 1 (issue 41).
        assert client.limit == 1 == client.aclient.limit
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


# -- the facade's signatures are AsyncClient's ---------------------------------------------------


def _parameters(function, *, drop: tuple[str, ...]) -> list[tuple[str, object, object]]:
    """(name, kind, default) of each parameter, without ``drop``: what an editor shows."""
    return [
        (p.name, p.kind, p.default)
        for p in inspect.signature(function).parameters.values()
        if p.name not in drop
    ]


def test_client_takes_exactly_the_async_clients_parameters():
    # A parameter added to AsyncClient and not to Client (or a default changed in one) fails here.
    sync = _parameters(dsclient.Client.__init__, drop=("self",))
    inner = _parameters(dsclient.AsyncClient.__init__, drop=("self",))
    assert sync == inner
    assert ("transport", inspect.Parameter.KEYWORD_ONLY, None) in sync


def test_client_map_and_imap_take_the_batch_runners_parameters():
    from dsclient.batch._batch import iter_map, run_map

    assert _parameters(dsclient.Client.map, drop=("self",)) == _parameters(
        run_map, drop=("client", "caller", "planner")
    )
    assert _parameters(dsclient.Client.imap, drop=("self",)) == _parameters(
        iter_map, drop=("client", "caller", "planner")
    )


def test_client_options_reach_the_async_client(tmp_path):
    fake = FakeServer()
    with dsclient.Client(
        "http://127.0.0.1:8000",
        transport=fake.transport,
        limit=3,
        adaptive=False,
        default_max_tokens=7,
        headers={"x-team": "search"},
    ) as client:
        assert client.limit == 3
        client.generate("x")
        results = client.map(["a", "b"], ordered=False, output=tmp_path / "out.jsonl", seed=5)
        pairs = sorted(client.imap(["c"], max_tokens=2, urgency=1))
    assert fake.bodies[0]["max_tokens"] == 7  # default_max_tokens went through
    assert fake.requests[0].headers["x-team"] == "search"
    assert len(results) == 2 and all(r.ok for r in results)
    assert {body.get("seed") for body in fake.bodies[1:3]} == {5}  # sampling went through
    assert len((tmp_path / "out.jsonl").read_text().splitlines()) == 2
    assert [index for index, _ in pairs] == [0] and fake.bodies[3]["max_tokens"] == 2
