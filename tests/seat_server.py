"""A small OpenAI-compatible server with seats and a first-come queue, in its own process.

What vLLM, SGLang, TGI, llama.cpp and transformers' server all do once their batch is full: run
at most ``seats`` requests at once and queue the rest first come, first served (or, past a hard
cap, refuse with 429 as TGI does past ``--max-concurrent-requests``). A real process with real
sockets and real time, unlike the pure simulations on a fake clock (tests/sim_blackbox.py): the
governor is judged here by the server's own queue, which the server counts itself.

    with SeatServer(seats=10, service=0.2) as server:
        client = dsclient.AsyncClient(server.url)
        ...
        server.stats()   # {"queue_peak": 4, "queue_p90": 3, "served": 600, "refused": 0, ...}

How long a request takes once seated:

* ``service`` seconds (``per_token=True``: ``service`` seconds a token of its ``max_tokens``),
  times a log-normal factor of spread ``noise`` (``sigma``; 0: none); or
* ``step_ms`` given: continuous batching: every step, each running request adds one token;
  a step takes ``step_ms + step_per_seq_ms x running`` milliseconds (a GPU's decode step is
  nearly flat in the batch: 10 + 0.2 x running); a request needs ``max_tokens`` steps, and
  waiting requests are seated between steps.

What it states about itself (``states``): ``"none"`` (a black box), ``"vllm"`` (vLLM's dev-mode
``/server_info`` with ``max_num_seqs``), ``"sglang"`` (``/server_info`` with
``max_running_requests``), ``"llamacpp"`` (``/props`` with ``total_slots``) or ``"tgi"``
(``/info`` with ``max_concurrent_requests`` = ``cap``, the limit past which it refuses).

``GET /sim/stats`` gives its own counts (time-sampled every 10 ms while any request is in it:
the queue's peak and p90, the running peak), ``POST /sim/reset`` clears them; no client under
test asks for either. Run as ``python -m tests.seat_server --seats 10 --service 0.2``; it prints
``READY <port>`` once it listens.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import subprocess
import sys
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

from aiohttp import web

__all__ = ["Leg", "SeatServer", "Shape", "run_leg"]

MODEL = "sim"
MAX_MODEL_LEN = 8192
_SAMPLE_S = 0.01


@dataclass(frozen=True)
class Shape:
    """How a seat server behaves (see the module docstring)."""

    seats: int
    service: float = 0.2
    per_token: bool = False
    noise: float = 0.0
    step_ms: float | None = None
    step_per_seq_ms: float = 0.0
    cap: int | None = None
    states: str = "none"
    seed: int = 1
    #: Whether ``/v1/models`` gives the context (``max_model_len``); off, the client judges
    #: what is long beside the calls it sends (its ``RecentSizes``), as on a server that says
    #: nothing.
    context: bool = True

    def args(self) -> list[str]:
        out = ["--seats", str(self.seats), "--service", repr(self.service)]
        out += ["--noise", repr(self.noise), "--states", self.states, "--seed", str(self.seed)]
        if self.per_token:
            out.append("--per-token")
        if self.step_ms is not None:
            out += [
                "--step-ms",
                repr(self.step_ms),
                "--step-per-seq-ms",
                repr(self.step_per_seq_ms),
            ]
        if self.cap is not None:
            out += ["--cap", str(self.cap)]
        if not self.context:
            out.append("--no-context")
        return out


class _Engine:
    """Seats, a first-come queue and the counts; one per server process."""

    def __init__(self, shape: Shape) -> None:
        self.shape = shape
        self.rng = random.Random(shape.seed)
        self.running = 0
        self.waiting: deque[asyncio.Future[None]] = deque()
        self.stepping: dict[asyncio.Future[None], int] = {}  # step mode: tokens left
        self.tokens: dict[asyncio.Future[None], int] = {}  # step mode: tokens asked
        self.reset()

    def reset(self) -> None:
        self.queue_samples: list[int] = []
        self.running_samples: list[int] = []
        self.sampled_at: list[float] = []
        self.queue_peak = 0
        self.running_peak = 0
        self.served = 0
        self.refused = 0
        self.started = time.monotonic()

    # -- first come, first served --------------------------------------------------------------
    async def _seat(self) -> None:
        if self.running < self.shape.seats and not self.waiting:
            self.running += 1
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.waiting.append(fut)
        self.queue_peak = max(self.queue_peak, len(self.waiting))
        try:
            await fut
        except asyncio.CancelledError:
            if fut in self.waiting:
                self.waiting.remove(fut)
            elif fut.done() and not fut.cancelled():
                self._unseat()  # seated as the client left: give the seat on
            raise

    def _unseat(self) -> None:
        self.running -= 1
        while self.waiting and self.running < self.shape.seats:
            fut = self.waiting.popleft()
            if not fut.done():
                self.running += 1
                fut.set_result(None)

    async def serve(self, tokens: int) -> None:
        shape = self.shape
        if shape.step_ms is not None:
            await self._serve_steps(tokens)
            return
        await self._seat()
        try:
            seconds = shape.service * (tokens if shape.per_token else 1)
            if shape.noise > 0:
                seconds *= self.rng.lognormvariate(-(shape.noise**2) / 2, shape.noise)
            self.running_peak = max(self.running_peak, self.running)
            await asyncio.sleep(seconds)
        finally:
            self._unseat()
        self.served += 1

    # -- continuous batching -----------------------------------------------------------------
    async def _serve_steps(self, tokens: int) -> None:
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.waiting.append(fut)
        self.queue_peak = max(self.queue_peak, len(self.waiting))
        self.tokens[fut] = max(1, tokens)
        try:
            await fut
        finally:
            self.tokens.pop(fut, None)
            if fut in self.waiting:
                self.waiting.remove(fut)
            self.stepping.pop(fut, None)
        self.served += 1

    async def step_loop(self) -> None:
        shape = self.shape
        assert shape.step_ms is not None
        while True:
            while self.waiting and len(self.stepping) < shape.seats:
                fut = self.waiting.popleft()
                if not fut.done():
                    self.stepping[fut] = self.tokens.get(fut, 1)
            self.running = len(self.stepping)
            self.running_peak = max(self.running_peak, self.running)
            if not self.stepping:
                await asyncio.sleep(0.001)
                continue
            step = shape.step_ms + shape.step_per_seq_ms * len(self.stepping)
            if shape.noise > 0:
                step *= self.rng.lognormvariate(-(shape.noise**2) / 2, shape.noise)
            await asyncio.sleep(step / 1000)
            for fut in list(self.stepping):
                left = self.stepping[fut] - 1
                if left <= 0 or fut.done():
                    del self.stepping[fut]
                    if not fut.done():
                        fut.set_result(None)
                else:
                    self.stepping[fut] = left

    # -- counts ----------------------------------------------------------------------------------
    async def sample_loop(self) -> None:
        while True:
            await asyncio.sleep(_SAMPLE_S)
            queued = len(self.waiting)
            if self.running or queued:
                self.queue_samples.append(queued)
                self.running_samples.append(self.running)
                self.sampled_at.append(time.monotonic() - self.started)

    def in_system(self) -> int:
        return self.running + len(self.waiting)

    def stats(self, after: float = 0.0) -> dict[str, Any]:
        """The counts since the reset; the queue's quantiles over the samples ``after`` seconds
        past it (the peak is always the whole run's)."""
        samples = sorted(q for q, t in zip(self.queue_samples, self.sampled_at) if t >= after)
        running = self.running_samples
        return {
            "seats": self.shape.seats,
            "running": self.running,
            "waiting": len(self.waiting),
            "queue_peak": self.queue_peak,
            "queue_p90": _rank(samples, 90),
            "queue_p50": _rank(samples, 50),
            "queue_mean": sum(samples) / len(samples) if samples else 0.0,
            "running_mean": sum(running) / len(running) if running else 0.0,
            "running_peak": self.running_peak,
            "served": self.served,
            "refused": self.refused,
            "busy_s": len(samples) * _SAMPLE_S,
            "since_s": time.monotonic() - self.started,
        }


def _rank(ordered: list[int], pct: float) -> int:
    if not ordered:
        return 0
    return ordered[max(0, math.ceil(pct / 100 * len(ordered)) - 1)]


def _app(engine: _Engine) -> web.Application:
    shape = engine.shape

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        chat = request.path.endswith("/chat/completions")
        tokens = int(body.get("max_tokens") or body.get("max_completion_tokens") or 16)
        if shape.cap is not None and engine.in_system() >= shape.cap:
            engine.refused += 1
            return web.json_response({"error": "Model is overloaded"}, status=429)
        if chat:
            prompt = " ".join(str(m.get("content", "")) for m in body.get("messages") or [])
        else:
            prompt = str(body.get("prompt", ""))
        await engine.serve(tokens)
        prompt_tokens = max(1, len(prompt.split()))
        usage = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": tokens,
            "total_tokens": prompt_tokens + tokens,
        }
        text = " x" * tokens
        if chat:
            choice: dict[str, Any] = {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "finish_reason": "length",
            }
        else:
            choice = {"index": 0, "text": text, "finish_reason": "length", "logprobs": None}
        answer = {
            "id": "sim-1",
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": MODEL,
            "choices": [choice],
            "usage": usage,
        }
        if not body.get("stream"):
            return web.json_response(answer)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        delta = {"index": 0, "finish_reason": "length"}
        if chat:
            delta["delta"] = {"role": "assistant", "content": text}
        else:
            delta["text"] = text
        chunk = dict(answer, choices=[delta])
        await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    async def models(_: web.Request) -> web.Response:
        entry: dict[str, Any] = {"id": MODEL, "object": "model", "owned_by": "sim"}
        if shape.context:
            entry["max_model_len"] = MAX_MODEL_LEN
        return web.json_response({"object": "list", "data": [entry]})

    async def health(_: web.Request) -> web.Response:
        return web.Response(text="")

    async def server_info(_: web.Request) -> web.Response:
        if shape.states == "vllm":
            config = {
                "scheduler_config": {"max_num_seqs": shape.seats},
                "model_config": {"max_model_len": MAX_MODEL_LEN},
            }
            return web.json_response({"vllm_config": config})
        if shape.states == "sglang":
            return web.json_response({"model_path": MODEL, "max_running_requests": shape.seats})
        raise web.HTTPNotFound()

    async def info(_: web.Request) -> web.Response:
        if shape.states != "tgi":
            raise web.HTTPNotFound()
        return web.json_response(
            {
                "model_id": MODEL,
                "max_concurrent_requests": shape.cap or 128,
                "max_input_tokens": MAX_MODEL_LEN - 1,
                "max_total_tokens": MAX_MODEL_LEN,
                "router": "text-generation-router",
                "version": "3.2.1",
            }
        )

    async def props(_: web.Request) -> web.Response:
        if shape.states != "llamacpp":
            raise web.HTTPNotFound()
        settings = {"n_ctx": MAX_MODEL_LEN}
        return web.json_response(
            {"total_slots": shape.seats, "default_generation_settings": settings}
        )

    async def stats(request: web.Request) -> web.Response:
        return web.json_response(engine.stats(float(request.query.get("after", "0"))))

    async def reset(_: web.Request) -> web.Response:
        engine.reset()
        return web.json_response({"ok": True})

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/server_info", server_info)
    app.router.add_get("/info", info)
    app.router.add_get("/props", props)
    app.router.add_get("/sim/stats", stats)
    app.router.add_post("/sim/reset", reset)
    return app


