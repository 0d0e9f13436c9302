"""Servers that queue: the governor against seats and a first-come queue, judged by the
server's own queue (issue 41).

Each server is a process of its own (``tests/seat_server.py``): at most ``seats`` requests run at
once, each for a fixed service time, and the rest wait first come, first served, as vLLM, SGLang,
TGI, llama.cpp and transformers' server do once their batch is full. It counts its own queue
(time-sampled every 10 ms). Per server, three legs, one after another, on the same batch with
one call of the highest urgency every 0.5 s beside it:

* ``fixed = seats``: ``AsyncClient(url, limit=seats)``, the best fixed limit on such a server;
* ``dsclient``: defaults; the server states its batch (``vllm``: dev-mode ``/server_info``)
  or nothing (``none``: a black box);
* ``unbounded``: ``AsyncClient(url, limit=min(n, 1024))``, everything in flight at once up to
  1024 sockets (what a plain ``asyncio.gather`` does to the server's queue).

Rows: makespan, throughput over the second half of the batch (``steady_rps``: after the limit
found the server), the server's queue p90 and peak, the urgent calls' p99. Goals (issue 41): the
queue p90 at most ``max(2, seats // 2)`` and its peak at most two batches; steady throughput at
least 0.9x the fixed leg's; the urgent p99 within two service times (+0.15 s of transit).

    python -m benchmarks seats                       # 1, 8, 64, 256 seats, both states, 2 runs
    python -m benchmarks seats --sizes 8,64 --runs 3

The server runs on the CPUs after the first, the client on the first (``_common.Placement``).
"""

from __future__ import annotations

import argparse
import asyncio
import math
from collections.abc import Sequence
from typing import Any

from benchmarks import _report as report_
from benchmarks._common import (
    Placement,
    default_placement,
    pin_process,
    placement_facts,
    say,
    server_group,
)
from benchmarks._results import Run
from tests.seat_server import SeatServer, Shape, run_leg

#: seats -> (service seconds, calls): about 25-40 batches, 10-20 s a leg.
SIZES: dict[int, tuple[float, int]] = {
    1: (0.05, 200),
    8: (0.1, 800),
    64: (0.2, 5120),
    256: (0.5, 10240),
}
URGENT_EVERY_S = 0.5
#: The "unbounded" leg's limit: past about a thousand sockets the machine's file limit binds.
UNBOUNDED = 1024
SLACK_S = 0.15
TABLE = (
    report_.Column("makespan s", "makespan_s", 2),
    report_.Column("steady calls/s", "steady_rps", 0),
    report_.Column("server queue p90", "queue_p90", 0),
    report_.Column("p90, 2nd half", "queue_p90_steady", 0),
    report_.Column("server queue peak", "queue_peak", 0),
    report_.Column("urgent p99 s", "urgent_p99_s", 2),
    report_.Column("p99, 2nd half", "urgent_p99_steady_s", 2),
)
ABOUT = {
    "fixed = seats": "AsyncClient(url, limit=seats): the best fixed limit",
    "dsclient": "AsyncClient(url), defaults",
    "unbounded": "AsyncClient(url, limit=min(n, 1024)): everything in flight at once",
}


def _p99(values: Sequence[float]) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(0.99 * len(ordered)) - 1)]


async def _server(run: Run, seats: int, states: str, runs: int, placement: Placement) -> None:
    service, n = SIZES[seats]
    shape = Shape(seats=seats, service=service, states=states)
    with SeatServer(shape, cpus=set(placement.server)) as server:
        # Where the client and this server's process were found to run (the first server's
        # finding stands for the rest: each is started the same way).
        run.facts.setdefault("placement", placement_facts(placement, [server_group(server.url)]))
        for r in range(1, runs + 1):
            for leg, options in (
                ("fixed = seats", {"limit": seats}),
                ("dsclient", {}),
                ("unbounded", {"limit": min(n, UNBOUNDED)}),
            ):
                got = await run_leg(server, n, urgent_every=URGENT_EVERY_S, **options)
                stats = got.stats
                row = run.add(
                    leg=leg,
                    run=r,
                    seats=seats,
                    states=states,
                    service_s=service,
                    calls=n,
                    makespan_s=round(got.makespan, 3),
                    steady_rps=round(got.steady, 1),
                    queue_p90=int(stats["queue_p90"]),  # type: ignore[call-overload]
                    queue_p90_steady=int(got.steady_stats["queue_p90"]),  # type: ignore[call-overload]
                    queue_peak=int(stats["queue_peak"]),  # type: ignore[call-overload]
                    urgent_p99_s=_p99(got.urgent),
                    urgent_p99_steady_s=_p99(got.steady_urgent),
                    errors=got.errors,
                    reason=got.reason if leg == "dsclient" else None,
                )
                say(f"{seats} seats, states {states}, run {r}, {leg}: {row}")


