"""Reading server load from /metrics text: the Prometheus parser and the four server dialects."""

from __future__ import annotations

import dataclasses
import math
import random

import pytest

from dsclient.governor._load import Load, parse_load, parse_prometheus

MODEL = "Qwen/Qwen2.5-0.5B-Instruct"
OTHER = "meta-llama/Llama-3.2-1B-Instruct"

_BUCKETS = ("0.001", "0.005", "0.01", "0.02", "0.04", "0.06", "0.08", "0.1", "0.25", "0.5")
_BUCKETS += ("0.75", "1.0", "2.5", "5.0", "7.5", "10.0", "20.0", "40.0", "80.0", "+Inf")


def _histogram(name: str, series: list[tuple[str, str]]) -> str:
    lines = [f"# HELP {name} Histogram of {name[5:]}.", f"# TYPE {name} histogram"]
    for engine, model in series:
        labels = f'engine="{engine}",model_name="{model}"'
        for n, le in enumerate(_BUCKETS):
            lines.append(f'{name}_bucket{{{labels},le="{le}"}} {float(min(n, 12))}')
        lines.append(f"{name}_count{{{labels}}} 12.0")
        lines.append(f"{name}_sum{{{labels}}} 3.2185821533203125")
    return "\n".join(lines) + "\n"


def _cache_config(engine: str, **extra: str) -> str:
    labels = {
        "block_size": "128",
        "cache_dtype": "auto",
        "calculate_kv_scales": "False",
        "cpu_kvcache_space_bytes": "4294967296",
        "enable_prefix_caching": "True",
        "engine": engine,
        "gpu_memory_utilization": "0.9",
        "is_attention_free": "False",
        "kv_cache_dtype_skip_layers": "[]",
        "kv_cache_max_concurrency": "24.5",
        "kv_cache_memory_bytes": "None",
        "kv_cache_size_tokens": "50176",
        "mamba_block_size": "None",
        "num_cpu_blocks": "None",
        "num_gpu_blocks": "784",
        "num_gpu_blocks_override": "None",
        "prefix_caching_hash_algo": "sha256",
        "sliding_window": "None",
        **extra,
    }
    body = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    return f"vllm:cache_config_info{{{body}}} 1.0\n"


