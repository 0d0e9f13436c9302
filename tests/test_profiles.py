"""The launch profiles and command builder: pure, with the machine's facts injected."""

from __future__ import annotations

import pytest

from dsclient.launcher._command import build_command, format_cpu_list, is_loopback
from dsclient.launcher._hardware import parse_meminfo, parse_nvidia_smi
from dsclient.launcher._profiles import (
    PROFILES,
    Hardware,
    ModelFacts,
    caps_for_version,
    describe_profiles,
)

CPU2 = Hardware(cpu_ids=(0, 1), mem_gib=24)
GPU24 = Hardware(gpu_count=1, gpu_mem_gib=24, gpu_name="L4", fp8_kv_supported=True, mem_gib=64)
GPU16_OLD = Hardware(gpu_count=1, gpu_mem_gib=16, gpu_name="T4", mem_gib=32)
TINY = ModelFacts(max_position_embeddings=4096, num_layers=2, num_kv_heads=2, head_dim=64,
                  dtype="float32")  # fmt: skip


def plan(hardware: Hardware = CPU2, **kw: object):
    kw.setdefault("port", 8000)
    return build_command("/m/tiny", hardware=hardware, python="/venv/bin/python", **kw)  # type: ignore[arg-type]


def flag(argv: tuple[str, ...], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else None


def test_cpu_fixture_plan_matches_what_worked_here():
    p = plan(max_num_seqs=8, max_model_len=2048, served_model_name="tiny", dtype="float32",
             model_facts=TINY, vllm_version="0.32.0")  # fmt: skip
    assert p.argv[:3] == ("/venv/bin/python", "-m", "vllm.entrypoints.openai.api_server")
    assert flag(p.argv, "--max-num-seqs") == "8"
    assert flag(p.argv, "--max-model-len") == "2048"
    assert flag(p.argv, "--served-model-name") == "tiny"
    assert flag(p.argv, "--host") == "127.0.0.1"
    assert flag(p.argv, "--dtype") == "float32"
    assert "--gpu-memory-utilization" not in p.argv
    assert p.env["VLLM_CPU_KVCACHE_SPACE"] == "1"
    assert p.env["VLLM_CPU_OMP_THREADS_BIND"] == "0"  # one core left free
    assert p.env["HF_HUB_OFFLINE"] == "1"
    assert p.url == "http://127.0.0.1:8000"
    assert (p.max_num_seqs, p.max_model_len) == (8, 2048)


def test_shell_line_is_exact():
    p = plan(max_num_seqs=8, max_model_len=2048, served_model_name="tiny", model_facts=TINY)
    line = p.shell()
    assert line.startswith("DO_NOT_TRACK=1 HF_HUB_OFFLINE=1 VLLM_CPU_KVCACHE_SPACE=1")
    assert line.endswith("--max-num-seqs 8 --max-model-len 2048")


@pytest.mark.parametrize(
    ("profile", "seqs", "ctx"),
    [("latency-sensitive", 4, 4096), ("balanced", 8, 4096), ("throughput-first", 16, 2048)],
)
def test_cpu_profiles(profile, seqs, ctx):
    p = plan(profile=profile)
    assert (p.max_num_seqs, p.max_model_len) == (seqs, ctx)
    assert "--kv-cache-dtype" not in p.argv  # no fp8 KV cache on the CPU


@pytest.mark.parametrize(
    ("profile", "seqs", "util"),
    [("latency-sensitive", 6, "0.85"), ("balanced", 12, "0.9"), ("throughput-first", 24, "0.92")],
)
def test_gpu_max_num_seqs_from_memory_and_said_so(profile, seqs, util):
    p = plan(GPU24, profile=profile)
    assert p.max_num_seqs == seqs
    assert flag(p.argv, "--max-num-seqs") == str(seqs)
    assert flag(p.argv, "--gpu-memory-utilization") == util
    assert any("24 GiB / 2" in n for n in p.notes)
    assert "VLLM_CPU_KVCACHE_SPACE" not in p.env


def test_gpu_explicit_max_num_seqs_wins():
    p = plan(GPU24, max_num_seqs=3, gpu_memory_utilization=0.5)
    assert flag(p.argv, "--max-num-seqs") == "3"
    assert flag(p.argv, "--gpu-memory-utilization") == "0.5"
    assert not any("GiB / 2" in n for n in p.notes)


def test_fp8_kv_cache_only_where_supported():
    assert flag(plan(GPU24, profile="latency-sensitive").argv, "--kv-cache-dtype") == "fp8"
    old = plan(GPU16_OLD, profile="latency-sensitive")
    assert "--kv-cache-dtype" not in old.argv
    assert any("no fp8" in n for n in old.notes)
    with pytest.raises(ValueError, match="compute capability"):
        plan(GPU16_OLD, kv_cache_dtype="fp8")


def test_kv_cache_dtype_checked_against_version_and_backend():
    with pytest.raises(ValueError, match=r"not accepted by vLLM 0\.32 on the CPU backend"):
        plan(kv_cache_dtype="nvfp4")
    with pytest.raises(ValueError, match="use one of"):
        plan(GPU24, kv_cache_dtype="fp7")
    assert flag(plan(GPU24, kv_cache_dtype="nvfp4").argv, "--kv-cache-dtype") == "nvfp4"
    with pytest.raises(ValueError, match=r"not accepted by vLLM <0\.10"):
        plan(GPU24, kv_cache_dtype="nvfp4", vllm_version="0.6.3")


@pytest.mark.parametrize("bad", [0, -32, 48, 16, 8192, True])
def test_cpu_block_size_must_be_multiple_of_32(bad):
    with pytest.raises(ValueError, match="block_size must be a multiple of 32"):
        plan(block_size=bad)


def test_block_sizes_accepted():
    assert flag(plan(block_size=128).argv, "--block-size") == "128"
    assert flag(plan(GPU24, block_size=16).argv, "--block-size") == "16"
    with pytest.raises(ValueError, match="multiple of 16"):
        plan(GPU24, block_size=24)


def test_model_limits():
    short = ModelFacts(max_position_embeddings=1024)
    p = plan(model_facts=short)  # profile wants 4096: capped, and said so
    assert p.max_model_len == 1024
    assert any("model's own limit" in n for n in p.notes)
    with pytest.raises(ValueError, match="max_position_embeddings \\(1024\\)"):
        plan(model_facts=short, max_model_len=2048)


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"max_num_seqs": 0}, "max_num_seqs must be an int"),
        ({"max_model_len": -1}, "max_model_len must be an int"),
        ({"profile": "fastest"}, "profile must be one of"),
        ({"dtype": "int3"}, "dtype must be one of"),
        ({"port": 70000}, "port must be in"),
        ({"gpu_memory_utilization": 0.9}, "for GPUs"),
        ({"kv_cache_gib": 20}, "more than half"),
        ({"extra_args": ["--port", "9"]}, "--port is set by dsclient"),
        ({"extra_args": ["--max-model-len=9"]}, "--max-model-len is set by dsclient"),
        # vLLM's parser reads these as dsclient's own flags too
        ({"extra_args": ["--max_num_seqs", "64"]}, "vLLM reads it as --max-num-seqs"),
        ({"extra_args": ["--hos", "0.0.0.0"]}, "vLLM reads it as --host"),
        ({"extra_args": ["--served_model=x"]}, "vLLM reads it as --served-model-name"),
        ({"extra_args": ["--device-memory-utilization", "1"]}, "as --gpu-memory-utilization"),
        ({"extra_args": ["--max-mod", "9"]}, "vLLM reads it as --max-model-len"),
        ({"extra_args": ["--m", "x"]}, "--max-model-len or --max-num-seqs or --model"),
    ],
)
def test_nonsense_is_refused_with_a_clear_message(kw, match):
    with pytest.raises(ValueError, match=match):
        plan(**kw)


