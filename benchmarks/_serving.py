"""Serving metrics for the benchmarks: a seeded lognormal spread of lengths, TTFT and TPOT per
lane, goodput at a stated objective.

    lengths = lognormal_lengths(7, 80)            # [(prompt tokens, output tokens), ...]
    distribution(lengths)                         # percentiles, for the results file and the page
    serving_figures(outcomes, Slo(ttft_ms=1000, tpot_ms=50), duration_s=24.0)

Public chat traces (ShareGPT, LMSYS-Chat, Azure's LLM inference traces) have prompt and output
lengths close to lognormal: most requests short, a long tail of long ones. :data:`SPREAD` keeps
that shape scaled to the tiny model's 2048-token context (a prompt's median 128 tokens with
sigma 1.0, an output's 48 with sigma 0.8, both clipped), so every drawn request fits. TTFT and
TPOT are ``vllm bench serve``'s (TPOT ``(latency - TTFT) / (output tokens - 1)``, from
submission; percentiles interpolated between ranks as numpy's, which it uses), and goodput is
its ``--goodput`` (:mod:`dsclient.cli.bench.goodput`).
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from benchmarks._common import percentile
from dsclient.cli.bench.goodput import Slo, goodput_rps, vllm_tpot_s
from dsclient.cli.bench.policy import percentile as interpolated


@dataclass(frozen=True, kw_only=True)
class Spread:
    """Lognormal prompt and output lengths in tokens: median, sigma (of the log), clipped."""

    prompt_median: float = 128
    prompt_sigma: float = 1.0
    prompt_min: int = 8
    prompt_max: int = 1024
    output_median: float = 48
    output_sigma: float = 0.8
    output_min: int = 4
    output_max: int = 400

    def __post_init__(self) -> None:
        for kind in ("prompt", "output"):
            low, high = getattr(self, f"{kind}_min"), getattr(self, f"{kind}_max")
            median = getattr(self, f"{kind}_median")
            if not 1 <= low <= median <= high:
                raise ValueError(f"{kind}: need 1 <= min <= median <= max, got {low}, "
                                 f"{median}, {high}")  # fmt: skip
            if getattr(self, f"{kind}_sigma") < 0:
                raise ValueError(f"{kind}_sigma must be >= 0")


SPREAD = Spread()
#: A request with at least this many output tokens, or a prompt of at least LONG_PROMPT, is a
#: long one (its own lane in the tables; ``priority`` 1 for a client that sends it).
LONG_OUTPUT = 128
LONG_PROMPT = 512


def lognormal_lengths(seed: int, n: int, spread: Spread = SPREAD) -> list[tuple[int, int]]:
    """``n`` ``(prompt tokens, output tokens)`` pairs, the same for the same seed."""
    rng = random.Random(seed)

    def draw(median: float, sigma: float, low: int, high: int) -> int:
        return min(high, max(low, round(rng.lognormvariate(math.log(median), sigma))))

    return [
        (
            draw(spread.prompt_median, spread.prompt_sigma, spread.prompt_min, spread.prompt_max),
            draw(spread.output_median, spread.output_sigma, spread.output_min, spread.output_max),
        )
        for _ in range(n)
    ]


def lane_of(prompt_tokens: int, output_tokens: int) -> str:
    """``"long"`` for a long output or prompt, else ``"short"``."""
    return "long" if output_tokens >= LONG_OUTPUT or prompt_tokens >= LONG_PROMPT else "short"


def distribution(lengths: Sequence[tuple[int, int]], spread: Spread = SPREAD) -> dict[str, Any]:
    """What was drawn: the spread's parameters, and min / p10 / p50 / p90 / p99 / max / mean
    of prompts and outputs, and how many are long."""
    found: dict[str, Any] = {"spread": asdict(spread), "n": len(lengths)}
    for index, kind in enumerate(("prompt", "output")):
        values = [float(pair[index]) for pair in lengths]
        found[kind] = {
            "min": min(values, default=None),
            **{f"p{p}": percentile(values, p) for p in (10, 50, 90, 99)},
            "max": max(values, default=None),
            "mean": round(sum(values) / len(values), 1) if values else None,
        }
    found["long"] = sum(lane_of(p, o) == "long" for p, o in lengths)
    return found


def distribution_text(found: dict[str, Any]) -> str:
    """:func:`distribution` as a markdown table."""
    head = "| tokens | min | p10 | p50 | p90 | p99 | max | mean |"
    lines = [head, "|---|---|---|---|---|---|---|---|"]
    for kind in ("prompt", "output"):
        row = found[kind]
        cells = [row[k] for k in ("min", "p10", "p50", "p90", "p99", "max", "mean")]
        lines.append(f"| {kind} | " + " | ".join(f"{c:g}" for c in cells) + " |")
    spread = found["spread"]
    return (
        "\n".join(lines)
        + f"\n\n{found['n']} requests, {found['long']} of them long (output >= {LONG_OUTPUT} or "
        f"prompt >= {LONG_PROMPT} tokens); lognormal, median {spread['prompt_median']:g} / "
        f"{spread['output_median']:g} tokens, sigma {spread['prompt_sigma']:g} / "
        f"{spread['output_sigma']:g}, clipped to {spread['prompt_min']}-{spread['prompt_max']} / "
        f"{spread['output_min']}-{spread['output_max']}."
    )


@dataclass(frozen=True)
class Timed:
    """One streamed request: its lane, whether it succeeded, TTFT and latency from submission,
    and its output tokens (``ignore_eos``: what was asked)."""

    lane: str
    ok: bool
    ttft_s: float | None
    latency_s: float
    output_tokens: int


def _tails(values: list[float], prefix: str) -> dict[str, float | None]:
    """p50 / p95 / p99 interpolated between ranks, as ``vllm bench serve`` (numpy) takes them."""
    return {
        f"{prefix}_{name}_s": None if (v := interpolated(values, p)) is None else round(v, 4)
        for name, p in (("p50", 50), ("p95", 95), ("p99", 99))
    }


def serving_figures(timed: Iterable[Timed], slo: Slo, duration_s: float) -> dict[str, Any]:
    """Per lane TTFT and TPOT p50 / p95 / p99 and the answered count, and goodput (overall and
    per lane) at ``slo`` over ``duration_s``: the row's serving figures."""
    timed = list(timed)
    row: dict[str, Any] = {}
    for lane in ("short", "long"):
        mine = [t for t in timed if t.lane == lane]
        ok = [t for t in mine if t.ok and t.ttft_s is not None]
        row[f"{lane}_n"] = len(ok)
        row.update(_tails([t.ttft_s for t in ok if t.ttft_s is not None], f"{lane}_ttft"))
        tpots = [
            vllm_tpot_s(t.latency_s, t.ttft_s, t.output_tokens)
            for t in ok
            if t.ttft_s is not None and t.output_tokens >= 2
        ]
        row.update(_tails(tpots, f"{lane}_tpot"))
        good, _ = goodput_rps(
            ((t.ok, t.ttft_s, t.latency_s, t.output_tokens) for t in mine), slo, duration_s
        )
        row[f"{lane}_good"] = good
    good, rate = goodput_rps(
        ((t.ok, t.ttft_s, t.latency_s, t.output_tokens) for t in timed), slo, duration_s
    )
    row.update(good=good, goodput_rps=rate, slo=slo.text())
    return row
