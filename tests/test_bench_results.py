"""benchmarks._results: what a run records before it starts, its rows, and the file it writes."""

from __future__ import annotations

import datetime as dt
import json
import subprocess
from pathlib import Path

import pytest

from benchmarks import _results
from benchmarks._results import MAX_BYTES, Run, benchmarks_with_results, git_state, load_records

T0 = dt.datetime(2026, 12, 4, 18, 1, 2, tzinfo=dt.timezone.utc)


def fixed_code() -> dict[str, object]:
    return {"commit": "abc123", "dirty": False, "changed": []}


class Clock:
    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> dt.datetime:
        return self.now


class Loads:
    def __init__(self) -> None:
        self.value = [0.5, 0.4, 0.3]

    def __call__(self) -> list[float]:
        return list(self.value)


def begin(**kwargs: object) -> tuple[Run, Clock, Loads]:
    clock, loads = Clock(), Loads()
    run = Run.begin("demo", now=clock, load=loads, code=fixed_code, **kwargs)  # type: ignore[arg-type]
    return run, clock, loads


def test_begin_records_the_conditions_before_anything_runs() -> None:
    run, clock, loads = begin(params={"runs": 3}, peers=["surely-not-installed-xyz", "pytest"])
    loads.value = [9.0, 9.0, 9.0]  # what happens later does not change what was recorded
    clock.now = T0 + dt.timedelta(minutes=5)
    assert run.started_utc == "2026-12-04T18:01:02Z"
    assert run.load_before == [0.5, 0.4, 0.3]
    assert run.code == fixed_code()
    assert run.params == {"runs": 3}
    assert run.versions["surely-not-installed-xyz"] is None
    assert run.versions["pytest"] == pytest.__version__
    assert "dsclient" in run.versions
    assert run.host["cores"] >= 1
    assert run.host["python"].count(".") == 2


def test_versions_found_elsewhere_are_added_as_given() -> None:
    run, _, _ = begin(versions={"vllm": "0.32.0"})
    assert run.versions["vllm"] == "0.32.0"


def test_add_appends_rows_with_the_load_at_that_moment() -> None:
    run, _, loads = begin()
    run.add(leg="a", run=1, makespan_s=1.5, failures=0, note="x", ok=True, p99=None)
    loads.value = [2.0, 1.0, 1.0]
    run.add(leg="b", run=1, makespan_s=2.5)
    run.add(leg="c", run=1, makespan_s=2.5, load_1min=7.0)
    assert run.rows[0] == {
        "leg": "a", "run": 1, "makespan_s": 1.5, "failures": 0, "note": "x", "ok": True,
        "p99": None, "load_1min": 0.5,
    }  # fmt: skip
    assert run.rows[1]["load_1min"] == 2.0
    assert run.rows[2]["load_1min"] == 7.0


@pytest.mark.parametrize("bad", [[1.0, 2.0], {"a": 1}, object()])
def test_add_refuses_anything_but_a_scalar(bad: object) -> None:
    run, _, _ = begin()
    with pytest.raises(TypeError, match="figure 'latencies'"):
        run.add(leg="a", run=1, latencies=bad)  # type: ignore[arg-type]


def test_begin_refuses_a_name_that_is_not_a_folder_name() -> None:
    with pytest.raises(ValueError, match="plain name"):
        Run.begin("../x", code=fixed_code)


def test_save_writes_one_json_named_by_the_utc_start(tmp_path: Path) -> None:
    run, clock, loads = begin(params={"seed": 7})
    run.add(leg="a", run=1, makespan_s=1.0)
    run.note("the machine was busy")
    run.fact("server", {"vllm": "0.32.0", "flags": ["--max-num-seqs", "8"]})
    clock.now = T0 + dt.timedelta(seconds=90)
    loads.value = [1.5, 1.0, 0.5]
    path = run.save(tmp_path)
    assert path == tmp_path / "demo" / "20261204T180102Z.json"
    data = json.loads(path.read_text())
    assert data["schema"] == _results.SCHEMA
    assert data["benchmark"] == "demo"
    assert data["started_utc"] == "2026-12-04T18:01:02Z"
    assert data["finished_utc"] == "2026-12-04T18:02:32Z"
    assert data["load_before"] == [0.5, 0.4, 0.3]
    assert data["load_after"] == [1.5, 1.0, 0.5]
    assert data["notes"] == ["the machine was busy"]
    assert data["facts"]["server"]["vllm"] == "0.32.0"
    assert data["rows"][0]["makespan_s"] == 1.0
    assert data["code"] == fixed_code()


