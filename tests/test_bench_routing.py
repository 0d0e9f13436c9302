"""The routing benchmark's pure parts: workload, leg order, stats, /metrics counters, summary."""

from __future__ import annotations

import asyncio

import pytest

from benchmarks.bench_routing import (
    LEGS,
    ROUTER_PACKAGE,
    ROUTER_POLICY,
    ROUTER_VERSION,
    Item,
    Outcome,
    Shape,
    counter_deltas,
    drive,
    goal_met,
    hit_rate,
    last_answers,
    leg_order,
    leg_stats,
    legs_arg,
    make_workload,
    parse_args,
    read_counters,
    report,
    router_argv,
    salt_for,
    summarize,
)

METRICS = """\
# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="tiny"} 9000.0
# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{engine="0",model_name="tiny"} 6144.0
vllm:prefix_cache_hits_created{engine="0",model_name="tiny"} 1.7e+09
vllm:request_success_total{engine="0",finished_reason="length",model_name="tiny"} 40.0
vllm:request_success_total{engine="0",finished_reason="stop",model_name="tiny"} 2.0
vllm:prompt_tokens_total{engine="0",model_name="tiny"} 9100.0
"""


# -- workload -----------------------------------------------------------------------------------
def test_workload_counts_kinds_and_prefixes() -> None:
    shape = Shape(long=30, short=7, prefixes=4, prefix_words=40, short_window_s=5.0)
    items = make_workload(shape, seed=3)
    longs = [it for it in items if it.kind == "long"]
    shorts = [it for it in items if it.kind == "short"]
    assert len(longs) == 30 and len(shorts) == 7
    assert [it.index for it in items] == list(range(37))
    # each prefix used 30 // 4 or one more times, and every long prompt starts with its prefix
    uses = sorted(sum(1 for it in longs if it.prefix == p) for p in range(4))
    assert uses == [7, 7, 8, 8]
    heads = {p: {it.prompt.split("\n\n")[0] for it in longs if it.prefix == p} for p in range(4)}
    assert all(len(h) == 1 for h in heads.values())
    assert len({next(iter(h)) for h in heads.values()}) == 4
    assert all(it.max_tokens == shape.long_tokens and it.at == 0.0 for it in longs)
    assert all(it.prefix is None and it.max_tokens == shape.short_tokens for it in shorts)
    assert all(0.0 <= it.at <= 5.0 for it in shorts)
    assert [it.at for it in items] == sorted(it.at for it in items)


def test_workload_is_deterministic_and_the_salt_leads_every_prompt() -> None:
    shape = Shape(long=6, short=3, prefixes=2, prefix_words=20)
    assert make_workload(shape, seed=1) == make_workload(shape, seed=1)
    assert make_workload(shape, seed=1) != make_workload(shape, seed=2)
    plain = make_workload(shape, seed=1)
    salted = make_workload(shape, seed=1, salt="Salt words here.")
    assert [it.prompt for it in salted] == ["Salt words here. " + it.prompt for it in plain]
    assert [(it.kind, it.at, it.prefix) for it in salted] == [
        (it.kind, it.at, it.prefix) for it in plain
    ]


def test_salts_differ_by_run_and_leg() -> None:
    salts = {salt_for(16, run, leg) for run in (1, 2) for leg in LEGS}
    assert len(salts) == 2 * len(LEGS)
    assert salt_for(16, 1, "dsclient") == salt_for(16, 1, "dsclient")


def test_shape_validation() -> None:
    with pytest.raises(ValueError, match="prefixes"):
        Shape(long=3, prefixes=0)
    with pytest.raises(ValueError, match="short_window_s"):
        Shape(short_window_s=-1.0)
    with pytest.raises(ValueError, match="long_tokens"):
        Shape(long_tokens=0)
    assert make_workload(Shape(long=0, short=2, prefixes=0), seed=1)[0].kind == "short"


def test_each_run_starts_one_leg_later() -> None:
    assert leg_order(LEGS, 1) == list(LEGS)
    assert leg_order(LEGS, 2) == [*LEGS[1:], LEGS[0]]
    assert leg_order(LEGS, len(LEGS) + 1) == list(LEGS)
    assert leg_order([], 2) == []


def test_legs_argument() -> None:
    assert legs_arg("round-robin, router-rr") == ["round-robin", "router-rr"]
    with pytest.raises(Exception, match="legs must be among"):
        legs_arg("dsclient,nginx")
    assert parse_args([]).legs == list(LEGS)
    assert parse_args(["--legs", "dsclient"]).legs == ["dsclient"]


