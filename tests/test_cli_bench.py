"""``dsclient bench``: the pure policy (steps, stop rule, knee, percentiles), and the command against
an in-process fake server that streams SSE through ``httpx.MockTransport``."""

from __future__ import annotations

import io
import json
import random
import sys

import anyio
import pytest

from dsclient._http import httpx
from dsclient.cli import build_parser
from dsclient.cli.bench import (
    Bench,
    BenchRequest,
    RequestSample,
    StepResult,
    SyntheticMix,
    concurrency_schedule,
    find_knee,
    governor_workers,
    load_workload_file,
    next_concurrency,
    percentile,
    prompt_of,
    run,
    stop_reason,
    summarize_load,
    summarize_step,
)
from dsclient.governor._load import Load

URL = "http://bench.test:8000"


# -- policy ----------------------------------------------------------------------------------------


def test_percentile_interpolates_like_numpy():
    assert percentile([], 50) is None
    assert percentile([3.0], 99) == 3.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 99) == pytest.approx(99.01)  # numpy.percentile(1..100, 99)
    assert percentile(values, 0) == 1.0 and percentile(values, 100) == 100.0
    with pytest.raises(ValueError, match="percent"):
        percentile(values, 101)


def test_next_concurrency_grows_by_factor_and_at_least_one():
    assert [next_concurrency(c, 1.2) for c in (1, 2, 5, 6, 10, 100)] == [2, 3, 6, 7, 12, 120]
    assert next_concurrency(4, 2.0) == 8


def test_schedule_ends_at_the_bounds():
    assert concurrency_schedule(1, 1.2, 10) == [1, 2, 3, 4, 5, 6, 7, 8, 10]
    assert concurrency_schedule(1, 1.2, 256, max_steps=3) == [1, 2, 3]
    assert concurrency_schedule(4, 1.5, 4) == [4]
    assert concurrency_schedule(1, 2.0, 5) == [1, 2, 4, 5]
    with pytest.raises(ValueError, match="factor"):
        concurrency_schedule(1, 1.0, 10)
    with pytest.raises(ValueError, match="start"):
        concurrency_schedule(8, 1.2, 4)


def test_tpot_is_vllm_bench_serve_s():
    sample = RequestSample(ok=True, latency_s=1.1, ttft_s=0.1, output_tokens=11)
    assert sample.tpot_s == pytest.approx(0.1)
    assert RequestSample(ok=True, latency_s=1.0, ttft_s=0.1, output_tokens=1).tpot_s is None
    assert RequestSample(ok=False, latency_s=1.0, error="HTTP 503").tpot_s is None


def test_summarize_step_closed_loop():
    samples = [
        RequestSample(ok=True, latency_s=0.5, ttft_s=0.1, output_tokens=5, itl_s=(0.1,) * 4),
        RequestSample(ok=True, latency_s=1.0, ttft_s=0.2, output_tokens=5, itl_s=(0.2,) * 4),
        RequestSample(ok=False, latency_s=0.01, error="HTTP 503", detail="busy"),
        RequestSample(ok=False, latency_s=0.01, error="HTTP 503"),
    ]
    loads = [
        Load(source="vllm /metrics", running=2, waiting=0, kv_usage=0.1),
        Load(source="vllm /metrics", running=4, waiting=2, kv_usage=0.3),
    ]
    step = summarize_step(samples, index=3, duration_s=2.0, concurrency=2, loads=loads)
    assert step.index == 3 and step.concurrency == 2 and step.rate_rps is None
    assert step.requests == 2 and step.errors == 2 and step.error_share == 0.5
    assert step.error_kinds == {"HTTP 503": 2}
    assert step.first_error == "HTTP 503: busy"
    assert step.throughput_rps == 1.0
    assert step.output_tokens_per_s == 5.0
    assert step.ttft_p50_s == pytest.approx(0.15)
    assert step.tpot_p50_s == pytest.approx(0.15)  # (0.4/4 + 0.8/4) / 2
    assert step.itl_p50_s == pytest.approx(0.15)
    assert step.p50_s == pytest.approx(0.75) and step.p99_s == pytest.approx(0.995)
    assert step.server == {
        "source": "vllm /metrics",
        "samples": 2,
        "running_mean": 3.0,
        "running_max": 4,
        "waiting_mean": 1.0,
        "waiting_max": 2,
        "kv_usage_mean": 0.2,
        "kv_usage_max": 0.3,
    }
    assert step.load == 2
    assert json.loads(json.dumps(step.to_dict()))["p99_s"] == step.p99_s


