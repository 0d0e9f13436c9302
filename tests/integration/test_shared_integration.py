"""The shared budget with real parts: client processes (``tests/integration/shared_worker.py``),
a real redis-server (``tests/redis_server.py``) and the real tiny vLLM (``vllm_server``).

What the server sees is read from its own gauges (``vllm:num_requests_running`` + ``waiting``
from ``/metrics``, every 50 ms); what each process holds is read from Redis's lease set.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from dsclient.governor._shared import LEASE_S
from tests.integration.test_closed_loop_integration import _gauge
from tests.redis_server import RedisServer

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


class Worker:
    """One client process; ``ready`` once it holds its first lease."""

    def __init__(self, url: str, redis_url: str, n: int, *args: str) -> None:
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.integration.shared_worker",
                url,
                redis_url,
                str(n),
                *args,
            ],
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
        line = self._line(timeout=120)
        self.id = json.loads(line)["ready"]

    def _line(self, timeout: float) -> str:
        box: list[str] = []
        reader = threading.Thread(target=lambda: box.append(self.proc.stdout.readline()))
        reader.start()
        reader.join(timeout)
        if not box or not box[0]:
            self.proc.kill()
            raise AssertionError(f"worker said nothing: {self.proc.stderr.read()[-2000:]}")
        return box[0]

    def go(self) -> None:
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()

    def result(self, timeout: float = 300) -> dict[str, Any]:
        line = self._line(timeout)
        self.proc.wait(30)
        self.stderr = self.proc.stderr.read()
        return json.loads(line)

    def kill9(self) -> None:
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)


class ServerWatch:
    """Samples the server's running + waiting every 50 ms in a thread."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.samples: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(base_url=self.url, timeout=10) as http:
            while not self._stop.is_set():
                text = http.get("/metrics").text
                self.samples.append(
                    _gauge(text, "vllm:num_requests_running")
                    + _gauge(text, "vllm:num_requests_waiting")
                )
                time.sleep(0.05)

    def __enter__(self) -> ServerWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)


def _holders(redis_url: str, server_url: str) -> Counter[str]:
    raw = redis.Redis.from_url(redis_url)
    members = raw.zrange(f"dsclient:{{{server_url}}}:leases", 0, -1)
    return Counter(m.decode().rsplit(":", 1)[0] for m in members)


def test_three_processes_share_one_limit_and_the_server_never_sees_more(
    vllm_server, redis_url: str
) -> None:
    workers = [Worker(vllm_server.url, redis_url, 60, "--limit", "6") for _ in range(3)]
    with ServerWatch(vllm_server.url) as watch:
        for worker in workers:
            worker.go()
        results = [worker.result() for worker in workers]
    assert [r["ok"] for r in results] == [60, 60, 60], results
    assert all(r["limit"] == 6 for r in results)
    most = max(watch.samples)
    assert most <= 6, f"the server saw {most} requests at once against a shared limit of 6"
    assert most >= 4, f"at most {most} at once: the three did not use the limit they share"


def test_a_process_killed_with_sigkill_gives_its_share_back_within_the_lease_time(
    vllm_server, redis_url: str
) -> None:
    workers = [Worker(vllm_server.url, redis_url, 120, "--limit", "6") for _ in range(3)]
    for worker in workers:
        worker.go()
    victim, survivors = workers[0], workers[1:]
    deadline = time.monotonic() + 30
    while _holders(redis_url, vllm_server.url)[victim.id] < 2:
        assert time.monotonic() < deadline, "the victim never held 2 leases"
        time.sleep(0.05)
    victim.kill9()
    killed_at = time.monotonic()
    gone_after = None
    while True:
        holders = _holders(redis_url, vllm_server.url)
        if gone_after is None and holders[victim.id] == 0:
            gone_after = time.monotonic() - killed_at
        if gone_after is not None and sum(holders[w.id] for w in survivors) == 6:
            regained_after = time.monotonic() - killed_at
            break
        assert time.monotonic() - killed_at < LEASE_S + 3.0, f"share not back: {holders}"
        time.sleep(0.05)
    # The lease time, plus a survivor's sync (0.2 s) and slack for a loaded CI machine.
    assert gone_after <= LEASE_S + 1.0, gone_after
    assert regained_after <= LEASE_S + 1.5, regained_after
    results = [worker.result() for worker in survivors]
    assert [r["ok"] for r in results] == [120, 120], results


def test_redis_restarted_mid_run_loses_no_request(vllm_server, redis_server: RedisServer) -> None:
    workers = [Worker(vllm_server.url, redis_server.url, 80, "--limit", "6") for _ in range(2)]
    for worker in workers:
        worker.go()
    time.sleep(1.0)
    redis_server.kill()
    time.sleep(2.0)
    redis_server.start()
    results = [worker.result() for worker in workers]
    assert [(r["ok"], r["failed"]) for r in results] == [(80, 0), (80, 0)], results
    for worker in workers:
        assert worker.stderr.count("does not answer") == 1, worker.stderr
        assert redis_server.password is None  # no password to leak here; see test_shared.py
