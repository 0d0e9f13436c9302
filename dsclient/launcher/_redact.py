"""Secrets in what the launcher prints: ``--api-key``'s value and ``*_KEY`` / ``*_TOKEN``
variables show as ``***`` in the shell line, a plan's ``repr``, errors and log tails.

Example::

    redact_argv(["vllm", "--api-key", "sk-1", "--port=8000"])  # (..., "--api-key", "***", ...)
    scrub(log_tail, secrets_in(plan.argv, plan.env))            # every secret value -> "***"
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Final

__all__ = ["SECRET_FLAGS", "is_secret_name", "redact_argv", "scrub", "secrets_in"]

#: Flags whose value is a secret: shown as ``***`` wherever the launcher prints a command.
SECRET_FLAGS: Final = frozenset({"--api-key", "--hf-token", "--ssl-keyfile-password"})


def is_secret_name(name: str) -> bool:
    """Whether an environment variable's name says it holds a secret (``HF_TOKEN``, ...)."""
    upper = name.upper()
    return any(word in upper for word in ("KEY", "TOKEN", "SECRET", "PASSWORD"))


def redact_argv(argv: Sequence[str]) -> tuple[str, ...]:
    """``argv`` with the values of :data:`SECRET_FLAGS` replaced by ``***``.

    redact_argv(["vllm", "--api-key", "sk-1", "--port=8000"])  # (..., "--api-key", "***", ...)
    """
    out: list[str] = []
    hide_next = False
    for arg in argv:
        if hide_next:
            out.append("***")
            hide_next = False
            continue
        flag, eq, _ = arg.partition("=")
        if flag in SECRET_FLAGS:
            if eq:
                out.append(f"{flag}=***")
            else:
                out.append(arg)
                hide_next = True
            continue
        out.append(arg)
    return tuple(out)


def secrets_in(argv: Sequence[str], env: Mapping[str, str] | None = None) -> list[str]:
    """The secret values in ``argv`` (and ``env``), to scrub from text that may echo them."""
    found: list[str] = []
    for plain, hidden in zip(argv, redact_argv(argv), strict=True):
        if plain != hidden:
            found.append(plain.partition("=")[2] if "=" in hidden else plain)
    found += [v for k, v in (env or {}).items() if is_secret_name(k) and v]
    return [value for value in found if len(value) >= 4]


def scrub(text: str, secrets: Sequence[str]) -> str:
    """``text`` with every one of ``secrets`` replaced by ``***``."""
    for secret in secrets:
        text = text.replace(secret, "***")
    return text