def test_summarize_step_open_loop_counts_mean_in_flight():
    samples = [RequestSample(ok=True, latency_s=0.5, ttft_s=0.1, output_tokens=3)] * 8
    step = summarize_step(samples, index=0, duration_s=2.0, rate_rps=4.0)
    assert step.concurrency == 2.0  # Little: 8 x 0.5 s over 2 s
    assert step.load == 4.0
    assert step.server is None


def test_summarize_load_without_gauges():
    assert summarize_load([]) is None
    summary = summarize_load([Load(source="tgi /metrics", running=1, waiting=None)])
    assert summary is not None and summary["waiting_mean"] is None and summary["running_max"] == 1


def step(
    index: int, load: float, rps: float, p99: float, errors: int = 0, rate: float | None = None
) -> StepResult:
    requests = 100
    return StepResult(
        index=index,
        concurrency=load,
        rate_rps=rate,
        duration_s=10.0,
        requests=requests,
        errors=errors,
        error_share=errors / (requests + errors),
        error_kinds={"HTTP 503": errors} if errors else {},
        first_error="HTTP 503" if errors else None,
        throughput_rps=rps,
        output_tokens_per_s=rps * 64,
        ttft_p50_s=0.01,
        ttft_p99_s=0.02,
        tpot_p50_s=0.003,
        itl_p50_s=0.003,
        p50_s=p99 * 0.8,
        p95_s=p99 * 0.9,
        p99_s=p99,
        mean_latency_s=p99 * 0.7,
    )


def steps_of(*rows: tuple[float, float, float]) -> list[StepResult]:
    return [step(i, c, rps, p99) for i, (c, rps, p99) in enumerate(rows)]


#: The concurrency sweep measured on the tiny vLLM with max_num_seqs 8 (ENVIRONMENT.md).
MEASURED = steps_of(
    (1, 5.1, 0.25), (4, 18.7, 0.23), (8, 27.2, 0.33), (16, 32.6, 0.53), (64, 31.5, 2.45)
)


def test_stop_on_errors():
    steps = [*steps_of((1, 5, 0.2)), step(1, 2, 9, 0.2, errors=6)]
    reason = stop_reason(steps)
    assert reason is not None and reason[0] == "errors"
    assert "6 of 106" in reason[1] and "concurrency 2" in reason[1]
    assert stop_reason([*steps_of((1, 5, 0.2)), step(1, 2, 9, 0.2, errors=5)]) is None


def test_stop_on_plateau_needs_two_flat_steps_with_rising_p99():
    rising = steps_of((1, 5, 0.2), (2, 10, 0.2), (3, 14, 0.21))
    assert stop_reason(rising) is None
    one_flat = steps_of((1, 5, 0.2), (2, 10, 0.2), (3, 10.2, 0.3))
    assert stop_reason(one_flat) is None
    two_flat = steps_of((1, 5, 0.2), (2, 10, 0.2), (3, 10.2, 0.3), (4, 10.1, 0.4))
    reason = stop_reason(two_flat)
    assert reason is not None and reason[0] == "plateau"
    # Flat throughput without p99 rising is noise, not saturation.
    calm = steps_of((1, 5, 0.2), (2, 10, 0.2), (3, 10.2, 0.2), (4, 10.1, 0.2))
    assert stop_reason(calm) is None
    # A dip then a recovery: judged against the best so far, and the recovery is > 5% over it.
    recovered = steps_of((1, 5, 0.2), (2, 10, 0.2), (3, 9, 0.3), (4, 11, 0.4))
    assert stop_reason(recovered) is None
    assert stop_reason([]) is None


