"""Client and server apart: the plan over the CPUs, and real pinning of real processes."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from benchmarks._common import (
    Placement,
    cpu_list,
    placement_facts,
    plan_placement,
    starting_server,
)

TWO = len(os.sched_getaffinity(0)) >= 2
needs_two = pytest.mark.skipif(not TWO, reason="pinning apart needs 2 usable CPUs")


def test_the_client_takes_the_first_cpu_and_the_server_the_rest() -> None:
    two = plan_placement([1, 0])
    assert (two.server, two.client, two.apart) == ((1,), (0,), True)
    assert "client on CPU 0" in two.note
    four = plan_placement({3, 2, 1, 0})
    assert (four.server, four.client) == ((1, 2, 3), (0,))


def test_one_cpu_or_asked_to_share_is_recorded_as_shared() -> None:
    one = plan_placement([5])
    assert (one.server, one.client, one.apart) == ((5,), (5,), False)
    assert "one CPU" in one.note
    shared = plan_placement([0, 1], apart=False)
    assert not shared.apart and "asked to share" in shared.note
    with pytest.raises(ValueError):
        plan_placement([])


def test_cpu_list_is_what_taskset_takes() -> None:
    assert cpu_list({3, 0, 2}) == "0,2,3"


# A child interpreter does the pinning, so this test process keeps its CPUs.
CHILD = textwrap.dedent(
    """
    import json, os, subprocess, sys, threading, time
    from benchmarks._common import Placement, placement_facts, pin_process, starting_server
    stop = threading.Event()
    early = threading.Thread(target=stop.wait)  # started before any pinning
    early.start()
    placement = Placement((1,), (0,), "test")
    with starting_server(placement):
        server = subprocess.Popen(
            [sys.executable, "-c", "import time; time.sleep(30)"], start_new_session=True
        )
    time.sleep(0.2)
    facts = placement_facts(placement, [os.getpgid(server.pid)])
    late = threading.Thread(target=lambda: print(json.dumps(sorted(os.sched_getaffinity(0)))))
    late.start(); late.join()
    facts["early_thread"] = sorted(os.sched_getaffinity(early.native_id))
    server.kill(); server.wait(); stop.set(); early.join()
    print(json.dumps(facts))
    """
)


@needs_two
def test_a_server_started_inside_keeps_its_cpus_and_every_client_thread_moves() -> None:
    import json

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run(
        [sys.executable, "-c", CHILD], capture_output=True, text=True, check=True, cwd=root,
        env={**os.environ, "PYTHONPATH": root}, timeout=60,
    )  # fmt: skip
    late, facts = (json.loads(line) for line in done.stdout.strip().splitlines())
    assert late == [0]  # a thread started afterwards inherits the client's CPU
    assert facts["early_thread"] == [0]  # so does one started before the pinning
    assert facts["server_threads"] == {"1": facts["server_threads"]["1"]}
    assert facts["client_cpus"] == "0" and facts["server_cpus"] == "1"
    assert facts["apart"] is True and facts["planned"] == "test"


def test_a_server_not_found_is_never_called_apart() -> None:
    facts = placement_facts(None, [None])
    assert facts["server_threads"] == {} and facts["server_cpus"] is None
    assert facts["apart"] is False


def test_no_placement_changes_nothing() -> None:
    before = os.sched_getaffinity(0)
    with starting_server(None):
        assert os.sched_getaffinity(0) == before
    assert os.sched_getaffinity(0) == before
    assert isinstance(plan_placement([0, 1]), Placement)


def test_the_page_says_where_each_side_ran_and_flags_a_run_that_did_not_record_it() -> None:
    from benchmarks._report import placement_line

    apart = {"client_cpus": "0", "server_cpus": "1", "apart": True}
    shared = {"client_cpus": "0", "server_cpus": "0,1", "apart": False}
    assert placement_line({"facts": {"placement": apart}}) == (
        "Placement: client on CPU 0, server's processes on CPU 1."
    )
    two = placement_line({"facts": {"placement nginx-vllm": apart, "placement x": shared}})
    assert "nginx-vllm: client on CPU 0" in two and "x: **not apart**" in two
    assert placement_line({"facts": {}}).startswith("**Placement not recorded:**")
    planned = placement_line({"facts": {"placement": "server on CPU 1, client on CPU 0"}})
    assert planned == "Placement planned, not checked: server on CPU 1, client on CPU 0."
