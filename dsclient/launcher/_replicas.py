"""N replicas of one model on one machine: :func:`split_hardware` (pure: the CPUs or GPUs of
each replica; their ports come from ``_ports.choose_ports``) and :class:`ServerGroup`, which
starts them (all at once by default, which was faster here, see :func:`split_hardware`) and
stops every one of them on exit or on any failure.

Use is shown in :func:`launch_replicas` and :mod:`dsclient.launcher`.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import time
import types
from collections.abc import Iterator, Sequence
from pathlib import Path

import anyio
import anyio.to_thread

from ._command import LaunchPlan, format_cpu_list
from ._errors import LaunchError
from ._hardware import detect_hardware
from ._install import VllmInstall, resolve_server_python
from ._plan import plan_launch, wants_flag_check
from ._ports import choose_ports, free_ports, port_is_free
from ._process import log_dir
from ._profiles import Hardware
from ._server import (
    STARTING_GRACE,
    Progress,
    Server,
    await_healthy,
    exit_status,
    spawn,
    verify_flags_once,
    wait_healthy,
)

__all__ = ["ReplicaLayout", "ServerGroup", "launch_replicas", "split_hardware"]

logger = logging.getLogger("dsclient")


# --- planning (pure) ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class ReplicaLayout:
    """How N replicas share the machine: the :class:`Hardware` each one is planned for.

    ``split_hardware(Hardware(cpu_ids=(0, 1, 2, 3), mem_gib=24), 2).per_replica[1].cpu_ids``
    is ``(2, 3)``: CPU 2 for its engine, CPU 3 for its API server.

    Parameters:
        per_replica: the hardware each replica is planned for (its CPUs, its share of memory,
            its GPUs).
        engine_core_cpus: where each replica's EngineCore goes (``None``: as planned).
        env: extra environment per replica (``CUDA_VISIBLE_DEVICES`` on GPUs).
        concurrent_start: whether to start them all at once (the default: see the module).
        notes: what was decided, and why.
    """

    per_replica: tuple[Hardware, ...]
    engine_core_cpus: tuple[tuple[int, ...] | None, ...]
    env: tuple[dict[str, str], ...]
    concurrent_start: bool
    notes: tuple[str, ...]


def split_hardware(hardware: Hardware, replicas: int) -> ReplicaLayout:
    """Split ``hardware`` between ``replicas`` vLLM servers of one model.

    CPU backend, with ``P`` CPUs (each vLLM computes on its engine CPUs and keeps one for its
    API server, see :func:`dsclient.launcher._command.build_command`):

    * ``P >= 2N``: each replica gets ``P // N`` CPUs of its own (its engine on all but the
      last, its API server on the last).
    * ``N < P < 2N``: each engine gets ``(P - 1) // N`` CPUs of its own; the last CPU is shared
      by the API servers.
    * ``P == N``: one CPU per engine (its EngineCore moved there too), API servers unpinned.
    * ``P < N``: refused: two engines bound to one CPU would each run at half speed at best.

    Memory is split evenly (each replica's KV cache is sized within its share). On GPUs each
    replica gets ``G // N`` cards through ``CUDA_VISIBLE_DEVICES``; ``G < N`` is refused.

    Start order: all at once. Two tiny-model replicas on the 2-CPU reference machine (load 2.8-6.4
    from other work, vLLM's compile cache warm) were healthy after 47-52 s started together and
    71-80 s one after another (``python -m benchmarks replicas``, 3 runs each), and with an
    empty compile cache 65 s against 93 s (``--cold``): much of a vLLM start-up is waiting on
    its own processes, not computing.
    """
    if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
        raise ValueError(f"replicas must be an int >= 1, got {replicas!r}")
    n = replicas
    mem = hardware.mem_gib / n
    cpus = sorted(hardware.cpu_ids)
    p = len(cpus)
    notes: list[str] = []
    if hardware.gpu_count > 0:
        g = hardware.gpu_count
        if g < n:
            raise LaunchError(
                f"{n} replicas need a GPU each; this machine has {g}. Start fewer replicas"
                f" (at most {g})"
            )
        per = g // n
        groups = [list(range(i * per, (i + 1) * per)) for i in range(n)]
        envs = tuple({"CUDA_VISIBLE_DEVICES": ",".join(map(str, grp))} for grp in groups)
        notes.append(
            f"{n} replicas: {per} GPU(s) each (CUDA_VISIBLE_DEVICES "
            + "; ".join(e["CUDA_VISIBLE_DEVICES"] for e in envs)
            + ")"
        )
        per_hw = tuple(dataclasses.replace(hardware, gpu_count=per, mem_gib=mem) for _ in range(n))
        notes.append(_START_NOTE)
        return ReplicaLayout(
            per_replica=per_hw,
            engine_core_cpus=(None,) * n,
            env=envs,
            concurrent_start=True,
            notes=tuple(notes),
        )
    if p < n:
        raise LaunchError(
            f"{n} replicas need at least {n} CPUs (one for each engine); this process may use"
            f" {p} (CPUs {format_cpu_list(cpus)}). Start at most {p} replicas"
        )
    per_hw_list: list[Hardware] = []
    cores: list[tuple[int, ...] | None] = []
    if p >= 2 * n:
        size = p // n
        for i in range(n):
            own = tuple(cpus[i * size : (i + 1) * size])
            per_hw_list.append(dataclasses.replace(hardware, cpu_ids=own, mem_gib=mem))
            cores.append(None)  # build_command places it on the replica's engine CPUs
        spare = cpus[n * size :]
        notes.append(
            f"{n} replicas: {size} CPUs each ("
            + "; ".join(format_cpu_list(h.cpu_ids) for h in per_hw_list)
            + "), engine on all but the last of each, API server on the last"
            + (f"; CPUs {format_cpu_list(spare)} unused" if spare else "")
        )
    elif p > n:
        api = cpus[-1]
        size = (p - 1) // n
        for i in range(n):
            engine = tuple(cpus[i * size : (i + 1) * size])
            per_hw_list.append(dataclasses.replace(hardware, cpu_ids=(*engine, api), mem_gib=mem))
            cores.append(None)
        notes.append(
            f"{n} replicas: engines on CPUs "
            + "; ".join(format_cpu_list(h.cpu_ids[:-1]) for h in per_hw_list)
            + f", the API servers share CPU {api}"
        )
    else:
        for cpu in cpus:
            per_hw_list.append(dataclasses.replace(hardware, cpu_ids=(cpu,), mem_gib=mem))
            cores.append((cpu,))
        notes.append(
            f"{n} replicas on {p} CPUs: one engine per CPU ("
            + ", ".join(str(c) for c in cpus)
            + "), each EngineCore moved to its engine's CPU; the API servers have no CPU of"
            " their own and run beside the engines"
        )
    notes.append(_START_NOTE)
    return ReplicaLayout(
        per_replica=tuple(per_hw_list),
        engine_core_cpus=tuple(cores),
        env=tuple({} for _ in range(n)),
        concurrent_start=True,
        notes=tuple(notes),
    )


_START_NOTE = (
    "start: all at once (two replicas on 2 CPUs were healthy in 47-52 s together, 71-80 s one"
    " after another; concurrent_start=False starts them in turn)"
)


def _replica_log(log_path: str | os.PathLike[str] | None, port: int, stamp: str) -> Path:
    if log_path is None:
        return log_dir() / f"vllm-{port}-{stamp}.log"
    path = Path(log_path).expanduser()
    return path.with_name(f"{path.stem}-{port}{path.suffix or '.log'}")


# --- the group ---------------------------------------------------------------------------------


class ServerGroup:
    """N vLLM replicas of one model, started and stopped together (returned by
    :func:`launch_replicas` and ``launch(..., replicas=N)``).

    ```python
    with launch(model_dir, served_model_name="tiny", replicas=2) as group:
        print(group.urls)  # ('http://127.0.0.1:8000', 'http://127.0.0.1:8001')
        for server in group.servers:  # each a Server: its url, pid, log, launch record
            print(server.pid, server.log_path)
    ```

    ``with`` / ``async with`` (or :meth:`start` / :meth:`astart`) start every replica and return
    once all answer ``/health``; when one fails to start, all are stopped before the error is
    raised. Leaving the block, an exception, Ctrl-C or the interpreter's exit stop every one's
    whole process group. Replicas start concurrently only when :attr:`concurrent_start`.
    """

    def __init__(
        self,
        servers: Sequence[Server],
        *,
        concurrent_start: bool = False,
        notes: Sequence[str] = (),
    ) -> None:
        if not servers:
            raise ValueError("a ServerGroup needs at least one Server")
        urls = [s.url for s in servers]
        if len(set(urls)) != len(urls):
            raise ValueError(f"the servers' URLs must be distinct, got {urls}")
        self.servers: tuple[Server, ...] = tuple(servers)
        self.concurrent_start = concurrent_start
        self.notes: tuple[str, ...] = tuple(notes)

    def __repr__(self) -> str:
        running = sum(s.running for s in self.servers)
        return (
            f"<ServerGroup {len(self.servers)} x {self.model!r} {running} running:"
            f" {', '.join(self.urls)}>"
        )

    def __len__(self) -> int:
        return len(self.servers)

    def __iter__(self) -> Iterator[Server]:
        return iter(self.servers)

    def __getitem__(self, index: int) -> Server:
        return self.servers[index]

    @property
    def urls(self) -> tuple[str, ...]:
        """Each replica's root URL (no ``/v1``), in order."""
        return tuple(s.url for s in self.servers)

    @property
    def model(self) -> str:
        """The served model name (the same on every replica)."""
        return self.servers[0].model

    @property
    def running(self) -> bool:
        """Whether every replica's process is alive."""
        return all(s.running for s in self.servers)

    # -- starting --

    def start(self) -> ServerGroup:
        """Start every replica and block until all are healthy; on any failure stop them all."""
        try:
            verify_flags_once(self.servers)
            if self.concurrent_start:
                for server in self.servers:
                    spawn(server)
                wait_healthy(self.servers)
            else:
                for server in self.servers:
                    spawn(server)
                    wait_healthy([server])
        except BaseException:
            self.stop(grace=STARTING_GRACE)
            raise
        return self

    async def astart(self) -> ServerGroup:
        """:meth:`start` without blocking the event loop."""
        try:
            await anyio.to_thread.run_sync(verify_flags_once, self.servers)
            if self.concurrent_start:
                for server in self.servers:
                    await anyio.to_thread.run_sync(spawn, server)
                await await_healthy(self.servers)
            else:
                for server in self.servers:
                    await anyio.to_thread.run_sync(spawn, server)
                    await await_healthy([server])
        except BaseException:
            await self.astop(grace=STARTING_GRACE)
            raise
        return self

    # -- stopping --

    def stop(self, grace: float = 15.0) -> None:
        """Stop every replica's process group (SIGTERM, SIGKILL after ``grace`` s); removes
        their launch records. Safe to call more than once; one failing stop does not keep the
        others running (its error is raised after all were stopped)."""
        errors: list[BaseException] = []
        for server in self.servers:
            try:
                server.stop(grace)
            except Exception as exc:  # every replica must get its stop
                errors.append(exc)
        if errors:
            raise errors[0]

    async def astop(self, grace: float = 15.0) -> None:
        """:meth:`stop` in a worker thread, shielded from cancellation so it always finishes."""
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(functools.partial(self.stop, grace))

    def wait(self, poll: float = 0.5) -> tuple[Server, int]:
        """Block until any replica exits; returns it and its exit status (the CLI's foreground
        mode: one replica gone ends the group)."""
        if any(s.pid is None for s in self.servers):
            raise RuntimeError("the group was not started")
        while True:
            for server in self.servers:
                code = exit_status(server)
                if code is not None:
                    return server, code
            time.sleep(poll)

    # -- context managers --

    def __enter__(self) -> ServerGroup:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: types.TracebackType | None,
    ) -> None:
        self.stop()

    async def __aenter__(self) -> ServerGroup:
        return await self.astart()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: types.TracebackType | None,
    ) -> None:
        await self.astop()