# -- stats --------------------------------------------------------------------------------------
def test_leg_stats() -> None:
    outcomes = [Outcome(i, "short", float(i), float(i) + 0.1 * (i + 1), True) for i in range(10)]
    outcomes += [Outcome(10, "long", 0.0, 30.0, True), Outcome(11, "long", 0.0, 31.5, False, "E")]
    outcomes.append(Outcome(12, "long", 0.0, 2.0, False, "E"))
    found = leg_stats(outcomes)
    assert found["requests"] == 13 and found["ok"] == 11 and found["failed"] == 2
    assert found["makespan_s"] == 31.5  # a failed request still ends the leg when it fails
    assert found["short_p50_s"] == 0.5 and found["short_p99_s"] == 1.0
    assert found["long_p50_s"] == 30.0 and found["long_p99_s"] == 30.0
    assert found["errors"] == {"E": 2}


def test_leg_stats_of_nothing() -> None:
    found = leg_stats([])
    assert found["makespan_s"] == 0.0 and found["short_p99_s"] is None and found["failed"] == 0


# -- counters -----------------------------------------------------------------------------------
def test_read_counters_sums_label_sets_and_ignores_created() -> None:
    found = read_counters(METRICS)
    assert found["queries"] == 9000.0 and found["hits"] == 6144.0
    assert found["success"] == 42.0 and found["prompt_tokens"] == 9100.0
    assert found["preemptions"] == 0.0  # not in this text


def test_hit_rate_over_both_servers() -> None:
    before = [read_counters(""), {"hits": 100.0, "queries": 1000.0}]
    after = [
        {"hits": 600.0, "queries": 1000.0, "success": 3.0},
        {"hits": 300.0, "queries": 3000.0, "success": 9.0},
    ]
    deltas = counter_deltas(before, after)
    assert deltas[0]["hits"] == 600.0 and deltas[1]["queries"] == 2000.0
    assert deltas[1]["success"] == 9.0  # a counter missing before counts from 0
    found = hit_rate(deltas, background_prompt_tokens=1000.0)
    assert found["hit_rate"] == round(800 / 3000, 4)
    assert found["hit_rate_own"] == round(800 / 2000, 4)
    assert hit_rate([{"hits": 0.0, "queries": 0.0}])["hit_rate"] is None


# -- summary ------------------------------------------------------------------------------------
def row(leg: str, run: int, makespan: float, p99: float, hits: float) -> dict:
    return {
        "run": run,
        "leg": leg,
        "makespan_s": makespan,
        "short_p50_s": p99 / 2,
        "short_p99_s": p99,
        "long_p99_s": makespan,
        "hit_rate": hits,
        "hit_rate_own": hits,
        "served": [10.0, 5.0],
        "failed": 0,
        "load": "1.0 -> 2.0",
    }


def test_summarize_ratios_and_goal() -> None:
    rows = [
        row("dsclient", 1, 10.0, 0.5, 0.8),
        row("round-robin", 1, 20.0, 5.0, 0.4),
        row("router-cache", 1, 12.0, 4.0, 0.9),
        row("dsclient", 2, 10.0, 0.5, 0.8),
        row("round-robin", 2, 20.0, 5.0, 0.4),
    ]
    summary = summarize(rows)
    assert [(s["run"], s["against"]) for s in summary] == [
        (1, "round-robin"),
        (1, "router-cache"),
        (2, "round-robin"),
    ]
    first = summary[0]
    assert first["makespan_s_ratio"] == 0.5 and first["short_p99_s_ratio"] == 0.1
    assert first["hit_rate_own_ratio"] == 2.0 and first["better_on_all"]
    worse = summary[1]
    assert worse["hit_rate_own_better"] is False and not worse["better_on_all"]
    assert not goal_met(summary)
    assert goal_met([summary[0], summary[2]])
    assert not goal_met([])
    text = report(rows, summary)
    assert "| 1 | router-cache | 0.83 | 0.12 | 0.89 | no |" in text
    assert text.endswith("NOT met")


def test_summarize_without_a_dsclient_leg_or_metric() -> None:
    assert summarize([row("round-robin", 1, 20.0, 5.0, 0.4)]) == []
    rows = [row("dsclient", 1, 10.0, 0.5, 0.8), {**row("router-rr", 1, 9.0, 1.0, 0.1)}]
    rows[1]["hit_rate_own"] = None
    (only,) = summarize(rows)
    assert only["hit_rate_own_ratio"] is None and not only["better_on_all"]
    assert "router-rr" in report(rows, [only])


def test_router_argv() -> None:
    argv = router_argv("/v/bin/vllm-router", ["http://a:1", "http://b:2"], "cache_aware", 9000)
    assert argv[0] == "/v/bin/vllm-router"
    i = argv.index("--worker-urls")
    assert argv[i + 1 : i + 3] == ["http://a:1", "http://b:2"]
    assert argv[argv.index("--policy") + 1] == "cache_aware"
    assert argv[argv.index("--port") + 1] == "9000"
    assert argv[argv.index("--host") + 1] == "127.0.0.1"
    # the load-balancing guide's cache-aware settings, not the command line's defaults
    assert argv[argv.index("--cache-threshold") + 1] == "0.5"
    assert argv[argv.index("--balance-abs-threshold") + 1] == "32"
    assert argv[argv.index("--balance-rel-threshold") + 1] == "1.1"
    p2 = router_argv("/v/bin/vllm-router", ["http://a:1", "http://b:2"], "power_of_two", 9000)
    assert "--cache-threshold" not in p2
    assert p2[p2.index("--policy") + 1] == "power_of_two"


