"""``dsclient bench`` against the real tiny vLLM: three short steps, bench.json and the plot."""

from __future__ import annotations

import json

import pytest

from dsclient.cli import main

pytestmark = [pytest.mark.integration]


def test_bench_three_steps_write_json_and_png(vllm_server, tmp_path, capsys):
    code = main(
        [
            "bench",
            vllm_server.url,
            "--max-steps",
            "3",
            "--step-seconds",
            "2",
            "--short-prompt-tokens",
            "32",
            "--long-prompt-tokens",
            "400",
            "--short-output",
            "16",
            "--long-output",
            "64",
            "-o",
            str(tmp_path),
        ]
    )
    captured = capsys.readouterr()
    assert code == 0, captured.err
    report = json.loads((tmp_path / "bench.json").read_text())
    steps = report["steps"]
    assert [s["concurrency"] for s in steps] == [1, 2, 3]
    for step in steps:
        for key in ("concurrency", "throughput_rps", "p99_s", "errors", "ttft_p50_s"):
            assert key in step
        assert step["errors"] == 0 and step["requests"] > 0
        assert 0 < step["ttft_p50_s"] <= step["p50_s"]
        assert step["tpot_p50_s"] > 0 and step["output_tokens_per_s"] > 0
        # vLLM publishes its queue: the steps saw its batch.
        assert step["server"]["source"] == "vllm /metrics"
        assert step["server"]["running_max"] >= 1
    assert report["model"] == "tiny"
    assert report["workload"]["tokens_per_word_source"] == "/tokenize"
    assert report["stop"]["reason"] == "max-steps"
    assert report["knee"]["step"] is not None
    governor = report["governor"]
    assert governor["limit"] >= 1 and governor["requests"] > 0
    assert governor["control"]["mode"] == "metrics"
    assert governor["max_num_seqs"] == 8
    assert (tmp_path / "bench.png").stat().st_size > 1000
    assert "knee" in captured.out and "Traceback" not in captured.err
