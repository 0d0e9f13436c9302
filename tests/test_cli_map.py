"""``dsclient map``: OpenAI batch files in and out, malformed lines, resume."""

from __future__ import annotations

import argparse
import io
import json

import pytest

from dsclient._exceptions import ContextOverflow, TimeoutError
from dsclient.batch._jsonl import derive_id
from dsclient.cli.map import add_map_parser, error_code, run

from .test_batch import EchoServer

URL = "http://127.0.0.1:8000"


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="dsclient")
    add_map_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["map", *argv])


def write_lines(path, rows) -> None:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))


def read_lines(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def batch_request(cid: str, content: str, **body) -> dict:
    return {
        "custom_id": cid,
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {
            "model": "gpt-4o-mini",
            "messages": [{"role": "user", "content": content}],
            **body,
        },
    }


def go(server, *argv: str) -> tuple[int, str]:
    err = io.StringIO()
    args = parse(*argv, "--url", URL, "--no-progress")
    code = run(args, transport=server.transport, stderr=err)
    return code, err.getvalue()


def test_batch_requests_become_batch_output(tmp_path):
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_lines(
        src,
        [
            batch_request("r1", "hello", max_tokens=4),
            {
                "custom_id": "r2",
                "method": "POST",
                "url": "/v1/completions",
                "body": {"model": "x", "prompt": "once", "max_completion_tokens": 3},
            },
        ],
    )
    server = EchoServer()
    code, err = go(server, str(src), "-o", str(out), "--model", "tiny")
    assert code == 0, err
    assert "2 items, 2 ok, 0 failed" in err
    by_id = {r["custom_id"]: r for r in read_lines(out)}
    assert set(by_id) == {"r1", "r2"}
    chat = by_id["r1"]
    assert chat["id"].startswith("batch_req_") and chat["error"] is None
    assert chat["response"]["status_code"] == 200
    assert chat["response"]["body"]["choices"][0]["message"]["content"] == "hello"
    assert chat["response"]["request_id"] == chat["response"]["body"]["id"]
    completion = by_id["r2"]["response"]["body"]
    assert completion["choices"][0]["text"] == "once"
    # --model replaces each line's model; max_completion_tokens becomes max_tokens
    bodies = {b.get("prompt") or b["messages"][0]["content"]: b for b in server.bodies}
    assert bodies["hello"]["model"] == "tiny" and bodies["hello"]["max_tokens"] == 4
    assert bodies["once"] == {"model": "tiny", "prompt": "once", "max_tokens": 3}


def test_plain_lines_get_derived_custom_ids_and_the_default_max_tokens(tmp_path):
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    rows = [{"prompt": "a"}, {"messages": [{"role": "user", "content": "b"}], "id": "mine"}]
    write_lines(src, rows)
    server = EchoServer()
    code, _ = go(server, str(src), "-o", str(out), "--max-tokens", "9")
    assert code == 0
    ids = sorted(r["custom_id"] for r in read_lines(out))
    assert ids == sorted([derive_id(rows[0], 0), "mine"])
    assert all(b["max_tokens"] == 9 for b in server.bodies)
    assert all("id" not in b and "custom_id" not in b for b in server.bodies)


def test_malformed_lines_are_reported_and_written_as_failures(tmp_path):
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_lines(
        src,
        [
            {"prompt": "fine"},
            "",
            "{not json",
            {"custom_id": "e1", "url": "/v1/embeddings", "body": {"input": "x"}},
            {"prompt": "bad one", "custom_id": "refused"},
            {"neither": 1},
        ],
    )
    code, err = go(EchoServer(), str(src), "-o", str(out))
    assert code == 1
    assert "line 3: not valid JSON" in err
    assert "line 4: url must be one of" in err
    assert "line 6: expected an OpenAI batch request" in err
    by_id = {r["custom_id"]: r for r in read_lines(out)}
    assert len(by_id) == 5  # the blank line is skipped, nothing else is lost
    assert by_id["line-3"]["response"] is None
    assert by_id["line-3"]["error"]["code"] == "invalid_request"
    assert by_id["e1"]["error"]["code"] == "invalid_request"
    refused = by_id["refused"]
    assert refused["response"]["status_code"] == 400
    assert refused["error"] == {
        "code": "request_refused",
        "message": "server refused the request: HTTP 400: no: bad one",
    }
    assert "5 items, 1 ok, 4 failed" in err


def test_resume_skips_successes_and_retries_failures(tmp_path):
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_lines(src, [batch_request(f"r{i}", f"p{i}") for i in range(6)])
    flaky = EchoServer(delay=lambda p: 0.0)
    flaky.calls_before = []

    # The first run is refused for r0 and r3 (rewrite their prompts for that run only).
    first_src = tmp_path / "first.jsonl"
    write_lines(
        first_src,
        [batch_request(f"r{i}", ("bad" if i % 3 == 0 else "p") + str(i)) for i in range(6)],
    )
    code, _ = go(flaky, str(first_src), "-o", str(out))
    assert code == 1
    with out.open("ab") as f:
        f.write(b'{"id": "batch_req_torn", "custom_id": "r1", "resp')  # a kill -9 mid-line

    second = EchoServer()
    code, err = go(second, str(src), "-o", str(out), "--resume")
    assert code == 0, err
    assert sorted(second.calls) == ["p0", "p3"]
    assert "(4 from an earlier run)" in err
    records = read_lines(out)  # the torn line is gone: every line parses
    successes = [r["custom_id"] for r in records if r["error"] is None]
    assert sorted(successes) == [f"r{i}" for i in range(6)]


def test_usage_errors(tmp_path, monkeypatch):
    monkeypatch.delenv("DSCLIENT_URL", raising=False)
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_lines(src, [{"prompt": "a"}])
    err = io.StringIO()
    assert run(parse(str(src), "-o", str(out)), stderr=err) == 2
    assert "pass --url or set DSCLIENT_URL" in err.getvalue()
    code, msg = go(EchoServer(), str(tmp_path / "missing.jsonl"), "-o", str(out))
    assert code == 2 and "cannot read" in msg
    out.write_text('{"x": 1}\n')
    code, msg = go(EchoServer(), str(src), "-o", str(out))
    assert code == 2 and "--resume" in msg


def test_url_defaults_to_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("DSCLIENT_URL", URL)
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_lines(src, [{"prompt": "a"}])
    args = parse(str(src), "-o", str(out), "--no-progress")
    assert args.url is None and args.func is run
    assert run(args, transport=EchoServer().transport, stderr=io.StringIO()) == 0


@pytest.mark.parametrize(
    ("error", "code"),
    [
        (ValueError("x"), "invalid_request"),
        (TimeoutError("x"), "timeout_error"),
        (ContextOverflow("x"), "context_overflow"),
    ],
)
def test_error_codes(error, code):
    assert error_code(error) == code


def test_several_urls_spread_the_batch_over_every_server(tmp_path, monkeypatch):
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_lines(src, [batch_request(f"r{i}", f"hello {i}", max_tokens=4) for i in range(20)])
    server = EchoServer()
    hosts: list[str] = []
    inner = server.transport

    class Recording(type(inner)):  # type: ignore[misc]
        async def handle_async_request(self, request):
            hosts.append(request.url.host)
            return await inner.handle_async_request(request)

    recording = Recording.__new__(Recording)
    recording.__dict__.update(inner.__dict__)
    err = io.StringIO()
    args = parse(
        str(src), "-o", str(out), "--model", "tiny", "--no-progress",
        "--url", "http://a.local:8000", "--url", "http://b.local:8000",
    )  # fmt: skip
    code = run(args, transport=recording, stderr=err)
    assert code == 0, err.getvalue()
    assert len(read_lines(out)) == 20
    assert {"a.local", "b.local"} <= set(hosts)
    monkeypatch.setenv("DSCLIENT_URL", "http://a.local:8000, http://b.local:8000")
    hosts.clear()
    args = parse(str(src), "-o", str(tmp_path / "again.jsonl"), "--model", "tiny", "--no-progress")
    assert run(args, transport=recording, stderr=io.StringIO()) == 0
    assert {"a.local", "b.local"} <= set(hosts)


@pytest.mark.parametrize(("order", "first"), [("shape", 300), ("input", 2)])
def test_order_flag_starts_the_longest_first_or_as_read(tmp_path, order, first):
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_lines(src, [{"prompt": f"p{i}", "max_tokens": n} for i, n in enumerate([2, 300, 9])])
    server = EchoServer()
    code, err = go(server, str(src), "-o", str(out), "--order", order)
    assert code == 0, err
    assert server.bodies[0]["max_tokens"] == first
    assert len(read_lines(out)) == 3


# --- limits, Ctrl-C, the resume line (issue 45) ---------------------------------------------------
class SlowServer:
    """A real HTTP server on a free port, answering completions after ``delay`` seconds (which
    a test may change while it runs)."""

    def __init__(self, delay: float) -> None:
        self.delay = delay
        owner = self
        import threading
        import time
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _send(self, code: int, obj: dict) -> None:
                data = json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                if self.path == "/v1/models":
                    self._send(200, {"data": [{"id": "m", "max_model_len": 4096}]})
                else:
                    self._send(404, {"detail": "Not Found"})

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["content-length"])))
                time.sleep(owner.delay)
                choice = {"index": 0, "text": "ok " + body["prompt"], "finish_reason": "length"}
                usage = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
                self._send(200, {"id": "cmpl-1", "choices": [choice], "usage": usage})

            def log_message(self, *args) -> None:
                pass

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.http.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.http.server_port}"
        threading.Thread(target=self.http.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.http.shutdown()
        self.http.server_close()


def _cli(*argv: str, **kw):
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    return subprocess.Popen(
        [sys.executable, "-m", "dsclient", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        **kw,
    )


def test_ctrl_c_prints_one_line_with_the_resume_command_and_exits_130(tmp_path):
    import shlex
    import signal
    import time

    server = SlowServer(delay=0.05)
    try:
        write_lines(tmp_path / "in.jsonl", [{"prompt": f"item {i}"} for i in range(120)])
        out = tmp_path / "out.jsonl"
        argv = ["map", str(tmp_path / "in.jsonl"), "-o", str(out), "--url", server.url]
        argv += ["--max-tokens", "4", "--no-progress", "--timeout", "300"]
        proc = _cli(*argv)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and (
            not out.exists() or len(out.read_text().splitlines()) < 10
        ):
            time.sleep(0.05)
        server.delay = 30.0  # what is still out stays out: Ctrl-C lands mid-run, every time
        time.sleep(0.3)
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=60)
        server.delay = 0.01
        assert proc.returncode == 130, stderr
        assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr, stderr
        lines = stderr.strip().splitlines()
        assert len(lines) == 1, stderr
        written = len(out.read_text().splitlines())
        assert 10 <= written < 120
        assert lines[0].startswith(f"dsclient map: interrupted: {written} items written to {out}")
        command = lines[0].split("resume with: ", 1)[1]
        words = shlex.split(command)
        assert words[:2] == ["dsclient", "map"] and words[-1] == "--resume"
        assert words[words.index("--timeout") + 1] == "300"
        # The printed command, run as printed, finishes the job without redoing what was done.
        resumed = _cli(*words[1:])
        _, stderr = resumed.communicate(timeout=120)
        assert resumed.returncode == 0, stderr
        assert f"({written} from an earlier run)" in stderr
        ids = [r["custom_id"] for r in read_lines(out)]
        assert len(ids) == len(set(ids)) == 120
    finally:
        server.close()


def test_timeout_and_outage_wait_flags_reach_the_client(tmp_path, monkeypatch):
    # The CLI takes the client's limits: a typo'd port fails in seconds with what was wrong.
    import socket
    import time

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    write_lines(tmp_path / "in.jsonl", [{"prompt": "a"}])
    err = io.StringIO()
    args = parse(
        str(tmp_path / "in.jsonl"),
        "-o",
        str(tmp_path / "out.jsonl"),
        "--url",
        f"http://127.0.0.1:{port}",
        "--no-progress",
        "--timeout",
        "60",
        "--outage-wait",
        "120",
    )
    assert (args.timeout, args.outage_wait) == (60.0, 120.0)
    started = time.monotonic()
    assert run(args, stderr=err) == 1
    assert time.monotonic() - started < 20
    assert f"nothing listens on 127.0.0.1:{port}" in err.getvalue()
    assert parse("i", "-o", "o", "--outage-wait", "none").outage_wait is None
    with pytest.raises(SystemExit):
        parse("i", "-o", "o", "--timeout", "-1")


def test_resume_command_repeats_the_flags_that_were_given():
    from dsclient.cli.map import resume_command

    args = parse(
        "in put.jsonl",
        "-o",
        "out.jsonl",
        "--url",
        "http://h:1",
        "--model",
        "m",
        "--order",
        "input",
        "--outage-wait",
        "none",
    )
    assert resume_command(args) == (
        "dsclient map 'in put.jsonl' -o out.jsonl --url http://h:1 --model m --order input "
        "--outage-wait none --resume"
    )


def test_the_progress_bar_knows_the_total_of_a_file(tmp_path, monkeypatch):
    from dsclient.batch import _progress

    seen = {}
    real = _progress._make_tqdm

    def spy(options):
        seen.update(options)
        return real({**options, "file": io.StringIO()})

    monkeypatch.setattr(_progress, "_make_tqdm", spy)
    monkeypatch.setattr("dsclient.cli.map.wanted", lambda setting: True)
    write_lines(tmp_path / "in.jsonl", [{"prompt": f"p{i}"} for i in range(7)] + [""])
    server = EchoServer()
    err = io.StringIO()
    args = parse(str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "out.jsonl"), "--url", URL)
    assert run(args, transport=server.transport, stderr=err) == 0
    assert seen["total"] == 7
