"""benchmarks/bench_batch_shape.py: the batches, the ratios, the goals and the page block."""

from __future__ import annotations

from collections import Counter

from benchmarks import bench_batch_shape as bench


def test_prefix_heavy_is_20_prefixes_of_30_questions_shuffled():
    items = bench.make_batch("prefix-heavy", 1, "s")
    assert len(items) == 600
    heads = [item["prompt"].split(":")[0] for item in items]
    assert set(Counter(heads).values()) == {30} and len(set(heads)) == 20
    assert heads[:20] != sorted(heads[:20])  # shuffled
    system = items[0]["prompt"].split("\nQuestion")[0]
    assert 1200 < len(system) < 2000


def test_mixed_has_a_tenth_long_items_and_salts_differ():
    items = bench.make_batch("mixed", 1, "a")
    outs = Counter(item["max_tokens"] for item in items)
    assert set(outs) == {32, 512} and 10 <= outs[512] <= 35
    other = bench.make_batch("mixed", 1, "b")
    assert items[0]["prompt"] != other[0]["prompt"]


def test_legs_alternate_and_the_hit_rate_is_a_difference_of_counters():
    assert bench.leg_order(["shape", "input"], 1) == ["shape", "input"]
    assert bench.leg_order(["shape", "input"], 2) == ["input", "shape"]
    assert bench.leg_order(["shape", "input", "router-cache"], 3) == [
        "router-cache",
        "shape",
        "input",
    ]
    assert bench.hit_rate((100.0, 1000.0), (400.0, 2000.0)) == 0.3
    assert bench.hit_rate((0.0, 5.0), (0.0, 5.0)) is None


def rows():
    out = []
    for run in (1, 2):
        out += [
            {
                "leg": "shape",
                "run": run,
                "workload": "prefix-heavy",
                "makespan_s": 8.0,
                "hit_rate": 0.6,
                "failed": 0,
                "items": 600,
            },
            {
                "leg": "input",
                "run": run,
                "workload": "prefix-heavy",
                "makespan_s": 10.0,
                "hit_rate": 0.3,
                "failed": 0,
                "items": 600,
            },
            {
                "leg": "shape",
                "run": run,
                "workload": "plain",
                "makespan_s": 10.5,
                "hit_rate": 0.0,
                "failed": 0,
                "items": 200,
            },
            {
                "leg": "input",
                "run": run,
                "workload": "plain",
                "makespan_s": 10.0,
                "hit_rate": 0.0,
                "failed": 0,
                "items": 200,
            },
        ]
    return out


def test_goals_are_checked_per_run():
    lines = bench.goal_lines(rows())
    assert "- prefix-heavy, hit rate: shape / input = 2.00x, 2.00x (goal >= 1.5x): met" in lines
    assert any(
        line.startswith("- prefix-heavy, makespan") and "0.80x" in line and line.endswith(": met")
        for line in lines
    )
    assert any(line.startswith("- plain, makespan") and "**not met**" in line for line in lines)


def test_with_four_runs_or_more_the_makespan_goal_is_also_judged_on_the_sums():
    plain = [
        {"leg": leg, "run": run, "workload": "plain", "makespan_s": m}
        for run, (a, b) in enumerate([(10.5, 10.0), (9.0, 10.0), (10.0, 10.0), (10.1, 10.0)], 1)
        for leg, m in (("shape", a), ("input", b))
    ]
    lines = bench.goal_lines(plain)
    assert any(line.startswith("- plain, makespan") and "**not met**" in line for line in lines)
    assert "  - over the 4 runs together (sum / sum): 0.990x: met" in lines
    assert not any("together" in line for line in bench.goal_lines(rows()))  # two runs: no sums


def test_render_has_a_table_per_workload_and_the_conditions():
    record = {
        "benchmark": "batch-shape",
        "_file": "x.json",
        "rows": rows(),
        "host": {"cores": 2},
        "code": {"commit": "abc", "dirty": False},
        "versions": {},
    }
    text = bench.render([record])
    assert "**prefix-heavy** (600 items)" in text and "**plain** (200 items)" in text
    assert "| shape | 2 |" in text
    assert "benchmarks/results/batch-shape/x.json" in text


def test_the_router_leg_needs_several_servers():
    import pytest

    with pytest.raises(SystemExit):
        bench.parse_args(["--legs", "shape,router-cache"])
    args = bench.parse_args(["--legs", "shape,input,router-cache", "--replicas", "2"])
    assert args.legs == ["shape", "input", "router-cache"] and args.replicas == 2
    assert bench.parse_args(["--urls", "http://a:1,http://b:2", "--legs", "router-cache"])