def test_two_saves_started_in_the_same_second_keep_both(tmp_path: Path) -> None:
    first, _, _ = begin()
    second, _, _ = begin()
    paths = [first.save(tmp_path), second.save(tmp_path)]
    assert [p.name for p in paths] == ["20261204T180102Z.json", "20261204T180102Z-2.json"]
    assert [r["_file"] for r in load_records("demo", tmp_path)] == [p.name for p in paths]
    assert benchmarks_with_results(tmp_path) == ["demo"]
    assert load_records("missing", tmp_path) == []


def test_a_file_over_the_size_limit_is_written_with_a_warning(tmp_path: Path) -> None:
    run, _, _ = begin()
    for i in range(MAX_BYTES // 40):
        run.add(leg=f"leg-{i}", run=1, x=i)
    with pytest.warns(UserWarning, match="keep summaries only"):
        path = run.save(tmp_path)
    assert path.exists()


def test_fact_refuses_what_json_cannot_hold() -> None:
    run, _, _ = begin()
    with pytest.raises(TypeError):
        run.fact("x", object())


def git(cwd: Path, *argv: str) -> None:
    subprocess.run(["git", *argv], cwd=cwd, check=True, capture_output=True)


def test_git_state_tells_a_clean_tree_from_a_changed_one(tmp_path: Path) -> None:
    git(tmp_path, "init", "-q")
    (tmp_path / "dsclient").mkdir()
    (tmp_path / "dsclient" / "a.py").write_text("x = 1\n")
    git(tmp_path, "add", ".")
    git(tmp_path, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "one")
    clean = git_state(tmp_path)
    assert len(clean["commit"]) == 40
    assert clean["dirty"] is False
    assert clean["changed"] == []
    (tmp_path / "other.txt").write_text("untracked, not ours\n")
    assert git_state(tmp_path)["dirty"] is False
    (tmp_path / "dsclient" / "a.py").write_text("x = 2\n")
    changed = git_state(tmp_path)
    assert changed["dirty"] is True
    assert changed["changed"] == ["dsclient/a.py"]


def test_git_state_outside_a_checkout_is_all_none(tmp_path: Path) -> None:
    assert git_state(tmp_path) == {"commit": None, "dirty": None, "changed": None}


def test_every_kept_result_file_is_a_small_summary_with_its_conditions() -> None:
    for name in benchmarks_with_results():
        for record in load_records(name):
            where = f"benchmarks/results/{name}/{record['_file']}"
            size = len(json.dumps(record))
            assert size < MAX_BYTES, f"{where} is {size} bytes: keep summaries, not traces"
            assert record["benchmark"] == name, where
            for key in ("started_utc", "code", "versions", "host", "load_before", "rows"):
                assert key in record, f"{where} has no {key!r}"
            assert all("leg" in row and "run" in row for row in record["rows"]), where


def test_an_aborted_run_is_kept_with_its_reason_and_never_counts_as_current(
    tmp_path: Path,
) -> None:
    from benchmarks import _report as report

    run = Run.begin("x", code=lambda: {"commit": "c" * 40, "dirty": False, "changed": []})
    with pytest.raises(KeyboardInterrupt), run.kept_if_aborted(tmp_path):
        raise KeyboardInterrupt  # before any row: nothing kept, as if it had not started
    assert not (tmp_path / "x").exists()
    run.add(leg="a", run=1, makespan_s=1.0)
    with pytest.raises(RuntimeError), run.kept_if_aborted(tmp_path):
        raise RuntimeError("the server died")
    [kept] = load_records("x", tmp_path)
    assert kept["facts"]["aborted"] == "RuntimeError: the server died"
    assert kept["rows"][0]["leg"] == "a"
    assert report.staleness(kept) == "the run was aborted (RuntimeError: the server died)"
