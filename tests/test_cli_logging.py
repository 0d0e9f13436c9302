"""The CLI's log lines: ``LEVEL logger: message``, never the logger's name twice (issue 45)."""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
from pathlib import Path

from dsclient.cli import LogFormat


def _line(name: str, message: str) -> str:
    record = logging.LogRecord(name, logging.WARNING, __file__, 1, message, None, None)
    return LogFormat().format(record)


def test_a_message_that_names_its_logger_is_not_prefixed_again():
    assert _line("dsclient", "dsclient: http://h does not answer") == (
        "WARNING dsclient: http://h does not answer"
    )
    assert _line("dsclient.launcher", "dsclient: vLLM exited") == "WARNING dsclient: vLLM exited"


def test_other_messages_keep_the_logger_name():
    assert _line("dsclient", "plain") == "WARNING dsclient: plain"
    assert _line("httpx", "HTTP Request: GET /") == "WARNING httpx: HTTP Request: GET /"


def test_the_command_line_logs_each_name_once(tmp_path):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    (tmp_path / "in.jsonl").write_text('{"prompt": "a"}\n')
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "dsclient",
            "map",
            str(tmp_path / "in.jsonl"),
            "-o",
            str(tmp_path / "out.jsonl"),
            "--url",
            f"http://127.0.0.1:{port}",
            "--no-progress",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert out.returncode == 1, out.stderr
    assert f"WARNING dsclient: http://127.0.0.1:{port}" in out.stderr
    assert "dsclient: dsclient:" not in out.stderr
    assert f"nothing listens on 127.0.0.1:{port}" in out.stderr