def test_goals_are_given_against_each_peer_and_invocations_per_server_count():
    two = [dict(r, leg="router-cache") for r in rows() if r["leg"] == "input"]
    lines = bench.goal_lines(rows() + two)
    assert any("shape / router-cache" in line for line in lines)
    one = {"benchmark": "batch-shape", "_file": "1.json", "rows": rows(), "params": {}}
    pair = {
        "benchmark": "batch-shape",
        "_file": "2.json",
        "rows": rows() + two,
        "params": {"replicas": 2},
    }
    text = bench.render([one, pair])
    assert "*One server, 8 sequences and 24 KV blocks each:*" in text and "*2 replicas, 8 sequences and 24 KV blocks" in text
    assert "*One server" not in bench.render([one])
    big = {**one, "_file": "3.json", "params": {"blocks": 64, "workloads": ["mixed"]}}
    text = bench.render([one, pair, big])
    assert "*One server, 8 sequences and 64 KV blocks each:*" in text and "*One server, 8 sequences and 24 KV" in text


def test_shape_moves_the_prefix_heavy_and_mixed_batches_and_leaves_the_plain_one_as_read():
    # The plain batch's goal (within 3% of input order) rests on its start order being input
    # order: computed as map() computes it, no item moves.
    for run in (1, 2):
        assert bench.moved(bench.make_batch("plain", 27 + run, f"plain-shape-{run}")) == 0
        assert bench.moved(bench.make_batch("mixed", 27 + run, f"mixed-shape-{run}")) > 100
        heavy = bench.make_batch("prefix-heavy", 27 + run, f"prefix-heavy-shape-{run}")
        assert bench.moved(heavy) > 500


def test_render_shows_how_many_items_shape_moved():
    shaped = [{**row, "moved": 0} if row["leg"] == "shape" else row for row in rows()]
    record = {
        "benchmark": "batch-shape",
        "_file": "x.json",
        "rows": shaped,
        "host": {"cores": 2},
        "code": {"commit": "abc", "dirty": False},
        "versions": {},
    }
    text = bench.render([record])
    assert "Items that shape started at another place than input order, per run: 0, 0 of 200." in text


def test_engine_steps_are_shown_beside_the_goals_and_older_rows_give_no_line():
    assert bench.step_lines(rows()) == []  # rows from before the steps were counted
    mixed = [
        {"leg": leg, "run": run, "workload": "mixed", "makespan_s": 7.0, "engine_steps": steps}
        for run, (a, b) in enumerate([(2000, 2500), (3000, 2500), (2600, 2600), (2400, 2400)], 1)
        for leg, steps in (("shape", a), ("input", b))
    ]
    assert bench.step_lines(mixed) == [
        "- mixed, engine steps: shape / input = 0.80x, 1.20x, 1.00x, 1.00x (sum / sum: 1.000x)"
    ]
    record = {"benchmark": "batch-shape", "_file": "x.json", "rows": mixed, "params": {}}
    text = bench.render([record])
    assert "The server's engine steps, per run (not a goal):" in text
    heads = "| leg | runs | makespan s | prefix hit rate | engine steps | output tokens a step | ms a step |"
    assert heads in text


def test_the_step_model_runs_first_come_first_served_within_seats_and_cache():
    # Two seats: the long ones together (512 steps), then the short ones (32).
    assert bench.model_steps([(30, 512)] * 2 + [(30, 32)] * 2, seats=2, blocks=99) == 544
    # Input order with a long one last: it runs alone after the others.
    assert bench.model_steps([(30, 32)] * 2 + [(30, 512)] * 2, seats=2, blocks=99) == 32 + 512
    assert bench.model_steps([(30, 32), (30, 512), (30, 32), (30, 512)], 2, 99) == 32 + 512 + 32
    # A cache of one block holds one sequence of up to 128 tokens at a time.
    assert bench.model_steps([(30, 40)] * 3, seats=8, blocks=1) == 120
    # Two sequences that each outgrow one block in a cache of two: the later one is preempted
    # when the first needs its second block, and resumes where it was once the first ends.
    assert bench.model_steps([(100, 100), (100, 100)], seats=2, blocks=2) > 100
    import pytest

    with pytest.raises(ValueError, match="does not fit"):
        bench.model_steps([(300, 1)], seats=2, blocks=2)


def test_the_model_finds_the_gain_of_longest_first_bounded_by_the_server():
    # The mixed batch on a server that holds its long items beside each other gains from
    # longest first; on the benchmark's first server (8 sequences, 23 usable blocks: about 5
    # long items) much less; the plain batch nothing (shape order is input order).
    mixed = bench.make_batch("mixed", 28, "mixed-shape-1")
    roomy, tight = bench.model_ratio(mixed, 16, 47), bench.model_ratio(mixed, 8, 23)
    assert roomy < 0.85 and roomy < tight
    assert bench.model_ratio(bench.make_batch("plain", 28, "plain-shape-1"), 8, 23) == 1.0


