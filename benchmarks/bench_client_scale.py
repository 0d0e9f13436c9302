"""Hundreds in flight from one process: requests/s and client CPU per request of each HTTP stack.

    python -m benchmarks client-scale                          # all legs, 2000 and 20000 requests
    python -m benchmarks client-scale --n 2000 --concurrency 16 256 --legs aiohttp dsclient
    python -m benchmarks client-scale --profile dsclient --concurrency 256 --n 5000
    python -m benchmarks client-scale --n 2000 --legs aiohttp dsclient --baseline main

A local server in its own process (a raw asyncio protocol: it parses the request line and headers,
skips the body and writes a canned vLLM completion; ``/v1/models`` for dsclient's discovery, 404
for anything else) costs next to nothing per request, so what limits the rate is the client. Each
leg runs in a subprocess of its own (its own imports, sockets and memory); it first sends
``concurrency`` uncounted requests (the pool's connections open), then ``n`` more, all gathered at
once behind a semaphore of ``concurrency`` (dsclient: behind its own governor,
``limit=concurrency``), ``--repeat`` times (default: 5 for 2,000 requests, 1 for 20,000).

The legs of one ``n`` and concurrency run paired: all their processes are alive at once and take
turns, one repetition of each leg a round (:func:`round_order`), so that a neighbour's burst falls
on every leg of a round alike; each repetition is preceded by ``concurrency`` uncounted requests
(``"rewarm": true`` in the results' parameters), so that a pool that let its idle connections go
while the other legs ran (dsclient's after 4 s) starts warm, as under a steady load. Each dsclient
leg's ratios to the fastest plain client are those of their totals over every round (``rate_ratio``,
``cpu_ratio`` in the results, with the rounds' lowest and highest CPU ratio; see :func:`_pair`), and
the goals are judged on them: on this shared 2-core machine one repetition's CPU moved by a third
between neighbouring minutes, more than the differences measured. (Two invocations on 2026-12-06,
``"method": "paired"``, took the median round's ratio instead.) ``--sequential`` runs each leg's
repetitions in a row, one leg after another, as the results without a ``method`` were taken (their
ratios are of the legs' medians).

Measured in the leg: wall seconds and ``time.process_time()`` over the ``n`` of the median
repetition by CPU (client CPU only: the server is another process), the lowest and highest
repetition's CPU, RSS after the first 1000 answers and the most seen, file descriptors before the
client was built and after ``aclose()``, and every ``ResourceWarning`` (``-W always``, a
``gc.collect()`` after closing).

Legs: ``aiohttp`` (a ``ClientSession`` with an unbounded connector), ``httpx2`` and ``httpx`` (an
unbounded pool), ``openai`` (``AsyncOpenAI`` as users run it, ``max_retries=0``) and
``openai-aiohttp`` (``http_client=DefaultAioHttpClient()``), ``dsclient`` (``generate()``),
``dsclient-map`` (``client.map()``), ``dsclient-openai`` (``client.openai()``), and with
``--baseline REF`` ``dsclient-base``: ``generate()`` on the dsclient of another commit (``git
archive REF``, imported in that leg's process), paired in the same rounds, so that a change is
measured against the code before it in one run (``base_rate_ratio``, ``base_cpu_ratio``).
Results: one JSON per invocation under ``benchmarks/results/`` (see :mod:`benchmarks._results`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import itertools
import json
import os
import select
import socket
import subprocess
import sys
import time
import warnings
from collections.abc import Awaitable, Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import CANNED_COMPLETION, CANNED_MODELS, median, say

LEGS = [
    "aiohttp",
    "httpx2",
    "httpx",
    "openai",
    "openai-aiohttp",
    "dsclient",
    "dsclient-map",
    "dsclient-openai",
]
#: ``generate()`` on the dsclient of ``--baseline``'s commit.
BASE = "dsclient-base"
PLAIN = ["aiohttp", "httpx2", "httpx", "openai", "openai-aiohttp"]
PEERS = ["aiohttp", "httpx2", "httpx", "openai", "httpcore", "httpcore2"]
MAX_TOKENS = 16


def prompt(i: int) -> str:
    return f"Request {i}: write one sentence about the sea"


# -- the server --------------------------------------------------------------------------------
def _answer(status: str, body: bytes) -> bytes:
    head = (
        f"HTTP/1.1 {status}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


_COMPLETION = _answer("200 OK", CANNED_COMPLETION)
_MODELS = _answer("200 OK", CANNED_MODELS)
_MISSING = _answer("404 Not Found", b'{"detail":"Not Found"}')


class _Http(asyncio.Protocol):
    """HTTP/1.1 keep-alive, one request at a time per connection (no client here pipelines)."""

    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        self.buffer = b""
        self.need = -1  # body bytes still to skip for the request being read; -1: in the head

    def data_received(self, data: bytes) -> None:
        buffer = self.buffer + data
        while True:
            if self.need < 0:
                end = buffer.find(b"\r\n\r\n")
                if end < 0:
                    break
                head = buffer[:end]
                buffer = buffer[end + 4 :]
                line, _, rest = head.partition(b"\r\n")
                path = line.split(b" ", 2)[1]
                length = 0
                for header in rest.split(b"\r\n"):
                    name, _, value = header.partition(b":")
                    if name.lower() == b"content-length":
                        length = int(value)
                self.need = length
                self.path = path
            if len(buffer) < self.need:
                break
            buffer = buffer[self.need :]
            self.need = -1
            path = self.path
            if path.endswith(b"/completions"):
                self.transport.write(_COMPLETION)
            elif path.startswith(b"/v1/models"):
                self.transport.write(_MODELS)
            else:
                self.transport.write(_MISSING)
        self.buffer = buffer


def serve(port: int) -> None:
    """Run the server until killed."""

    async def run() -> None:
        loop = asyncio.get_running_loop()
        server = await loop.create_server(_Http, "127.0.0.1", port, backlog=4096)
        print("ready", flush=True)
        async with server:
            await server.serve_forever()

    asyncio.run(run())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# -- the legs ----------------------------------------------------------------------------------
class Meter:
    """Counts answers; RSS after the first 1000 and the peak seen every 500."""

    def __init__(self) -> None:
        self.done = 0
        self.rss_1000: int | None = None
        self.rss_max = 0

    def tick(self) -> None:
        self.done += 1
        if self.done % 500 == 0:
            rss = _rss()
            self.rss_max = max(self.rss_max, rss)
            if self.done == 1000:
                self.rss_1000 = rss


def _rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


Send = Callable[[int], Awaitable[str]]


async def _gathered(send: Send, n: int, concurrency: int, meter: Meter, start: int) -> None:
    sem = asyncio.Semaphore(concurrency)

    async def one(i: int) -> None:
        async with sem:
            text = await send(i)
        assert text, i
        meter.tick()

    await asyncio.gather(*(one(start + i) for i in range(n)))


async def _timed(
    run: Callable[[int, int, Meter], Awaitable[None]], n: int, concurrency: int
) -> dict[str, Any]:
    """Warm up (``concurrency`` requests), then time ``n``, ``REPEAT`` times in a row.

    The leg's figures are the median repetition's (by CPU): one repetition of 2,000 requests lasts
    about half a second here, and a neighbour's burst moves it by a third. RSS is the first
    repetition's after its first 1000 answers, and the most seen in any repetition: memory that
    grows from one repetition to the next shows.
    """
    await run(concurrency, -(10**9), Meter())
    samples: list[tuple[float, float]] = []
    first: int | None = None
    peak = 0
    go = _told_to_go if PAIRED else None
    for number in range(REPEAT) if go is None else itertools.count():
        if go is not None:
            if not await go():
                break
            # Paired, a leg waits while the others take their turns: longer than a client's
            # keep-alive (dsclient's wire lets an idle connection go after 4 s, under uvicorn's
            # 5 s) on a busy machine. The connections open again uncounted, so that every leg's
            # repetition starts on the warm pool a steady load would keep.
            await run(concurrency, -(10**9), Meter())
        meter = Meter()
        gc.collect()
        wall, cpu = time.perf_counter(), time.process_time()
        await run(n, number * n, meter)
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        assert meter.done == n, (meter.done, n)
        samples.append((wall, cpu))
        first = meter.rss_1000 if first is None else first
        peak = max(peak, meter.rss_max)
    by_cpu = sorted(samples, key=lambda sample: sample[1])
    wall, cpu = by_cpu[len(by_cpu) // 2]
    return {
        "wall_s": wall,
        "cpu_s": cpu,
        "samples": samples,
        "rss_1000": first,
        "rss_max": peak,
    }


REPEAT = 1  # set by --repeat in the leg's process
#: The folder holding the ``--baseline`` commit's files (set by main(), in both processes).
BASELINE_TREE = ""
PAIRED = False  # set by --paired in the leg's process: a repetition each time the parent says


async def _told_to_go() -> bool:
    """Paired legs: say that the last repetition is done (or the warm-up: ``ready``), then wait
    for the parent's next line: ``go`` (one more repetition) or ``stop``."""
    print("ready", flush=True)
    line = await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    return line.strip() == "go"


