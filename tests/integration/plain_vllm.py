"""A vLLM server started the way a user starts one by hand: not through dsclient's launcher.

No launch record, no EngineCore placement, no dev mode: discovery must learn what it can from the
server itself. Used by the ``plain_vllm_server`` fixture (tests/conftest.py).
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
        yield url
    finally:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=20)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            with suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