async def _main(shape: Shape, port: int) -> None:
    engine = _Engine(shape)
    runner = web.AppRunner(_app(engine), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", port, backlog=4096)
    await site.start()
    server = site._server
    assert server is not None
    bound = server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    tasks = [asyncio.create_task(engine.sample_loop())]
    if shape.step_ms is not None:
        tasks.append(asyncio.create_task(engine.step_loop()))
    print(f"READY {bound}", flush=True)
    await asyncio.Event().wait()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--seats", type=int, required=True)
    parser.add_argument("--service", type=float, default=0.2)
    parser.add_argument("--per-token", action="store_true")
    parser.add_argument("--noise", type=float, default=0.0)
    parser.add_argument("--step-ms", type=float, default=None)
    parser.add_argument("--step-per-seq-ms", type=float, default=0.0)
    parser.add_argument("--cap", type=int, default=None)
    parser.add_argument(
        "--states", choices=["none", "vllm", "sglang", "llamacpp", "tgi"], default="none"
    )
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--no-context", action="store_true", help="no max_model_len in /v1/models")
    a = parser.parse_args(argv)
    shape = Shape(
        seats=a.seats,
        service=a.service,
        per_token=a.per_token,
        noise=a.noise,
        step_ms=a.step_ms,
        step_per_seq_ms=a.step_per_seq_ms,
        cap=a.cap,
        states=a.states,
        seed=a.seed,
        context=not a.no_context,
    )
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_main(shape, a.port))