async def leg_aiohttp(url: str, n: int, concurrency: int) -> dict[str, Any]:
    import aiohttp

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:

        async def send(i: int) -> str:
            body = {"model": "tiny", "prompt": prompt(i), "max_tokens": MAX_TOKENS}
            async with session.post(url + "/v1/completions", json=body) as response:
                response.raise_for_status()
                data = json.loads(await response.read())
            return str(data["choices"][0]["text"])

        return await _timed(lambda k, s, m: _gathered(send, k, concurrency, m, s), n, concurrency)


async def _leg_httpx(module: Any, url: str, n: int, concurrency: int) -> dict[str, Any]:
    limits = module.Limits(max_connections=None, max_keepalive_connections=None)
    async with module.AsyncClient(limits=limits, timeout=600) as http:

        async def send(i: int) -> str:
            body = {"model": "tiny", "prompt": prompt(i), "max_tokens": MAX_TOKENS}
            response = await http.post(url + "/v1/completions", json=body)
            response.raise_for_status()
            return str(json.loads(response.content)["choices"][0]["text"])

        return await _timed(lambda k, s, m: _gathered(send, k, concurrency, m, s), n, concurrency)


async def leg_httpx2(url: str, n: int, concurrency: int) -> dict[str, Any]:
    import httpx2

    return await _leg_httpx(httpx2, url, n, concurrency)