# Shaped like vLLM 0.32.0's /metrics: process and python_gc noise, `model_name` and `engine` on
# every series, two data-parallel engines of MODEL and one engine of OTHER (a gateway exposing
# two servers), histograms with buckets, counters with `_total` and `_created`.
VLLM = (
    """\
# HELP python_gc_objects_collected_total Objects collected during gc
# TYPE python_gc_objects_collected_total counter
python_gc_objects_collected_total{generation="0"} 21045.0
python_gc_objects_collected_total{generation="1"} 3890.0
python_gc_objects_collected_total{generation="2"} 1204.0
# HELP python_info Python platform information
# TYPE python_info gauge
python_info{implementation="CPython",major="3",minor="11",patchlevel="7",version="3.11.7"} 1.0
# HELP process_virtual_memory_bytes Virtual memory size in bytes.
# TYPE process_virtual_memory_bytes gauge
process_virtual_memory_bytes 2.1768704e+010
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="Qwen/Qwen2.5-0.5B-Instruct"} 5.0
vllm:num_requests_running{engine="1",model_name="Qwen/Qwen2.5-0.5B-Instruct"} 3.0
vllm:num_requests_running{engine="0",model_name="meta-llama/Llama-3.2-1B-Instruct"} 7.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="Qwen/Qwen2.5-0.5B-Instruct"} 2.0
vllm:num_requests_waiting{engine="1",model_name="Qwen/Qwen2.5-0.5B-Instruct"} 1.0
vllm:num_requests_waiting{engine="0",model_name="meta-llama/Llama-3.2-1B-Instruct"} 0.0
# HELP vllm:num_requests_waiting_by_reason Number of waiting requests by reason.
# TYPE vllm:num_requests_waiting_by_reason gauge
vllm:num_requests_waiting_by_reason{engine="0",model_name="Qwen/Qwen2.5-0.5B-Instruct",reason="capacity"} 2.0
vllm:num_requests_waiting_by_reason{engine="0",model_name="Qwen/Qwen2.5-0.5B-Instruct",reason="deferred"} 0.0
vllm:num_requests_waiting_by_reason{engine="1",model_name="Qwen/Qwen2.5-0.5B-Instruct",reason="capacity"} 0.0
vllm:num_requests_waiting_by_reason{engine="1",model_name="Qwen/Qwen2.5-0.5B-Instruct",reason="deferred"} 1.0
vllm:num_requests_waiting_by_reason{engine="0",model_name="meta-llama/Llama-3.2-1B-Instruct",reason="capacity"} 0.0
vllm:num_requests_waiting_by_reason{engine="0",model_name="meta-llama/Llama-3.2-1B-Instruct",reason="deferred"} 0.0
# HELP vllm:engine_sleep_state Engine sleep state; awake = 0 means engine is sleeping.
# TYPE vllm:engine_sleep_state gauge
vllm:engine_sleep_state{engine="0",model_name="Qwen/Qwen2.5-0.5B-Instruct",sleep_state="awake"} 1.0
vllm:engine_sleep_state{engine="0",model_name="Qwen/Qwen2.5-0.5B-Instruct",sleep_state="weights_offloaded"} 0.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="Qwen/Qwen2.5-0.5B-Instruct"} 0.75
vllm:kv_cache_usage_perc{engine="1",model_name="Qwen/Qwen2.5-0.5B-Instruct"} 0.25
vllm:kv_cache_usage_perc{engine="0",model_name="meta-llama/Llama-3.2-1B-Instruct"} 0.9
# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="Qwen/Qwen2.5-0.5B-Instruct"} 48211.0
vllm:prefix_cache_queries_total{engine="1",model_name="Qwen/Qwen2.5-0.5B-Instruct"} 40022.0
# HELP vllm:num_preemptions_total Cumulative number of preemption from the engine.
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{engine="0",model_name="Qwen/Qwen2.5-0.5B-Instruct"} 4.0
vllm:num_preemptions_total{engine="1",model_name="Qwen/Qwen2.5-0.5B-Instruct"} 1.0
vllm:num_preemptions_total{engine="0",model_name="meta-llama/Llama-3.2-1B-Instruct"} 9.0
# HELP vllm:num_preemptions_created Cumulative number of preemption from the engine.
# TYPE vllm:num_preemptions_created gauge
vllm:num_preemptions_created{engine="0",model_name="Qwen/Qwen2.5-0.5B-Instruct"} 1.7651232451e+09
"""
    + _histogram("vllm:time_to_first_token_seconds", [("0", MODEL), ("1", MODEL), ("0", OTHER)])
    + _histogram("vllm:e2e_request_latency_seconds", [("0", MODEL), ("1", MODEL)])
    + _histogram("vllm:inter_token_latency_seconds", [("0", MODEL), ("1", MODEL)])
    + _histogram("vllm:request_queue_time_seconds", [("0", MODEL), ("1", MODEL)])
    + _histogram("vllm:request_prefill_time_seconds", [("0", MODEL), ("1", MODEL)])
    + """\
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
"""
    + _cache_config("0")
    + _cache_config("1")
)

SGLANG = """\
# HELP sglang:num_running_reqs The number of running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{engine_type="unified",model_name="Qwen/Qwen2.5-7B-Instruct",pp_rank="0",tp_rank="0"} 12.0
# HELP sglang:num_queue_reqs The number of requests in the waiting queue.
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{engine_type="unified",model_name="Qwen/Qwen2.5-7B-Instruct",pp_rank="0",tp_rank="0"} 4.0
# HELP sglang:token_usage The token usage.
# TYPE sglang:token_usage gauge
sglang:token_usage{engine_type="unified",model_name="Qwen/Qwen2.5-7B-Instruct",pp_rank="0",tp_rank="0"} 0.28
# HELP sglang:max_total_num_tokens Maximum total number of tokens in the KV cache pool.
# TYPE sglang:max_total_num_tokens gauge
sglang:max_total_num_tokens{engine_type="unified",model_name="Qwen/Qwen2.5-7B-Instruct",pp_rank="0",tp_rank="0"} 161721.0
# HELP sglang:page_size The page size.
# TYPE sglang:page_size gauge
sglang:page_size{engine_type="unified",model_name="Qwen/Qwen2.5-7B-Instruct",pp_rank="0",tp_rank="0"} 1.0
# HELP sglang:num_retracted_requests_total Total number of retracted requests.
# TYPE sglang:num_retracted_requests_total counter
sglang:num_retracted_requests_total{engine_type="unified",model_name="Qwen/Qwen2.5-7B-Instruct",pp_rank="0",tp_rank="0"} 3.0
# HELP sglang:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE sglang:time_to_first_token_seconds histogram
sglang:time_to_first_token_seconds_sum{model_name="Qwen/Qwen2.5-7B-Instruct"} 2.3518979474117756e+06
sglang:time_to_first_token_seconds_bucket{le="0.001",model_name="Qwen/Qwen2.5-7B-Instruct"} 0.0
sglang:time_to_first_token_seconds_bucket{le="+Inf",model_name="Qwen/Qwen2.5-7B-Instruct"} 11008.0
sglang:time_to_first_token_seconds_count{model_name="Qwen/Qwen2.5-7B-Instruct"} 11008.0
"""