def test_knee_marginal_on_the_measured_sweep_is_max_num_seqs():
    knee = find_knee(MEASURED)
    assert knee.rule == "marginal" and knee.found
    assert knee.step == 2 and knee.concurrency == 8 and knee.throughput_rps == 27.2
    assert "concurrency 8" in knee.detail


def test_knee_marginal_ignores_one_noisy_step():
    # Step 3 dips; the later steps show the rise went on, so the knee is not at step 2.
    steps = steps_of((1, 5, 0.2), (2, 10, 0.2), (3, 9.5, 0.2), (4, 20, 0.2), (5, 20.5, 0.3))
    knee = find_knee(steps)
    assert knee.found and knee.concurrency == 4


def test_knee_marginal_not_reached_while_throughput_rises():
    knee = find_knee(steps_of((1, 5, 0.2), (2, 10, 0.2), (3, 15, 0.2)))
    assert not knee.found and knee.concurrency == 3 and "beyond" in knee.detail


def test_knee_fraction_is_a_parameter():
    assert find_knee(MEASURED, fraction=0.5).concurrency == 4


def test_knee_with_an_slo():
    knee = find_knee(MEASURED, slo_p99=0.4)
    assert knee.rule == "slo" and knee.found and knee.concurrency == 8
    assert find_knee(MEASURED, slo_p99=0.6).concurrency == 16
    none = find_knee(MEASURED, slo_p99=0.1)
    assert not none.found and none.step is None and "0.1" in none.detail


def test_knee_skips_steps_with_errors():
    steps = [*steps_of((1, 5, 0.2), (2, 10, 0.2)), step(2, 3, 30, 0.2, errors=50)]
    assert find_knee(steps, slo_p99=1.0).concurrency == 2
    assert find_knee([step(0, 1, 5, 0.2, errors=50)]).step is None


def test_knee_open_loop_uses_the_rate():
    steps = [
        step(i, c, rps, p99, rate=rate)
        for i, (rate, c, rps, p99) in enumerate(
            [(2, 0.5, 2, 0.2), (4, 1, 4, 0.2), (8, 3, 7.9, 0.3), (16, 40, 8.5, 5.0)]
        )
    ]
    knee = find_knee(steps)
    assert knee.found and knee.rate_rps == 8


def test_governor_workers():
    knee = find_knee(MEASURED)
    assert governor_workers(MEASURED, knee, 256) == 64
    assert governor_workers(MEASURED[:3], knee, 256) == 16  # twice the knee
    assert governor_workers(MEASURED, knee, 10) == 10
    assert governor_workers([], find_knee([]), 256) == 1
    # Twice the client's starting limit and the server's batch: room for the limit to grow.
    assert governor_workers(MEASURED[:3], knee, 256, limit=5, max_num_seqs=12) == 24
    assert governor_workers(MEASURED[:3], knee, 256, limit=10) == 20


# -- workloads -------------------------------------------------------------------------------------


def test_prompt_of_hits_the_token_target_at_the_rate():
    rng = random.Random(0)
    assert len(prompt_of(rng, 130, 1.3).split()) == 100
    assert len(prompt_of(rng, 64, 2.0).split()) == 32
    assert len(prompt_of(rng, 1, 5.0).split()) == 1


def test_synthetic_mix():
    mix = SyntheticMix(short_ratio=0.75, short_prompt_tokens=10, long_prompt_tokens=100)
    requests = mix.requests(random.Random(0), 1.0, ignore_eos=True)
    drawn = [next(requests) for _ in range(400)]
    shorts = [r for r in drawn if r.kind == "short"]
    assert 0.65 < len(shorts) / 400 < 0.85
    assert all(r.path == "/v1/completions" and r.body["ignore_eos"] for r in drawn)
    assert {len(r.body["prompt"].split()) for r in shorts} == {10}
    assert {r.body["max_tokens"] for r in drawn} == {64, 256}
    plain = next(mix.requests(random.Random(0), 1.0, ignore_eos=False))
    assert "ignore_eos" not in plain.body
    with pytest.raises(ValueError, match="short_ratio"):
        SyntheticMix(short_ratio=1.5)
    with pytest.raises(ValueError, match="long_output"):
        SyntheticMix(long_output=0)