def goals(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per server and run, whether dsclient met issue 41's goals against the fixed leg."""
    out = []
    for mine in (r for r in rows if r["leg"] == "dsclient"):
        fixed = [
            r for r in rows
            if r["leg"] == "fixed = seats" and r["run"] == mine["run"]
            and r["seats"] == mine["seats"] and r["states"] == mine["states"]
        ]  # fmt: skip
        seats, service = int(mine["seats"]), float(mine["service_s"])
        steady_urgent = mine.get("urgent_p99_steady_s", mine["urgent_p99_s"])
        checks = {
            "queue p90 (steady)": mine.get("queue_p90_steady", mine["queue_p90"])
            <= max(2, seats // 2),
            "queue peak": mine["queue_peak"] <= 2 * seats,
            "urgent p99 (steady)": steady_urgent is not None
            and steady_urgent <= 2 * service + SLACK_S,
        }
        if fixed:
            checks["steady >= 0.9x fixed"] = mine["steady_rps"] >= 0.9 * fixed[0]["steady_rps"]
        out.append({"seats": seats, "states": mine["states"], "run": mine["run"], **checks})
    return out


def newest_per_server(
    records: Sequence[dict[str, Any]],
) -> list[tuple[int, str, list[dict[str, Any]], dict[str, Any]]]:
    """Per server (seats, states): the rows of the newest invocation that ran it, and that
    invocation. An invocation of some sizes (``--sizes 64,256``) replaces those servers only."""
    found: dict[tuple[int, str], tuple[list[dict[str, Any]], dict[str, Any]]] = {}
    for record in records:  # oldest first: the newest wins
        for key in {(int(r["seats"]), str(r["states"])) for r in record["rows"]}:
            rows = report_.select(record["rows"], seats=key[0], states=key[1])
            found[key] = ([dict(r) for r in rows], record)
    order = {"none": 0, "vllm": 1}
    return [
        (seats, states, rows, record)
        for (seats, states), (rows, record) in sorted(
            found.items(), key=lambda item: (item[0][0], order.get(item[0][1], 2))
        )
    ]


def render(records: Sequence[dict[str, Any]]) -> str:
    """Per server, the newest invocation that ran it: one table each (median and range over
    runs; the file named where the tables come from several), then the goals, then where the
    figures come from."""
    servers = newest_per_server(records)
    assert servers
    used: list[dict[str, Any]] = []
    for *_, record in servers:
        if not any(record is u for u in used):
            used.append(record)
    parts = []
    rows: list[dict[str, Any]] = []
    for seats, states, mine, record in servers:
        said = "states its batch" if states == "vllm" else "states nothing"
        title = f"**{seats} seats, {mine[0]['service_s']} s a call, {said}**"
        if len(used) > 1:
            title += f" (`{record.get('_file')}`)"
        parts.append(title + "\n\n" + report_.leg_table(mine, TABLE, about=ABOUT))
        rows += mine
    checks = goals(rows)
    if checks:
        names = [k for k in checks[0] if k not in ("seats", "states", "run")]
        lines = [
            "| seats | states | run | " + " | ".join(names) + " |",
            "|---|---|---|" + "---|" * len(names),
        ]
        for c in checks:
            cells = " | ".join("yes" if c.get(k) else "**no**" for k in names)
            lines.append(f"| {c['seats']} | {c['states']} | {c['run']} | {cells} |")
        parts.append("Goals of issue 41, per run:\n\n" + "\n".join(lines))
    used.sort(key=lambda r: str(r.get("_file")))
    for record in used[:-1]:
        parts.append(report_.conditions(record))
    # The newest lists the invocations kept but shown nowhere.
    parts.append(report_.conditions(used[-1], [r for r in records if r not in used[:-1]]))
    return "\n\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks seats", description=__doc__)
    parser.add_argument("--sizes", default="1,8,64,256", help="seats, comma-separated")
    parser.add_argument("--states", default="none,vllm", help="none (black box), vllm")
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--no-save", action="store_true", help="print only")
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    unknown = [s for s in sizes if s not in SIZES]
    if unknown:
        parser.error(f"--sizes takes {sorted(SIZES)}, got {unknown}")
    placement = default_placement()
    pin_process(placement.client)
    run = Run.begin("seats", params={"sizes": sizes, "states": args.states, "runs": args.runs})
    for seats in sizes:
        for states in args.states.split(","):
            asyncio.run(_server(run, seats, states, args.runs, placement))
    if not args.no_save:
        say(f"results: {run.save()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
