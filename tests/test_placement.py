"""Finding vLLM's EngineCore in a process group and moving it: a fake /proc, and real processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dsclient.launcher._placement import engine_core_pids, group_members, pin_process

pytestmark = pytest.mark.skipif(
    not hasattr(os, "sched_setaffinity") or not Path("/proc/self/task").is_dir(),
    reason="Linux only: /proc and sched_setaffinity",
)


def fake_proc(tmp_path: Path, stats: dict[int, str]) -> Path:
    for pid, stat in stats.items():
        (tmp_path / str(pid)).mkdir()
        (tmp_path / str(pid) / "stat").write_text(stat)
    (tmp_path / "self").mkdir()  # not a pid: skipped
    (tmp_path / "uptime").write_text("1 1")
    return tmp_path


def test_group_members_parses_stat_lines_with_odd_names(tmp_path: Path) -> None:
    proc = fake_proc(
        tmp_path,
        {
            100: "100 (python) S 1 100 100 0 -1",
            101: "101 (VLLM::EngineCor) S 100 100 100 0 -1",
            102: "102 (VLLM::Worker) S 100 100 100 0 -1",
            103: "103 (a (weird) name) S 100 100 100 0 -1",
            104: "104 (VLLM::EngineCor) Z 100 100 100 0 -1",  # a zombie: not live
            200: "200 (VLLM::EngineCor) S 1 200 200 0 -1",  # another server's group
        },
    )
    assert sorted(group_members(100, proc)) == [
        (100, "python"),
        (101, "VLLM::EngineCor"),
        (102, "VLLM::Worker"),
        (103, "a (weird) name"),
    ]
    assert engine_core_pids(100, proc=proc) == [101]
    assert engine_core_pids(200, proc=proc) == [200]
    assert engine_core_pids(300, proc=proc) == []


def test_pin_process_sets_every_thread_of_the_process() -> None:
    # Re-applying this process's own mask changes nothing, but goes through every thread.
    mask = os.sched_getaffinity(0)
    threads = len(list(Path(f"/proc/{os.getpid()}/task").iterdir()))
    assert pin_process(os.getpid(), mask) == threads
    assert os.sched_getaffinity(0) == mask


def test_pin_process_of_a_process_without_threads_raises(tmp_path: Path) -> None:
    (tmp_path / "999999" / "task" / "999999").mkdir(parents=True)  # a tid no process has
    with pytest.raises(ProcessLookupError, match="no threads left"):
        pin_process(999999, {0}, proc=tmp_path)


# A stand-in for vLLM: a leader in its own session that starts a child which names itself the
# way vLLM names its EngineCore and starts a second thread, then both wait.
_FAKE_SERVER = r"""
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", '''
import threading, time
open("/proc/self/comm", "w").write("VLLM::EngineCore")
threading.Thread(target=time.sleep, args=(60,), daemon=True).start()
print("ready", flush=True)
time.sleep(60)
'''], stdout=sys.stdout)
time.sleep(60)
"""


def test_engine_core_of_a_real_process_group_is_found_and_moved() -> None:
    cpus = sorted(os.sched_getaffinity(0))
    leader = subprocess.Popen(
        [sys.executable, "-c", _FAKE_SERVER], stdout=subprocess.PIPE, start_new_session=True
    )
    try:
        assert leader.stdout is not None
        assert leader.stdout.readline().strip() == b"ready"
        deadline = time.monotonic() + 10
        while not (pids := engine_core_pids(leader.pid)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(pids) == 1 and pids[0] != leader.pid
        target = {cpus[0]}
        assert pin_process(pids[0], target) == 2  # the main thread and the sleeper
        for task in Path(f"/proc/{pids[0]}/task").iterdir():
            assert os.sched_getaffinity(int(task.name)) == target
        assert os.sched_getaffinity(leader.pid) == set(cpus)  # the leader is left alone
    finally:
        os.killpg(leader.pid, signal.SIGKILL)
        leader.wait()
