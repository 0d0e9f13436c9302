"""Detect the machine's facts for the launcher (GPUs, CPUs, memory): the I/O half of sizing.

The policy that uses them lives in ``_command`` and takes a
:class:`~dsclient.launcher._profiles.Hardware`, so tests inject facts instead of needing a GPU.
The parsers here are pure and tested on samples.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess

from ._profiles import Hardware

__all__ = ["detect_hardware", "parse_meminfo", "parse_nvidia_smi"]

logger = logging.getLogger("dsclient")


def parse_nvidia_smi(text: str) -> list[tuple[str, float, tuple[int, int] | None]]:
    """Parse ``nvidia-smi --query-gpu=name,memory.total,compute_cap --format=csv,noheader,nounits``.

    Returns ``(name, memory GiB, (major, minor) or None)`` per card; bad lines are skipped.
    """
    cards = []
    for line in text.strip().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) < 2:
            continue
        try:
            mem_gib = float(parts[1]) / 1024  # MiB
        except ValueError:
            continue
        cap: tuple[int, int] | None = None
        if len(parts) > 2 and "." in parts[2]:
            major, _, minor = parts[2].partition(".")
            if major.isdigit() and minor.isdigit():
                cap = (int(major), int(minor))
        cards.append((parts[0], mem_gib, cap))
    return cards


def parse_meminfo(text: str) -> float | None:
    """``MemTotal`` from ``/proc/meminfo`` text, in GiB."""
    for line in text.splitlines():
        if line.startswith("MemTotal:"):
            fields = line.split()
            if len(fields) >= 2 and fields[1].isdigit():
                return int(fields[1]) / 2**20  # kB
    return None


def _gpus() -> list[tuple[str, float, tuple[int, int] | None]]:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return []
    try:
        out = subprocess.run(
            [exe, "--query-gpu=name,memory.total,compute_cap", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=20,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        logger.warning("nvidia-smi is present but failed (%s); assuming no GPU", exc)
        return []
    return parse_nvidia_smi(out)


def _read(path: str) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def detect_hardware() -> Hardware:
    """Look at this machine: NVIDIA GPUs (``nvidia-smi``), usable CPUs, memory, AVX-512."""
    cards = _gpus()
    try:
        cpu_ids = tuple(sorted(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - not Linux
        cpu_ids = tuple(range(os.cpu_count() or 1))
    mem_gib = parse_meminfo(_read("/proc/meminfo")) or 8.0
    has_avx512 = " avx512f" in _read("/proc/cpuinfo")
    if not cards:
        return Hardware(cpu_ids=cpu_ids, mem_gib=mem_gib, has_avx512=has_avx512)
    smallest = min(cards, key=lambda c: c[1])
    caps = [c[2] for c in cards]
    return Hardware(
        gpu_count=len(cards),
        gpu_mem_gib=smallest[1],
        gpu_name=smallest[0],
        # vLLM's CUDA platform: supports_fp8() is compute capability >= 8.9 (Ada, Hopper, ...).
        fp8_kv_supported=all(c is not None and c >= (8, 9) for c in caps),
        cpu_ids=cpu_ids,
        mem_gib=mem_gib,
        has_avx512=has_avx512,
    )
