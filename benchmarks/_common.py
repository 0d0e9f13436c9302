"""Helpers shared by the benchmarks.

Canned vLLM answers, percentiles and the results folder; for the benchmarks on a real vLLM also
prompts of the tiny model's words, a vLLM started by hand (no launcher), a ``/metrics`` sampler,
a sampler of any value (``client.limit``) and how busy the shared machine was (CPU by whom).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import platform
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Collection, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dsclient.cli.bench.workload import _WORDS as _BENCH_WORDS

ROOT = Path(__file__).resolve().parents[1]
RESULTS_DIR = ROOT / "benchmarks" / "results"

#: What a vLLM completions call answers, trimmed to the fields clients read.
CANNED_COMPLETION = json.dumps(
    {
        "id": "cmpl-bench",
        "object": "text_completion",
        "created": 1,
        "model": "tiny",
        "choices": [
            {
                "index": 0,
                "text": " and the rest of the story",
                "finish_reason": "length",
                "logprobs": None,
                "stop_reason": None,
                "prompt_logprobs": None,
            }
        ],
        "usage": {"prompt_tokens": 6, "completion_tokens": 8, "total_tokens": 14},
    }
).encode()

#: vLLM's ``GET /v1/models`` for a 2048-token model served as "tiny".
CANNED_MODELS = json.dumps(
    {
        "object": "list",
        "data": [
            {
                "id": "tiny",
                "object": "model",
                "created": 1,
                "owned_by": "vllm",
                "root": "tiny",
                "max_model_len": 2048,
            }
        ],
    }
).encode()


def percentile(values: list[float], percent: float) -> float | None:
    """Nearest-rank percentile (the smallest value with ``percent`` % of values at or below it)."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, -(-len(ordered) * percent // 100))
    return ordered[int(rank) - 1]


