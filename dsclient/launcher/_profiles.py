"""Launch profiles, and the facts a launch is decided from: pure, no I/O.

A *profile* is a named preset of server settings. The command builder
(:func:`~dsclient.launcher._command.build_command`) turns a model, a profile, the machine's facts
(:class:`Hardware`, detected elsewhere), the model's (:class:`ModelFacts`), what the installed
vLLM accepts (:class:`VllmCaps`) and the user's overrides into the exact command to start vLLM
with.

=========================  =======================================================================
``latency-sensitive``      small batch, 4096-token context, fp8 KV cache where the hardware has it
``throughput-first``       larger batch, 2048-token context
``balanced`` (default)     in between, 4096-token context
=========================  =======================================================================

Example::

    PROFILES["latency-sensitive"].max_model_len        # 4096
    caps_for_version("0.32.0").cpu_block_multiple     # --block-size on the CPU: a multiple of it
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = [
    "DEFAULT_PROFILE",
    "PROFILES",
    "Hardware",
    "ModelFacts",
    "Profile",
    "VllmCaps",
    "caps_for_version",
    "describe_profiles",
]


@dataclass(frozen=True, kw_only=True)
class Hardware:
    """Facts about the machine the server will run on (detected in ``_hardware``, or injected).

    ==============================================================  ============================
    ``Hardware(cpu_ids=(0, 1), mem_gib=24)``                         a 2-core box with no GPU
    ``Hardware(gpu_count=1, gpu_mem_gib=80, fp8_kv_supported=True)``  one H100-class card
    ==============================================================  ============================

    Parameters:
        gpu_count: NVIDIA GPUs visible (0: run on the CPU backend).
        gpu_mem_gib: memory of the smallest visible card, GiB.
        gpu_name: the card's name, for messages.
        fp8_kv_supported: the accelerator can store the KV cache in fp8 (CUDA compute
            capability >= 8.9, vLLM's own ``supports_fp8`` rule).
        cpu_ids: the logical CPUs this process may run on (its affinity mask).
        mem_gib: the machine's total memory, GiB.
        has_avx512: the CPU has AVX-512 (informational; vLLM's CPU build works on AVX2).
    """

    gpu_count: int = 0
    gpu_mem_gib: float = 0.0
    gpu_name: str | None = None
    fp8_kv_supported: bool = False
    cpu_ids: tuple[int, ...] = (0,)
    mem_gib: float = 8.0
    has_avx512: bool = False

    def __post_init__(self) -> None:
        if self.gpu_count < 0:
            raise ValueError(f"Hardware.gpu_count must be >= 0, got {self.gpu_count!r}")
        if self.gpu_count > 0 and not self.gpu_mem_gib > 0:
            raise ValueError(f"Hardware.gpu_mem_gib must be > 0 with a GPU, got {self.gpu_mem_gib}")
        if not self.cpu_ids:
            raise ValueError("Hardware.cpu_ids must list at least one CPU")
        if not self.mem_gib > 0:
            raise ValueError(f"Hardware.mem_gib must be > 0, got {self.mem_gib!r}")

    @property
    def cpu_count(self) -> int:
        """Logical CPUs available to the server."""
        return len(self.cpu_ids)


@dataclass(frozen=True, kw_only=True)
class ModelFacts:
    """What the model's ``config.json`` says, as far as sizing the server needs.

    Build it with :meth:`from_config` from the parsed JSON; unknown fields stay ``None``.
    """

    max_position_embeddings: int | None = None
    num_layers: int | None = None
    num_kv_heads: int | None = None
    head_dim: int | None = None
    dtype: str | None = None

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> ModelFacts:
        """Read a Hugging Face ``config.json`` mapping (text models; nested ``text_config`` too)."""
        cfg: Mapping[str, Any] = config.get("text_config") or config
        heads = _opt_int(cfg.get("num_attention_heads"))
        hidden = _opt_int(cfg.get("hidden_size"))
        head_dim = _opt_int(cfg.get("head_dim"))
        if head_dim is None and heads and hidden:
            head_dim = hidden // heads
        dtype = cfg.get("torch_dtype") or cfg.get("dtype") or config.get("torch_dtype")
        return cls(
            max_position_embeddings=_opt_int(cfg.get("max_position_embeddings")),
            num_layers=_opt_int(cfg.get("num_hidden_layers")),
            num_kv_heads=_opt_int(cfg.get("num_key_value_heads")) or heads,
            head_dim=head_dim,
            dtype=dtype if isinstance(dtype, str) else None,
        )

    def kv_bytes_per_token(self, dtype_bytes: int) -> int | None:
        """Bytes of KV cache one token takes (K and V, all layers), when the shape is known."""
        if self.num_layers and self.num_kv_heads and self.head_dim:
            return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes
        return None


def _opt_int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


@dataclass(frozen=True, kw_only=True)
class Profile:
    """A named preset of server settings; see the module docstring for the three built in.

    Parameters:
        name: how ``--profile`` names it.
        summary: one line for ``dsclient serve --list-profiles``.
        max_model_len: context length, capped to the model's own when the model is smaller.
        cpu_max_num_seqs: batch size on the CPU backend.
        gpu_seqs_per_2gib: batch size on a GPU, per 2 GiB of card memory (the rule of thumb
            "GPU GiB / 2", scaled: 0.5 halves it, 2.0 doubles it).
        gpu_memory_utilization: share of the card vLLM may take (weights + KV cache).
        fp8_kv_cache: store the KV cache in fp8 when ``Hardware.fp8_kv_supported``.
    """

    name: str
    summary: str
    max_model_len: int
    cpu_max_num_seqs: int
    gpu_seqs_per_2gib: float
    gpu_memory_utilization: float
    fp8_kv_cache: bool = False


PROFILES: Mapping[str, Profile] = {
    p.name: p
    for p in (
        Profile(
            name="latency-sensitive",
            summary="small batch, 4096-token context, fp8 KV cache where the hardware has it",
            max_model_len=4096,
            cpu_max_num_seqs=4,
            gpu_seqs_per_2gib=0.5,
            # Leaves room for CUDA graphs and activation spikes of long prompts.
            gpu_memory_utilization=0.85,
            fp8_kv_cache=True,
        ),
        Profile(
            name="balanced",
            summary="medium batch, 4096-token context",
            max_model_len=4096,
            cpu_max_num_seqs=8,
            gpu_seqs_per_2gib=1.0,
            gpu_memory_utilization=0.90,
        ),
        Profile(
            name="throughput-first",
            summary="larger batch, 2048-token context, most of the card for the KV cache",
            max_model_len=2048,
            cpu_max_num_seqs=16,
            gpu_seqs_per_2gib=2.0,
            gpu_memory_utilization=0.92,
        ),
    )
}
DEFAULT_PROFILE = "balanced"


@dataclass(frozen=True, kw_only=True)
class VllmCaps:
    """What one vLLM version accepts for the values dsclient checks before starting it.

    Read from vLLM 0.32.0's source: ``vllm/config/cache.py`` (``CacheDType``), the CPU attention
    backend (``supported_kv_cache_dtypes``, kernel block sizes ``MultipleOf(32)``) and the
    FlashAttention backend (``MultipleOf(16)``).
    """

    version: str
    kv_cache_dtypes: frozenset[str]
    cpu_kv_cache_dtypes: frozenset[str]
    cpu_block_multiple: int
    gpu_block_multiple: int
    model_dtypes: frozenset[str] = frozenset(
        {"auto", "half", "float16", "bfloat16", "float", "float32"}
    )
    max_block_size: int = 4096


_CAPS_0_32 = VllmCaps(
    version="0.32",
    kv_cache_dtypes=frozenset(
        {
            "auto",
            "float16",
            "bfloat16",
            "fp8",
            "fp8_e4m3",
            "fp8_e5m2",
            "fp8_inc",
            "fp8_ds_mla",
            "nvfp4_ds_mla",
            "turboquant_k8v4",
            "turboquant_4bit_nc",
            "turboquant_k3v4_nc",
            "turboquant_3bit_nc",
            "ultraquant_4bit",
            "int4_per_token_head",
            "int8_per_token_head",
            "fp8_per_token_head",
            "nvfp4",
            "nvfp4_4over6",
        }
    ),
    cpu_kv_cache_dtypes=frozenset({"auto", "fp8", "fp8_e4m3", "fp8_e5m2"}),
    cpu_block_multiple=32,
    gpu_block_multiple=16,
)
# Older releases (before the v1 engine's cache dtype zoo): the long-standing common set.
_CAPS_OLD = VllmCaps(
    version="<0.10",
    kv_cache_dtypes=frozenset({"auto", "fp8", "fp8_e4m3", "fp8_e5m2"}),
    cpu_kv_cache_dtypes=frozenset({"auto", "fp8", "fp8_e5m2"}),
    cpu_block_multiple=16,
    gpu_block_multiple=8,
    max_block_size=128,
)


def caps_for_version(version: str | None) -> VllmCaps:
    """The checks for an installed vLLM version; unknown or newer versions get 0.32's."""
    if version:
        parts = version.split(".")
        try:
            major, minor = int(parts[0]), int("".join(c for c in parts[1] if c.isdigit()) or 0)
        except (ValueError, IndexError):
            return _CAPS_0_32
        if (major, minor) < (0, 10):
            return _CAPS_OLD
    return _CAPS_0_32


def describe_profiles() -> str:
    """Every profile with what it sets, for ``dsclient serve --list-profiles``."""
    lines = []
    for prof in PROFILES.values():
        default = " (default)" if prof.name == DEFAULT_PROFILE else ""
        lines.append(f"{prof.name}{default}: {prof.summary}")
        lines.append(f"    --max-model-len {prof.max_model_len}")
        lines.append(f"    --max-num-seqs {prof.cpu_max_num_seqs}   (CPU)")
        lines.append(
            f"    --max-num-seqs <GPU GiB / 2 x {prof.gpu_seqs_per_2gib:g}>   (GPU, unless given)"
        )
        lines.append(f"    --gpu-memory-utilization {prof.gpu_memory_utilization}   (GPU)")
        if prof.fp8_kv_cache:
            lines.append("    --kv-cache-dtype fp8   (GPU with compute capability >= 8.9)")
        lines.append(
            "    VLLM_CPU_KVCACHE_SPACE=<GiB for max-num-seqs full contexts>"
            "  VLLM_CPU_OMP_THREADS_BIND=<all CPUs but one>   (CPU)"
        )
    return "\n".join(lines)
