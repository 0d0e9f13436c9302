"""The processes of a running vLLM (Linux ``/proc``), and moving its EngineCore onto given CPUs.

The policy, which CPUs, is :attr:`dsclient.launcher._command.LaunchPlan.engine_core_cpus`; this
module finds the process and applies it. vLLM names that process ``VLLM::EngineCore`` (its
``comm``, cut to 15 characters by the kernel, reads ``VLLM::EngineCor``). Affinity is per thread
on Linux, so every thread of the process is moved; threads it starts later inherit the mask.
"""

from __future__ import annotations

import os
from collections.abc import Collection, Iterator
from pathlib import Path

__all__ = ["engine_core_pids", "group_members", "pin_process"]

ENGINE_CORE_COMM = "VLLM::EngineCor"


def group_members(pgid: int, proc: Path) -> Iterator[tuple[int, str]]:
    """(pid, comm) of the live processes in process group ``pgid``."""
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # gone meanwhile, or not ours to read
            continue
        # "pid (comm) state ppid pgrp ...": comm may hold spaces and parentheses.
        comm = stat[stat.find("(") + 1 : stat.rfind(")")]
        fields = stat[stat.rfind(")") + 1 :].split()
        if len(fields) > 2 and fields[2] == str(pgid) and fields[0] != "Z":
            yield int(entry.name), comm


def engine_core_pids(pgid: int, *, proc: Path = Path("/proc")) -> list[int]:
    """The EngineCore processes among the members of process group ``pgid``, sorted."""
    return sorted(pid for pid, comm in group_members(pgid, proc) if comm == ENGINE_CORE_COMM)


def pin_process(pid: int, cpus: Collection[int], *, proc: Path = Path("/proc")) -> int:
    """Set the CPU affinity of every thread of ``pid`` to ``cpus``; returns how many were set.

    Threads that exit meanwhile are skipped. Raises ``OSError`` when the process itself cannot
    be changed (gone, or not permitted).
    """
    mask = set(cpus)
    done = 0
    for task in (proc / str(pid) / "task").iterdir():
        try:
            os.sched_setaffinity(int(task.name), mask)
        except ProcessLookupError:
            continue
        done += 1
    if not done:
        raise ProcessLookupError(f"process {pid} has no threads left to move")
    return done
