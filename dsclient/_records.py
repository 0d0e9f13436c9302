"""Launch records: what the launcher started at a url, so a client can know its ``max_num_seqs``.

vLLM reports ``max_model_len`` on ``/v1/models`` but no public route tells ``max_num_seqs``.
When dsclient's launcher starts a server it writes one JSON file per url into the state folder
(``~/.cache/dsclient/servers/``, or ``$DSCLIENT_STATE_DIR``). Discovery reads it back by url.

A record is believed only while it matches the server that answers at that url:

1. :func:`read_record` returns ``None`` (and deletes the file) when the recorded vLLM process is
   gone, or when that pid is now something else (its command line lacks ``vllm`` or the port),
   so a record left by a killed launcher never describes the next server on the same port;
2. :func:`record_matches` checks the live server's ``/v1/models`` answer: the recorded served
   model must be listed, with the recorded ``max_model_len`` when the server reports one.

Use from discovery::

    record = read_record(url)
    if record is not None and record_matches(record, models_json):
        max_num_seqs = record.max_num_seqs

Urls are compared normalized (:func:`normalize_url`): no trailing ``/`` or ``/v1``, lowercase
scheme and host, ``localhost`` / ``127.0.0.1`` / ``::1`` / ``0.0.0.0`` all the same host.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import tempfile
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from ._urls import root_url

__all__ = [
    "LaunchRecord",
    "normalize_url",
    "process_is_vllm",
    "read_record",
    "record_matches",
    "record_path",
    "remove_record",
    "state_dir",
    "write_record",
]

logger = logging.getLogger("dsclient")

_LOOPBACK = {"localhost", "127.0.0.1", "::1", "0.0.0.0", "::"}  # noqa: S104 - names, not binds


@dataclass(frozen=True, kw_only=True)
class LaunchRecord:
    """What the launcher started (one JSON file per url).

    Parameters:
        url: the server's root url, normalized (``http://127.0.0.1:8123``).
        model: the served model name clients send (``--served-model-name``).
        model_path: what ``--model`` was (a folder or a model id).
        max_num_seqs: the server's batch size (``--max-num-seqs``).
        max_model_len: the context length (``--max-model-len``).
        pid: the vLLM server process (leader of its process group).
        launcher_pid: the Python process that started it.
        started_at: Unix time of the start.
        instance: a random token unique to this launch.
        log_path: where the server's output goes.
        scheduling_policy: vLLM's ``--scheduling-policy`` (``"fcfs"``, ``"priority"``), when
            the launch passed one; ``None``: vLLM's default (first-come).
    """

    url: str
    model: str
    model_path: str
    max_num_seqs: int
    max_model_len: int
    pid: int
    launcher_pid: int
    started_at: float
    instance: str
    log_path: str | None = None
    scheduling_policy: str | None = None

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any]) -> LaunchRecord:
        """Build from parsed JSON; raises ``ValueError`` / ``TypeError`` on a bad shape."""
        ints = ("max_num_seqs", "max_model_len", "pid", "launcher_pid")
        for key in ints:
            if not isinstance(data.get(key), int) or isinstance(data.get(key), bool):
                raise ValueError(f"launch record field {key!r} must be an int")
        for key in ("url", "model", "model_path", "instance"):
            if not isinstance(data.get(key), str):
                raise ValueError(f"launch record field {key!r} must be a string")
        log_path = data.get("log_path")
        policy = data.get("scheduling_policy")
        return cls(
            url=data["url"],
            model=data["model"],
            model_path=data["model_path"],
            max_num_seqs=data["max_num_seqs"],
            max_model_len=data["max_model_len"],
            pid=data["pid"],
            launcher_pid=data["launcher_pid"],
            started_at=float(data.get("started_at", 0.0)),
            instance=data["instance"],
            log_path=log_path if isinstance(log_path, str) else None,
            scheduling_policy=policy if isinstance(policy, str) else None,
        )


def state_dir() -> Path:
    """Where records live: ``$DSCLIENT_STATE_DIR``, else ``~/.cache/dsclient/servers``."""
    override = os.environ.get("DSCLIENT_STATE_DIR")
    if override:
        return Path(override).expanduser()
    return Path.home() / ".cache" / "dsclient" / "servers"


def normalize_url(url: str) -> str:
    """``http://localhost:8000/v1/`` -> ``http://127.0.0.1:8000``; the key records are kept by.

    :func:`dsclient._urls.root_url`'s rule (``ValueError`` for what is no http(s) URL), then
    stricter, since a record must be found under any spelling of its server's address: ``http://``
    added when no scheme is given, every loopback name is ``127.0.0.1``, the port is always
    written, user info dropped.
    """
    text = url.strip()
    if "://" not in text:
        text = "http://" + text
    parts = urlsplit(root_url(text))
    host = parts.hostname or ""
    if host in _LOOPBACK:
        host = "127.0.0.1"
    port = parts.port or (443 if parts.scheme == "https" else 80)
    host_part = f"[{host}]" if ":" in host else host
    return f"{parts.scheme}://{host_part}:{port}{parts.path}"


def record_path(url: str) -> Path:
    """The record file for ``url`` (normalized), inside :func:`state_dir`."""
    key = re.sub(r"[^A-Za-z0-9.-]+", "_", normalize_url(url)).strip("_")
    return state_dir() / f"{key}.json"


def write_record(record: LaunchRecord) -> Path:
    """Write ``record`` atomically (replacing any older one for the same url); returns its path."""
    path = record_path(record.url)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".record.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(record.to_json())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return path


def _port_of(url: str) -> int | None:
    try:
        return urlsplit(normalize_url(url)).port
    except ValueError:
        return None


def process_is_vllm(pid: int, *, port: int | None = None) -> bool:
    """True when ``pid`` is alive and runs vLLM (on ``port``, when its command line shows one).

    Reads ``/proc/PID/cmdline`` (Linux); elsewhere it answers ``False``.
    """
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    args = [a.decode(errors="replace") for a in raw.split(b"\0") if a]
    if not any("vllm" in a.lower() for a in args):
        return False
    ports = [args[i + 1] for i, a in enumerate(args[:-1]) if a == "--port"]
    ports += [a.split("=", 1)[1] for a in args if a.startswith("--port=")]
    # A process that renamed itself (setproctitle) shows no flags; the models check remains.
    return port is None or not ports or str(port) in ports


def read_record(url: str) -> LaunchRecord | None:
    """The launch record for ``url`` if one exists and its vLLM process still runs, else ``None``.

    A record whose process is gone (or whose pid now runs something else) is stale: it is
    deleted and ``None`` returned. An unreadable file is ignored (``None``) and left alone.
    The caller still checks the live server with :func:`record_matches`.
    """
    path = record_path(url)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        record = LaunchRecord.from_mapping(data)
    except FileNotFoundError:
        return None
    except (OSError, ValueError, TypeError) as exc:
        logger.warning("ignoring unreadable launch record %s: %s", path, exc)
        return None
    if normalize_url(record.url) != normalize_url(url):
        return None
    if not process_is_vllm(record.pid, port=_port_of(record.url)):
        logger.info("launch record %s is stale (pid %d is gone); removing it", path, record.pid)
        with contextlib.suppress(OSError):
            path.unlink()
        return None
    return record


def record_matches(record: LaunchRecord, models_json: Any) -> bool:
    """True when the ``/v1/models`` answer (parsed JSON) is the server ``record`` describes.

    The recorded served model must be listed; when the entry has ``max_model_len`` (vLLM's does),
    it must equal the recorded one. Pure: pass the JSON you already fetched.
    """
    if not isinstance(models_json, Mapping):
        return False
    data = models_json.get("data")
    if not isinstance(data, list):
        return False
    for entry in data:
        if not isinstance(entry, Mapping) or entry.get("id") != record.model:
            continue
        served_len = entry.get("max_model_len")
        if served_len is None:
            return True
        return bool(served_len == record.max_model_len)
    return False


def remove_record(url: str, *, instance: str | None = None) -> bool:
    """Delete the record for ``url``; with ``instance``, only if it is still that launch's.

    Returns whether a file was removed. A launcher passes its own ``instance`` so it never
    deletes the record of a newer server that took the same url.
    """
    path = record_path(url)
    if instance is not None:
        try:
            current = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return False
        if not isinstance(current, dict) or current.get("instance") != instance:
            return False
    try:
        path.unlink()
    except FileNotFoundError:
        return False
    return True
