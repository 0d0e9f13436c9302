"""A launched vLLM that a test may kill (``kill -9`` of its whole process group) and start again
on the same port, and vLLM's own counters and gauges read from its ``/metrics``.

    server = KillableServer(model_dir, python=install.python, max_num_seqs=8, ...)
    await server.astart()                 # healthy; server.url keeps its port for good
    await server.kill()                   # SIGKILL to the group, returns once no process is left
    await server.astart()                 # a new vLLM on the same port (its counters from 0)
    server.stop()

Used by tests/integration/test_pool_integration.py; the shared ``vllm_server`` is never killed.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import socket
from typing import Any

import anyio
import httpx

from dsclient.launcher import Server, launch
from dsclient.launcher._hardware import detect_hardware
from dsclient.launcher._process import group_alive

__all__ = ["KillableServer", "gauges", "metric_sum", "success_total"]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class KillableServer:
    """One port, one launched vLLM at a time on it: started, killed and started again.

    Parameters:
        model: the model folder.
        options: :func:`dsclient.launcher.launch`'s keyword arguments (not ``port``: the port
            is chosen once here, so that every incarnation answers at the same URL).
    """

    def __init__(
        self, model: Any, *, engine_cpus: tuple[int, ...] | None = None, **options: Any
    ) -> None:
        if "port" in options:
            raise TypeError("KillableServer chooses its own port")
        self.port = _free_port()
        self._model = model
        self._options = options
        #: Where its engine (worker and EngineCore) runs, as a replica's would (``None``: as
        #: the launcher plans it for the whole machine).
        self._engine_cpus = engine_cpus
        self.server: Server | None = None
        self.kills = 0
        self.starts = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def running(self) -> bool:
        return self.server is not None and self.server.running

    def _new(self) -> Server:
        if self.server is not None:
            # The killed one: forget it (its launch record and exit hook) before the next.
            self.server.stop()
        options = dict(self._options)
        cpus = self._engine_cpus
        if cpus is not None:
            options["hardware"] = dataclasses.replace(detect_hardware(), cpu_ids=cpus)
        server = launch(self._model, port=self.port, **options)
        assert isinstance(server, Server)
        if cpus is not None:  # as launch_replicas does with one CPU per replica
            server.plan = dataclasses.replace(server.plan, engine_core_cpus=cpus)
        return server

    def start(self) -> None:
        """Start a new vLLM on the port and wait until it is healthy (blocking)."""
        if self.running:
            raise RuntimeError(f"a vLLM already runs at {self.url}")
        self.server = self._new()
        self.server.start()
        self.starts += 1

    async def astart(self) -> None:
        """:meth:`start` without blocking the event loop."""
        if self.running:
            raise RuntimeError(f"a vLLM already runs at {self.url}")
        self.server = self._new()
        await self.server.astart()
        self.starts += 1

    async def kill(self) -> None:
        """``kill -9`` of the server's whole process group (API server, EngineCore, workers);
        returns once none of them is left (at most 60 s). The launch record stays behind, as
        it does when a machine loses a server."""
        server = self.server
        assert server is not None and server.pid is not None, "not started"
        pgid = server.pid  # start_new_session: the leader's pid is the group's id
        os.killpg(pgid, signal.SIGKILL)
        self.kills += 1
        with anyio.fail_after(60):
            # `running` reaps the leader (a killed child stays a zombie, which killpg(pgid, 0)
            # still finds); group_alive skips zombies among the rest of the group.
            while server.running or group_alive(pgid):
                await anyio.sleep(0.1)

    def stop(self) -> None:
        """Stop the current vLLM, if any (safe after a kill)."""
        if self.server is not None:
            self.server.stop()


# --- vLLM's own numbers ----------------------------------------------------------------------


def metric_sum(text: str, name: str, *, skip: tuple[str, ...] = ()) -> float:
    """The sum of every series of ``name`` in a Prometheus text page, but those whose labels
    contain one of ``skip`` (e.g. ``'finished_reason="abort"'``)."""
    total = 0.0
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        series, _, value = line.rpartition(" ")
        if series.split("{", 1)[0].strip() == name and not any(s in series for s in skip):
            total += float(value)
    return total


async def _metrics(url: str) -> str:
    async with httpx.AsyncClient(timeout=10.0) as http:
        response = await http.get(url + "/metrics")
        response.raise_for_status()
        return response.text


async def success_total(url: str) -> int:
    """``vllm:request_success_total`` over the finish reasons of an answer sent (vLLM 0.32 also
    counts ``abort`` and ``error`` under that name; those are left out). A new vLLM process
    starts it from 0."""
    text = await _metrics(url)
    skip = ('finished_reason="abort"', 'finished_reason="error"')
    return round(metric_sum(text, "vllm:request_success_total", skip=skip))


async def refused_total(url: str) -> int:
    """``/v1/completions`` requests the server answered with a 4xx (the ``http_requests_total``
    counter vLLM's HTTP layer keeps). A new vLLM process starts it from 0."""
    text = await _metrics(url)
    total = 0.0
    for line in text.splitlines():
        series, _, value = line.rpartition(" ")
        if (
            series.startswith("http_requests_total{")
            and 'handler="/v1/completions"' in series
            and 'status="4xx"' in series
        ):
            total += float(value)
    return round(total)


async def gauges(url: str) -> tuple[int, int]:
    """``(running, waiting)`` as the server reports them now."""
    text = await _metrics(url)
    return (
        round(metric_sum(text, "vllm:num_requests_running")),
        round(metric_sum(text, "vllm:num_requests_waiting")),
    )
