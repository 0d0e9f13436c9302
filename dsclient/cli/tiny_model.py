"""``dsclient make-tiny-model``: build the tiny random-weight model tests serve."""

from __future__ import annotations

import argparse


def _add_make_tiny_model(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "make-tiny-model",
        help="build a tiny RANDOM Llama model for tests (no download)",
        description=(
            "Build a tiny Llama-architecture model with RANDOM weights (it writes nonsense),"
            " a byte-level BPE tokenizer trained on generated text, and a chat template, in"
            " seconds and without any download. It exists to run a real vLLM engine in tests."
            " Runs in the server venv (which has transformers and tokenizers)."
        ),
    )
    p.add_argument(
        "dir",
        nargs="?",
        help="where to put it (default ~/.cache/dsclient/models/tiny-llama)",
    )
    p.add_argument("--force", action="store_true", help="rebuild even if the folder is complete")
    p.add_argument("--python", help="the server venv's python")
    p.set_defaults(func=_make_tiny_model)


def _make_tiny_model(args: argparse.Namespace) -> int:
    from .. import launcher

    folder = launcher.make_tiny_model(args.dir, force=args.force, python=args.python)
    print(f"tiny model (RANDOM weights, for testing only) at {folder}")
    print(f"serve it with: dsclient serve {folder} --dtype float32 --max-model-len 2048")
    return 0