@dataclass
class Leg:
    """What one leg measured (:func:`run_leg`)."""

    makespan: float
    steady: float  # calls a second over the second half of the batch
    steady_stats: dict[str, object]  # the server's counts over the second half
    steady_urgent: list[float]  # the urgent calls sent in the second half
    urgent: list[float]
    stats: dict[str, object]
    reason: str
    errors: int


async def run_leg(
    server: SeatServer, n: int, *, urgent_every: float | None, **options: object
) -> Leg:
    """``n`` calls of 4 tokens at once through a fresh ``dsclient.AsyncClient(server.url,
    **options)``, and one call of the highest urgency every ``urgent_every`` seconds while they
    run; the server's own counts are reset after a first call, and read at the end."""
    import dsclient

    async with dsclient.AsyncClient(server.url, **options) as client:  # type: ignore[arg-type]
        await client.generate("warm", max_tokens=4)
        server.reset()
        done_at: list[float] = []
        urgent: list[float] = []
        urgent_at: list[float] = []
        finished = asyncio.Event()
        errors = 0

        async def one(i: int) -> None:
            nonlocal errors
            try:
                await client.generate(f"prompt {i}", max_tokens=4)
            except dsclient.DSClientError:
                errors += 1
            done_at.append(time.monotonic())

        async def urgent_calls() -> None:
            assert urgent_every is not None
            while not finished.is_set():
                await asyncio.sleep(urgent_every)
                if finished.is_set():
                    return
                t = time.monotonic()
                await client.generate("urgent", max_tokens=4, urgency=10)
                urgent.append(time.monotonic() - t)
                urgent_at.append(t)

        t0 = time.monotonic()
        side = asyncio.create_task(urgent_calls()) if urgent_every else None
        await asyncio.gather(*(one(i) for i in range(n)))
        makespan = time.monotonic() - t0
        finished.set()
        if side is not None:
            await side
        half = t0 + makespan / 2
        steady = sum(1 for t in done_at if t >= half) / (makespan / 2)
        return Leg(
            makespan,
            steady,
            server.stats(after=makespan / 2),
            [u for u, t in zip(urgent, urgent_at) if t >= half],
            urgent,
            server.stats(),
            client.stats().control.reason,
            errors,
        )


