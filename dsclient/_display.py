"""HTML for notebooks: results and statistics as small tables, not walls of reprs."""

from __future__ import annotations

import html
from collections.abc import Iterable, Sequence
from typing import Any

__all__ = ["result_html", "table_html"]


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
        [[text, result.finish_reason, result.usage.prompt_tokens, result.usage.completion_tokens,
          result.latency_s, result.attempts, result.lane]],
    )
