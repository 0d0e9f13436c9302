"""Silence: one warning when the calls out have had nothing back for a while (issue 45)."""

from __future__ import annotations

import json
import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import anyio
import pytest

import dsclient
from dsclient.client._silence import SILENCE_S, Silence


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_one_warning_names_the_server_the_calls_and_the_time(caplog):
    clock, out = Clock(), [3]
    silence = Silence("http://h:8000", in_flight=lambda: out[0], after=60.0, clock=clock)
    for _ in range(3):
        silence.sent()
    clock.now += 59.0
    assert silence.check() is None  # not yet
    clock.now += 2.0
    with caplog.at_level(logging.WARNING, logger="dsclient"):
        message = silence.check()
    assert message is not None and message in caplog.text
    assert "http://h:8000" in message and "3 calls out" in message and "61 s" in message
    clock.now += 120.0
    assert silence.check() is None  # once per silence
    silence.ended(True)  # something came back: the silence is over
    clock.now += 61.0
    assert "2 calls out" in (silence.check() or "")  # a new silence is told again


def test_a_timeout_does_not_end_the_silence():
    clock = Clock()
    silence = Silence("s", in_flight=lambda: 5, clock=clock)
    silence.sent()
    silence.sent()
    clock.now += SILENCE_S + 1
    silence.ended(False)  # it timed out: still nothing from the server
    assert "1 call out" in (silence.check() or "")


def test_idleness_is_not_silence():
    clock = Clock()
    silence = Silence("s", in_flight=lambda: 1, after=60.0, clock=clock)
    assert silence.check() is None  # nothing out
    clock.now += 3600.0  # an hour with no calls
    silence.sent()
    assert silence.check() is None  # the call just went out


def test_calls_queued_on_the_client_are_not_counted():
    # Sent from the caller's side but waiting for a slot: the server has not seen them.
    clock = Clock()
    silence = Silence("s", in_flight=lambda: 0, after=1.0, clock=clock)
    silence.sent()
    clock.now += 10
    assert silence.check() is None


def test_after_must_be_positive():
    with pytest.raises(ValueError, match="after"):
        Silence("s", in_flight=lambda: 0, after=0)


class HangingServer:
    """A real HTTP server: lists model "m", and never answers a POST until closed."""

    def __init__(self) -> None:
        release = self.release = threading.Event()

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self) -> None:
                if self.path == "/v1/models":
                    data = json.dumps({"data": [{"id": "m", "max_model_len": 2048}]}).encode()
                    self.send_response(200)
                    self.send_header("content-type", "application/json")
                else:
                    data = b"{}"
                    self.send_response(404)
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_POST(self) -> None:
                release.wait(30)  # a deadlocked engine: the connection stays open, silent

            def log_message(self, *args) -> None:
                pass

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.http.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.http.server_port}"
        threading.Thread(target=self.http.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.release.set()
        self.http.shutdown()
        self.http.server_close()


@pytest.mark.anyio
async def test_a_server_that_hangs_is_told_while_the_calls_wait(caplog):
    server = HangingServer()
    try:
        async with dsclient.AsyncClient(server.url, max_num_seqs=4) as client:
            client._caller.silence.after = 0.5  # a minute in use; half a second here
            with caplog.at_level(logging.WARNING, logger="dsclient"):
                with anyio.move_on_after(3):
                    async with anyio.create_task_group() as tg:
                        for _ in range(2):
                            tg.start_soon(lambda: client.generate("hi", max_tokens=4))
        warnings = [r.getMessage() for r in caplog.records if "nothing back" in r.getMessage()]
        assert len(warnings) == 1, warnings
        assert warnings[0].startswith(f"dsclient: {server.url}: 2 calls out and nothing back")
    finally:
        server.close()