async def leg_httpx(url: str, n: int, concurrency: int) -> dict[str, Any]:
    import httpx

    return await _leg_httpx(httpx, url, n, concurrency)


async def _leg_openai(sdk: Any, n: int, concurrency: int) -> dict[str, Any]:
    async with sdk:

        async def send(i: int) -> str:
            completion = await sdk.completions.create(
                model="tiny", prompt=prompt(i), max_tokens=MAX_TOKENS
            )
            return str(completion.choices[0].text)

        return await _timed(lambda k, s, m: _gathered(send, k, concurrency, m, s), n, concurrency)


async def leg_openai(url: str, n: int, concurrency: int) -> dict[str, Any]:
    import openai

    sdk = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    return await _leg_openai(sdk, n, concurrency)


async def leg_openai_aiohttp(url: str, n: int, concurrency: int) -> dict[str, Any]:
    import openai

    http = openai.DefaultAioHttpClient()
    sdk = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0, http_client=http)
    return await _leg_openai(sdk, n, concurrency)


def _dsclient(url: str, concurrency: int, **options: Any) -> Any:
    import dsclient

    return dsclient.AsyncClient(url, limit=concurrency, timeout=600, **options)


async def _leg_dsclient(url: str, n: int, concurrency: int, **options: Any) -> dict[str, Any]:
    async with _dsclient(url, concurrency, **options) as client:

        async def run(k: int, start: int, meter: Meter) -> None:
            async def one(i: int) -> None:
                result = await client.generate(prompt(i), max_tokens=MAX_TOKENS)
                assert result.text
                meter.tick()

            await asyncio.gather(*(one(start + i) for i in range(k)))

        return await _timed(run, n, concurrency)


async def leg_dsclient(url: str, n: int, concurrency: int) -> dict[str, Any]:
    return await _leg_dsclient(url, n, concurrency)


async def leg_dsclient_base(url: str, n: int, concurrency: int) -> dict[str, Any]:
    import dsclient

    # The leg's process put the baseline's tree first on its path (main(): --baseline-tree).
    assert BASELINE_TREE and dsclient.__file__.startswith(BASELINE_TREE), dsclient.__file__
    return await _leg_dsclient(url, n, concurrency)


async def leg_dsclient_map(url: str, n: int, concurrency: int) -> dict[str, Any]:
    async with _dsclient(url, concurrency) as client:

        async def run(k: int, start: int, meter: Meter) -> None:
            async def items() -> Any:
                for i in range(k):
                    yield prompt(start + i)
                    if i % 500 == 499:  # map() gives results at the end: sample RSS as it feeds
                        meter.done = i + 1 - 500
                        for _ in range(500):
                            meter.tick()

            results = await client.map(items(), max_tokens=MAX_TOKENS, on_error="raise")
            assert len(results) == k
            meter.done = k

        return await _timed(run, n, concurrency)


async def leg_dsclient_openai(url: str, n: int, concurrency: int) -> dict[str, Any]:
    async with _dsclient(url, concurrency) as client:
        sdk = client.openai()

        async def run(k: int, start: int, meter: Meter) -> None:
            async def one(i: int) -> None:
                completion = await sdk.completions.create(
                    model="tiny", prompt=prompt(start + i), max_tokens=MAX_TOKENS
                )
                assert completion.choices[0].text
                meter.tick()

            await asyncio.gather(*(one(i) for i in range(k)))

        try:
            return await _timed(run, n, concurrency)
        finally:
            await sdk.close()


LEG_FUNCTIONS: dict[str, Callable[[str, int, int], Awaitable[dict[str, Any]]]] = {
    "aiohttp": leg_aiohttp,
    "httpx2": leg_httpx2,
    "httpx": leg_httpx,
    "openai": leg_openai,
    "openai-aiohttp": leg_openai_aiohttp,
    "dsclient": leg_dsclient,
    "dsclient-map": leg_dsclient_map,
    "dsclient-openai": leg_dsclient_openai,
    BASE: leg_dsclient_base,
}


def run_leg(leg: str, url: str, n: int, concurrency: int) -> dict[str, Any]:
    """One leg in this process: its measurements, fds and ResourceWarnings included."""
    fds_before = _fds()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResourceWarning)
        result = asyncio.run(LEG_FUNCTIONS[leg](url, n, concurrency))
        gc.collect()
    result["fds_left"] = _fds() - fds_before
    result["resource_warnings"] = [
        str(w.message)[:200] for w in caught if issubclass(w.category, ResourceWarning)
    ]
    return result


