"""The vLLM command builder: pure policy, no I/O.

:func:`build_command` turns a model, a profile (:mod:`dsclient.launcher._profiles`), the
machine's facts (:class:`~dsclient.launcher._profiles.Hardware`, detected elsewhere) and the
user's overrides into a :class:`LaunchPlan`: the exact argv and environment to start vLLM with,
plus notes that say where each derived number came from. Values vLLM would refuse (or silently
mangle) are refused here with a ``ValueError`` that names the setting and what is allowed. Each
setting is decided by a part of its own (``_batch_size``, ``_context_length``, ``_dtypes``, ...),
in the order :func:`build_command` asks them.

Example::

    plan = build_command("/models/tiny", hardware=Hardware(cpu_ids=(0, 1), mem_gib=24),
                         python="/venv/bin/python", port=8000)
    subprocess.Popen(plan.argv, env={**os.environ, **plan.env})
"""

from __future__ import annotations

import ipaddress
import math
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from ._profiles import (
    DEFAULT_PROFILE,
    PROFILES,
    Hardware,
    ModelFacts,
    Profile,
    VllmCaps,
    caps_for_version,
)
from ._redact import is_secret_name, redact_argv

__all__ = [
    "OWNED_DESTS",
    "LaunchPlan",
    "build_command",
    "format_cpu_list",
    "is_loopback",
]


@dataclass(frozen=True, kw_only=True)
class LaunchPlan:
    """The exact command and environment to start vLLM with, and why.

    ``env`` holds only the variables dsclient sets; the launcher adds them to its own environment.
    ``extra_args`` are the flags passed through to vLLM (the end of ``argv``).
    """

    argv: tuple[str, ...]
    env: Mapping[str, str]
    url: str
    served_model_name: str
    max_num_seqs: int
    max_model_len: int
    profile: str
    notes: tuple[str, ...] = field(default=())
    #: CPU backend: the CPUs the launcher moves vLLM's EngineCore process to once it runs (the
    #: engine's own, where its busy-polling costs nothing), or ``None`` to leave it alone.
    engine_core_cpus: tuple[int, ...] | None = None
    extra_args: tuple[str, ...] = ()

    def shell(self) -> str:
        """The plan as one shell line (``VAR=value ... python -m ...``), for ``--dry-run`` and
        the log's first line; secrets (``--api-key``'s value, ``*_KEY`` / ``*_TOKEN`` variables)
        show as ``***``."""
        env = " ".join(
            f"{k}={'***' if is_secret_name(k) else shlex.quote(v)}"
            for k, v in sorted(self.env.items())
        )
        return f"{env} {shlex.join(redact_argv(self.argv))}".strip()

    def __repr__(self) -> str:
        return (
            f"LaunchPlan(url={self.url!r}, profile={self.profile!r},"
            f" max_num_seqs={self.max_num_seqs}, max_model_len={self.max_model_len},"
            f" argv={redact_argv(self.argv)!r})"
        )


# Flags dsclient sets itself: passing them again after ``--`` would make the record lie (or,
# for --host, bind where the caller did not ask). Aliases vLLM 0.32 has for them too.
_OWNED_FLAGS = frozenset(
    {
        "--model",
        "--served-model-name",
        "--host",
        "--port",
        "--max-num-seqs",
        "--max-model-len",
        "--dtype",
        "--kv-cache-dtype",
        "--block-size",
        "--gpu-memory-utilization",
    }
)
_OWNED_ALIASES = {"--device-memory-utilization": "--gpu-memory-utilization"}
#: The parser destinations of the flags dsclient sets (``"host"``, ``"max_num_seqs"``, ...).
OWNED_DESTS: tuple[str, ...] = tuple(sorted(f[2:].replace("-", "_") for f in _OWNED_FLAGS))


def _owned_flags(arg: str) -> list[str]:
    """The dsclient-owned flags ``arg`` may set in vLLM (none for a flag of vLLM's own).

    vLLM's parser reads ``--max_num_seqs`` as ``--max-num-seqs``, ``--device-memory-utilization``
    as ``--gpu-memory-utilization`` and, as argparse does, a unique prefix (``--hos``) as the
    whole flag; a prefix of several is refused by vLLM, and here.
    """
    if not arg.startswith("--") or len(arg) <= 2:
        return []
    head = arg.split("=", 1)[0].split(".", 1)[0]  # --flag.key: a JSON field of --flag
    flag = head.replace("_", "-")
    flag = _OWNED_ALIASES.get(flag, flag)
    if flag in _OWNED_FLAGS:
        return [flag]
    if head != arg.split("=", 1)[0]:
        return []  # prefixes do not apply to --flag.key
    found = {
        _OWNED_ALIASES.get(f, f) for f in (*_OWNED_FLAGS, *_OWNED_ALIASES) if f.startswith(flag)
    }
    return sorted(found)


