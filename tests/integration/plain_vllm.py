"""A vLLM server started the way a user starts one by hand: not through dsclient's launcher.

No launch record, no dev mode, its own port: discovery must learn what it can from the server
itself. Its EngineCore is moved next to its worker once healthy, as a user would with taskset on a
2-core machine (see docs/governor.md for a server left as vLLM places it). Used by the ``plain_vllm_server`` fixture (tests/conftest.py).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from pathlib import Path

import httpx

#: ENVIRONMENT.md: what worked for the CPU build on these machines.
ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "HF_HUB_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _place_engine_core(pgid: int) -> None:
    """Move the EngineCore onto CPU 0, next to its worker, as a careful user does with ``taskset``
    on a 2-core machine (docs/governor.md): left where vLLM puts it, its busy loop starves the
    API server, whose gauges then lag by seconds. Launch record, dev mode and port stay the
    user's own: discovery still learns nothing from the launcher."""
    from dsclient.launcher._placement import engine_core_pids, pin_process

    if not hasattr(os, "sched_setaffinity") or (os.cpu_count() or 1) < 2:
        return
    for pid in engine_core_pids(pgid):
        pin_process(pid, [0])


@contextmanager
def plain_vllm(
    python: str, model_dir: str, args: Sequence[str], *, start_timeout: float = 300.0
) -> Iterator[str]:
    """Start ``python -m vllm.entrypoints.openai.api_server`` on a free port; yield its URL.

    The whole process group is killed on exit, whatever happened.
    """
    port = free_port()
    log = Path(tempfile.mkdtemp(prefix="plain-vllm-")) / "server.log"
    argv = [
        python,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        model_dir,
        "--served-model-name",
        "tiny",
        "--dtype",
        "float32",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        *args,
    ]
    env = {k: v for k, v in os.environ.items() if k != "VLLM_SERVER_DEV_MODE"}
    env.update(ENV)
    with log.open("wb") as out:
        proc = subprocess.Popen(
            argv, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + start_timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(
                    f"plain vLLM exited with {proc.returncode}:\n{log.read_text()[-3000:]}"
                )
            try:
                if httpx.get(url + "/health", timeout=2.0).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"plain vLLM not healthy after {start_timeout:.0f} s")
            time.sleep(1.0)
        _place_engine_core(proc.pid)
        yield url
    finally:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=20)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            with suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