def median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def machine() -> dict[str, Any]:
    return {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "when": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def write_results(name: str, payload: dict[str, Any]) -> Path:
    """Write ``benchmarks/results/<name>.json`` (gitignored: traces) and return its path.

    What is kept in git goes through :class:`benchmarks._results.Run` instead.
    """
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"{name}.json"
    path.write_text(json.dumps(payload, indent=2) + "\n")
    return path


def say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# -- prompts -------------------------------------------------------------------------------------
# Words the tiny model's BPE tokenizer was trained on (dsclient/_data/build_tiny_model.py), so a
# prompt costs about a token or two per word, as English text does for a real tokenizer: the same
# list `dsclient bench` builds its synthetic prompts from.
WORDS = list(_BENCH_WORDS)


def words(rng: random.Random, n: int) -> str:
    """``n`` random words of the tiny model's vocabulary, as a sentence."""
    text = " ".join(rng.choice(WORDS) for _ in range(n))
    return text[0].upper() + text[1:] + "."


# -- vLLM's /metrics -----------------------------------------------------------------------------
def gauge(metrics: str, name: str) -> float:
    """The sum of a Prometheus gauge's samples (every label set) in a ``/metrics`` text."""
    total = 0.0
    for line in metrics.splitlines():
        if line.startswith(name) and line[len(name) : len(name) + 1] in ("{", " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


def engine_summary(samples: Sequence[tuple[float, float]]) -> dict[str, float]:
    """Mean running, and mean / p90 / max waiting, of ``(running, waiting)`` samples."""
    if not samples:
        return {}
    waiting = [w for _, w in samples]
    return {
        "running_mean": round(sum(r for r, _ in samples) / len(samples), 2),
        "waiting_mean": round(sum(waiting) / len(samples), 2),
        "waiting_p90": percentile(waiting, 90) or 0.0,
        "waiting_max": max(waiting),
        "samples": len(samples),
    }


@contextlib.asynccontextmanager
async def engine_sampler(url: str, every: float = 0.2) -> AsyncIterator[dict[str, float]]:
    """Polls vLLM's ``/metrics`` while the block runs; fills in the engine's occupancy after.

    Samples count only while anything was running or waiting (idle moments before the first
    request and after the last would dilute the means). The keys are :func:`engine_summary`'s:
    ``vllm:num_requests_running`` is the engine's batch, ``vllm:num_requests_waiting`` the
    server's own queue. ``polls`` and ``poll_max_s`` tell whether the sampler itself kept up: a
    busy API server answers ``/metrics`` late, and then there are fewer samples than 1 / every.
    """
    import httpx

    found: dict[str, float] = {}
    samples: list[tuple[float, float]] = []
    polls: list[float] = []  # seconds each poll took

    async def poll() -> None:
        async with httpx.AsyncClient(timeout=5.0) as http:
            while True:
                begun = time.perf_counter()
                try:
                    text = (await http.get(url + "/metrics")).text
                except httpx.HTTPError:
                    pass
                else:
                    running = gauge(text, "vllm:num_requests_running")
                    waiting = gauge(text, "vllm:num_requests_waiting")
                    if running or waiting:
                        samples.append((running, waiting))
                polls.append(time.perf_counter() - begun)
                await asyncio.sleep(every)

    task = asyncio.create_task(poll())
    try:
        yield found
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        found.update(engine_summary(samples))
        found.update(polls=len(polls), poll_max_s=round(max(polls, default=0.0), 3))


# -- how busy the machine was -------------------------------------------------------------------
# The machine is shared (2 cores; other engineers run servers and tests on it), so a benchmark
# says how much CPU went elsewhere while it ran: the machine's busy time from /proc/stat, minus
# this process's and the vLLM server's own.
@dataclass(frozen=True)
class CpuSnapshot:
    """CPU seconds used so far: the whole machine (all cores), this process, the server's group."""

    wall: float
    machine: float
    own: float
    server: float
    loadavg: float
    children: float = 0.0  # client processes this one started and waited for (their CPU)


def parse_proc_stat(text: str, ticks_per_s: float) -> float:
    """Busy CPU seconds of all cores from ``/proc/stat``'s ``cpu`` line (idle and iowait left out).

    The fields are user nice system idle iowait irq softirq steal [guest guest_nice]; guest time
    is already counted in user, so only the first eight are added.
    """
    for line in text.splitlines():
        fields = line.split()
        if fields and fields[0] == "cpu":
            ticks = [int(x) for x in fields[1:9]]
            return (sum(ticks) - ticks[3] - ticks[4]) / ticks_per_s
    raise ValueError("no 'cpu' line in /proc/stat")


def process_cpu_s(stat: str, ticks_per_s: float) -> float:
    """utime + stime of one ``/proc/PID/stat`` text, in seconds (comm may hold spaces)."""
    fields = stat[stat.rfind(")") + 1 :].split()
    return (int(fields[11]) + int(fields[12])) / ticks_per_s


def listening_pid(port: int, proc: Path = Path("/proc")) -> int | None:
    """The process that listens on TCP ``port`` here (``/proc/net/tcp{,6}``, then the socket's
    inode among the processes' open files), or ``None``."""
    inodes = set()
    for table in ("tcp", "tcp6"):
        with contextlib.suppress(OSError):
            for line in (proc / "net" / table).read_text().splitlines()[1:]:
                fields = line.split()
                local, state = fields[1], fields[3]
                if state == "0A" and int(local.rsplit(":", 1)[1], 16) == port:
                    inodes.add(f"socket:[{fields[9]}]")
    if not inodes:
        return None
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            for fd in (entry / "fd").iterdir():
                with contextlib.suppress(OSError):
                    if os.readlink(fd) in inodes:
                        return int(entry.name)
    return None


def server_group(url: str) -> int | None:
    """The process group of the server listening at ``url`` on this machine: the process that
    holds the port's listening socket, else the one with that ``--port`` in its command line
    (vLLM's API server, ``transformers serve``)."""
    port = url.rstrip("/").rsplit(":", 1)[-1]
    if port.isdigit() and (pid := listening_pid(int(port))) is not None:
        with contextlib.suppress(ProcessLookupError):
            return os.getpgid(pid)
    done = subprocess.run(
        ["pgrep", "-af", "--", "--port"], capture_output=True, text=True, check=False
    )
    for line in done.stdout.splitlines():
        pid, _, argv = line.partition(" ")
        if f"--port {port}" in argv or f"--port={port}" in argv:
            with contextlib.suppress(ProcessLookupError, ValueError):
                return os.getpgid(int(pid))
    return None


def cpu_snapshot(server_pgid: int | None, proc: Path = Path("/proc")) -> CpuSnapshot:
    ticks = float(os.sysconf("SC_CLK_TCK"))
    server = 0.0
    if server_pgid is not None:
        for pid in group_pids(server_pgid, proc):
            with contextlib.suppress(OSError, IndexError, ValueError):
                server += process_cpu_s((proc / str(pid) / "stat").read_text(), ticks)
    return CpuSnapshot(
        wall=time.monotonic(),
        machine=parse_proc_stat((proc / "stat").read_text(), ticks),
        own=time.process_time(),
        server=server,
        loadavg=os.getloadavg()[0],
        children=_children_cpu_s(),
    )


def _children_cpu_s() -> float:
    """CPU seconds of this process's children that ended and were waited for (a benchmark's
    client worker processes; the server, still running, is not among them)."""
    import resource

    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def cpu_split(before: CpuSnapshot, after: CpuSnapshot) -> dict[str, float]:
    """Cores in use on average between two snapshots: machine, the client (this process and
    the client processes it waited for), server, others.

    ``others_cores`` is what the rest of the machine used (other engineers' servers and tests);
    it can dip slightly below 0 from rounding, and is clamped there. A server whose processes
    were not found counts as others.
    """
    wall = after.wall - before.wall
    if wall <= 0:
        return {}
    machine_ = (after.machine - before.machine) / wall
    own = (after.own - before.own + after.children - before.children) / wall
    server = (after.server - before.server) / wall
    return {
        "wall_s": round(wall, 2),
        "machine_cores": round(machine_, 2),
        "own_cores": round(own, 2),
        "server_cores": round(server, 2),
        "others_cores": round(max(0.0, machine_ - own - server), 2),
        "loadavg_1min_before": round(before.loadavg, 2),
        "loadavg_1min_after": round(after.loadavg, 2),
    }


def busiest_processes(n: int = 5) -> list[str]:
    """The ``n`` processes using the most CPU right now (``ps``), to say who else was running."""
    done = subprocess.run(
        ["ps", "-eo", "pcpu,pid,comm", "--sort=-pcpu", "--no-headers"],
        capture_output=True,
        text=True,
        check=False,
    )
    return [" ".join(line.split()) for line in done.stdout.splitlines()[:n]]


# -- any value over time (client.limit) ----------------------------------------------------------
def spread(values: Sequence[float]) -> dict[str, float]:
    """Min, mean, max and last of sampled values (``{}`` for none)."""
    if not values:
        return {}
    return {
        "min": min(values),
        "mean": round(sum(values) / len(values), 2),
        "max": max(values),
        "final": values[-1],
        "samples": len(values),
    }


@contextlib.asynccontextmanager
async def sample_every(read: Callable[[], float], every: float = 0.2) -> AsyncIterator[list[float]]:
    """Calls ``read()`` at once, then every ``every`` s while the block runs, and once on leaving.

    Yields the list the values go into (live: read it inside the block for what came so far).
    """
    values: list[float] = []

    async def poll() -> None:
        while True:
            values.append(read())
            await asyncio.sleep(every)

    task = asyncio.create_task(poll())
    try:
        yield values
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        values.append(read())


def client_facts(client: Any) -> dict[str, Any]:
    """What a dsclient client found and decided: limit, ``max_num_seqs`` and its source, control.

    ``stats().control`` is the closed-loop governor's frozen dataclass; older clients have none.
    """
    server = getattr(client, "server", None)
    facts: dict[str, Any] = {
        "limit": client.limit,
        "max_num_seqs": getattr(server, "max_num_seqs", None),
        "max_num_seqs_source": (getattr(server, "sources", None) or {}).get("max_num_seqs"),
    }
    control = getattr(client.stats(), "control", None)
    if control is not None:
        facts["control"] = (
            dataclasses.asdict(control) if dataclasses.is_dataclass(control) else repr(control)
        )
    return facts


# -- client and server apart --------------------------------------------------------------------
# A client that shares a core with the server takes CPU the server would have had: its cost
# shows up as the server's slowness, and a heavier client stack looks slower than it is on two
# hosts. So every benchmark with a real server starts the server's processes (API server,
# engine, a gateway in front of it) on their own cores and runs the client on another.
@dataclass(frozen=True)
class Placement:
    """Which CPUs the server's processes get and which the client keeps:
    ``plan_placement([0, 1])`` is server ``(1,)``, client ``(0,)``, apart."""

    server: tuple[int, ...]
    client: tuple[int, ...]
    note: str

    @property
    def apart(self) -> bool:
        return not set(self.server) & set(self.client)


#: The CPUs this process may use as it starts (before any pinning below narrows them).
START_CPUS: frozenset[int] = frozenset(os.sched_getaffinity(0))


def default_placement(*, apart: bool = True) -> Placement:
    """:func:`plan_placement` over the CPUs this process had when it started."""
    return plan_placement(START_CPUS, apart=apart)


def cpu_list(cpus: Collection[int]) -> str:
    """``{0, 2, 3}`` -> ``"0,2,3"`` (sorted; what ``taskset -c`` takes)."""
    return ",".join(str(c) for c in sorted(cpus))


def plan_placement(cpus: Collection[int], *, apart: bool = True) -> Placement:
    """The client on the first CPU, the server's processes on all the others.

    With one CPU (or ``apart=False``) both share every CPU, and the note says so. On the
    2-core machines here this is server on CPU 1 (the launcher then binds the engine's threads
    there too: with one CPU it has nothing to separate, so the API server and the engine share
    it) and client on CPU 0.
    """
    ids = tuple(sorted(set(cpus)))
    if not ids:
        raise ValueError("no CPUs to place on")
    if not apart or len(ids) < 2:
        why = "asked to share" if not apart else "one CPU"
        return Placement(ids, ids, f"client and server share CPUs {cpu_list(ids)} ({why})")
    return Placement(
        ids[1:],
        ids[:1],
        f"server's processes (API server, engine, any gateway) on CPUs {cpu_list(ids[1:])}, "
        f"client on CPU {ids[0]}",
    )


def pin_process(cpus: Collection[int], pid: int | None = None) -> int:
    """Move every thread of ``pid`` (this process by default) onto ``cpus``; how many moved.

    ``os.sched_setaffinity(0, ...)`` moves the calling thread only; threads started before
    (a launcher's log reader, the default executor) keep their CPUs, so each is moved.
    Processes started afterwards inherit the CPUs of the thread that starts them.
    """
    return pin_threads(os.getpid() if pid is None else pid, cpus)


@contextlib.contextmanager
def starting_server(placement: Placement | None) -> Iterator[None]:
    """Inside the block this process runs on the server's CPUs, so what it starts (vLLM and
    its engine, nginx, a transformers server) inherits them, and the launcher, which plans from
    ``os.sched_getaffinity(0)``, places the engine there; on the way out it moves to the
    client's CPUs for good. ``None`` changes nothing."""
    if placement is None:
        yield
        return
    pin_process(placement.server)
    try:
        yield
    finally:
        pin_process(placement.client)


def group_affinities(pgid: int, proc: Path = Path("/proc")) -> dict[str, int]:
    """How many threads of process group ``pgid`` may run on which CPUs (``{"1": 57}``)."""
    counts: dict[str, int] = {}
    for pid in group_pids(pgid, proc):
        with contextlib.suppress(OSError):
            for key, n in thread_affinities(pid).items():
                counts[key] = counts.get(key, 0) + n
    return counts


def placement_facts(
    placement: Placement | None, server_pgids: Collection[int | None]
) -> dict[str, Any]:
    """Where the client and the server's processes were found to run, for the results file.

    ``apart`` is judged on what the threads may run on, not on the plan: the client's threads
    and every thread of the server's process groups (a server given by URL and started by
    someone else keeps its own CPUs). ``server_threads`` is ``{}`` when no server process was
    found on this machine.
    """
    client: dict[str, int] = thread_affinities(os.getpid())
    server: dict[str, int] = {}
    for pgid in server_pgids:
        if pgid is not None:
            for key, n in group_affinities(pgid).items():
                server[key] = server.get(key, 0) + n
    used = {int(c) for key in client for c in key.split(",")}
    served = {int(c) for key in server for c in key.split(",") if c}
    return {
        "planned": None if placement is None else placement.note,
        "client_threads": client,
        "server_threads": server,
        "client_cpus": cpu_list(used),
        "server_cpus": cpu_list(served) if served else None,
        "apart": bool(served) and not used & served,
    }


# -- a vLLM started by hand ----------------------------------------------------------------------
#: The environment of a vLLM started by hand here (docs: /work/shared/ENVIRONMENT.md).
HAND_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "HF_HUB_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
}
#: What vLLM calls its engine process (``comm`` is cut to 15 characters by the kernel).
ENGINE_CORE_COMM = "VLLM::EngineCor"


def vllm_processes() -> list[str]:
    """Command lines of the vLLM API servers running on this machine."""
    done = subprocess.run(
        ["pgrep", "-af", "vllm.entrypoints"], capture_output=True, text=True, check=False
    )
    return [line for line in done.stdout.splitlines() if line.strip()]


@contextlib.contextmanager
def tiny_vllm(
    url: str | None,
    *,
    max_num_seqs: int,
    max_model_len: int,
    model_name: str = "tiny",
    wait_s: float | None = None,
    startup_timeout: float | None = None,
    extra_args: Sequence[str] = (),
    placement: Placement | None = None,
) -> Iterator[str]:
    """The server to benchmark: ``url`` as given, or the tiny random Llama launched through
    ``dsclient.launcher`` for the block (once no other vLLM runs), served as ``model_name``.

    ``placement`` (default: :func:`default_placement`, server and client apart) is where the
    launched server's processes start and where this process (the client) runs afterwards; with
    a ``url`` given only the client moves. Record it with :func:`placement_facts`.

    ``wait_s`` bounds the wait for other vLLMs to finish: past it, the server starts anyway
    (the results then say how busy the machine was); ``None`` waits for ever.
    ``startup_timeout`` overrides the launcher's (a loaded machine starts vLLM slowly).
    ``extra_args`` go to vLLM as they are (``--scheduling-policy priority``); a ``url`` given
    is used as it runs.
    """
    placement = placement or default_placement()
    if url:
        pin_process(placement.client)
        yield url.rstrip("/")
        return
    from dsclient.launcher import launch, make_tiny_model, resolve_server_python

    try:
        wait_for_no_vllm(wait_s)
    except SystemExit as exc:
        if wait_s is None:
            raise
        say(f"waited {wait_s:.0f} s; starting anyway beside them ({exc})")
    install = resolve_server_python()
    say(f"vLLM: {install.dist} {install.version} ({install.python})")
    model = make_tiny_model(python=install.python)
    say(placement.note)
    with contextlib.ExitStack() as stack:
        with starting_server(placement):
            server = launch(
                model,
                python=install.python,
                max_num_seqs=max_num_seqs,
                max_model_len=max_model_len,
                served_model_name=model_name,
                dtype="float32",
                extra_args=tuple(extra_args),
                progress=lambda m: say(f"[vllm] {m}"),
                **({} if startup_timeout is None else {"startup_timeout": startup_timeout}),
            )
            # The process starts on entering, not in launch(): still on the server's CPUs.
            stack.enter_context(server)
        yield server.url


def wait_for_no_vllm(timeout: float | None = None, every: float = 30.0) -> None:
    """Wait until no other vLLM runs (numbers on a shared 2-core machine would be meaningless).

    ``timeout`` ``None`` waits for ever; past it, exits with the processes found.
    """
    deadline = None if timeout is None else time.monotonic() + timeout
    others = vllm_processes()
    while others:
        if deadline is not None and time.monotonic() >= deadline:
            raise SystemExit("another vLLM server is still running:\n  " + "\n  ".join(others))
        say("another vLLM server is running; waiting for it to finish:\n  " + "\n  ".join(others))
        time.sleep(every)
        others = vllm_processes()


def group_pids(pgid: int, proc: Path = Path("/proc")) -> dict[int, str]:
    """``{pid: comm}`` of the live processes in process group ``pgid`` (Linux ``/proc``).

    dsclient has the same in a private module; the benchmarks keep their own copy so that they
    do not break when dsclient's modules move.
    """
    found = {}
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # "pid (comm) state ppid pgrp ...": comm may hold spaces and parentheses.
        comm = stat[stat.find("(") + 1 : stat.rfind(")")]
        fields = stat[stat.rfind(")") + 1 :].split()
        if len(fields) > 2 and fields[2] == str(pgid) and fields[0] != "Z":
            found[int(entry.name)] = comm
    return found


def thread_affinities(pid: int) -> dict[str, int]:
    """How many threads of ``pid`` may run on which CPUs, e.g. ``{"0": 5, "0,1": 12}``."""
    counts: dict[str, int] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            key = ",".join(map(str, sorted(os.sched_getaffinity(int(task.name)))))
        except OSError:  # a thread that exited meanwhile
            continue
        counts[key] = counts.get(key, 0) + 1
    return counts


def pin_threads(pid: int, cpus: Collection[int]) -> int:
    """Move every thread of ``pid`` onto ``cpus`` (what dsclient's launcher does to EngineCore)."""
    done = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(ProcessLookupError):  # a thread that exited meanwhile
            os.sched_setaffinity(int(task.name), set(cpus))
            done += 1
    return done


@dataclass
class HandServer:
    """A vLLM that :func:`hand_started_vllm` started: its url, process group and log."""

    url: str
    pid: int
    log_path: Path
    argv: list[str]
    facts: dict[str, Any]  # engine_core_pid, where its threads were, where they went (--place)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _stop_group(proc: subprocess.Popen[bytes], grace: float = 15.0) -> None:
    """SIGTERM the whole process group, SIGKILL what is left after ``grace`` s; wait for all."""
    pgid = proc.pid  # start_new_session made it the group's leader
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while (proc.poll() is None or group_pids(pgid)) and time.monotonic() < deadline:
        time.sleep(0.2)
    if proc.poll() is None or group_pids(pgid):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)
        proc.wait()
        deadline = time.monotonic() + grace
        while group_pids(pgid) and time.monotonic() < deadline:
            time.sleep(0.2)


