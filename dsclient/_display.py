"""HTML for notebooks: results and statistics as small tables, not walls of reprs."""

from __future__ import annotations

import html
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

__all__ = ["batch_html", "control_html", "result_html", "stats_html", "table_html"]


def table_html(header: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """A plain HTML table; every cell is escaped."""
    head = "".join(f"<th>{html.escape(str(h))}</th>" for h in header)
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(_fmt(c))}</td>" for c in row) + "</tr>" for row in rows
    )
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3f}"
    return str(value)


def result_html(result: Any) -> str:
    text = result.text if len(result.text) <= 200 else result.text[:200] + "…"
    return table_html(
        ["text", "finish", "prompt tok", "completion tok", "latency s", "attempts", "lane"],
        [
            [
                text,
                result.finish_reason,
                result.usage.prompt_tokens,
                result.usage.completion_tokens,
                result.latency_s,
                result.attempts,
                result.lane,
            ]
        ],
    )


def batch_html(summary: Mapping[str, Any], failures: Sequence[Any], *, show: int = 10) -> str:
    """A batch's summary (``BatchResults.summary()``) and its first ``show`` failures."""
    rate = summary.get("items_per_s")
    html_out = table_html(
        [
            "items",
            "ok",
            "failed",
            "resumed",
            "elapsed s",
            "items/s",
            "p50 latency s",
            "p99 latency s",
        ],
        [
            [
                summary.get("count"),
                summary.get("ok"),
                summary.get("failed"),
                summary.get("resumed"),
                summary.get("elapsed_s"),
                None if rate is None else f"{rate:.1f}",
                summary.get("p50_latency_s"),
                summary.get("p99_latency_s"),
            ]
        ],
    )
    if failures:
        shown = failures[:show]
        html_out += table_html(
            ["index", "id", "error", "message", "attempts"],
            [
                [f.index, f.id, type(f.error).__name__, _clip(str(f.error)), f.attempts]
                for f in shown
            ],
        )
        if len(failures) > show:
            html_out += f"<p>… and {len(failures) - show} more failures (see .failures)</p>"
    return html_out


def stats_html(stats: Any) -> str:
    """A ``GovernorStats`` snapshot: the limit control, the totals, then one row per lane."""
    lanes = getattr(stats, "lanes", {}) or {}
    control = getattr(stats, "control", None)
    head = control_html(control) if control is not None else ""
    return head + table_html(
        ["lane", "limit", "in flight", "waiting", "done", "failed", "p50 s", "p95 s", "p99 s"],
        [["all", stats.limit, stats.in_flight, stats.waiting, None, None, None, None, None]]
        + [
            [
                name,
                lane.limit,
                lane.in_flight,
                lane.waiting,
                lane.done,
                lane.failed,
                lane.p50,
                lane.p95,
                lane.p99,
            ]
            for name, lane in lanes.items()
        ],
    )


def control_html(control: Any) -> str:
    """The limit control (``ControlStats``): mode, limit and bounds, why it last moved, the
    server's queue as last seen and the learned capacity."""
    return table_html(
        [
            "mode",
            "limit",
            "bounds",
            "last change",
            "changes",
            "server running",
            "server waiting",
            "target waiting",
            "learned max_num_seqs",
        ],
        [
            [
                control.mode,
                control.limit,
                f"{control.floor}..{control.ceiling}",
                control.reason,
                control.changes,
                control.server_running,
                control.server_waiting,
                control.target_waiting,
                control.learned_max_num_seqs,
            ]
        ],
    )


def _clip(text: str, keep: int = 200) -> str:
    return text if len(text) <= keep else text[:keep] + "…"