def test_gpu_utilization_range():
    with pytest.raises(ValueError, match=r"gpu_memory_utilization must be in \(0, 1\]"):
        plan(GPU24, gpu_memory_utilization=1.5)


def test_kv_cache_space_sized_from_model_and_batch():
    facts = ModelFacts(
        max_position_embeddings=32768, num_layers=32, num_kv_heads=8, head_dim=128, dtype="bfloat16"
    )  # fmt: skip  (a Llama-3-8B shape)
    p = plan(model_facts=facts, max_num_seqs=4, max_model_len=8192)  # 4 GiB exactly
    assert p.env["VLLM_CPU_KVCACHE_SPACE"] == "4"
    with pytest.raises(ValueError, match="lower max_num_seqs or max_model_len"):
        plan(model_facts=facts, max_num_seqs=64, max_model_len=8192)
    assert plan(kv_cache_gib=3).env["VLLM_CPU_KVCACHE_SPACE"] == "3"
    assert plan().env["VLLM_CPU_KVCACHE_SPACE"] == "4"  # shape unknown: vLLM's default


def test_thread_binding_leaves_one_cpu():
    assert plan(Hardware(cpu_ids=(0,), mem_gib=8)).env["VLLM_CPU_OMP_THREADS_BIND"] == "0"
    big = Hardware(cpu_ids=(0, 1, 2, 3, 8, 9), mem_gib=64)
    assert plan(big).env["VLLM_CPU_OMP_THREADS_BIND"] == "0-3,8"
    assert format_cpu_list([5, 2, 3, 4, 9]) == "2-5,9"


