"""Two real tiny-vLLM replicas started through the launcher: both answer, and stop leaves nothing.

Starts its own servers (the launcher's replicas are what it checks), so run it alone under the
machine's vLLM lock: ``flock /tmp/dsclient-vllm.lock pytest tests/integration/test_replicas_integration.py``.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from dsclient._records import read_record, record_matches
from dsclient.launcher import (
    LaunchError,
    ServerGroup,
    launch,
    make_tiny_model,
    resolve_server_python,
)

pytestmark = pytest.mark.integration


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes in process group ``pgid``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[-1].split()
        except OSError:
            continue
        if fields[2] == str(pgid) and fields[0] != "Z":
            found.append(int(entry.name))
    return found


def vllm_processes_on(port: int) -> list[str]:
    out = subprocess.run(["pgrep", "-af", f"vllm.*--port {port}"], capture_output=True, text=True)
    return [line for line in out.stdout.splitlines() if "pgrep" not in line]


def _progress(message: str) -> None:
    print(f"[replicas] {message}", file=sys.__stderr__, flush=True)


def test_two_replicas_answer_and_stop_leaves_no_process() -> None:
    try:
        install = resolve_server_python()
    except LaunchError as exc:
        pytest.fail(f"the integration tests need the vLLM server venv: {exc}", pytrace=False)
    model = make_tiny_model(python=install.python)
    group = launch(
        model,
        python=install.python,
        max_num_seqs=8,
        max_model_len=2048,
        served_model_name="tiny",
        dtype="float32",
        replicas=2,
        startup_timeout=600.0,
        progress=_progress,
    )
    assert isinstance(group, ServerGroup) and len(group) == 2
    ports = [int(url.rsplit(":", 1)[1]) for url in group.urls]
    assert len(set(ports)) == 2
    begun = time.monotonic()
    with group:
        _progress(
            f"both healthy after {time.monotonic() - begun:.0f} s"
            f" ({'concurrent' if group.concurrent_start else 'one after another'})"
        )
        leaders = []
        for server in group.servers:
            assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
            models = httpx.get(f"{server.url}/v1/models", timeout=10).json()
            assert [m["id"] for m in models["data"]] == ["tiny"]
            record = read_record(server.url)
            assert record is not None and record.pid == server.pid
            assert record_matches(record, models)
            assert server.pid is not None and len(group_members(server.pid)) >= 2  # + engine
            leaders.append(server.pid)
            # Each replica really serves: a completion comes back from each.
            answer = httpx.post(
                f"{server.url}/v1/completions",
                json={"model": "tiny", "prompt": "Hello", "max_tokens": 4},
                timeout=60,
            )
            assert answer.status_code == 200, answer.text
        assert leaders[0] != leaders[1]
        logs = {s.log_path for s in group.servers}
        assert len(logs) == 2 and all(p.exists() for p in logs)
        binds = [s.plan.env["VLLM_CPU_OMP_THREADS_BIND"] for s in group.servers]
        assert len(set(binds)) == 2, binds  # each engine on CPUs of its own
    for pgid in leaders:
        deadline = time.monotonic() + 10
        while group_members(pgid) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert group_members(pgid) == [], f"process group {pgid} outlived stop()"
    for port in ports:
        assert vllm_processes_on(port) == []
    for server in group.servers:
        assert read_record(server.url) is None
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"{server.url}/health", timeout=2)
