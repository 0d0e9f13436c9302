"""The plot of a ``dsclient bench`` run: throughput and p99 latency against the load, knee marked.

    from dsclient.cli.bench.plot import plot_bench
    plot_bench(json.load(open("bench.json")), Path("bench.png"))

matplotlib is optional (``pip install 'dsclient[bench]'``): it is imported when called, and
:class:`ImportError` says it is missing. The figure is drawn on the Agg canvas directly, without
``pyplot``, so it neither needs a display nor changes the caller's backend.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = ["plot_bench"]


def plot_bench(report: Mapping[str, Any], path: Path) -> Path:
    """Draw ``report`` (``bench.json``'s content) into the PNG ``path``; returns ``path``.

    Left: requests/s; right: p99 latency and p99 TTFT; both against the concurrency (closed
    loop) or the offered rate (open loop). The knee is a red star and a dotted line, the SLO a
    horizontal line, and the governor's final limit a green dashed line (closed loop).
    """
    figure_module: Any = importlib.import_module("matplotlib.figure")
    agg: Any = importlib.import_module("matplotlib.backends.backend_agg")
    steps = list(report["steps"])
    open_loop = report.get("mode") == "open"
    key = "rate_rps" if open_loop else "concurrency"
    x = [s[key] for s in steps]
    figure = figure_module.Figure(figsize=(11, 4.2), layout="constrained")
    agg.FigureCanvasAgg(figure)
    left, right = figure.subplots(1, 2)
    left.plot(x, [s["throughput_rps"] for s in steps], marker="o", label="requests/s")
    right.plot(x, [s["p99_s"] for s in steps], marker="o", label="p99 latency")
    right.plot(x, [s["ttft_p99_s"] for s in steps], marker=".", ls="--", label="p99 TTFT")
    knee = report.get("knee") or {}
    if knee.get("step") is not None:
        kx = knee["rate_rps"] if open_loop else knee["concurrency"]
        label = "knee" if knee.get("found") else "best seen (knee beyond)"
        for axis, value in ((left, knee["throughput_rps"]), (right, knee["p99_s"])):
            axis.axvline(kx, color="tab:red", ls=":", lw=1)
            if value is not None:
                axis.plot([kx], [value], marker="*", ms=15, color="tab:red", ls="", label=label)
    slo = (report.get("settings") or {}).get("slo_p99")
    if slo is not None:
        right.axhline(slo, color="tab:orange", lw=1, label=f"SLO p99 {slo:g} s")
    governor = report.get("governor") or {}
    if not open_loop and governor.get("limit") is not None:
        left.axvline(
            governor["limit"], color="tab:green", ls="--", lw=1,
            label=f"dsclient limit ({governor['limit']})",
        )  # fmt: skip
    xlabel = "offered rate (requests/s)" if open_loop else "concurrency (requests in flight)"
    left.set(xlabel=xlabel, ylabel="requests/s", title="throughput")
    right.set(xlabel=xlabel, ylabel="seconds", title="latency")
    positive = [v for v in x if v]
    if positive and max(positive) / min(positive) >= 16:
        for axis in (left, right):
            axis.set_xscale("log", base=2)
    for axis in (left, right):
        axis.grid(True, alpha=0.3)
        axis.set_ylim(bottom=0)
        axis.legend(loc="best", fontsize="small")
    figure.suptitle(f"dsclient bench: {report.get('model')} at {report.get('url')}")
    figure.savefig(path, dpi=100)
    return path
