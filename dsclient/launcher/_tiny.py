"""The tiny random model the tests and examples serve: built locally, no download."""

from __future__ import annotations

import logging
import os
import subprocess
from pathlib import Path

from ._errors import LaunchError
from ._install import resolve_server_python

__all__ = ["DEFAULT_MODEL_DIR", "make_tiny_model", "tiny_model_script"]

logger = logging.getLogger("dsclient")

#: Where ``dsclient make-tiny-model`` puts the tiny random model when no folder is given.
DEFAULT_MODEL_DIR = Path.home() / ".cache" / "dsclient" / "models" / "tiny-llama"


# --- tiny model ------------------------------------------------------------------------------


def tiny_model_script() -> Path:
    """The self-contained builder script, run with the server's interpreter."""
    return Path(__file__).resolve().parent / "_data" / "build_tiny_model.py"


def make_tiny_model(
    directory: str | os.PathLike[str] | None = None,
    *,
    force: bool = False,
    python: str | os.PathLike[str] | None = None,
) -> Path:
    """Build the tiny RANDOM Llama model (for tests and demos) and return its folder.

    It lands in ``directory`` (default ``~/.cache/dsclient/models/tiny-llama``); an existing
    complete build is kept unless ``force``. Its weights are random, so it writes nonsense:
    the point is a real engine to test against. Runs the builder with the server's interpreter
    (which has transformers and tokenizers); see :func:`resolve_server_python`.
    """
    folder = Path(directory).expanduser().resolve() if directory else DEFAULT_MODEL_DIR
    server_python = resolve_server_python(python).python
    argv = [server_python, str(tiny_model_script()), str(folder)]
    if force:
        argv.append("--force")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, check=False)
    if proc.returncode != 0:
        raise LaunchError(f"building the tiny model failed:\n{proc.stderr[-3000:]}")
    logger.info("%s", proc.stdout.strip())
    return folder