# The 2024 releases: a `name` label, and the batch limit stated as a gauge.
SGLANG_2024 = """\
# HELP sglang:max_total_num_tokens Maximum total number of tokens
# TYPE sglang:max_total_num_tokens gauge
sglang:max_total_num_tokens{name="google/gemma-2-9b-it"} 161721.0
# HELP sglang:max_running_requests Maximum running requests
# TYPE sglang:max_running_requests gauge
sglang:max_running_requests{name="google/gemma-2-9b-it"} 4097.0
# HELP sglang:num_running_reqs Number of running requests
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{name="google/gemma-2-9b-it"} 1.0
# HELP sglang:num_queue_reqs Number of queued requests
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{name="google/gemma-2-9b-it"} 0.0
# HELP sglang:token_usage Token usage
# TYPE sglang:token_usage gauge
sglang:token_usage{name="google/gemma-2-9b-it"} 0.03
"""

LLAMA_CPP = """\
# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed.
# TYPE llamacpp:prompt_tokens_total counter
llamacpp:prompt_tokens_total 33065
# HELP llamacpp:tokens_predicted_total Number of generation tokens processed.
# TYPE llamacpp:tokens_predicted_total counter
llamacpp:tokens_predicted_total 7801
# HELP llamacpp:prompt_tokens_seconds Average prompt throughput in tokens/s.
# TYPE llamacpp:prompt_tokens_seconds gauge
llamacpp:prompt_tokens_seconds 140.259
# HELP llamacpp:kv_cache_usage_ratio KV-cache usage. 1 means 100 percent usage.
# TYPE llamacpp:kv_cache_usage_ratio gauge
llamacpp:kv_cache_usage_ratio 0.63
# HELP llamacpp:kv_cache_tokens KV-cache tokens.
# TYPE llamacpp:kv_cache_tokens gauge
llamacpp:kv_cache_tokens 2580
# HELP llamacpp:requests_processing Number of requests processing.
# TYPE llamacpp:requests_processing gauge
llamacpp:requests_processing 2
# HELP llamacpp:requests_deferred Number of requests deferred.
# TYPE llamacpp:requests_deferred gauge
llamacpp:requests_deferred 1
"""

TGI = """\
# TYPE tgi_request_generated_tokens histogram
tgi_request_generated_tokens_bucket{le="1"} 0
tgi_request_generated_tokens_bucket{le="+Inf"} 44
tgi_request_generated_tokens_sum 8123
tgi_request_generated_tokens_count 44
# TYPE tgi_batch_max_total_tokens gauge
tgi_batch_max_total_tokens 163840
# TYPE tgi_batch_current_max_tokens gauge
tgi_batch_current_max_tokens 2048
# TYPE tgi_batch_current_size gauge
tgi_batch_current_size 4
# TYPE tgi_queue_size gauge
tgi_queue_size 7
# TYPE tgi_request_success counter
tgi_request_success 250
"""


# -- parse_prometheus ----------------------------------------------------------------------------


def test_parses_names_labels_and_values_skipping_help_and_type():
    samples = parse_prometheus(VLLM)
    assert "# HELP" not in "".join(samples)
    assert samples["process_virtual_memory_bytes"] == [({}, 2.1768704e10)]
    running = samples["vllm:num_requests_running"]
    assert running[0] == ({"engine": "0", "model_name": MODEL}, 5.0)
    assert [value for _, value in running] == [5.0, 3.0, 7.0]
    assert samples["python_info"][0][0]["patchlevel"] == "7"


def test_histograms_keep_their_bucket_sum_and_count_series():
    samples = parse_prometheus(VLLM)
    buckets = samples["vllm:time_to_first_token_seconds_bucket"]
    assert len(buckets) == 3 * len(_BUCKETS)
    assert buckets[-1] == ({"engine": "0", "model_name": OTHER, "le": "+Inf"}, 12.0)
    assert len(samples["vllm:time_to_first_token_seconds_sum"]) == 3
    assert len(samples["vllm:e2e_request_latency_seconds_count"]) == 2


