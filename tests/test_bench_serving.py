"""Serving metrics for the benchmarks: the lognormal spread, TTFT / TPOT per lane, goodput, and
the headline's serving workload rows, table and opening-table lines."""

from __future__ import annotations

import argparse
import math
import statistics

import pytest

from benchmarks._serving import (
    LONG_OUTPUT,
    SPREAD,
    Spread,
    Timed,
    distribution,
    distribution_text,
    lane_of,
    lognormal_lengths,
    serving_figures,
)
from benchmarks.bench_governor import Outcome
from dsclient.cli.bench.goodput import Slo


def test_the_lengths_are_seeded_lognormal_and_clipped() -> None:
    a, b = lognormal_lengths(7, 2000), lognormal_lengths(7, 2000)
    assert a == b and a != lognormal_lengths(8, 2000)
    prompts, outputs = [p for p, _ in a], [o for _, o in a]
    assert min(prompts) >= SPREAD.prompt_min and max(prompts) <= SPREAD.prompt_max
    assert min(outputs) >= SPREAD.output_min and max(outputs) <= SPREAD.output_max
    # The median of a lognormal is exp(mu): the drawn medians land near the stated ones.
    assert statistics.median(prompts) == pytest.approx(SPREAD.prompt_median, rel=0.1)
    assert statistics.median(outputs) == pytest.approx(SPREAD.output_median, rel=0.1)
    # A right tail: the mean is above the median, and the log's spread is near sigma.
    assert statistics.mean(prompts) > statistics.median(prompts)
    inner = [math.log(o) for o in outputs if SPREAD.output_min < o < SPREAD.output_max]
    assert statistics.stdev(inner) == pytest.approx(SPREAD.output_sigma, rel=0.15)
    with pytest.raises(ValueError, match="median"):
        Spread(prompt_min=200, prompt_median=100)


def test_the_distribution_is_summarised_for_the_file_and_the_page() -> None:
    lengths = [(10, 4), (100, 50), (600, 20), (50, 200)]
    found = distribution(lengths)
    assert found["n"] == 4 and found["long"] == 2  # a 600-token prompt, a 200-token output
    assert found["prompt"]["min"] == 10 and found["output"]["max"] == 200
    assert found["prompt"]["p50"] == 50 and found["output"]["mean"] == 68.5
    text = distribution_text(found)
    assert text.startswith("| tokens | min | p10 | p50 |") and "| prompt | 10 |" in text
    assert "4 requests, 2 of them long" in text
    assert lane_of(100, LONG_OUTPUT) == "long" and lane_of(100, LONG_OUTPUT - 1) == "short"


def test_serving_figures_per_lane_and_goodput_as_vllm_counts_it() -> None:
    slo = Slo(ttft_ms=1000, tpot_ms=50)
    timed = [
        Timed("short", True, 0.2, 1.2, 21),  # TPOT 50 ms: good
        Timed("short", True, 1.5, 2.0, 11),  # TTFT missed
        Timed("short", False, None, 0.1, 0),  # failed
        Timed("long", True, 0.5, 10.5, 201),  # TPOT 50 ms: good
        Timed("long", True, 0.5, 20.5, 201),  # TPOT 100 ms
    ]
    row = serving_figures(timed, slo, duration_s=10.0)
    assert row["short_n"] == 2 and row["long_n"] == 2
    assert row["short_ttft_p50_s"] == pytest.approx(0.85)
    assert row["long_tpot_p99_s"] == pytest.approx(0.0995, abs=1e-4)
    assert (row["short_good"], row["long_good"], row["good"]) == (1, 1, 2)
    assert row["goodput_rps"] == 0.2 and row["slo"] == "ttft:1000,tpot:50"


def test_the_headline_serving_row_table_and_lines() -> None:
    from benchmarks import _report as report
    from benchmarks.bench_headline import (
        SERVING_LEGS,
        WORKLOADS,
        headline,
        render,
        serving_requests,
        serving_row,
    )

    assert "serving" in WORKLOADS and {"dsclient", "openai+priority"} <= set(SERVING_LEGS)
    args = argparse.Namespace(seed=5, serving_rate=4.0, serving_seconds=10.0)
    one, lengths = serving_requests(11, args, 1.5)
    two, same = serving_requests(12, args, 1.5)
    assert lengths == same and [r.at for r in one] == [r.at for r in two]  # same arrivals
    assert [r.prompt for r in one] != [r.prompt for r in two]  # fresh words per leg
    assert [r.max_tokens for r in one] == [o for _, o in lengths]
    assert all(r.kind == lane_of(p, o) for r, (p, o) in zip(one, lengths, strict=True))

    def outcome(kind: str, ttft: float, latency: float, tokens: int) -> Outcome:
        o = Outcome(kind, 0.0, 0.0, latency=latency)
        o.ttft, o.tokens = ttft, tokens
        return o

    slo = Slo(ttft_ms=1000, tpot_ms=50)
    ours = serving_row([outcome("short", 0.1, 0.6, 11), outcome("long", 0.3, 5.3, 101)], 6, slo)
    theirs = serving_row([outcome("short", 0.4, 0.9, 11), outcome("long", 0.2, 9.2, 101)], 9, slo)
    assert ours["short_ttft_p95_s"] == 0.1 and ours["good"] == 2 and theirs["good"] == 1
    rows = [
        {"leg": leg, "run": 1, "workload": "serving", **row}
        for leg, row in (("dsclient", ours), ("openai+priority", theirs))
    ]
    record = {
        "rows": rows, "_file": "x.json", "benchmark": "headline", "started_utc": "now",
        "facts": {"serving_lengths": distribution(lengths)},
        "code": {"commit": None}, "host": {}, "versions": {},
    }  # fmt: skip
    text = render([record])
    assert "**serving** (streamed; goodput at `--goodput ttft:1000,tpot:50`)" in text
    assert "short TPOT p50 ms" in text and "| 50.0 |" in text  # 0.05 s shown as 50 ms
    assert "Serving lengths drawn:" in text
    lines = headline([record])
    ttft = [v for v in lines if v.workload == "serving" and v.column == "short-request tail"]
    assert ttft and ttft[0].ratios == (0.25,) and ttft[0].label == "TTFT p95"
    good = [v for v in lines if v.workload == "serving" and v.column == "other"]
    assert good[0].higher_better and good[0].ratios == (round((2 / 6) / (1 / 9), 3),)
    assert "better" in report.verdict(good)


def test_long_arrivals_spread_evenly_over_the_window_or_all_at_once() -> None:
    from benchmarks.bench_governor import burst_times

    spread = argparse.Namespace(burst=4, burst_at=1.0, burst_window=4.0)
    assert burst_times(spread) == [1.0, 2.0, 3.0, 4.0]
    at_once = argparse.Namespace(burst=3, burst_at=1.0)  # the governor benchmark: no window
    assert burst_times(at_once) == [1.0, 1.0, 1.0]
