"""Helpers shared by the benchmarks: canned vLLM answers, percentiles, the results folder."""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS_DIR = ROOT / "benchmarks" / "results"

#: What a vLLM completions call answers, trimmed to the fields clients read.
CANNED_COMPLETION = json.dumps(
    {
        "id": "cmpl-bench",
        "object": "text_completion",
        "created": 1,
        "model": "tiny",
        "choices": [
            {
                "index": 0,
                "text": " and the rest of the story",
                "finish_reason": "length",
                "logprobs": None,
                "stop_reason": None,
                "prompt_logprobs": None,
            }
        ],
        "usage": {"prompt_tokens": 6, "completion_tokens": 8, "total_tokens": 14},
    }
).encode()

#: vLLM's ``GET /v1/models`` for a 2048-token model served as "tiny".
CANNED_MODELS = json.dumps(
    {
        "object": "list",
        "data": [
            {
                "id": "tiny",
                "object": "model",
                "created": 1,
                "owned_by": "vllm",
                "root": "tiny",
                "max_model_len": 2048,
            }
        ],
    }
).encode()


def percentile(values: list[float], percent: float) -> float | None:
    """Nearest-rank percentile (the smallest value with ``percent`` % of values at or below it)."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, -(-len(ordered) * percent // 100))
    return ordered[int(rank) - 1]


def median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def machine() -> dict[str, Any]:
    return {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "when": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def write_results(name: str, payload: dict[str, Any]) -> Path:
    """Write ``benchmarks/results/<name>.json`` (the folder is gitignored) and return its path."""
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"{name}.json"
    path.write_text(json.dumps(payload, indent=2) + "\n")
    return path