def test_special_values_timestamps_and_spacing():
    text = (
        "a NaN\n"
        "b +Inf\n"
        "c -Inf 1700000000000\n"
        'd{x="1"} 2.5e-3 1700000000000\n'
        "e\t7\n"
        'f { x = "1" , y="2", } 3\n'
        "g{} 4\n"
        'h 5 # {trace_id="abc"} 1.0\n'
        "  i 6  \r\n"
    )
    samples = parse_prometheus(text)
    assert math.isnan(samples["a"][0][1])
    assert samples["b"] == [({}, math.inf)]
    assert samples["c"] == [({}, -math.inf)]
    assert samples["d"] == [({"x": "1"}, 0.0025)]
    assert samples["e"] == [({}, 7.0)]
    assert samples["f"] == [({"x": "1", "y": "2"}, 3.0)]
    assert samples["g"] == [({}, 4.0)]
    assert samples["h"] == [({}, 5.0)]
    assert samples["i"] == [({}, 6.0)]


def test_escaped_label_values():
    text = (
        r'm{path="C:\\models\\q.gguf",quote="say \"hi\"",nl="a\nb",odd="\t",brace="}{,=",u="☃"} 1'
        "\n"
    )
    (labels, value), *_ = parse_prometheus(text)["m"]
    assert value == 1.0
    assert labels == {
        "path": "C:\\models\\q.gguf",
        "quote": 'say "hi"',
        "nl": "a\nb",
        "odd": "\\t",  # an unknown escape stays as written
        "brace": "}{,=",
        "u": "☃",
    }


def test_an_escaped_backslash_before_n_is_not_a_newline():
    (labels, _), *_ = parse_prometheus('m{x="a\\\\nb"} 1\n')["m"]
    assert labels == {"x": "a\\nb"}


@pytest.mark.parametrize(
    "line",
    [
        "no_value",
        "bad_value abc",
        "underscored 1_000",
        'unclosed{a="b" 1',
        "unquoted{a=b} 1",
        'unterminated{a="b} 1',
        'half_escape{a="b\\"} 1',
        'no_comma{a="1" b="2"} 1',
        '{a="b"} 1',
        "9starts_with_digit 1",
        "has-dash 1",
        "has.dot 1",
        'bad_label{1a="b"} 1',
        "}{ 1",
        "\x00\x01\x02",
        "nul\x00 1",
    ],
)
def test_malformed_lines_are_skipped(line: str):
    samples = parse_prometheus(f"good 1\n{line}\nalso_good 2\n")
    assert samples == {"good": [({}, 1.0)], "also_good": [({}, 2.0)]}


def test_empty_and_comment_only_texts():
    assert parse_prometheus("") == {}
    assert parse_prometheus("\n\n# HELP x y\n# TYPE x gauge\n# just a comment\n") == {}


# -- parse_load: vLLM ----------------------------------------------------------------------------


def test_vllm_sums_data_parallel_engines_for_one_model():
    load = parse_load(VLLM, model=MODEL)
    assert load == Load(
        source="vllm /metrics",
        running=8,
        waiting=3,
        waiting_capacity=2,
        kv_usage=0.5,  # the mean of two equal caches at 0.75 and 0.25
        preemptions=5.0,
        # Each engine's cache_config_info is its own cache, less the null block vLLM keeps back.
        kv_cache_size_tokens=2 * (50176 - 128),
        kv_cache_max_concurrency=2 * 24.5,
        block_size=128,
        max_num_seqs=None,  # vLLM states it nowhere
    )


def test_vllm_model_filter_keeps_only_that_models_series():
    load = parse_load(VLLM, model=OTHER)
    assert load is not None
    assert (load.running, load.waiting, load.waiting_capacity) == (7, 0, 0)
    assert load.kv_usage == pytest.approx(0.9)
    assert load.preemptions == 9.0
    # cache_config_info has no model_name label, so it is kept under any filter
    assert load.block_size == 128


def test_vllm_without_model_sums_every_series():
    load = parse_load(VLLM)
    assert load is not None
    assert (load.running, load.waiting, load.waiting_capacity) == (15, 3, 2)
    assert load.kv_usage == pytest.approx((0.75 + 0.25 + 0.9) / 3)
    assert load.preemptions == 14.0


