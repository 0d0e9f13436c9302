"""`dsclient probe` on a server that does not answer: a record of defaults, not a crash."""

from __future__ import annotations

import json
import socket

from dsclient.cli import main


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_probe_of_a_silent_url_prints_the_defaults(capsys):
    url = f"http://127.0.0.1:{_closed_port()}"
    assert main(["probe", url, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["kind"] == "unknown"
    assert out["max_num_seqs"] == 8
    assert out["sources"]["max_num_seqs"] == "default"
    assert out["dsclient_limit"] == 5


def test_probe_table_names_the_cap(capsys):
    url = f"http://127.0.0.1:{_closed_port()}/v1"
    assert main(["probe", url, "--headroom", "1.0"]) == 0
    out = capsys.readouterr().out
    assert "dsclient limit: starts at 8 in flight" in out
    assert "no queue metrics" in out
