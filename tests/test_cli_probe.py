"""`dsclient probe`: nothing answering is an error that says so; a server that publishes no queue
metrics gets the throughput mode, said in words."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from dsclient.cli import main


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Models(BaseHTTPRequestHandler):
    """An OpenAI-compatible server with a model list and nothing else (no /metrics)."""

    def do_GET(self) -> None:
        if self.path == "/v1/models":
            body = json.dumps({"object": "list", "data": [{"id": "m", "object": "model"}]})
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body.encode())
        else:
            self.send_error(404)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def blackbox_url() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Models)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_probe_of_a_silent_url_fails_and_says_why(capsys):
    url = f"http://127.0.0.1:{_closed_port()}"
    assert main(["probe", url, "--json"]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert f"nothing answers at {url}" in captured.err
    assert "refused" in captured.err.lower()


def test_probe_of_a_server_without_metrics_says_throughput_mode(blackbox_url, capsys):
    assert main(["probe", blackbox_url + "/v1", "--headroom", "1.0"]) == 0
    out = capsys.readouterr().out
    # No batch stated: the limit starts at 1 (headroom applies to a stated batch), and the
    # probe says what bounds it.
    assert "dsclient limit: starts at 1 in flight" in out
    assert "no queue metrics: the limit finds its knee from the answers" in out
    assert "between 1 and 1024" in out
    assert "bound: no batch stated: the limit starts at 1, and a queue guard" in out


def test_probe_json_names_the_mode_and_signal(blackbox_url, capsys):
    assert main(["probe", blackbox_url, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["kind"], out["model"]) == ("openai-compatible", "m")
    assert out["sources"]["max_num_seqs"] == "default"
    assert (out["dsclient_limit"], out["limit_mode"], out["limit_signal"]) == (
        5,
        "throughput",
        "throughput",
    )
    assert out["queue_metrics"] is None


def test_the_command_says_its_version(capsys: pytest.CaptureFixture[str]) -> None:
    import dsclient

    with pytest.raises(SystemExit) as stop:
        main(["--version"])
    assert stop.value.code == 0
    assert capsys.readouterr().out.strip() == f"dsclient {dsclient.__version__}"


def test_probe_takes_the_url_as_map_does_or_from_the_environment(
    blackbox_url: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    assert main(["probe", "--url", blackbox_url, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["model"] == "m"
    monkeypatch.setenv("DSCLIENT_URL", f"{blackbox_url},http://127.0.0.1:1")
    assert main(["probe", "--json"]) == 0  # the first of the environment's
    assert json.loads(capsys.readouterr().out)["model"] == "m"
    monkeypatch.delenv("DSCLIENT_URL")
    assert main(["probe"]) == 2
    assert "no server: pass its URL or set DSCLIENT_URL" in capsys.readouterr().err
    assert main(["probe", blackbox_url, "--url", "http://127.0.0.1:1"]) == 2
    assert "two URLs given" in capsys.readouterr().err