def test_vllm_unknown_model_gives_none():
    assert parse_load(VLLM, model="not-served") is None


def test_vllm_counts_given_as_floats_become_ints():
    load = parse_load("vllm:num_requests_running 3.0\nvllm:num_requests_waiting 2e0\n")
    assert load is not None
    assert load.running == 3 and isinstance(load.running, int)
    assert load.waiting == 2 and isinstance(load.waiting, int)


@pytest.mark.parametrize(
    ("size", "block", "usable"),
    [
        ("3072", "128", 2944),  # --num-gpu-blocks-override 24: vLLM runs 23 blocks
        ("3072", "None", 3072),  # no block size: nothing to take off
        ("128", "128", 128),  # a block size that is the whole cache is not believed
        ("3072", "-5", 3072),
    ],
)
def test_vllm_cache_size_leaves_out_the_null_block(size: str, block: str, usable: int):
    text = 'vllm:num_requests_running{engine="0",model_name="m"} 1.0\n' + _cache_config(
        "0", kv_cache_size_tokens=size, block_size=block
    )
    load = parse_load(text)
    assert load is not None
    assert load.kv_cache_size_tokens == usable


def test_vllm_cache_config_tolerates_none_and_missing_labels():
    text = 'vllm:num_requests_running{engine="0",model_name="m"} 1.0\n' + _cache_config(
        "0", kv_cache_max_concurrency="None", kv_cache_size_tokens="None"
    )
    load = parse_load(text)
    assert load is not None
    assert load.kv_cache_size_tokens is None
    assert load.kv_cache_max_concurrency is None
    assert load.block_size == 128
    older = (
        'vllm:num_requests_running 1.0\nvllm:cache_config_info{block_size="16",engine="0"} 1.0\n'
    )
    load = parse_load(older)
    assert load is not None
    assert (load.block_size, load.kv_cache_size_tokens, load.kv_cache_max_concurrency) == (
        16,
        None,
        None,
    )


def test_vllm_without_cache_config_or_waiting_reasons():
    load = parse_load('vllm:num_requests_waiting{model_name="m"} 4.0\n')
    assert load == Load(source="vllm /metrics", waiting=4)


def test_older_vllm_gpu_cache_usage_perc():
    text = (
        "# TYPE vllm:gpu_cache_usage_perc gauge\n"
        'vllm:gpu_cache_usage_perc{model_name="m"} 0.42\n'
        'vllm:num_requests_running{model_name="m"} 2.0\n'
        'vllm:num_requests_swapped{model_name="m"} 0.0\n'
    )
    load = parse_load(text, model="m")
    assert load is not None
    assert load.kv_usage == pytest.approx(0.42)
    assert load.waiting_capacity is None


def test_odd_values_are_clamped_or_dropped():
    text = (
        'vllm:num_requests_running{engine="0"} NaN\n'
        'vllm:num_requests_waiting{engine="0"} -1.0\n'
        'vllm:kv_cache_usage_perc{engine="0"} 1.2\n'
        'vllm:kv_cache_usage_perc{engine="1"} +Inf\n'
        'vllm:num_preemptions_total{engine="0"} NaN\n'
        'vllm:num_preemptions_total{engine="1"} 2.0\n'
    )
    load = parse_load(text)
    assert load is not None
    assert load.running is None
    assert load.waiting == 0
    assert load.kv_usage == 1.0  # the infinite series is left out, the other clamped
    assert load.preemptions == 2.0


def test_info_metric_alone_is_not_load():
    assert parse_load(_cache_config("0")) is None


# -- parse_load: the other servers ---------------------------------------------------------------


def test_sglang():
    assert parse_load(SGLANG, model="Qwen/Qwen2.5-7B-Instruct") == Load(
        source="sglang /metrics",
        running=12,
        waiting=4,
        kv_usage=pytest.approx(0.28),
        preemptions=3.0,
        kv_cache_size_tokens=161721,
        block_size=1,
    )
    assert parse_load(SGLANG, model="other") is None


def test_sglang_2024_states_the_batch_limit():
    load = parse_load(SGLANG_2024)
    assert load is not None
    assert (load.source, load.running, load.waiting) == ("sglang /metrics", 1, 0)
    assert load.max_num_seqs == 4097
    assert load.kv_cache_size_tokens == 161721
    # these series carry `name`, not `model_name`, so a model filter keeps them
    assert parse_load(SGLANG_2024, model="anything") == load