def test_the_page_shows_the_models_ratio_per_run_and_servers_apart_by_their_batch():
    modelled = [
        {**row, "model_ratio": 0.8 + row["run"] / 100}
        if row["leg"] == "shape" and row["workload"] != "prefix-heavy"
        else row
        for row in rows()
    ]
    lines = bench.model_lines(modelled)
    assert [line.split(":")[0] for line in lines] == ["- plain"]
    assert all(line.endswith(": 0.81x, 0.82x") for line in lines)
    assert bench.model_lines(rows()) == []
    eight = {"benchmark": "batch-shape", "_file": "1.json", "rows": rows(), "params": {}}
    sixteen = {
        "benchmark": "batch-shape",
        "_file": "2.json",
        "rows": modelled,
        "params": {"max_num_seqs": 16, "blocks": 48},
    }
    text = bench.render([eight, sixteen])
    assert "*One server, 8 sequences and 24 KV blocks each:*" in text
    assert "*One server, 16 sequences and 48 KV blocks each:*" in text
    assert "by a model of vLLM's scheduler" in text


def test_a_legs_steps_give_how_full_they_ran_and_how_long_each_took():
    row = {"leg": "shape", "makespan_s": 6.0, "engine_steps": 1000.0, "completion_tokens": 14000}
    assert bench.with_step_figures(row) == {**row, "tokens_per_step": 14.0, "ms_per_step": 6.0}
    older = {"leg": "shape", "makespan_s": 6.0}  # before the steps were counted
    assert bench.with_step_figures(older) == older
    counted = [
        {**r, "engine_steps": 100.0, "completion_tokens": 800} for r in rows() if "run" in r
    ]
    text = bench.render([{"benchmark": "batch-shape", "_file": "1.json", "rows": counted}])
    assert "output tokens a step" in text and "ms a step" in text and "| 8.0 |" in text


def test_the_page_shows_the_servers_step_cost_by_sequences_when_measured():
    record = {
        "benchmark": "batch-shape",
        "_file": "1.json",
        "rows": rows(),
        "facts": {"step_ms_by_sequences": {"1": 4.1, "8": 4.6, "16": 6.04}},
    }
    text = bench.render([record])
    assert "by the sequences it ran" in text and "1: 4.1 ms, 8: 4.6 ms, 16: 6.0 ms." in text
    assert "by the sequences it ran" not in bench.render([{**record, "facts": {}}])


def test_the_flat_batch_is_issue_46s():
    items = bench.make_flat_batch(1, "s")
    outs = Counter(item["max_tokens"] for item in items)
    assert outs == {300: 27, 8: 373}
    assert [i["max_tokens"] for i in items[:27]] != [300] * 27  # shuffled
    assert items != bench.make_flat_batch(2, "s")


def flat_rows(shape: float, runs: int = 2) -> list[dict]:
    legs = {
        "shape": shape,
        "input": 11.0,
        "semaphore-input": 10.9,
        "semaphore-longest-16": 10.2,
        "semaphore-longest-24": 9.9,
    }
    return [
        {"leg": leg, "run": run, "workload": "flat", "makespan_s": m, "failed": 0}
        for run in range(1, runs + 1)
        for leg, m in legs.items()
    ]


def test_flat_goals_take_the_best_semaphore_and_are_judged_per_run():
    assert bench.flat_ratios(flat_rows(9.9), "shape", ("input",)) == [0.9, 0.9]
    best = ("semaphore-longest-16", "semaphore-longest-24")
    assert bench.flat_ratios(flat_rows(9.9), "shape", best) == [1.0, 1.0]  # 9.9, not 10.2
    lines = bench.flat_goal_lines(flat_rows(9.9))
    assert lines[0] == "- shape / input = 0.90x, 0.90x (goal <= 0.9x): met"
    assert lines[1].startswith("- shape / the best of semaphore-longest-16 and semaphore-longest")
    assert lines[1].endswith(": met")
    assert lines[2] == "- input / semaphore-input = 1.01x, 1.01x (goal <= 1.02x): met"
    rows = flat_rows(10.5)
    rows[0]["makespan_s"] = 9.0  # one run meets it, the other does not
    assert bench.flat_goal_lines(rows)[0].endswith("**not met**")


def test_the_flat_servers_block_is_apart_from_the_vllm_setups():
    vllm = {
        "benchmark": "batch-shape",
        "_file": "v.json",
        "rows": rows(),
        "params": {"server": "vllm"},
        "host": {"cores": 2},
        "code": {"commit": "abc", "dirty": False},
        "versions": {},
    }
    flat = dict(vllm, _file="f.json", rows=flat_rows(9.8), params={"server": "flat"})
    flat["facts"] = {"server": {"seats": 16, "step_ms": 10.0, "step_ms_per_sequence": 0.2}}
    text = bench.render([vllm, flat])
    assert "**prefix-heavy** (600 items)" in text
    assert "10.0 ms + 0.2 ms a sequence, 16 sequences" in text
    assert "| semaphore-longest-24 | 2 | 9.90 |" in text
    assert "- shape / input = 0.89x, 0.89x (goal <= 0.9x): met" in text
    assert "benchmarks/results/batch-shape/f.json" in text
    assert "**flat**" not in bench.render([vllm])