#: The legs that take their turns next to each other in a round: the fastest plain client and
#: dsclient's legs on its stack, each about half a second for 2,000 requests here, so that a
#: ratio compares repetitions a second apart, not a minute (the slow legs' time).
ADJACENT = ("aiohttp", "dsclient", "dsclient-map", BASE)


def round_order(legs: Sequence[str], number: int) -> list[str]:
    """The order of round ``number`` (from 0): the :data:`ADJACENT` legs first, then the
    others, each group turned by one leg a round (no leg always first or last)."""
    near = [leg for leg in legs if leg in ADJACENT]
    rest = [leg for leg in legs if leg not in ADJACENT]
    return [*_turned(near, number), *_turned(rest, number)]


def _turned(legs: list[str], number: int) -> list[str]:
    turn = number % len(legs) if legs else 0
    return [*legs[turn:], *legs[:turn]]


def _command(leg: str, url: str, n: int, concurrency: int, repeat: int) -> list[str]:
    command = [
        sys.executable,
        "-W",
        "always::ResourceWarning",
        "-m",
        "benchmarks.bench_client_scale",
    ]
    command += ["--child", leg, "--url", url, "--n", str(n), "--concurrency", str(concurrency)]
    if leg == BASE:
        command += ["--baseline-tree", BASELINE_TREE]
    return [*command, "--repeat", str(repeat)]


def _child(
    leg: str, url: str, n: int, concurrency: int, timeout: float, repeat: int
) -> dict[str, Any]:
    """One leg in a process of its own, its repetitions in a row (``--sequential``)."""
    done = subprocess.run(
        _command(leg, url, n, concurrency, repeat),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        cwd=_ROOT,
    )
    return _outcome(done.returncode, done.stdout, done.stderr)


def _outcome(code: int, stdout: str, stderr: str) -> dict[str, Any]:
    """A leg's figures (its last line on stdout), or ``{"error": [...]}``."""
    if code != 0:
        # The exception's own line: the last unindented one that is not a warning.
        lines = [
            line
            for line in stderr.splitlines()
            if line and not line[0].isspace() and "Warning" not in line
        ]
        return {"error": lines[-1:] or [f"exit {code}"]}
    return dict(json.loads(stdout.strip().splitlines()[-1]))


def _paired(
    legs: Sequence[str], url: str, n: int, concurrency: int, timeout: float, repeat: int
) -> dict[str, dict[str, Any]]:
    """Every leg in a process of its own, all alive at once, their repetitions taken in turns.

    Each process is started and warmed up in turn; then, ``repeat`` rounds, each leg runs one
    repetition while the others wait (:func:`round_order`), so that a neighbour's burst or a
    quiet spell falls on every leg of a round alike, and a ratio taken within a round compares
    like with like. Each leg's figures are then those of
    :func:`_timed` (its ``samples`` in round order); the parent pairs them (:func:`_pair`).
    """
    import tempfile

    procs: dict[str, subprocess.Popen[str]] = {}
    errors: dict[str, Any] = {}
    logs: dict[str, Any] = {}

    def step(leg: str, say_: str | None) -> None:
        proc = procs[leg]
        assert proc.stdin is not None and proc.stdout is not None
        try:
            if say_ is not None:
                proc.stdin.write(say_ + "\n")
                proc.stdin.flush()
            ready, _, _ = select.select([proc.stdout], [], [], timeout)
            line = proc.stdout.readline() if ready else ""
        except OSError as exc:  # the leg's process has gone
            line = str(exc)
        if line.strip() != "ready":
            proc.kill()
            errors[leg] = {"error": [f"no answer from the leg ({line.strip() or 'timeout'})"]}

    with contextlib.ExitStack() as files:
        try:
            for leg in legs:
                logs[leg] = files.enter_context(tempfile.TemporaryFile("w+"))
                procs[leg] = subprocess.Popen(
                    [*_command(leg, url, n, concurrency, 1), "--paired"],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=logs[leg],
                    text=True,
                    cwd=_ROOT,
                )
                step(leg, None)  # its warm-up done
            for number in range(repeat):
                for leg in round_order(legs, number):
                    if leg not in errors:
                        step(leg, "go")
            results: dict[str, dict[str, Any]] = {}
            for leg, proc in procs.items():
                if leg in errors:
                    proc.wait(timeout)
                    logs[leg].seek(0)
                    told = _outcome(1, "", logs[leg].read())  # its own error, where it said one
                    results[leg] = told if told["error"] != ["exit 1"] else errors[leg]
                    continue
                stdout, _ = proc.communicate("stop\n", timeout=timeout)
                logs[leg].seek(0)
                results[leg] = _outcome(proc.returncode, stdout, logs[leg].read())
            return results
        finally:
            for proc in procs.values():
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()