def test_llama_cpp():
    assert parse_load(LLAMA_CPP) == Load(
        source="llama.cpp /metrics", running=2, waiting=1, kv_usage=pytest.approx(0.63)
    )
    recent = "\n".join(line for line in LLAMA_CPP.splitlines() if "kv_cache_usage" not in line)
    assert parse_load(recent) == Load(source="llama.cpp /metrics", running=2, waiting=1)


def test_tgi():
    assert parse_load(TGI) == Load(
        source="tgi /metrics", running=4, waiting=7, kv_cache_size_tokens=163840
    )


def test_vllm_wins_when_dialects_are_mixed():
    load = parse_load(TGI + VLLM)
    assert load is not None and load.source == "vllm /metrics"


@pytest.mark.parametrize(
    "text",
    [
        "",
        "\n\n",
        "# HELP vllm:num_requests_running x\n# TYPE vllm:num_requests_running gauge\n",
        'python_gc_objects_collected_total{generation="0"} 1.0\nup 1\n',
        "<html><body>404 Not Found</body></html>",
        '{"object": "list", "data": []}',
    ],
)
def test_no_known_gauges_gives_none(text: str):
    assert parse_load(text) is None


def test_load_is_a_frozen_keyword_only_record():
    load = Load(source="tgi /metrics", running=1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        load.running = 2  # type: ignore[misc]
    with pytest.raises(TypeError):
        Load("tgi /metrics")  # type: ignore[misc]


# -- robustness and speed ------------------------------------------------------------------------


def test_random_garbage_never_raises():
    rng = random.Random(20240607)
    for _ in range(400):
        blob = bytes(rng.randrange(256) for _ in range(rng.randrange(400)))
        for text in (blob.decode("utf-8", "replace"), blob.decode("latin-1")):
            assert isinstance(parse_prometheus(text), dict)
            load = parse_load(text)
            assert load is None or isinstance(load, Load)


def test_mutated_scrapes_never_raise():
    rng = random.Random(7)
    corpus = [VLLM, SGLANG, SGLANG_2024, LLAMA_CPP, TGI]
    alphabet = '{}",=\\\n \t#:._-+eE0123456789naNInf\x00☃'
    for _ in range(300):
        chars = list(rng.choice(corpus))
        for _ in range(rng.randrange(1, 40)):
            at = rng.randrange(len(chars))
            action = rng.randrange(3)
            if action == 0:
                del chars[at]
            elif action == 1:
                chars.insert(at, rng.choice(alphabet))
            else:
                chars[at] = rng.choice(alphabet)
        text = "".join(chars)[: rng.randrange(1, len(chars) + 1)]
        samples = parse_prometheus(text)
        assert all(isinstance(v, float) for series in samples.values() for _, v in series)
        load = parse_load(text, model=rng.choice([None, MODEL, OTHER]))
        if load is not None:
            assert load.kv_usage is None or 0.0 <= load.kv_usage <= 1.0
            assert load.running is None or load.running >= 0


@pytest.mark.timeout(10)  # catastrophic backtracking would hang here; speed is a benchmark's job
def test_pathological_label_values_do_not_backtrack():
    nasty = 'm{a="' + '\\"' * 5000 + "}" * 5000 + " 1\n"  # never closed
    nasty += "m{" + 'a="b",' * 5000 + "} 1\n"
    assert len(parse_prometheus(nasty)["m"]) == 1


# --- hostile scrapes (found by tests/test_fuzz.py unless said otherwise) --------------------------
def test_two_series_of_1e308_do_not_overflow_the_sum():
    # Found: math.fsum raised OverflowError ("intermediate overflow in fsum") on two data-parallel
    # series of 1e308, out of parse_load and the poller.
    text = "\n".join(
        f'{name}{{engine="{e}"}} 1e308'
        for name in ("vllm:num_requests_running", "vllm:kv_cache_usage_perc", "vllm:num_preemptions_total")
        for e in (0, 1)
    )
    load = parse_load(text + "\nvllm:num_requests_waiting 0\n")
    assert load is not None
    assert load.running is None and load.waiting == 0
    assert load.preemptions is None and load.kv_usage == 1.0


def test_a_count_no_float_holds_exactly_is_dropped():
    # Not a crash: a running count of 1e308 was passed on as a batch size to learn, and the
    # limit's ceiling (four times the batch) became 7e308.
    load = parse_load("vllm:num_requests_running 1e300\nvllm:num_requests_waiting 9007199254740992\n")
    assert load is not None and load.running is None and load.waiting == 2**53
