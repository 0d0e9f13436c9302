"""The soak benchmark's verdict (pure): what counts as flat."""

from __future__ import annotations

from benchmarks.bench_soak import Tally, Window, judge, open_sockets, rss_mib


def window(t: float, rss: float = 100.0, sockets: int = 10, tasks: int = 12, **kw) -> Window:
    values = dict(in_flight=5, waiting=0, limit=8, calls_open=6)
    values.update(kw)
    return Window(t_s=t, rss_mib=rss, sockets=sockets, tasks=tasks, **values)


def drained(t: float) -> Window:
    return window(t, in_flight=0, calls_open=0, tasks=2, sockets=5)


def test_flat_soak_passes():
    steady = [window(60), window(70, rss=103), window(80, rss=104), drained(81)]
    verdict = judge(steady, steady[-1], 8.0, Tally())
    assert verdict["ok"] and verdict["rss_growth_mib"] == 4.0


def test_rss_creep_fails():
    steady = [window(60), window(70, rss=110), window(80, rss=120), drained(81)]
    assert not judge(steady, steady[-1], 8.0, Tally())["ok"]


def test_sockets_are_judged_by_their_peaks_and_tasks_net_of_the_calls():
    # Idle pool connections come and go (a real soak: 13 sockets with 8 in flight at the start,
    # 10 with 1 at the end): only a higher peak in the last third means a leak.
    idle_pool = [
        window(60, sockets=13, in_flight=8),
        window(70),
        window(80, sockets=10, in_flight=1),
    ]
    assert judge([*idle_pool, drained(81)], drained(81), 8.0, Tally())["ok"]
    leaked = [window(60), window(70), window(80, sockets=20), drained(81)]
    verdict = judge(leaked, leaked[-1], 8.0, Tally())
    assert not verdict["ok"] and verdict["sockets_peak_first_last_third"] == (10, 20)
    # More calls open explain more tasks; leaked tasks do not.
    busier = [window(60), window(70), window(80, tasks=20, calls_open=14)]
    assert judge([*busier, drained(81)], drained(81), 8.0, Tally())["ok"]
    tasks = [window(60), window(70), window(80, tasks=30), drained(81)]
    assert not judge(tasks, tasks[-1], 8.0, Tally())["ok"]


def test_a_failed_call_or_an_undrained_client_fails():
    steady = [window(60), window(70), window(80), drained(81)]
    assert not judge(steady, steady[-1], 8.0, Tally(failed_total=1))["ok"]
    stuck = window(81, in_flight=1, calls_open=0)
    assert not judge([*steady[:-1], stuck], stuck, 8.0, Tally())["ok"]


def test_too_short_a_soak_has_no_verdict():
    verdict = judge([window(60), drained(61)], drained(61), 8.0, Tally())
    assert not verdict["ok"] and "too few" in verdict["why"]


def test_the_process_probes_read_this_process():
    assert rss_mib() > 1
    assert open_sockets() >= 0
