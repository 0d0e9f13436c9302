"""The operating system's side of one vLLM: start it in a process group of its own with its
output in a log file, read the log's tail, and stop the whole group (SIGTERM, then SIGKILL).

Nothing here knows the :class:`~dsclient.launcher.Server` handle; ``_server`` wires these to it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import time
from pathlib import Path

from .._records import state_dir
from ._command import LaunchPlan
from ._errors import LaunchError
from ._placement import group_members
from ._ports import port_is_free

__all__ = ["group_alive", "last_line", "log_dir", "spawn_process", "stop_group", "tail"]

logger = logging.getLogger("dsclient")

_LOG_TAIL_LINES = 40


def log_dir() -> Path:
    """Where server logs go by default: ``~/.cache/dsclient/logs`` (or the state dir's)."""
    if os.environ.get("DSCLIENT_STATE_DIR"):
        return state_dir() / "logs"
    return Path.home() / ".cache" / "dsclient" / "logs"


def spawn_process(plan: LaunchPlan, log_path: Path) -> subprocess.Popen[bytes]:
    """Start ``plan.argv`` in its own session, its output appended to ``log_path``.

    The log's first line is the plan's shell line (secrets shown as ``***``). Raises
    :class:`LaunchError` when the plan's port is already taken: vLLM would only find out
    after a minute of loading.
    """
    host = plan.argv[plan.argv.index("--host") + 1]
    port = int(plan.argv[plan.argv.index("--port") + 1])
    if not port_is_free(host, port):
        raise LaunchError(
            f"port {port} on {host} is already in use; pass another port (or none, to"
            " get a free one)"
        )
    log_path.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, **plan.env}
    with log_path.open("ab") as log:
        log.write(f"# dsclient launcher: {plan.shell()}\n".encode())
        log.flush()
        return subprocess.Popen(
            plan.argv,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            # Its own session and process group: Ctrl-C in a terminal does not reach it
            # half-way, and stop_group() can signal vLLM and all its engine processes at once.
            start_new_session=True,
        )


def stop_group(proc: subprocess.Popen[bytes], grace: float, *, url: str) -> None:
    """Stop ``proc``'s whole process group: SIGTERM, then SIGKILL after ``grace`` s.

    ``proc`` leads its group (:func:`spawn_process` started it in a session of its own); the
    engine's processes share the group and are waited for too.
    """
    pgid = proc.pid
    if proc.poll() is None or group_alive(pgid):
        logger.info("stopping vLLM (process group %d) at %s", pgid, url)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGTERM)
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            logger.warning("vLLM did not stop in %.0f s; killing it", grace)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGKILL)
            proc.wait()
        # The engine's own processes share the group; wait for them too.
        deadline = time.monotonic() + grace
        while group_alive(pgid) and time.monotonic() < deadline:
            time.sleep(0.1)
        if group_alive(pgid):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGKILL)


def group_alive(pgid: int) -> bool:
    """Whether any live (non-zombie) process is left in process group ``pgid``."""
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    proc = Path("/proc")
    if not proc.is_dir():  # pragma: no cover - not Linux: trust killpg
        return True
    # killpg also "finds" zombies, which an init that does not reap orphans keeps around.
    return any(group_members(pgid, proc))  # (pid, comm) pairs: never falsy


def tail(path: Path, lines: int = _LOG_TAIL_LINES) -> str:
    """The last ``lines`` lines of a log (of its last 64 kB); ``""`` when it cannot be read."""
    try:
        with path.open("rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - 64_000))
            text = f.read().decode(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


def last_line(path: Path) -> str:
    """The log's last line, cut to 160 characters (for "waiting for ..." messages)."""
    return tail(path, 1).strip()[:160]