def test_workload_file(tmp_path):
    path = tmp_path / "w.jsonl"
    lines = [
        {"prompt": "Once", "max_tokens": 8, "model": "other", "stream": True},
        {"messages": [{"role": "user", "content": "Hi"}]},
        {
            "custom_id": "b1",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"model": "m", "messages": [{"role": "user", "content": "Yo"}], "stream": True},
        },
    ]
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    requests = load_workload_file(str(path), default_max_tokens=32)
    assert [r.path for r in requests] == [
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/chat/completions",
    ]
    assert requests[0].body == {"prompt": "Once", "max_tokens": 8}
    assert requests[1].body["max_tokens"] == 32
    assert "custom_id" not in requests[2].body and "stream" not in requests[2].body
    path.write_text('{"prompt": "ok"}\n{"nothing": 1}\n')
    with pytest.raises(ValueError, match="line 2"):
        load_workload_file(str(path), default_max_tokens=32)
    path.write_text("\n")
    with pytest.raises(ValueError, match="no requests"):
        load_workload_file(str(path), default_max_tokens=32)


# -- the command against a fake server -----------------------------------------------------------


class FakeVllm:
    """A vLLM-like server: ``capacity`` sequences at once, the rest queue; ``tokens`` per answer,
    ``per_token`` seconds apart. Streams SSE, answers /metrics, /tokenize and /v1/models."""

    def __init__(
        self,
        *,
        capacity: int = 3,
        per_token: float = 0.004,
        metrics: bool = True,
        status: int = 200,
        model: str = "tiny",
        fail_every: int = 0,
    ) -> None:
        self.fail_every = fail_every
        self.capacity = capacity
        self.per_token = per_token
        self.metrics = metrics
        self.status = status
        self.model = model
        self.running = 0
        self.waiting = 0
        self.bodies: list[dict] = []
        self._slots: anyio.Semaphore | None = None

    @property
    def transport(self) -> httpx.MockTransport:
        return httpx.MockTransport(self.handle)

    def slots(self) -> anyio.Semaphore:
        if self._slots is None:
            self._slots = anyio.Semaphore(self.capacity)
        return self._slots

    async def handle(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if path == "/v1/models":
            return httpx.Response(
                200, json={"object": "list", "data": [{"id": self.model, "max_model_len": 2048}]}
            )
        if path == "/metrics" and self.metrics:
            text = (
                f'vllm:num_requests_running{{model_name="{self.model}",engine="0"}} {self.running}\n'
                f'vllm:num_requests_waiting{{model_name="{self.model}",engine="0"}} {self.waiting}\n'
                f'vllm:kv_cache_usage_perc{{model_name="{self.model}",engine="0"}} 0.25\n'
            )
            return httpx.Response(200, text=text)
        if path == "/tokenize":
            body = json.loads(request.content)
            return httpx.Response(200, json={"count": round(len(body["prompt"].split()) * 1.5)})
        if path in ("/v1/completions", "/v1/chat/completions"):
            body = json.loads(request.content)
            self.bodies.append(body)
            if self.fail_every and len(self.bodies) % self.fail_every == 0:
                return httpx.Response(503, json={"error": {"message": "busy"}})
            if self.status != 200:
                return httpx.Response(self.status, json={"error": {"message": "no such model"}})
            tokens = min(int(body.get("max_tokens") or 4), 4)
            if body.get("stream"):
                return httpx.Response(
                    200,
                    headers={"content-type": "text/event-stream"},
                    content=self.sse(tokens, chat=path.endswith("chat/completions")),
                )
            async with self.admitted():
                await anyio.sleep(self.per_token * tokens)
            return httpx.Response(
                200,
                json={
                    "id": "cmpl-1",
                    "object": "text_completion",
                    "created": 1,
                    "model": self.model,
                    "choices": [{"index": 0, "text": " a" * tokens, "finish_reason": "length"}],
                    "usage": {"prompt_tokens": 5, "completion_tokens": tokens},
                },
            )
        return httpx.Response(404, json={"detail": "Not Found"})

    def admitted(self):
        fake = self

        class Admitted:
            async def __aenter__(self) -> None:
                fake.waiting += 1
                await fake.slots().acquire()
                fake.waiting -= 1
                fake.running += 1

            async def __aexit__(self, *exc: object) -> None:
                fake.running -= 1
                fake.slots().release()

        return Admitted()

    async def sse(self, tokens: int, *, chat: bool):
        async with self.admitted():
            for i in range(tokens):
                await anyio.sleep(self.per_token)
                choice = {"index": 0, "finish_reason": "length" if i == tokens - 1 else None}
                if chat:
                    choice["delta"] = {"content": f" w{i}"}
                else:
                    choice["text"] = f" w{i}"
                yield f"data: {json.dumps({'choices': [choice]})}\n\n".encode()
        # Out of the slot before the last events: a reader stops at [DONE] and never resumes us.
        usage = {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": tokens}}
        yield f"data: {json.dumps(usage)}\n\n".encode()
        yield b"data: [DONE]\n\n"


def parse(*argv: str):
    return build_parser().parse_args(["bench", *argv])


def go(fake: FakeVllm | None, *argv: str, url: str = URL) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = run(
        parse(url, *argv),
        transport=None if fake is None else fake.transport,
        stdout=out,
        stderr=err,
    )
    return code, out.getvalue(), err.getvalue()


FAST = ("--step-seconds", "0.25", "--short-output", "4", "--long-output", "4")


def test_closed_loop_writes_bench_json_and_a_plot(tmp_path):
    pytest.importorskip("matplotlib")
    fake = FakeVllm()
    code, out, err = go(fake, *FAST, "--max-steps", "4", "-o", str(tmp_path))
    assert code == 0, err
    report = json.loads((tmp_path / "bench.json").read_text())
    assert [s["concurrency"] for s in report["steps"]] == [1, 2, 3, 4]
    for s in report["steps"]:
        assert s["requests"] > 0 and s["errors"] == 0
        assert s["throughput_rps"] > 0 and s["p99_s"] > 0 and s["ttft_p50_s"] > 0
        assert s["tpot_p50_s"] > 0 and s["itl_p50_s"] > 0
        assert s["output_tokens_per_s"] == pytest.approx(4 * s["throughput_rps"], rel=0.01)
    assert report["steps"][0]["server"]["source"] == "vllm /metrics"
    assert report["steps"][0]["server"]["kv_usage_mean"] == 0.25
    assert report["stop"]["reason"] == "max-steps"
    assert report["knee"]["rule"] == "marginal"
    assert report["model"] == "tiny" and report["mode"] == "closed"
    assert report["workload"]["tokens_per_word"] == pytest.approx(1.5, abs=0.01)
    assert report["workload"]["tokens_per_word_source"] == "/tokenize"
    governor = report["governor"]
    assert governor["limit"] >= 1 and governor["requests"] > 0 and governor["control"]["mode"]
    assert (tmp_path / "bench.png").stat().st_size > 1000
    assert report["plots"] == ["bench.png"]
    # What went to the server: streamed, with usage, ignore_eos, the discovered model.
    streamed = [b for b in fake.bodies if b.get("stream")]
    assert streamed and all(b["model"] == "tiny" and b["ignore_eos"] for b in streamed)
    assert all(b["stream_options"] == {"include_usage": True} for b in streamed)
    # Progress on stderr, one line a step; the table and the verdicts on stdout.
    assert err.count("step ") >= 4 and "Traceback" not in err
    assert "knee" in out and "dsclient's governor: limit" in out
    assert "wrote" in err and "bench.png" in err


def test_saturation_stops_at_a_plateau_and_finds_the_knee():
    # Capacity 2, one slow token: past two in flight the fake queues, so throughput flattens.
    fake = FakeVllm(capacity=2, per_token=0.02)
    code, out, _ = go(
        fake,
        "--step-seconds",
        "0.4",
        "--short-output",
        "1",
        "--long-output",
        "1",
        "--factor",
        "2",
        "--max-concurrency",
        "32",
        "--no-governor",
        "--json",
    )
    assert code == 0
    report = json.loads(out)
    assert report["stop"]["reason"] == "plateau"
    assert len(report["steps"]) < 6
    assert report["knee"]["found"] and report["knee"]["concurrency"] == 2
    assert report["governor"] is None


def test_open_loop_rates():
    fake = FakeVllm(metrics=False)
    code, out, _ = go(fake, *FAST, "--rates", "20,40", "--no-governor", "--json")
    assert code == 0
    report = json.loads(out)
    assert report["mode"] == "open"
    assert [s["rate_rps"] for s in report["steps"]] == [20.0, 40.0]
    assert all(s["server"] is None for s in report["steps"])
    assert all(0 < s["concurrency"] < 5 for s in report["steps"])
    assert report["stop"]["reason"] == "rates"


def test_workload_file_with_chat(tmp_path):
    path = tmp_path / "w.jsonl"
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "Hi"}]}) + "\n")
    fake = FakeVllm()
    code, out, _ = go(fake, *FAST, "--workload", str(path), "--max-steps", "1", "--json")
    assert code == 0
    report = json.loads(out)
    assert report["workload"] == {"kind": "file", "path": str(path), "requests": 1}
    assert report["steps"][0]["requests"] > 0 and report["steps"][0]["ttft_p50_s"] > 0
    assert any(b.get("messages") for b in fake.bodies)