def test_engine_core_goes_to_the_engines_cpus_on_the_cpu_backend_only():
    two = plan()
    assert two.engine_core_cpus == (0,)  # with the engine's threads; CPU 1 stays the API's
    assert any("EngineCore moved to CPUs 0" in n for n in two.notes)
    big = Hardware(cpu_ids=(0, 1, 2, 3, 8, 9), mem_gib=64)
    assert plan(big).engine_core_cpus == (0, 1, 2, 3, 8)
    one = plan(Hardware(cpu_ids=(0,), mem_gib=8))
    assert one.engine_core_cpus is None  # one CPU: nothing to separate
    assert not any("EngineCore" in n for n in one.notes)
    assert plan(GPU24).engine_core_cpus is None


def test_host_and_default_name():
    p = plan(host="0.0.0.0")
    assert flag(p.argv, "--host") == "0.0.0.0"
    assert p.url == "http://127.0.0.1:8000"
    assert p.served_model_name == "tiny"
    assert any(n.startswith("warning: host 0.0.0.0 is not loopback") for n in p.notes)
    p = build_command("org/model-x", hardware=CPU2, python="py", port=1)
    assert p.served_model_name == "model-x"


def test_model_facts_from_config():
    config = {
        "hidden_size": 256,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_hidden_layers": 2,
        "max_position_embeddings": 4096,
        "torch_dtype": "float32",
    }
    f = ModelFacts.from_config(config)
    assert f == TINY
    assert f.kv_bytes_per_token(4) == 2048
    assert ModelFacts.from_config({}).kv_bytes_per_token(2) is None


def test_caps_for_version():
    assert caps_for_version("0.32.0").cpu_block_multiple == 32
    assert caps_for_version("0.6.3.post1").version == "<0.10"
    assert caps_for_version("1.2.0").version == "0.32"
    assert caps_for_version(None).version == "0.32"


def test_describe_profiles_lists_every_flag():
    text = describe_profiles()
    for name, prof in PROFILES.items():
        assert name in text
        assert f"--max-model-len {prof.max_model_len}" in text
    assert "--kv-cache-dtype fp8" in text


def test_hardware_validation_and_parsers():
    with pytest.raises(ValueError, match="gpu_mem_gib"):
        Hardware(gpu_count=1)
    with pytest.raises(ValueError, match="cpu_ids"):
        Hardware(cpu_ids=())
    cards = parse_nvidia_smi("NVIDIA L4, 23034, 8.9\nTesla T4, 15360, 7.5\ngarbage\n")
    assert cards[0] == ("NVIDIA L4", pytest.approx(22.49, abs=0.01), (8, 9))
    assert cards[1][2] == (7, 5)
    assert parse_meminfo("MemTotal:       24576000 kB\n") == pytest.approx(23.44, abs=0.01)


# --- bind address and dev mode: safe unless asked -------------------------------------------


def test_defaults_bind_loopback_and_keep_dev_routes_closed():
    p = plan()
    assert flag(p.argv, "--host") == "127.0.0.1"
    assert p.env["VLLM_SERVER_DEV_MODE"] == "0"  # set, so an inherited 1 is overridden
    assert not any("warning" in n or "DEV_MODE" in n for n in p.notes)
    assert "VLLM_SERVER_DEV_MODE=0" in p.shell()
    gpu = plan(GPU24)
    assert flag(gpu.argv, "--host") == "127.0.0.1" and gpu.env["VLLM_SERVER_DEV_MODE"] == "0"


def test_dev_mode_is_opt_in_and_loopback_only():
    p = plan(dev_mode=True)
    assert p.env["VLLM_SERVER_DEV_MODE"] == "1"
    assert any("/collective_rpc" in n and "/server_info" in n for n in p.notes)
    assert plan(dev_mode=True, host="::1").env["VLLM_SERVER_DEV_MODE"] == "1"
    for host in ("0.0.0.0", "::", "10.1.2.3", "myhost"):
        with pytest.raises(ValueError, match=f"host {host!r} is not loopback"):
            plan(dev_mode=True, host=host)


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "localhost", "LOCALHOST", "::1"])
def test_loopback_hosts_get_no_warning(host):
    assert is_loopback(host)
    p = plan(host=host)
    assert flag(p.argv, "--host") == host
    assert not [n for n in p.notes if n.startswith("warning")]


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "192.168.1.5", "example.org", "10.0.0.1"])
def test_other_hosts_are_passed_as_given_with_a_warning(host):
    assert not is_loopback(host)
    p = plan(host=host)
    assert flag(p.argv, "--host") == host
    (warning,) = [n for n in p.notes if n.startswith("warning")]
    assert f"host {host} is not loopback" in warning and "--api-key" in warning


@pytest.mark.parametrize(
    "extra",
    [
        ["--enable-prefix-caching"],
        ["--max-num-batched-tokens", "4096"],
        ["--model-impl", "vllm"],  # starts with an owned flag: not a prefix of one
        ["--hf-overrides.head_dim", "64"],
        ["-O3"],
        ["--api-key", "s3cret"],
    ],
)
def test_vllm_flags_of_its_own_pass_through(extra):
    p = plan(extra_args=extra)
    assert list(p.argv[-len(extra) :]) == extra
    assert p.extra_args == tuple(extra)