def is_loopback(host: str) -> bool:
    """Whether ``host`` is this machine only: ``localhost``, ``127.0.0.0/8`` or ``::1``."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a name that may resolve anywhere


def format_cpu_list(ids: Sequence[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2,5"``, the form ``VLLM_CPU_OMP_THREADS_BIND`` takes."""
    out: list[str] = []
    ordered = sorted(set(ids))
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        out.append(str(ordered[i]) if i == j else f"{ordered[i]}-{ordered[j]}")
        i = j + 1
    return ",".join(out)


_DTYPE_BYTES = {"float32": 4, "float": 4, "float16": 2, "half": 2, "bfloat16": 2}


def build_command(
    model: str,
    *,
    hardware: Hardware,
    python: str,
    port: int,
    profile: str = DEFAULT_PROFILE,
    host: str = "127.0.0.1",
    served_model_name: str | None = None,
    max_num_seqs: int | None = None,
    max_model_len: int | None = None,
    dtype: str | None = None,
    kv_cache_dtype: str | None = None,
    block_size: int | None = None,
    gpu_memory_utilization: float | None = None,
    kv_cache_gib: int | None = None,
    model_facts: ModelFacts | None = None,
    vllm_version: str | None = None,
    extra_args: Sequence[str] = (),
    dev_mode: bool = False,
) -> LaunchPlan:
    """Decide how to start vLLM for ``model`` on ``hardware``; refuse values vLLM would not take.

    Example::

        plan = build_command("/m/tiny", hardware=Hardware(cpu_ids=(0, 1), mem_gib=24),
                             python="python", port=8000, max_num_seqs=8, max_model_len=2048)
        plan.env["VLLM_CPU_OMP_THREADS_BIND"]   # "0": one core for the engine, one left free

    Parameters:
        model: a local model folder or a model id vLLM can load.
        hardware: the machine's facts.
        python: the server venv's interpreter (vLLM runs as ``python -m
            vllm.entrypoints.openai.api_server``, which works for ``vllm`` and ``vllm-cpu``).
        port: the TCP port to listen on.
        profile: a name from :data:`PROFILES`.
        host: the address to bind; loopback unless the caller means otherwise (any other
            address gets a warning note: vLLM's API then answers other machines).
        served_model_name: the name clients use; default the model folder's base name.
        max_num_seqs: the batch size; default from the profile (CPU) or GPU memory / 2 (GPU).
        max_model_len: the context length; default from the profile, capped to the model's.
        dtype: weights' dtype (``auto``, ``float32``, ...); default vLLM's ``auto``.
        kv_cache_dtype: KV cache dtype; default ``fp8`` for latency-sensitive on fp8 hardware.
        block_size: KV cache block size in tokens; default vLLM's.
        gpu_memory_utilization: share of the GPU vLLM may take; default from the profile.
        kv_cache_gib: CPU backend only, ``VLLM_CPU_KVCACHE_SPACE`` in GiB; default: what
            ``max_num_seqs`` full contexts need (at least 1), when the model's shape is known.
        model_facts: the model's ``config.json`` facts, for the checks that need them.
        vllm_version: the installed vLLM version, for the per-version checks.
        extra_args: more vLLM flags, passed through after dsclient's own.
        dev_mode: set ``VLLM_SERVER_DEV_MODE=1``, which opens vLLM's development routes
            (``/server_info``, ``/collective_rpc``, ``/sleep``, ``/update_weights``, ...);
            loopback hosts only. Otherwise ``VLLM_SERVER_DEV_MODE=0``, whatever the launching
            environment says.
    """
    if profile not in PROFILES:
        raise ValueError(f"profile must be one of {sorted(PROFILES)}, got {profile!r}")
    prof = PROFILES[profile]
    caps = caps_for_version(vllm_version)
    facts = model_facts or ModelFacts()
    # Each part checks its own values and appends its reasons to the notes, in this order.
    notes: list[str] = [f"profile {prof.name}: {prof.summary}"]
    _check_address(host, port, dev_mode)
    max_num_seqs = _batch_size(max_num_seqs, prof, hardware, notes)
    max_model_len = _context_length(max_model_len, prof, facts, notes)
    kv_cache_dtype = _dtypes(dtype, kv_cache_dtype, prof, hardware, caps, notes)
    _check_block_size(block_size, caps, on_gpu=hardware.gpu_count > 0)
    env = _environment(host, dev_mode, notes)
    engine_core_cpus: tuple[int, ...] | None = None
    if hardware.gpu_count > 0:
        gpu_memory_utilization = _gpu_memory(gpu_memory_utilization, kv_cache_gib, prof, notes)
    else:
        if gpu_memory_utilization is not None:
            raise ValueError(
                "gpu_memory_utilization is for GPUs; on the CPU backend use kv_cache_gib"
            )
        kv_cache_gib = _cpu_kv_cache_gib(
            kv_cache_gib, hardware, facts, dtype, max_num_seqs, max_model_len, notes
        )
        env["VLLM_CPU_KVCACHE_SPACE"] = str(kv_cache_gib)
        env["VLLM_CPU_OMP_THREADS_BIND"] = _cpu_bind(hardware, notes)
        engine_core_cpus = _engine_core_cpus(hardware, notes)
    _check_extra_args(extra_args)

    name = served_model_name or _default_name(model)
    argv = [
        python, "-m", "vllm.entrypoints.openai.api_server",
        "--model", model,
        "--served-model-name", name,
        "--host", host,
        "--port", str(port),
        "--max-num-seqs", str(max_num_seqs),
        "--max-model-len", str(max_model_len),
    ]  # fmt: skip
    if dtype is not None:
        argv += ["--dtype", dtype]
    if kv_cache_dtype is not None:
        argv += ["--kv-cache-dtype", kv_cache_dtype]
    if block_size is not None:
        argv += ["--block-size", str(block_size)]
    if gpu_memory_utilization is not None:
        argv += ["--gpu-memory-utilization", f"{gpu_memory_utilization:g}"]
    argv += list(extra_args)
    return LaunchPlan(
        argv=tuple(argv),
        env=env,
        url=_url(host, port),
        served_model_name=name,
        max_num_seqs=max_num_seqs,
        max_model_len=max_model_len,
        profile=prof.name,
        notes=tuple(notes),
        engine_core_cpus=engine_core_cpus,
        extra_args=tuple(extra_args),
    )


