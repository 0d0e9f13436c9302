"""benchmarks/bench_client_scale.py: paired legs, the ratios taken round by round, the goals."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from benchmarks import bench_client_scale as bench


def _got(*samples: tuple[float, float]) -> dict[str, object]:
    return {"samples": list(samples)}


def test_ratios_are_of_the_totals_over_the_same_rounds_against_the_fastest_plain_leg() -> None:
    """Round 2 ran everything twice as slow (a neighbour's burst), and dsclient's round 3 had a
    full collection: the totals over the same rounds count both as they came."""
    rows = [
        {"leg": "aiohttp", "rps": 1000.0},
        {"leg": "httpx2", "rps": 200.0},
        {"leg": "dsclient", "rps": 900.0},
        {"leg": "dsclient-map", "error": "boom"},
    ]
    got = {
        "aiohttp": _got((1.0, 1.0), (2.0, 2.0), (1.0, 1.0)),
        "httpx2": _got((5.0, 5.0), (9.0, 9.0), (5.0, 5.0)),
        "dsclient": _got((1.1, 1.1), (2.4, 2.4), (1.5, 1.5)),
    }
    bench._pair(rows, got)  # type: ignore[arg-type]
    ours = rows[2]
    assert ours["paired_with"] == "aiohttp" and ours["rounds"] == 3
    assert ours["cpu_ratio"] == pytest.approx(5.0 / 4.0)
    assert ours["rate_ratio"] == pytest.approx(4.0 / 5.0)
    assert (ours["cpu_ratio_low"], ours["cpu_ratio_high"]) == pytest.approx((1.1, 1.5))
    assert "cpu_ratio" not in rows[3] and "cpu_ratio" not in rows[0]
    assert bench._ratios(ours, rows[0]) == (ours["rate_ratio"], ours["cpu_ratio"])
    before = {"leg": "dsclient", "rps": 500.0, "cpu_per_req": 3.0}  # a sequential run's row
    assert bench._ratios(before, {"rps": 1000.0, "cpu_per_req": 2.0}) == (0.5, 1.5)


def test_the_fast_legs_take_their_turns_next_to_each_other_and_every_group_turns() -> None:
    legs = ["aiohttp", "httpx2", "openai", "dsclient", "dsclient-map"]
    assert bench.round_order(legs, 0) == ["aiohttp", "dsclient", "dsclient-map", "httpx2", "openai"]
    assert bench.round_order(legs, 1) == ["dsclient", "dsclient-map", "aiohttp", "openai", "httpx2"]
    assert bench.round_order(["httpx2"], 3) == ["httpx2"]


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    with bench.served() as url:
        yield url


def test_paired_legs_take_turns_and_each_gives_a_repetition_a_round(server: str) -> None:
    got = bench._paired(["aiohttp", "dsclient"], server, 40, 4, timeout=120, repeat=3)
    for leg in ("aiohttp", "dsclient"):
        assert "error" not in got[leg], got[leg]
        assert len(got[leg]["samples"]) == 3
        assert got[leg]["fds_left"] == 0 and got[leg]["resource_warnings"] == []
    rows = [bench._row(leg, 1, 40, 4, got[leg], 3) for leg in ("aiohttp", "dsclient")]
    bench._pair(rows, got)
    assert rows[1]["paired_with"] == "aiohttp" and rows[1]["cpu_ratio"] > 0


def test_a_leg_that_fails_gives_its_own_error() -> None:
    """A leg whose process dies (here: no server where it sends) gives its exception's line,
    and the run goes on."""
    got = bench._paired(["aiohttp"], "http://127.0.0.1:9", 10, 2, timeout=60, repeat=2)
    assert "Connect" in " ".join(got["aiohttp"]["error"])


def test_dsclient_is_paired_with_the_baseline_commits_dsclient_and_judged_on_its_bounds() -> None:
    rows = [
        {"leg": "aiohttp", "rps": 1000.0, "run": 1, "n": 40, "concurrency": 4},
        {"leg": "dsclient", "rps": 900.0, "run": 1, "n": 40, "concurrency": 4},
        {"leg": bench.BASE, "rps": 950.0, "run": 1, "n": 40, "concurrency": 4},
    ]
    got = {
        "aiohttp": _got((1.0, 1.0), (1.0, 1.0)),
        "dsclient": _got((1.0, 0.6), (1.2, 0.8)),
        bench.BASE: _got((1.0, 0.5), (1.0, 0.7)),
    }
    bench._pair(rows, got)  # type: ignore[arg-type]
    ours = rows[1]
    assert ours["base_cpu_ratio"] == pytest.approx(1.4 / 1.2)
    assert ours["base_rate_ratio"] == pytest.approx(2.0 / 2.2)
    assert "base_cpu_ratio" not in rows[2]  # the baseline is not paired with itself
    assert any(f"of {bench.BASE} -> MISSED" in line for line in bench.goals(rows))


def test_the_baseline_leg_imports_the_baseline_commits_dsclient(server: str) -> None:
    with bench._checked_out("HEAD") as (tree, commit):
        assert len(commit) == 40
        bench.BASELINE_TREE = tree
        try:
            got = bench._paired([bench.BASE], server, 20, 2, timeout=120, repeat=1)
        finally:
            bench.BASELINE_TREE = ""
    assert "error" not in got[bench.BASE], got[bench.BASE]
    assert len(got[bench.BASE]["samples"]) == 1
