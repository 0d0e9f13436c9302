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