# --- the parts of build_command, in the order it asks them -------------------------------------


def _check_address(host: str, port: int, dev_mode: bool) -> None:
    if not 0 < port < 65536:
        raise ValueError(f"port must be in 1..65535, got {port!r}")
    if not host:
        raise ValueError("host must not be empty")
    if dev_mode and not is_loopback(host):
        raise ValueError(
            f"dev_mode opens vLLM's development routes (/collective_rpc, /sleep,"
            f" /update_weights, ...), which take no API key; host {host!r} is not loopback."
            " Use 127.0.0.1 with dev_mode, or leave dev_mode off"
        )


def _batch_size(given: int | None, prof: Profile, hardware: Hardware, notes: list[str]) -> int:
    """``--max-num-seqs``: the given one, else GPU memory / 2 x the profile's factor (GPU) or
    the profile's CPU batch."""
    max_num_seqs = given
    if max_num_seqs is None:
        if hardware.gpu_count > 0:
            base = hardware.gpu_mem_gib / 2
            max_num_seqs = max(1, math.floor(base * prof.gpu_seqs_per_2gib))
            notes.append(
                f"max_num_seqs={max_num_seqs}: from GPU memory, {hardware.gpu_mem_gib:g} GiB / 2"
                f" = {base:g} (rule of thumb), x{prof.gpu_seqs_per_2gib:g} for {prof.name};"
                " pass --max-num-seqs to choose"
            )
        else:
            max_num_seqs = prof.cpu_max_num_seqs
            notes.append(f"max_num_seqs={max_num_seqs}: the {prof.name} profile's CPU batch")
    _check_int("max_num_seqs", max_num_seqs, 1, 65536)
    return max_num_seqs


def _context_length(given: int | None, prof: Profile, facts: ModelFacts, notes: list[str]) -> int:
    """``--max-model-len``: the given one (at most the model's own), else the profile's, capped
    to the model's."""
    model_max = facts.max_position_embeddings
    max_model_len = given
    if max_model_len is None:
        max_model_len = prof.max_model_len
        if model_max is not None and model_max < max_model_len:
            notes.append(
                f"max_model_len={model_max}: the model's own limit, below the profile's"
                f" {max_model_len}"
            )
            max_model_len = model_max
    else:
        _check_int("max_model_len", max_model_len, 1, 10_000_000)
        if model_max is not None and max_model_len > model_max:
            raise ValueError(
                f"max_model_len={max_model_len} is more than the model's"
                f" max_position_embeddings ({model_max}); vLLM refuses it. Use at most {model_max}."
            )
    _check_int("max_model_len", max_model_len, 1, 10_000_000)
    return max_model_len