@contextlib.contextmanager
def hand_started_vllm(
    python: str,
    model: str | os.PathLike[str],
    *,
    max_num_seqs: int,
    max_model_len: int = 2048,
    served_model_name: str = "tiny",
    extra_args: Sequence[str] = (),
    engine_core_cpus: Collection[int] | None = None,
    startup_timeout: float = 180.0,
) -> Iterator[HandServer]:
    """Start vLLM as a user would by hand (no launcher: no launch record, no placement).

        with hand_started_vllm(py, model_dir, max_num_seqs=32) as server:
            ...  # server.url answers /health

    ``engine_core_cpus`` moves the EngineCore's threads there once healthy, as dsclient's
    launcher does. The log goes to a temporary file that is kept (its path is printed). The
    whole process group is stopped on the way out, whatever happens.
    """
    import httpx

    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    argv = [
        python, "-m", "vllm.entrypoints.openai.api_server",
        "--model", os.fspath(model),
        "--served-model-name", served_model_name,
        "--dtype", "float32",
        "--max-num-seqs", str(max_num_seqs),
        "--max-model-len", str(max_model_len),
        "--host", "127.0.0.1",
        "--port", str(port),
        *extra_args,
    ]  # fmt: skip
    fd, log_name = tempfile.mkstemp(prefix="bench-vllm-", suffix=".log")
    log_path = Path(log_name)
    with os.fdopen(fd, "wb") as log:
        log.write(f"# {' '.join(argv)}\n".encode())
        log.flush()
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **HAND_ENV},
            start_new_session=True,  # its own group: stopped as a whole, never half-way
        )
    say(f"started vLLM by hand (pid {proc.pid}) at {url}; log: {log_path}")
    try:
        begun = time.monotonic()
        with httpx.Client(timeout=2.0) as http:
            while True:
                if proc.poll() is not None:
                    tail = log_path.read_text(errors="replace")[-3000:]
                    raise SystemExit(f"vLLM exited with status {proc.returncode}:\n{tail}")
                if time.monotonic() - begun > startup_timeout:
                    raise SystemExit(f"vLLM not healthy after {startup_timeout:.0f} s: {log_path}")
                with contextlib.suppress(httpx.HTTPError):
                    if http.get(url + "/health").status_code == 200:
                        break
                time.sleep(0.5)
        say(f"vLLM is healthy after {time.monotonic() - begun:.0f} s")
        facts: dict[str, Any] = {}
        cores = [pid for pid, comm in group_pids(proc.pid).items() if comm == ENGINE_CORE_COMM]
        if len(cores) == 1:
            facts["engine_core_pid"] = cores[0]
            facts["engine_core_threads_before"] = thread_affinities(cores[0])
            if engine_core_cpus:
                cpus = sorted(engine_core_cpus)
                moved = pin_threads(cores[0], cpus)
                facts.update(engine_core_moved_to=cpus, engine_core_threads_moved=moved)
                say(f"moved EngineCore (pid {cores[0]}, {moved} threads) to CPUs {cpus}")
        elif engine_core_cpus:
            raise SystemExit(f"expected one EngineCore in vLLM's group to move, found {cores}")
        yield HandServer(url, proc.pid, log_path, argv, facts)
    finally:
        _stop_group(proc)
        say(f"stopped vLLM (process group {proc.pid})")