_ROOT = Path(__file__).resolve().parents[1]


# -- the report --------------------------------------------------------------------------------
def table(rows: list[dict[str, Any]]) -> str:
    """A markdown table per ``n``: requests/s and CPU us/request by leg and concurrency."""
    out = []
    for n in sorted({r["n"] for r in rows}):
        concs = sorted({r["concurrency"] for r in rows if r["n"] == n})
        legs = [leg for leg in [*LEGS, BASE] if any(r["leg"] == leg and r["n"] == n for r in rows)]
        out.append(f"\n{n} requests: requests/s | client CPU us/request (median of the runs)\n")
        out.append("| leg | " + " | ".join(f"{c} in flight" for c in concs) + " |")
        out.append("|---|" + "---|" * len(concs))
        for leg in legs:
            cells = []
            for c in concs:
                mine = [r for r in rows if (r["leg"], r["n"], r["concurrency"]) == (leg, n, c)]
                ok = [r for r in mine if "rps" in r]
                if not ok:
                    cells.append("failed" if mine else "")
                    continue
                rps = median([r["rps"] for r in ok])
                cpu = median([r["cpu_per_req"] for r in ok])
                cells.append(f"{rps:,.0f} / {cpu * 1e6:,.0f}")
            out.append(f"| {leg} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def goals(rows: list[dict[str, Any]]) -> list[str]:
    """Per run, n and concurrency: each dsclient leg against the fastest plain client."""
    lines = []
    keys = sorted({(r["run"], r["n"], r["concurrency"]) for r in rows})
    for run, n, c in keys:
        here = {r["leg"]: r for r in rows if (r["run"], r["n"], r["concurrency"]) == (run, n, c)}
        plain = [here[leg] for leg in PLAIN if "rps" in here.get(leg, {})]
        if not plain:
            continue
        best = max(plain, key=lambda r: r["rps"])
        for leg in ("dsclient", "dsclient-map", "dsclient-openai"):
            mine = here.get(leg, {})
            if "rps" not in mine:
                continue
            speed, cost = _ratios(mine, best)
            met = "met" if speed >= 0.8 and cost <= 1.2 else "MISSED"
            lines.append(
                f"run {run} n={n} c={c} {leg}: {speed:.2f}x the rate, {cost:.2f}x the CPU of "
                f"{best['leg']} -> {met}"
            )
        mine = here.get("dsclient", {})
        if "base_cpu_ratio" in mine:
            speed, cost = mine["base_rate_ratio"], mine["base_cpu_ratio"]
            met = "met" if speed >= BASE_RATE and cost <= BASE_CPU else "MISSED"
            lines.append(
                f"run {run} n={n} c={c} dsclient: {speed:.2f}x the rate, {cost:.2f}x the CPU of "
                f"{BASE} -> {met}"
            )
    return lines


#: A change of dsclient's against ``--baseline``: at least this share of its rate, at most this
#: multiple of its CPU per request (issue 42's bounds for the wire).
BASE_RATE = 0.95
BASE_CPU = 1.1


def _versus(
    rows: Sequence[dict[str, Any]], leg: str, run: int, concurrency: int
) -> tuple[float, float] | None:
    """``leg``'s requests/s and CPU/request over the fastest plain client's, in one run."""
    here = {r["leg"]: r for r in rows if (r["run"], r["concurrency"]) == (run, concurrency)}
    plain = [here[name] for name in PLAIN if "rps" in here.get(name, {})]
    mine = here.get(leg, {})
    if not plain or "rps" not in mine:
        return None
    best = max(plain, key=lambda r: r["rps"])
    return _ratios(mine, best)


def _leg_rank(leg: str) -> int:
    return LEGS.index(leg) if leg in LEGS else len(LEGS)


#: How each kind of invocation's ratios were taken, for the page.
_METHODS = {
    "sequential": "legs run one after another, the ratio of the legs' median repetitions",
    "paired": "legs paired, the median of the ratios within each round",
    "paired-totals": "legs paired, the ratio of their totals over every round",
}


def _ratios(mine: dict[str, Any], best: dict[str, Any]) -> tuple[float, float]:
    """Requests/s and CPU/request of ``mine`` over ``best``'s: as :func:`_pair` took them where
    the legs ran paired (the default), else the ratio of their medians."""
    if "cpu_ratio" in mine:
        return mine["rate_ratio"], mine["cpu_ratio"]
    return mine["rps"] / best["rps"], mine["cpu_per_req"] / best["cpu_per_req"]


def render(records: Sequence[dict[str, Any]]) -> str:
    """``docs/benchmarks.md``'s block: per number of requests, requests/s and CPU us/request
    per leg and concurrency as median (range) over each leg's last two invocations, then each
    dsclient leg against the fastest plain client in the last two invocations (the goals are
    met or not in each)."""
    from benchmarks import _report as report_

    out = []
    for n in sorted({r["params"]["n"][0] for r in records if len(r["params"]["n"]) == 1}):
        every = [r for r in records if r["params"]["n"] == [n]]
        mine = every[-2:]
        rows = []
        for number, record in enumerate(mine, 1):
            rows += [{**row, "run": number} for row in record["rows"]]
        # A leg the last two invocations left out (a quick one of the fast legs alone): its
        # own last two.
        shown = {id(record): record for record in mine}
        table_rows = list(rows)
        for leg in LEGS:
            if any(r["leg"] == leg for r in rows):
                continue
            theirs = [r for r in every if leg in r["params"]["legs"]][-2:]
            for record in theirs:
                shown[id(record)] = record
                table_rows += [row for row in record["rows"] if row["leg"] == leg]
        concs = sorted({r["concurrency"] for r in rows})
        out.append(f"**{n} requests**, each leg's last 2 invocations: requests/s; CPU us/request")
        out.append("")
        out.append("| leg | " + " | ".join(f"{c} in flight" for c in concs) + " |")
        out.append("|---|" + "---|" * len(concs))
        for leg in sorted(report_.legs(table_rows), key=_leg_rank):
            cells = []
            for c in concs:
                here = report_.select(table_rows, leg=leg, concurrency=c)
                if not here:
                    cells.append(report_.NONE)
                    continue
                rps = report_.spread_cell((r.get("rps") for r in here), 0)
                cpu = [
                    None if r.get("cpu_per_req") is None else r["cpu_per_req"] * 1e6 for r in here
                ]
                failed = sum("error" in r for r in here)
                note = f" ({failed} run failed)" if failed else ""
                cells.append(f"{rps}; {report_.spread_cell(cpu, 0)}{note}")
            out.append(f"| {leg} | " + " | ".join(cells) + " |")
        out.append("")
        methods = "; ".join(
            f"{number}: {_METHODS[r['params'].get('method', 'sequential')]}"
            for number, r in enumerate(mine, 1)
        )
        out.append(
            "Against the fastest plain client at each concurrency, per invocation (the last "
            "two): requests/s ratio; CPU/request ratio (the goal: at least 0.8x; at most 1.2x). "
            f"How they were taken: {methods}."
        )
        out.append("")
        out.append("| leg | " + " | ".join(f"{c} in flight" for c in concs) + " |")
        out.append("|---|" + "---|" * len(concs))
        for leg in ("dsclient", "dsclient-map", "dsclient-openai"):
            if not any(r["leg"] == leg for r in rows):
                continue  # not in the last two invocations
            cells = []
            for c in concs:
                pairs = []
                for number in sorted({r["run"] for r in rows}):
                    ratio = _versus(rows, leg, number, c)
                    if ratio is not None:
                        pairs.append(f"{ratio[0]:.2f}x; {ratio[1]:.2f}x")
                cells.append(" / ".join(pairs) or report_.NONE)
            out.append(f"| {leg} | " + " | ".join(cells) + " |")
        out.append("")
        based = [r for r in rows if r["leg"] == "dsclient" and "base_cpu_ratio" in r]
        if based:
            commits = "; ".join(
                f"{number}: `{r['params']['baseline']['commit'][:10]}`"
                for number, r in enumerate(mine, 1)
                if r["params"].get("baseline")
            )
            out.append(
                f"`dsclient` against `{BASE}` (the same calls on the dsclient of an earlier "
                f"commit, paired in the same rounds), per invocation: requests/s ratio; "
                f"CPU/request ratio (the goal: at least {BASE_RATE}x; at most {BASE_CPU}x). "
                f"Earlier commits: {commits}."
            )
            out.append("")
            out.append("| leg | " + " | ".join(f"{c} in flight" for c in concs) + " |")
            out.append("|---|" + "---|" * len(concs))
            cells = []
            for c in concs:
                pairs = [
                    f"{r['base_rate_ratio']:.2f}x; {r['base_cpu_ratio']:.2f}x"
                    for r in sorted(based, key=lambda r: r["run"])
                    if r["concurrency"] == c
                ]
                cells.append(" / ".join(pairs) or report_.NONE)
            out.append("| dsclient | " + " | ".join(cells) + " |")
            out.append("")
        memory = [r for r in table_rows if r.get("rss_max_mb") is not None and r.get("rss_1000_mb")]
        if memory:
            growth = {
                leg: max(r["rss_max_mb"] - r["rss_1000_mb"] for r in memory if r["leg"] == leg)
                for leg in report_.legs(memory)
            }
            grown = ", ".join(f"{leg} {mb:.1f}" for leg, mb in growth.items())
            fds = max(r.get("fds_left") or 0 for r in memory)
            warned = sum(r.get("resource_warnings") or 0 for r in memory)
            out.append(
                f"RSS growth after the first 1000 answers, most in any run (MB): {grown}. "
                f"File descriptors left open after `aclose()`: at most {fds}. "
                f"ResourceWarnings: {warned}."
            )
            out.append("")
        for record in sorted(shown.values(), key=lambda record: record["started_utc"]):
            out.append(report_.conditions(record))
            out.append("")
    return "\n".join(out).rstrip() + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks client-scale", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--n", type=int, nargs="+", default=[2000, 20000])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[16, 64, 256, 1024])
    parser.add_argument("--legs", nargs="+", default=LEGS, choices=LEGS)
    parser.add_argument("--runs", type=int, default=1, help="runs in this invocation")
    parser.add_argument(
        "--repeat",
        type=int,
        help="timed repetitions of n in each leg's process, the median reported "
        "(default: 5 for 2000 requests, 1 for 20000)",
    )
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per leg")
    parser.add_argument("--no-save", action="store_true", help="do not write a results file")
    parser.add_argument(
        "--sequential",
        action="store_true",
        help="run each leg's repetitions in a row, one leg after another (default: every "
        "leg's process alive at once, their repetitions in turns, ratios taken within a round)",
    )
    parser.add_argument(
        "--baseline",
        metavar="REF",
        help="also run generate() on this git commit's dsclient (leg dsclient-base), paired in "
        "the same rounds; its ratios are base_rate_ratio and base_cpu_ratio",
    )
    parser.add_argument("--baseline-tree", help=argparse.SUPPRESS)
    parser.add_argument("--profile", choices=LEGS, help="pyinstrument one leg, print its tree")
    parser.add_argument("--paired", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--child", choices=[*LEGS, BASE], help=argparse.SUPPRESS)
    parser.add_argument("--url", help=argparse.SUPPRESS)
    parser.add_argument("--serve", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if args.serve:
        serve(args.serve)
        return
    global BASELINE_TREE
    if args.child:
        global REPEAT, PAIRED
        REPEAT = args.repeat or 1
        PAIRED = args.paired
        if args.baseline_tree:
            BASELINE_TREE = args.baseline_tree
            # The leg imports the baseline's dsclient: benchmarks._common imported this tree's
            # already (a word list), so it is forgotten first.
            sys.path.insert(0, BASELINE_TREE)
            for name in [m for m in sys.modules if m.split(".")[0] == "dsclient"]:
                del sys.modules[name]
        result = run_leg(args.child, args.url, args.n[0], args.concurrency[0])
        print(json.dumps(result))
        return

    with contextlib.ExitStack() as stack:
        url = stack.enter_context(served())
        if args.profile:
            _profile(args.profile, url, args.n[0], args.concurrency[0])
            return
        if args.baseline:
            BASELINE_TREE, args.baseline_commit = stack.enter_context(_checked_out(args.baseline))
            args.legs = [*args.legs, BASE]
        _measure(args, url)


@contextlib.contextmanager
def _checked_out(ref: str) -> Iterator[tuple[str, str]]:
    """The files of commit ``ref`` in a temporary folder (``git archive``: the checkout it is
    run from is not touched), and the commit's hash."""
    import tempfile

    commit = subprocess.run(
        ["git", "rev-parse", "--verify", f"{ref}^{{commit}}"],
        cwd=_ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    with tempfile.TemporaryDirectory(prefix="dsclient-base-") as folder:
        archive = subprocess.run(
            ["git", "archive", commit, "dsclient"], cwd=_ROOT, capture_output=True, check=True
        ).stdout
        subprocess.run(["tar", "-x", "-C", folder], input=archive, check=True)
        yield folder + os.sep, commit


@contextlib.contextmanager
def served() -> Iterator[str]:
    """The local server (:func:`serve`) in a process of its own, for the block: its URL."""
    port = _free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "benchmarks.bench_client_scale", "--serve", str(port)],
        stdout=subprocess.PIPE,
        cwd=_ROOT,
    )
    try:
        assert server.stdout is not None and server.stdout.readline().strip() == b"ready"
        yield f"http://127.0.0.1:{port}"
    finally:
        server.terminate()
        server.wait(10)


def _profile(leg: str, url: str, n: int, concurrency: int) -> None:
    from pyinstrument import Profiler

    async def go() -> None:
        profiler = Profiler(async_mode="disabled")
        profiler.start()
        result = await LEG_FUNCTIONS[leg](url, n, concurrency)
        profiler.stop()
        print(result)
        print(profiler.output_text(unicode=False, color=False, show_all=False))

    asyncio.run(go())


def _measure(args: argparse.Namespace, url: str) -> None:
    from benchmarks._results import Run

    params = {
        "n": args.n,
        "concurrency": args.concurrency,
        "legs": args.legs,
        "runs": args.runs,
        "repeat": args.repeat,
        "method": "sequential" if args.sequential else "paired-totals",
    }
    if not args.sequential:
        params["rewarm"] = True
    if args.baseline:
        params["baseline"] = {"ref": args.baseline, "commit": args.baseline_commit}
    run = Run.begin("client-scale", params=params, peers=PEERS)
    rows: list[dict[str, Any]] = []
    for number in range(1, args.runs + 1):
        for n in args.n:
            for c in args.concurrency:
                repeat = args.repeat or _repeat_for(n)
                if args.sequential:
                    got = {leg: _child(leg, url, n, c, args.timeout, repeat) for leg in args.legs}
                else:
                    got = _paired(args.legs, url, n, c, args.timeout, repeat)
                mine = [_row(leg, number, n, c, got[leg], repeat) for leg in args.legs]
                if not args.sequential:
                    _pair(mine, got)
                for row in mine:
                    _say_row(row, got[row["leg"]])
                    run.add(**row)
                    rows.append(row)
    print(table(rows))
    print()
    print("\n".join(goals(rows)))
    if not args.no_save:
        say(f"saved {run.save()}")


def _row(leg: str, number: int, n: int, c: int, got: dict[str, Any], repeat: int) -> dict[str, Any]:
    row: dict[str, Any] = {"leg": leg, "run": number, "concurrency": c, "n": n}
    if "error" in got:
        row["error"] = " ".join(got["error"])[:300]
        return row
    row.update(
        rps=n / got["wall_s"],
        cpu_per_req=got["cpu_s"] / n,
        rss_1000_mb=_mb(got["rss_1000"]),
        rss_max_mb=_mb(got["rss_max"]),
        fds_left=got["fds_left"],
        resource_warnings=len(got["resource_warnings"]),
        repeat=repeat,
        cpu_per_req_low=min(cpu for _, cpu in got["samples"]) / n,
        cpu_per_req_high=max(cpu for _, cpu in got["samples"]) / n,
    )
    return row


def _pair(rows: list[dict[str, Any]], got: dict[str, dict[str, Any]]) -> None:
    """Paired legs: each dsclient leg against the fastest plain client (by median requests/s)
    over the same rounds: ``rate_ratio`` and ``cpu_ratio`` are of their totals (wall seconds,
    CPU seconds) over every round, with the lowest and highest ratio of one round's CPU. What
    the goals are judged on.

    Totals, not the median round: a full collection of the garbage collector comes every few
    thousand calls and costs about a fifth of a repetition's CPU, so it falls in some of a leg's
    repetitions and not in others, and the median round can land on either side (for the same
    dsclient code, 0.97x in one invocation and 1.37x in another). Over every round each leg
    pays for the collections its own calls bring on."""
    plain = [r for r in rows if r["leg"] in PLAIN and "rps" in r]
    if not plain:
        return
    best = max(plain, key=lambda r: r["rps"])
    theirs = got[best["leg"]]["samples"]
    for row in rows:
        if not row["leg"].startswith("dsclient") or "rps" not in row:
            continue
        ours = got[row["leg"]]["samples"]
        rounds = list(zip(ours, theirs, strict=True))
        cpu = sorted(mine[1] / best_[1] for mine, best_ in rounds)
        row.update(
            paired_with=best["leg"],
            rounds=len(rounds),
            rate_ratio=sum(best_[0] for best_ in theirs) / sum(mine[0] for mine in ours),
            cpu_ratio=sum(mine[1] for mine in ours) / sum(best_[1] for best_ in theirs),
            cpu_ratio_low=cpu[0],
            cpu_ratio_high=cpu[-1],
        )
    base = got.get(BASE, {}).get("samples")
    for row in rows:
        if row["leg"] != "dsclient" or "rps" not in row or not base:
            continue
        ours = got[row["leg"]]["samples"]
        rounds = list(zip(ours, base, strict=True))
        cpu = sorted(mine[1] / theirs_[1] for mine, theirs_ in rounds)
        row.update(
            base_rate_ratio=sum(b[0] for b in base) / sum(mine[0] for mine in ours),
            base_cpu_ratio=sum(mine[1] for mine in ours) / sum(b[1] for b in base),
            base_cpu_ratio_low=cpu[0],
            base_cpu_ratio_high=cpu[-1],
        )


def _say_row(row: dict[str, Any], got: dict[str, Any]) -> None:
    where = f"run {row['run']} n={row['n']} c={row['concurrency']} {row['leg']}"
    if "error" in row:
        say(f"{where}: FAILED {got['error']}")
        return
    paired = (
        f", against {row['paired_with']} {row['rate_ratio']:.2f}x the rate, "
        f"{row['cpu_ratio']:.2f}x the CPU ({row['cpu_ratio_low']:.2f}-{row['cpu_ratio_high']:.2f})"
        if "cpu_ratio" in row
        else ""
    )
    say(
        f"{where}: {row['rps']:,.0f} req/s, {row['cpu_per_req'] * 1e6:,.0f} us CPU/req, "
        f"RSS {row['rss_1000_mb']} -> {row['rss_max_mb']} MB, fds left {row['fds_left']}, "
        f"ResourceWarnings {row['resource_warnings']}{paired}"
    )


def _repeat_for(n: int) -> int:
    """Five repetitions of a short leg, one of a long one (about ten seconds here)."""
    return max(1, 10_000 // n)


def _mb(value: int | None) -> float | None:
    return None if value is None else round(value / 2**20, 1)


if __name__ == "__main__":
    main()