def _dtypes(
    dtype: str | None,
    kv_cache_dtype: str | None,
    prof: Profile,
    hardware: Hardware,
    caps: VllmCaps,
    notes: list[str],
) -> str | None:
    """Check ``dtype`` and ``kv_cache_dtype`` against this vLLM; the KV cache dtype to pass
    (``fp8`` for a profile that wants it on hardware that has it)."""
    on_gpu = hardware.gpu_count > 0
    if dtype is not None and dtype not in caps.model_dtypes:
        raise ValueError(f"dtype must be one of {sorted(caps.model_dtypes)}, got {dtype!r}")
    allowed_kv = caps.kv_cache_dtypes if on_gpu else caps.cpu_kv_cache_dtypes
    if kv_cache_dtype is None:
        if prof.fp8_kv_cache and on_gpu and hardware.fp8_kv_supported:
            notes.append("kv_cache_dtype=fp8: this GPU stores the KV cache in fp8 (half the room)")
            return "fp8"
        if prof.fp8_kv_cache:
            notes.append(
                "kv_cache_dtype left to vLLM: no fp8 KV cache on this hardware"
                " (needs CUDA compute capability >= 8.9)"
            )
    elif kv_cache_dtype not in allowed_kv:
        where = "GPU" if on_gpu else "CPU backend"
        raise ValueError(
            f"kv_cache_dtype {kv_cache_dtype!r} is not accepted by vLLM {caps.version}"
            f" on the {where}; use one of {sorted(allowed_kv)}"
        )
    elif kv_cache_dtype.startswith("fp8") and on_gpu and not hardware.fp8_kv_supported:
        raise ValueError(
            f"kv_cache_dtype {kv_cache_dtype!r} needs fp8 support (CUDA compute capability"
            f" >= 8.9); {hardware.gpu_name or 'this GPU'} does not have it. Use 'auto'."
        )
    return kv_cache_dtype


def _check_block_size(block_size: int | None, caps: VllmCaps, *, on_gpu: bool) -> None:
    if block_size is None:
        return
    multiple = caps.gpu_block_multiple if on_gpu else caps.cpu_block_multiple
    if (
        isinstance(block_size, bool)
        or not isinstance(block_size, int)
        or block_size < multiple
        or block_size % multiple
        or block_size > caps.max_block_size
    ):
        where = "GPU" if on_gpu else "CPU backend"
        raise ValueError(
            f"block_size must be a multiple of {multiple} between {multiple} and"
            f" {caps.max_block_size} for vLLM {caps.version} on the {where}, got {block_size!r}"
        )


def _environment(host: str, dev_mode: bool, notes: list[str]) -> dict[str, str]:
    """The variables every launch sets, and the notes on what the address and dev mode open."""
    env: dict[str, str] = {
        "HF_HUB_OFFLINE": "1",  # a launcher must not start downloading behind the user's back
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        # Set either way: an inherited VLLM_SERVER_DEV_MODE=1 must not open the dev routes.
        "VLLM_SERVER_DEV_MODE": "1" if dev_mode else "0",
    }
    if dev_mode:
        notes.append(
            "VLLM_SERVER_DEV_MODE=1 (dev_mode): /server_info reports max_num_seqs, and vLLM's"
            " development routes (/collective_rpc, /sleep, /update_weights, /reset_prefix_cache,"
            " ...) are open to anyone who reaches the port"
        )
    if not is_loopback(host):
        notes.append(
            f"warning: host {host} is not loopback: vLLM answers other machines that reach"
            " this address; --api-key after '--' guards only its /v1 routes (/metrics,"
            " /tokenize and others stay open)"
        )
    return env


def _gpu_memory(
    given: float | None, kv_cache_gib: int | None, prof: Profile, notes: list[str]
) -> float:
    """``--gpu-memory-utilization`` on a GPU: the given share, else the profile's."""
    gpu_memory_utilization = given
    if gpu_memory_utilization is None:
        gpu_memory_utilization = prof.gpu_memory_utilization
        notes.append(
            f"gpu_memory_utilization={gpu_memory_utilization}: the {prof.name} profile's"
            " share of the card (the rest is headroom for CUDA graphs and activations)"
        )
    if not 0 < gpu_memory_utilization <= 1:
        raise ValueError(
            f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization!r}"
        )
    if kv_cache_gib is not None:
        raise ValueError("kv_cache_gib is for the CPU backend; on a GPU use"
                         " gpu_memory_utilization")  # fmt: skip
    return gpu_memory_utilization