def test_no_matplotlib_is_a_note(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    code, _, err = go(FakeVllm(), *FAST, "--max-steps", "1", "--no-governor", "-o", str(tmp_path))
    assert code == 0
    assert "no plots: matplotlib is not installed" in err
    assert json.loads((tmp_path / "bench.json").read_text())["plots"] == []
    assert not (tmp_path / "bench.png").exists()


def test_every_request_failing_is_exit_1():
    code, _, err = go(FakeVllm(status=404), *FAST, "--max-steps", "3", "--json")
    assert code == 1
    assert "every request failed (HTTP 404" in err


def test_errors_stop_the_run(tmp_path):
    code, out, _ = go(FakeVllm(fail_every=3), *FAST, "--max-steps", "3", "--json")
    assert code == 0
    report = json.loads(out)
    assert report["stop"]["reason"] == "errors" and len(report["steps"]) == 1
    assert report["steps"][0]["error_kinds"] == {"HTTP 503": report["steps"][0]["errors"]}
    assert "HTTP 503" in report["stop"]["detail"]


@pytest.mark.parametrize("url", ["not-a-url", "ftp://x:1"])
def test_bad_url_is_one_line_and_exit_2(url):
    code, out, err = go(None, url=url)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("dsclient bench: ")


def test_unreachable_server_is_one_line_and_exit_2():
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("[Errno 111] Connection refused", request=request)

    out, err = io.StringIO(), io.StringIO()
    code = run(parse(URL), transport=httpx.MockTransport(refuse), stdout=out, stderr=err)
    assert code == 2 and out.getvalue() == ""
    assert err.getvalue() == f"dsclient bench: cannot reach {URL}: [Errno 111] Connection refused\n"


def test_unreachable_real_port_through_main(capsys):
    from dsclient.cli import main

    assert main(["bench", "http://127.0.0.1:9", "--step-seconds", "1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cannot reach http://127.0.0.1:9" in err


def test_bad_arguments_are_exit_2(tmp_path):
    code, _, err = go(FakeVllm(), "--factor", "1")
    assert code == 2 and "--factor must be > 1" in err
    code, _, err = go(FakeVllm(), "--start", "8", "--max-concurrency", "4")
    assert code == 2 and "below --start" in err
    code, _, err = go(FakeVllm(), "--workload", str(tmp_path / "missing.jsonl"))
    assert code == 2 and "cannot read" in err
    blocker = tmp_path / "file"
    blocker.write_text("")
    code, _, err = go(FakeVllm(), "-o", str(blocker / "out"))
    assert code == 2 and "cannot create" in err
    for bad in (("--step-seconds", "0"), ("--rates", ","), ("--factor", "x")):
        with pytest.raises(SystemExit):
            parse(URL, *bad)


def test_several_models_need_model():
    fake = FakeVllm()

    async def handle(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "a"}, {"id": "b"}]})
        return await fake.handle(request)

    err = io.StringIO()
    code = run(parse(URL), transport=httpx.MockTransport(handle), stdout=io.StringIO(), stderr=err)
    assert code == 2 and "serves 2 models (a, b); pass --model" in err.getvalue()