class SeatServer:
    """A seat server in a child process, for ``with``: ``url``, ``stats()``, ``reset()``.

        with SeatServer(Shape(seats=8, service=0.1, states="vllm")) as server:
            server.url     # "http://127.0.0.1:PORT"

    ``cpus``: the cores the server process may run on (``None``: any), so that a benchmark can
    keep the client off them.
    """

    def __init__(self, shape: Shape, *, cpus: set[int] | None = None) -> None:
        self.shape = shape
        self.cpus = cpus
        self.url = ""
        self._proc: subprocess.Popen[str] | None = None

    def __enter__(self) -> SeatServer:
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
        cpus = self.cpus

        def pin() -> None:
            if cpus:
                os.sched_setaffinity(0, cpus)

        self._proc = subprocess.Popen(
            [sys.executable, "-m", "tests.seat_server", *self.shape.args()],
            stdout=subprocess.PIPE,
            text=True,
            env=env,
            cwd=root,
            preexec_fn=pin if cpus else None,
            # Placed on CPUs of its own, it is a process group of its own too: the benchmarks'
            # placement check reads where a server's group runs, and the caller's group holds
            # the client.
            start_new_session=bool(cpus),
        )
        assert self._proc.stdout is not None
        line = self._proc.stdout.readline()
        if not line.startswith("READY "):
            self._proc.kill()
            raise RuntimeError(f"seat server did not start: {line!r}")
        self.url = f"http://127.0.0.1:{int(line.split()[1])}"
        return self

    def __exit__(self, *exc: object) -> None:
        proc = self._proc
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()

    def _call(self, method: str, path: str) -> dict[str, Any]:
        import urllib.request

        request = urllib.request.Request(
            self.url + path, method=method, data=b"" if method == "POST" else None
        )
        with urllib.request.urlopen(request, timeout=10) as answer:
            out: dict[str, Any] = json.loads(answer.read())
            return out

    def stats(self, after: float = 0.0) -> dict[str, Any]:
        """The server's own counts since the last reset (see the module docstring); the
        queue's quantiles over what came ``after`` seconds past the reset."""
        return self._call("GET", f"/sim/stats?after={after}")

    def reset(self) -> None:
        """Clear the counts (a new leg on the same server)."""
        self._call("POST", "/sim/reset")


if __name__ == "__main__":
    main()
