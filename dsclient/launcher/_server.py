"""The handle of one vLLM: :class:`Server` (returned by :func:`dsclient.launcher.launch`), and
the steps of a start as package-level functions that :class:`Server` and
:class:`~dsclient.launcher.ServerGroup` both call: :func:`verify_flags_once`, :func:`spawn`,
:func:`wait_healthy` / :func:`await_healthy`; :func:`exit_status` once it runs.

A start is: vLLM's own parser on the plan (when asked), the process spawned in its own group
(``_process``), ``/health`` polled until it answers 200 or the process dies or the start-up
time runs out (then :class:`ServerStartError` with the log's tail), and, once healthy, the
EngineCore placed and the launch record written. Stopping signals the whole process group.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import functools
import logging
import os
import secrets
import subprocess
import threading
import time
import types
from collections.abc import Callable, Sequence
from pathlib import Path

import anyio
import anyio.to_thread

from .._http import httpx
from .._records import LaunchRecord, remove_record, write_record
from ._command import LaunchPlan, format_cpu_list
from ._errors import ServerStartError
from ._placement import engine_core_pids, pin_process
from ._plan import verify_flags
from ._process import last_line, spawn_process, stop_group, tail
from ._redact import scrub, secrets_in

__all__ = [
    "STARTING_GRACE",
    "Progress",
    "Server",
    "await_healthy",
    "exit_status",
    "spawn",
    "verify_flags_once",
    "wait_healthy",
]

logger = logging.getLogger("dsclient")

#: Seconds between SIGTERM and SIGKILL for a server that never got healthy: nothing to drain
#: yet, and vLLM may ignore SIGTERM while compiling.
STARTING_GRACE = 5.0

#: Called with a line of text while a server starts (default: the ``dsclient`` logger).
Progress = Callable[[str], None]


# Servers started and not yet stopped: the interpreter's exit stops them.
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


def _flag_value(args: Sequence[str], flag: str) -> str | None:
    """The value given to ``flag`` in ``args`` (``--flag v`` or ``--flag=v``), or ``None``."""
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith(flag + "="):
            return arg[len(flag) + 1 :]
    return None


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

    def _check_alive(self, elapsed: float) -> None:
        proc = self._proc
        assert proc is not None
        code = proc.poll()
        if code is not None:
            raise ServerStartError(
                f"vLLM exited with status {code} after {elapsed:.0f} s while starting",
                log_tail=scrub(tail(self.log_path), secrets_in(self.plan.argv, self.plan.env)),
                log_path=self.log_path,
                returncode=code,
            )
        if elapsed > self.startup_timeout:
            raise ServerStartError(
                f"vLLM was not healthy after {self.startup_timeout:.0f} s (startup_timeout)",
                log_tail=scrub(tail(self.log_path), secrets_in(self.plan.argv, self.plan.env)),
                log_path=self.log_path,
            )

    def _waiting(self, elapsed: float) -> None:
        self._say(
            f"waiting for {self.url}/health: {elapsed:.0f} s of at most"
            f" {self.startup_timeout:.0f} s; log: {last_line(self.log_path)}"
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
        verify_flags_once([self])
        spawn(self)
        try:
            wait_healthy([self])
        except BaseException:
            self.stop(grace=STARTING_GRACE)
            raise
        return self

    async def astart(self) -> Server:
        """Start vLLM and wait for ``/health`` without blocking the event loop."""
        await anyio.to_thread.run_sync(verify_flags_once, [self])
        await anyio.to_thread.run_sync(spawn, self)
        try:
            await await_healthy([self])
        except BaseException:
            await self.astop(grace=STARTING_GRACE)
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
            stop_group(proc, grace, url=self.url)
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


def verify_flags_once(servers: Sequence[Server]) -> None:
    """Before the first start: vLLM's own parser on the first server's plan, once for all.

    The servers of a group differ only in port and CPUs, so one check (10 to 25 s) speaks for
    every one; each plan gets its note. Raises :class:`VllmFlagsError` when vLLM refuses the
    flags, before any process starts. Nothing to do without ``check_flags``, or once started.
    """
    first = servers[0]
    if not first._check_flags or first._proc is not None:
        return
    first._say("checking the flags with vLLM's own argument parser ...")
    first.plan = verify_flags(first.plan)
    first._say(first.plan.notes[-1])
    for server in servers:
        server._check_flags = False
    for other in servers[1:]:
        other.plan = dataclasses.replace(
            other.plan, notes=(*other.plan.notes, first.plan.notes[-1])
        )


def spawn(server: Server) -> None:
    """Start the server's process (:func:`~dsclient.launcher._process.spawn_process`); does
    not wait for it. Raises ``RuntimeError`` when this server was started before."""
    with server._lock:
        if server._proc is not None:
            raise RuntimeError("this Server was already started; launch() a new one")
        server._proc = spawn_process(server.plan, server.log_path)
        server.started_at = time.time()
        server._spawned = time.monotonic()
        _register(server)
    server._say(
        f"starting vLLM (pid {server._proc.pid}) at {server.url}: model {server.model!r},"
        f" max_num_seqs={server.max_num_seqs}, max_model_len={server.max_model_len};"
        f" log: {server.log_path}"
    )


def exit_status(server: Server) -> int | None:
    """The server's exit status once its process has ended; ``None`` before, or unstarted."""
    return server._proc.poll() if server._proc is not None else None


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