@pytest.mark.anyio
async def test_request_measures_ttft_itl_and_tokens():
    fake = FakeVllm(per_token=0.01)
    async with httpx.AsyncClient(transport=fake.transport) as http:
        bench = Bench(http, URL, model="tiny", requests=iter(()), step_seconds=1)
        sample = await bench.request(
            BenchRequest(path="/v1/completions", body={"prompt": "hi", "max_tokens": 4})
        )
    assert sample.ok and sample.output_tokens == 4 and len(sample.itl_s) == 3
    assert 0.005 < sample.ttft_s < sample.latency_s
    assert all(gap > 0.005 for gap in sample.itl_s)
    assert sample.tpot_s == pytest.approx((sample.latency_s - sample.ttft_s) / 3)


@pytest.mark.anyio
async def test_request_failures_are_samples():
    async def handle(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/chat/completions":
            raise httpx.ReadTimeout("slow", request=request)
        return httpx.Response(
            200,
            headers={"content-type": "text/event-stream"},
            content=b'data: {"error": {"message": "boom"}}\n\n',
        )

    async with httpx.AsyncClient(transport=httpx.MockTransport(handle)) as http:
        bench = Bench(http, URL, model="tiny", requests=iter(()), step_seconds=1)
        timeout = await bench.request(BenchRequest(path="/v1/chat/completions", body={}))
        broken = await bench.request(BenchRequest(path="/v1/completions", body={}))
    assert not timeout.ok and timeout.error == "timeout"
    assert not broken.ok and broken.error == "stream error" and "boom" in broken.detail


def test_bench_is_registered_in_the_cli():
    args = parse(URL, "--rates", "1,2.5")
    assert args.rates == [1.0, 2.5] and args.func is run


def test_bound_reason_names_the_bound():
    from dsclient.cli.bench.report import _bound_reason

    assert _bound_reason("closed", [1, 2, 4], 4, None)[0] == "max-concurrency"
    assert _bound_reason("closed", [1, 2, 3], 256, 3) == ("max-steps", "ran --max-steps 3")
    assert _bound_reason("open", [1.0, 2.0], 256, None)[0] == "rates"
    assert _bound_reason("open", [1.0, 2.0], 256, 2)[0] == "max-steps"


def test_the_url_may_come_as_map_takes_it_or_not_at_all(capsys, monkeypatch):
    from dsclient.cli import main

    monkeypatch.delenv("DSCLIENT_URL", raising=False)
    assert main(["bench", "--step-seconds", "1"]) == 2
    assert (
        capsys.readouterr().err == "dsclient bench: no server: pass its URL or set DSCLIENT_URL\n"
    )
    assert main(["bench", "--url", "http://127.0.0.1:9", "--step-seconds", "1"]) == 2
    assert "cannot reach http://127.0.0.1:9" in capsys.readouterr().err
    monkeypatch.setenv("DSCLIENT_URL", "http://127.0.0.1:9")
    assert main(["bench", "--step-seconds", "1"]) == 2
    assert "cannot reach http://127.0.0.1:9" in capsys.readouterr().err


# -- goodput (vllm bench serve --goodput) -----------------------------------------------------------


def test_goodput_objectives_parse_as_vllm_bench_serve_takes_them():
    from dsclient.cli.bench import Slo, parse_goodput

    assert parse_goodput("ttft:500,tpot:50") == Slo(ttft_ms=500, tpot_ms=50)
    assert parse_goodput("e2el:2000 TTFT:1.5") == Slo(ttft_ms=1.5, e2el_ms=2000)
    assert parse_goodput("ttft:500,tpot:50").text() == "ttft:500,tpot:50"
    for bad, match in (
        ("ttft", "NAME:MS"),
        ("itl:5", "NAME:MS"),
        ("ttft:x", "not a number"),
        ("ttft:1,ttft:2", "twice"),
        ("", "at least one"),
        ("ttft:-1", ">= 0"),
        ("tpot:nan", ">= 0"),
    ):
        with pytest.raises(ValueError, match=match):
            parse_goodput(bad)


def test_a_request_is_good_only_when_every_objective_holds_inclusively():
    from dsclient.cli.bench import Slo
    from dsclient.cli.bench.goodput import goodput_rps, vllm_tpot_s

    slo = Slo(ttft_ms=500, tpot_ms=50)
    # TPOT (1.5 - 0.5) / (21 - 1) = 50 ms: on the objective counts as met (vLLM's <=).
    assert slo.met(ttft_s=0.5, latency_s=1.5, output_tokens=21)
    assert not slo.met(ttft_s=0.5, latency_s=1.6, output_tokens=21)  # TPOT 55 ms
    assert not slo.met(ttft_s=0.6, latency_s=0.7, output_tokens=2)  # TTFT 600 ms
    # One token: TPOT is 0 for goodput (vLLM's rule), so only TTFT decides.
    assert vllm_tpot_s(9.0, 0.1, 1) == 0.0 and slo.met(ttft_s=0.1, latency_s=9.0, output_tokens=1)
    # No text at all: no TTFT, so a TTFT or TPOT objective is missed (vLLM would count 0).
    assert not slo.met(ttft_s=None, latency_s=0.2, output_tokens=0)
    assert Slo(e2el_ms=300).met(ttft_s=None, latency_s=0.3, output_tokens=0)
    samples = [
        (True, 0.5, 1.5, 21),  # good
        (True, 0.5, 1.6, 21),  # TPOT missed
        (False, 0.1, 0.2, 3),  # failed: never good
        (True, 0.2, 0.26, 4),  # good: TPOT 20 ms
    ]
    assert goodput_rps(samples, slo, duration_s=4.0) == (2, 0.5)


def test_summarize_step_adds_goodput_and_the_tails_only_with_objectives():
    from dsclient.cli.bench import Slo

    samples = [
        RequestSample(ok=True, latency_s=0.5, ttft_s=0.1, output_tokens=5),  # TPOT 100 ms
        RequestSample(ok=True, latency_s=0.2, ttft_s=0.1, output_tokens=5),  # TPOT 25 ms
        RequestSample(ok=False, latency_s=0.01, error="HTTP 503"),
    ]
    plain = summarize_step(samples, index=0, duration_s=2.0, concurrency=2)
    assert plain.goodput_rps is None and plain.good_requests is None
    assert plain.tpot_p95_s == pytest.approx(0.09625)  # numpy's p95 of 25, 100 ms and plain.ttft_p95_s == pytest.approx(0.1)
    good = summarize_step(samples, index=0, duration_s=2.0, concurrency=2, slo=Slo(tpot_ms=50))
    assert (good.good_requests, good.goodput_rps) == (1, 0.5)


def test_the_command_reports_goodput_per_step_and_records_the_objectives(tmp_path):
    fake = FakeVllm(per_token=0.004)
    code, out, err = go(
        fake, *FAST, "--max-steps", "2", "--no-governor", "--goodput", "ttft:60000,tpot:60000",
        "-o", str(tmp_path),
    )  # fmt: skip
    assert code == 0, err
    report = json.loads((tmp_path / "bench.json").read_text())
    assert report["settings"]["goodput"] == "ttft:60000,tpot:60000"
    for s in report["steps"]:  # objectives nothing misses: every answer is good
        assert s["good_requests"] == s["requests"] > 0
        assert s["goodput_rps"] == pytest.approx(s["throughput_rps"], rel=0.01)
    assert "good/s" in out and "goodput" in err
    code, out, err = go(fake, *FAST, "--max-steps", "1", "--no-governor", "--goodput", "ttft:0")
    assert code == 0, err
    assert "good/s" in out and ", goodput 0 req/s (0 good)" in err  # nothing is that fast
    with pytest.raises(SystemExit) as exit_:
        parse(URL, "--goodput", "speed:1")
    assert exit_.value.code == 2
