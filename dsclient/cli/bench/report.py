"""The report of a ``dsclient bench`` run: the table, the summary and the output files."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from .policy import Mode, StepResult


def _table(steps: Sequence[StepResult], mode: Mode) -> str:
    head = "rate" if mode == "open" else "conc"
    columns = (
        f"{head:>6} {'req/s':>7} {'tok/s':>7} {'ttft50':>7} {'ttft99':>7} {'tpot50':>7}"
        f" {'itl50':>7} {'p50':>7} {'p95':>7} {'p99':>7} {'err':>5} {'run':>5} {'wait':>5}"
        f" {'kv':>5}"
    )

    def f(value: float | None, width: int = 7) -> str:
        return f"{'-':>{width}}" if value is None else f"{value:>{width}.3g}"

    good = any(s.goodput_rps is not None for s in steps)
    if good:
        columns += f" {'good/s':>7}"
    lines = [columns]
    for s in steps:
        server = s.server or {}
        kv = server.get("kv_usage_mean")
        lines.append(
            f"{f(s.load, 6)} {f(s.throughput_rps)} {s.output_tokens_per_s:>7.0f}"
            f" {f(s.ttft_p50_s)} {f(s.ttft_p99_s)} {f(s.tpot_p50_s)} {f(s.itl_p50_s)}"
            f" {f(s.p50_s)} {f(s.p95_s)} {f(s.p99_s)} {s.errors:>5}"
            f" {f(server.get('running_mean'), 5)} {f(server.get('waiting_mean'), 5)}"
            f" {'-' if kv is None else format(kv, '.0%'):>5}"
            + (f" {f(s.goodput_rps)}" if good else "")
        )
    return "\n".join(lines)


def summary_text(report: Mapping[str, Any]) -> str:
    """What ``dsclient bench`` prints on stdout (without ``--json``)."""
    steps = [StepResult(**s) for s in report["steps"]]
    lines = [_table(steps, report["mode"])]
    stop = report["stop"]
    lines.append(f"stopped: {stop['reason']}: {stop['detail']}")
    knee = report["knee"]
    if knee["step"] is None:
        lines.append(f"knee: none ({knee['detail']})")
    else:
        where = (
            f"{knee['rate_rps']:g} req/s offered (mean in flight {knee['concurrency']:g})"
            if knee["rate_rps"] is not None
            else f"concurrency {knee['concurrency']:g}"
        )
        verdict = "" if knee["found"] else " (not reached; best seen)"
        lines.append(
            f"knee{verdict}: {where}: {knee['throughput_rps']:g} req/s, p99 {knee['p99_s']} s"
            f" -- {knee['detail']}"
        )
    governor = report.get("governor")
    if governor is None:
        pass
    elif "error" in governor:
        lines.append(f"governor: could not run: {governor['error']}")
    else:
        control = governor.get("control") or {}
        lines.append(
            f"dsclient's governor: limit {governor['limit']} after {governor['duration_s']:g} s"
            f" with {governor['workers']} callers (started at {governor['limit_start']}, range"
            f" {governor['limit_min']}-{governor['limit_max']}, mode {control.get('mode')}):"
            f" {governor['throughput_rps']:g} req/s, p99 {governor['p99_s']} s from the call"
            f" (server's share {governor['service_p99_s']} s), {governor['errors']} errors"
        )
    return "\n".join(lines)


def write_outputs(report: dict[str, Any], folder: Path) -> list[str]:
    """Write ``bench.json`` and, when matplotlib is importable, ``bench.png``; returns notes."""
    folder.mkdir(parents=True, exist_ok=True)
    notes: list[str] = []
    try:
        from .plot import plot_bench

        png = plot_bench(report, folder / "bench.png")
        report["plots"] = [png.name]
    except ImportError:
        report["plots"] = []
        notes.append("no plots: matplotlib is not installed (pip install 'dsclient[bench]')")
    path = folder / "bench.json"
    path.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    written = [str(path)] + [str(folder / p) for p in report["plots"]]
    notes.insert(0, "wrote " + ", ".join(written))
    return notes


def _bound_reason(
    mode: Mode, loads: Sequence[float], max_concurrency: int, max_steps: int | None
) -> tuple[str, str]:
    """Which bound ended a run that went through every planned step."""
    if mode == "closed" and loads and loads[-1] >= max_concurrency:
        return "max-concurrency", f"reached --max-concurrency {max_concurrency}"
    if max_steps is not None and len(loads) == max_steps:
        return "max-steps", f"ran --max-steps {max_steps}"
    return "rates", "ran every rate"
