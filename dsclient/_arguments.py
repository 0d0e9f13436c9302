"""A call's arguments: the prompt and message shapes, their checks, and :data:`USE_DEFAULT`.

    check_prompt("Hello")                               # fine
    check_messages([{"role": "user", "content": "Hi"}])  # fine
    check_max_tokens(0)                                 # ValueError: max_tokens must be > 0, got 0

Pure, and in the core because two layers apply the same rules: the client to each call, and
the batch runner (``dsclient.batch``) to each item as it is read, so that a bad item becomes its
own ``Failure`` before anything is sent. Programmer mistakes stay ``TypeError`` /
``ValueError``, naming the argument.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Final

__all__ = [
    "USE_DEFAULT",
    "Messages",
    "Prompt",
    "UseDefault",
    "check_max_tokens",
    "check_messages",
    "check_prompt",
]

Messages = Sequence[Mapping[str, Any]]
Prompt = str | Messages


class UseDefault:
    """The type of :data:`USE_DEFAULT`: "use the client's default" (``None`` means "turn it
    off"). Typed like httpx's ``UseClientDefault``: a parameter reads
    ``timeout: float | None | UseDefault = USE_DEFAULT``, and code tells it apart with
    ``isinstance(value, UseDefault)``."""

    _instance: UseDefault | None = None

    def __new__(cls) -> UseDefault:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "USE_DEFAULT"


USE_DEFAULT: Final[UseDefault] = UseDefault()


def check_messages(messages: Any) -> None:
    """A non-empty list of dicts, each with a ``"role"``: ``TypeError`` / ``ValueError`` if not."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise TypeError(
            f"messages must be a list of {{'role', 'content'}} dicts, got {type(messages).__name__}"
        )
    if not messages:
        raise ValueError("messages is empty; give at least one {'role': ..., 'content': ...}")
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or "role" not in m:
            raise TypeError(
                f"messages[{i}] must be a dict with 'role' and 'content', got {m!r:.80}"
            )


def check_prompt(prompt: Any) -> None:
    """A non-empty ``str``: ``TypeError`` / ``ValueError`` if not."""
    if not isinstance(prompt, str):
        raise TypeError(f"prompt must be a str, got {type(prompt).__name__}")
    if not prompt:
        raise ValueError("prompt is empty")


def check_max_tokens(max_tokens: Any) -> None:
    """``None`` (the client's default) or an int > 0 (not a bool)."""
    if max_tokens is None:
        return
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int):
        raise TypeError(f"max_tokens must be an int, got {type(max_tokens).__name__}")
    if max_tokens <= 0:
        raise ValueError(f"max_tokens must be > 0, got {max_tokens}")