def _check_extra_args(extra_args: Sequence[str]) -> None:
    """Refuse flags after ``--`` that set what dsclient sets itself (the record would lie)."""
    for arg in extra_args:
        owned = _owned_flags(arg)
        if owned:
            given = arg.split("=", 1)[0]
            said = given if [given] == owned else f"{given} (vLLM reads it as {' or '.join(owned)})"
            raise ValueError(
                f"{said} is set by dsclient itself; use its own option (e.g. dsclient serve"
                f" {owned[0]}) instead of passing it after '--', so the launch record stays true"
            )


def _url(host: str, port: int) -> str:
    """The URL a client uses: a wildcard or ``localhost`` bind is reached on 127.0.0.1."""
    url_host = "127.0.0.1" if host in ("0.0.0.0", "::", "localhost") else host  # noqa: S104
    if ":" in url_host:
        url_host = f"[{url_host}]"
    return f"http://{url_host}:{port}"


def _check_int(name: str, value: object, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"{name} must be an int in {low}..{high}, got {value!r}")


def _default_name(model: str) -> str:
    base = model.rstrip("/").rsplit("/", 1)[-1]
    return base or model


def _cpu_kv_cache_gib(
    given: int | None,
    hardware: Hardware,
    facts: ModelFacts,
    dtype: str | None,
    max_num_seqs: int,
    max_model_len: int,
    notes: list[str],
) -> int:
    """``VLLM_CPU_KVCACHE_SPACE``: what full batches of full contexts need, within the machine."""
    # Never give the KV cache more than half the machine: the weights and Python live there too.
    ceiling = max(1, math.floor(hardware.mem_gib / 2))
    if given is not None:
        _check_int("kv_cache_gib", given, 1, 1_000_000)
        if given > ceiling:
            raise ValueError(
                f"kv_cache_gib={given} is more than half of this machine's"
                f" {hardware.mem_gib:g} GiB; use at most {ceiling}"
            )
        return given
    dtype_name = dtype if dtype not in (None, "auto") else facts.dtype
    per_token = facts.kv_bytes_per_token(_DTYPE_BYTES.get(dtype_name or "", 2))
    if per_token is None:
        gib = min(4, ceiling)  # vLLM's own CPU default is 4 GiB
        notes.append(f"VLLM_CPU_KVCACHE_SPACE={gib}: model shape unknown, vLLM's 4 GiB default")
        return gib
    need = per_token * max_num_seqs * max_model_len
    gib = max(1, math.ceil(need / 2**30))
    if gib > ceiling:
        raise ValueError(
            f"{max_num_seqs} sequences x {max_model_len} tokens need {gib} GiB of KV cache, more"
            f" than half of this machine's {hardware.mem_gib:g} GiB; lower max_num_seqs or"
            " max_model_len"
        )
    notes.append(
        f"VLLM_CPU_KVCACHE_SPACE={gib}: {max_num_seqs} x {max_model_len} tokens x"
        f" {per_token} B/token = {need / 2**20:.0f} MiB, rounded up to whole GiB"
    )
    return gib


def _engine_cpus(hardware: Hardware) -> list[int]:
    """The CPUs the engine computes on: all but the last one, which the API server keeps."""
    ids = sorted(hardware.cpu_ids)
    return ids[:-1] if len(ids) > 1 else ids


def _cpu_bind(hardware: Hardware, notes: list[str]) -> str:
    """Bind the engine's OpenMP threads to all cores but one, left to the API server."""
    ids = sorted(hardware.cpu_ids)
    value = format_cpu_list(_engine_cpus(hardware))
    free = "" if len(ids) == 1 else f", CPU {ids[-1]} left to the API server"
    notes.append(f"VLLM_CPU_OMP_THREADS_BIND={value}: engine threads on CPUs {value}{free}")
    return value


def _engine_core_cpus(hardware: Hardware, notes: list[str]) -> tuple[int, ...] | None:
    """Where the EngineCore process goes: with the engine's threads, off the API server's CPU.

    vLLM's EngineCore (the scheduler) busy-polls for the worker's results and is otherwise
    free to run on any CPU, the API server's included. On the 2-core reference machine it took
    85 % of the API server's core, and short requests waited there: moving it to the engine's
    CPU raised throughput of 64-token requests at 8 in flight from 9.5 to 40 requests/s.
    """
    if len(hardware.cpu_ids) == 1:
        return None  # one CPU: nothing to separate
    cpus = tuple(_engine_cpus(hardware))
    notes.append(
        f"EngineCore moved to CPUs {format_cpu_list(cpus)} by the launcher once started (the"
        " shell line cannot say it): its busy-polling stays off the API server's CPU"
    )
    return cpus