def launch_replicas(
    model: str | os.PathLike[str],
    replicas: int,
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
    vllm: VllmInstall | None = None,
    extra_args: Sequence[str] = (),
    dev_mode: bool = False,
    check_flags: bool | None = None,
    concurrent_start: bool | None = None,
    log_path: str | os.PathLike[str] | None = None,
    startup_timeout: float = 300.0,
    progress: Progress | None = None,
) -> ServerGroup:
    """Plan ``replicas`` vLLM servers of ``model`` on this machine; a :class:`ServerGroup`.

    ```python
    async with launch_replicas(model_dir, 2, served_model_name="tiny") as group:
        client = AsyncClient(group)
    ```

    The other parameters are those of :func:`dsclient.launcher.launch`, planned for each
    replica with :func:`plan_launch` on its share of the machine.

    Parameters:
        replicas: how many servers (>= 1).
        port: the first replica's port, the next ones follow (``port + 1``, ...); default
            8000, 8001, ... when all are free, else free ones.
        concurrent_start: start them all at once (default) or, with ``False``, one after
            another (see :func:`split_hardware` for what was measured).
        log_path: a file name each replica's log derives from (``vllm-8001.log``); default
            ``~/.cache/dsclient/logs/vllm-<port>-<time>.log``.
        vllm: the installed vLLM (default: found from ``python``).

    Raises ``ValueError`` for ``replicas < 1``, :class:`LaunchError` when the machine has fewer
    CPUs (or GPUs) than replicas, or the ports are taken.
    """
    if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
        raise ValueError(f"replicas must be an int >= 1, got {replicas!r}")
    hardware = hardware or detect_hardware()
    layout = split_hardware(hardware, replicas)
    install = vllm or resolve_server_python(python)
    ports, port_note = choose_ports(
        replicas,
        port,
        is_free=functools.partial(port_is_free, host),
        free_ports=functools.partial(free_ports, host),
    )
    notes = [*layout.notes] + ([port_note] if port_note else [])
    stamp = time.strftime("%Y%m%d-%H%M%S")
    servers = []
    for i, replica_port in enumerate(ports):
        plan: LaunchPlan = plan_launch(
            model,
            host=host,
            port=replica_port,
            hardware=layout.per_replica[i],
            vllm=install,
            extra_args=extra_args,
            check_flags=False,  # at start, once for the group
            profile=profile,
            max_num_seqs=max_num_seqs,
            max_model_len=max_model_len,
            served_model_name=served_model_name,
            dtype=dtype,
            kv_cache_dtype=kv_cache_dtype,
            block_size=block_size,
            gpu_memory_utilization=gpu_memory_utilization,
            kv_cache_gib=kv_cache_gib,
            dev_mode=dev_mode,
        )
        if layout.env[i]:
            plan = dataclasses.replace(plan, env={**plan.env, **layout.env[i]})
        if layout.engine_core_cpus[i] is not None:
            plan = dataclasses.replace(plan, engine_core_cpus=layout.engine_core_cpus[i])
        servers.append(
            Server(
                plan,
                log_path=_replica_log(log_path, replica_port, stamp),
                startup_timeout=startup_timeout,
                progress=progress,
                check_flags=wants_flag_check(check_flags, extra_args),
            )
        )
    for note in notes:
        logger.info("launch plan: %s", note)
    concurrent = layout.concurrent_start if concurrent_start is None else concurrent_start
    return ServerGroup(servers, concurrent_start=concurrent, notes=notes)
