"""Launch records: url keys, writing, reading back only while the server is the recorded one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from dsclient._records import (
    LaunchRecord,
    normalize_url,
    process_is_vllm,
    read_record,
    record_matches,
    record_path,
    remove_record,
    state_dir,
    write_record,
)


@pytest.fixture(autouse=True)
def _state(tmp_path, monkeypatch):
    monkeypatch.setenv("DSCLIENT_STATE_DIR", str(tmp_path / "servers"))


@pytest.fixture
def fake_vllm():
    """A live process whose command line looks like vLLM's on port 8123."""
    proc = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)", "vllm.entrypoints", "--port", "8123"]
    )
    deadline = time.monotonic() + 10
    while not process_is_vllm(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.01)  # until the exec shows in /proc
    yield proc
    proc.kill()
    proc.wait()


def record(pid: int, **kw: object) -> LaunchRecord:
    data: dict[str, object] = dict(
        url="http://127.0.0.1:8123", model="tiny", model_path="/m/tiny", max_num_seqs=8,
        max_model_len=2048, pid=pid, launcher_pid=os.getpid(), started_at=time.time(),
        instance="abc",
    )  # fmt: skip
    data.update(kw)
    return LaunchRecord(**data)  # type: ignore[arg-type]


MODELS = {"object": "list", "data": [{"id": "tiny", "max_model_len": 2048}]}


@pytest.mark.parametrize(
    "url",
    [
        "http://127.0.0.1:8123",
        "http://localhost:8123/",
        "http://localhost:8123/v1",
        "http://127.0.0.1:8123/v1/",
        "HTTP://LOCALHOST:8123",
        "127.0.0.1:8123",
        "http://0.0.0.0:8123",
        "http://[::1]:8123/v1",
    ],
)
def test_normalize_url_treats_loopback_spellings_alike(url):
    assert normalize_url(url) == "http://127.0.0.1:8123"
    assert record_path(url) == record_path("http://127.0.0.1:8123")


def test_normalize_url_keeps_real_differences():
    assert normalize_url("http://gpu-box:8000/v1") == "http://gpu-box:8000"
    assert normalize_url("https://example.org/v1") == "https://example.org:443"
    assert normalize_url("http://h:1/prefix/v1") == "http://h:1/prefix"
    assert record_path("http://127.0.0.1:1") != record_path("http://127.0.0.1:2")


def test_state_dir_override(tmp_path):
    assert state_dir() == tmp_path / "servers"


def test_write_then_read_while_process_lives(fake_vllm):
    path = write_record(record(fake_vllm.pid))
    assert json.loads(path.read_text())["max_num_seqs"] == 8
    got = read_record("http://localhost:8123/v1")
    assert got == record(fake_vllm.pid, started_at=got.started_at)
    assert record_matches(got, MODELS)


def test_stale_record_of_dead_process_is_ignored_and_removed():
    proc = subprocess.Popen([sys.executable, "-c", "pass", "vllm", "--port", "8123"])
    proc.wait()
    path = write_record(record(proc.pid))
    assert read_record("http://127.0.0.1:8123") is None
    assert not path.exists()


def test_pid_reused_by_something_else_is_not_believed():
    me = os.getpid()  # pytest: alive, but not vLLM
    write_record(record(me))
    assert read_record("http://127.0.0.1:8123") is None


def test_vllm_on_another_port_is_not_believed(fake_vllm):
    write_record(record(fake_vllm.pid, url="http://127.0.0.1:9000"))
    assert not process_is_vllm(fake_vllm.pid, port=9000)
    assert process_is_vllm(fake_vllm.pid, port=8123)
    assert read_record("http://127.0.0.1:9000") is None


def test_unreadable_record_is_ignored(tmp_path):
    path = record_path("http://127.0.0.1:8123")
    path.parent.mkdir(parents=True)
    path.write_text("{not json")
    assert read_record("http://127.0.0.1:8123") is None
    path.write_text(json.dumps({"url": "http://127.0.0.1:8123", "pid": "x"}))
    assert read_record("http://127.0.0.1:8123") is None


@pytest.mark.parametrize(
    ("models", "ok"),
    [
        (MODELS, True),
        ({"data": [{"id": "tiny"}]}, True),  # a server that does not report max_model_len
        ({"data": [{"id": "tiny", "max_model_len": 4096}]}, False),  # another server
        ({"data": [{"id": "other", "max_model_len": 2048}]}, False),
        ({"data": []}, False),
        ({"error": "nope"}, False),
        ([], False),
        (None, False),
    ],
)
def test_record_matches(models, ok):
    assert record_matches(record(1), models) is ok


def test_remove_record_only_removes_its_own_instance(fake_vllm):
    write_record(record(fake_vllm.pid, instance="new"))
    assert not remove_record("http://127.0.0.1:8123", instance="old")
    assert read_record("http://127.0.0.1:8123") is not None
    assert remove_record("http://localhost:8123", instance="new")
    assert not remove_record("http://127.0.0.1:8123")
    assert read_record("http://127.0.0.1:8123") is None
