"""A simulated continuous-batching server that publishes nothing, and a client driving a limit
controller against it on a fake clock (tests of the knee finder; no network, no sleeping).

The server runs up to ``batch`` sequences, one token each per step; a step takes
``step_s(running)`` seconds (times a log-normal noise factor when ``noise`` > 0); the rest waits in
its first-come queue, or is refused with 503 once ``queue_cap`` requests wait. The client has
``n`` requests of ``tokens`` each and keeps at most the controller's limit in flight.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from dsclient.governor._control import LimitController


@dataclass
class Shape:
    batch: int
    step_s: Callable[[int], float]
    queue_cap: int | None = None
    noise: float = 0.0
    #: Seconds each waiting request adds to a step (a scheduler, or a client on the same
    #: cores, that pays for every request it holds): more in flight then costs throughput.
    queue_cost: float = 0.0


#: A GPU-like server: a batch of 256, each step a little slower with more sequences, so that
#: throughput rises almost in proportion up to 256 in flight.
GPU = Shape(batch=256, step_s=lambda b: 0.010 + 0.00002 * b)
#: A CPU-like server: compute-bound past 8 sequences (throughput flat from 8), batch of 64.
CPU = Shape(batch=64, step_s=lambda b: 0.05 * max(1.0, b / 8))
#: Refuses with 503 once 24 requests wait beyond its batch of 16 (vLLM's
#: ``--max-num-queued-reqs``): throughput flat past 16.
REFUSING = Shape(batch=16, step_s=lambda b: 0.02 * max(1.0, b / 16), queue_cap=24)
#: A GPU-like server whose steps vary by a factor of about 1.35 either way.
NOISY = Shape(batch=256, step_s=lambda b: 0.010 + 0.00002 * b, noise=0.3)


@dataclass
class Outcome:
    makespan: float
    done: int
    refused: int
    limits: list[tuple[float, int]] = field(default_factory=list)
    in_flight_mean: float = 0.0


def run(
    control: LimitController,
    shape: Shape,
    *,
    n: int,
    tokens: int | Callable[[random.Random], int] = 64,
    period: float = 0.25,
    seed: int = 1,
    until: float = 3600.0,
) -> Outcome:
    """Push ``n`` requests through ``shape`` under ``control``'s limit; returns when all are done."""
    rng = random.Random(seed)
    now = 0.0
    next_tick = period
    todo = n
    running: list[list[float]] = []  # [tokens left, admitted at, tokens]
    waiting: deque[list[float]] = deque()
    in_flight = 0
    done = refused = 0
    limits = [(0.0, control.limit)]
    area = 0.0

    def size() -> int:
        return tokens if isinstance(tokens, int) else tokens(rng)

    while done < n and now < until:
        # The client sends what its limit allows (instantly: no transit).
        while todo > 0 and in_flight < control.limit:
            if shape.queue_cap is not None and len(waiting) >= shape.queue_cap:
                refused += 1
                if control.on_outcome(now, "overloaded", 0.001):
                    limits.append((now, control.limit))
                break  # retried at the next tick, as a backoff would
            t = size()
            waiting.append([float(t), now, float(t)])
            todo -= 1
            in_flight += 1
        while now >= next_tick:
            # A tick sees what the client has in flight once the answers of the last step have
            # been replaced (as a real client's are, at once), at the time it comes: counted
            # before the sends, a batch of equal calls that finished together read as a limit
            # left half empty, and the queue guard cut under it.
            if control.on_idle_period(now, demand=todo > 0, in_flight=in_flight):
                limits.append((now, control.limit))
            next_tick += period
        while waiting and len(running) < shape.batch:
            running.append(waiting.popleft())
        if running:
            step = shape.step_s(len(running))
            if shape.noise:
                step *= rng.lognormvariate(0.0, shape.noise)
            step += shape.queue_cost * len(waiting)
        else:
            step = next_tick - now
        area += in_flight * step
        now += step
        finished = []
        for seq in running:
            seq[0] -= 1
            if seq[0] <= 0:
                finished.append(seq)
        for seq in finished:
            running.remove(seq)
            in_flight -= 1
            done += 1
            if control.on_outcome(now, "ok", now - seq[1], work=seq[2]):
                limits.append((now, control.limit))
    return Outcome(now, done, refused, limits, area / now if now else 0.0)


def best_fixed(shape: Shape, *, n: int, tokens: int = 64) -> float:
    """The makespan of the unbounded client (everything sent at once) on ``shape``."""
    control = LimitController(start=max(1, n), mode="fixed")
    return run(control, shape, n=n, tokens=tokens).makespan


#: transformers' own server (continuous batching in Python): each sequence adds to the step, so
#: throughput keeps rising with the batch, ever more slowly (elasticity 0.5 at 40, 0.2 at 160).
PYTHONIC = Shape(batch=1024, step_s=lambda b: 0.02 + 0.0005 * b)