def test_the_router_is_pinned_and_every_policy_has_a_leg() -> None:
    assert f"vllm-router=={ROUTER_VERSION}" == ROUTER_PACKAGE
    assert set(ROUTER_POLICY.values()) == {"round_robin", "cache_aware", "power_of_two"}
    assert set(ROUTER_POLICY) <= set(LEGS)


# -- driving (no server: a send that records) ---------------------------------------------------
def test_drive_sends_each_item_once_and_records_failures() -> None:
    items = [Item(i, "short", f"p{i}", 4, 0.0, None) for i in range(5)]
    seen: list[int] = []

    async def send(item: Item) -> None:
        seen.append(item.index)
        if item.index == 3:
            raise RuntimeError("refused")

    outcomes = asyncio.run(drive(items, send))
    assert sorted(seen) == list(range(5))
    assert [o.index for o in outcomes] == list(range(5))
    assert [o.ok for o in outcomes] == [True, True, True, False, True]
    assert outcomes[3].error == "RuntimeError: refused"
    assert all(o.ended >= o.sent >= 0.0 for o in outcomes)


def test_last_answers_per_server() -> None:
    finished = [("http://a", 10.5), ("http://b", 12.0), ("http://a", 11.25), ("http://b", 11.0)]
    assert last_answers(finished, t0=10.0) == {"http://a": 1.25, "http://b": 2.0}
    assert last_answers([], t0=0.0) == {}


def test_diagnostic_legs_are_accepted_but_not_compared() -> None:
    assert legs_arg("dsclient,dsclient-long1") == ["dsclient", "dsclient-long1"]
    rows = [row("dsclient", 1, 10.0, 0.5, 0.8), row("dsclient-long1", 1, 8.0, 0.4, 0.9)]
    rows.append(row("round-robin", 1, 20.0, 5.0, 0.4))
    assert [s["against"] for s in summarize(rows)] == ["round-robin"]


def test_long_window_spreads_long_arrivals_and_keeps_the_default_workload() -> None:
    at_once = make_workload(Shape(long=20, short=4, prefixes=4, prefix_words=10), seed=5)
    spread = make_workload(
        Shape(long=20, short=4, prefixes=4, prefix_words=10, long_window_s=8.0), seed=5
    )
    longs = [it for it in spread if it.kind == "long"]
    assert all(0.0 <= it.at <= 8.0 for it in longs) and len({it.at for it in longs}) > 1
    assert [it.at for it in spread] == sorted(it.at for it in spread)
    assert all(it.at == 0.0 for it in at_once if it.kind == "long")
    with pytest.raises(ValueError, match="long_window_s"):
        Shape(long_window_s=-1.0)
    assert parse_args(["--long-window", "15"]).long_window == 15.0


def test_diagnostic_index_leg_builds_a_routing_policy_argument() -> None:
    import dsclient
    from benchmarks.bench_routing import DIAGNOSTIC_LEGS

    policy = dsclient.RoutingPolicy(**DIAGNOSTIC_LEGS["dsclient-index"]["routing"])
    assert policy.index_blocks == 180


def test_the_replicas_schedule_by_priority_and_one_router_leg_sends_it() -> None:
    from benchmarks.bench_routing import (
        ABOUT,
        PRIORITY,
        REPLICA_ARGS,
        ROUTER_POLICY,
        SENDS_PRIORITY,
        Item,
        body_of,
    )

    assert REPLICA_ARGS == ("--scheduling-policy", "priority")
    assert SENDS_PRIORITY == ("router-cache+priority",) and set(SENDS_PRIORITY) <= set(LEGS)
    assert ROUTER_POLICY["router-cache+priority"] == "cache_aware" and set(LEGS) <= set(ABOUT)
    short = Item(0, "short", "hi", 16, 0.0, None)
    long = Item(1, "long", "doc", 32, 0.0, 3)
    assert "priority" not in body_of(short)
    assert body_of(short, True)["priority"] == PRIORITY["short"] < body_of(long, True)["priority"]


def test_the_background_goes_to_the_slowed_replica_in_every_leg() -> None:
    import inspect

    from benchmarks import bench_routing

    source = inspect.getsource(bench_routing.run_leg)
    assert "via_router = False" in source and 'facts["router_url"] if' not in source
    assert bench_routing.parse_args([]).long_window == 5.0  # long arrivals over a window
