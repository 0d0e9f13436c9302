"""map() and ``dsclient map`` against the real vLLM server, including a kill -9 mid-batch."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter

import pytest

from dsclient import AsyncClient, CompletionResult

pytestmark = [pytest.mark.integration, pytest.mark.anyio]


async def test_map_50_prompts(vllm_server, tmp_path):
    out = tmp_path / "results.jsonl"
    prompts = [f"Item {i}: the quick brown fox" for i in range(50)]
    async with AsyncClient(vllm_server) as client:
        results = await client.map(
            prompts, max_tokens=8, temperature=0.0, ignore_eos=True, output=out, progress=False
        )
        assert client.in_flight == 0
    assert len(results) == 50 and not results.failures, results.failures[:3]
    assert [r.index for r in results] == list(range(50))
    assert all(isinstance(r, CompletionResult) for r in results)
    assert all(r.usage.completion_tokens == 8 and r.finish_reason == "length" for r in results)
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(line["index"] for line in lines) == list(range(50))
    assert all(line["ok"] for line in lines)


def _success_ids(path) -> Counter[str]:
    ids: Counter[str] = Counter()
    for raw in path.read_bytes().splitlines():
        record = json.loads(raw)  # after the resume, every line parses
        if record["error"] is None:
            ids[record["custom_id"]] += 1
    return ids


def test_kill_9_mid_batch_then_resume(vllm_server, tmp_path):
    n = 300
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    with src.open("w") as f:
        for i in range(n):
            if i % 2:
                line = {
                    "custom_id": f"r{i}",
                    "method": "POST",
                    "url": "/v1/completions",
                    "body": {
                        "model": "tiny",
                        "prompt": f"Request {i}",
                        "max_tokens": 4,
                        "ignore_eos": True,
                    },
                }
            else:
                line = {
                    "prompt": f"Request {i}",
                    "max_tokens": 4,
                    "ignore_eos": True,
                    "custom_id": f"r{i}",
                }
            f.write(json.dumps(line) + "\n")
    command = [
        sys.executable,
        "-m",
        "dsclient",
        "map",
        str(src),
        "-o",
        str(out),
        "--url",
        vllm_server.url,
        "--no-progress",
    ]

    proc = subprocess.Popen(command, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            if out.exists() and out.read_bytes().count(b"\n") >= 40:
                break
            time.sleep(0.05)
        assert proc.poll() is None, "the batch finished before it could be killed"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == -signal.SIGKILL
    before = out.read_bytes()
    assert 40 <= before.count(b"\n") < n

    resumed = subprocess.run([*command, "--resume"], capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr
    assert "from an earlier run" in resumed.stderr
    ids = _success_ids(out)
    assert set(ids) == {f"r{i}" for i in range(n)}  # nothing lost
    assert set(ids.values()) == {1}  # exactly one success line per item
    # What the killed run wrote (whole lines) is still there, unchanged.
    whole = before[: before.rfind(b"\n") + 1]
    assert out.read_bytes().startswith(whole)
