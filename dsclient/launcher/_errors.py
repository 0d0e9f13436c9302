"""The launcher's errors.

::

    DSClientError
    └── LaunchError            could not prepare or start a server
        ├── VllmFlagsError     vLLM's own parser refused the planned flags (nothing started)
        └── ServerStartError   the server died while starting, or was not healthy in time
"""

from __future__ import annotations

from pathlib import Path

from .._exceptions import DSClientError

__all__ = ["LaunchError", "ServerStartError", "VllmFlagsError"]


class LaunchError(DSClientError):
    """The launcher could not prepare or start a server (no vLLM installed, port taken, ...)."""


class VllmFlagsError(LaunchError):
    """vLLM's own argument parser refused the planned command line; nothing was started.

    ``vllm_message`` is vLLM's text (``"vllm serve: error: unrecognized arguments: ..."``),
    ``argv`` the planned command.
    """

    def __init__(self, vllm_message: str, *, argv: tuple[str, ...], python: str) -> None:
        self.vllm_message = vllm_message
        self.argv = argv
        super().__init__(
            f"vLLM refuses the flags: {vllm_message}\n(vLLM's own argument parser, run by"
            f" {python} on the planned command; nothing was started)"
        )


class ServerStartError(LaunchError):
    """The server died while starting, or was not healthy in time.

    ``log_tail`` holds the last lines of its log, ``log_path`` the whole log's path and
    ``returncode`` the exit status when it died.
    """

    def __init__(
        self, message: str, *, log_tail: str, log_path: Path, returncode: int | None = None
    ) -> None:
        self.log_tail = log_tail
        self.log_path = log_path
        self.returncode = returncode
        super().__init__(
            f"{message}\n--- last lines of {log_path} ---\n{log_tail.rstrip()}\n---"
            if log_tail
            else f"{message} (log: {log_path})"
        )
