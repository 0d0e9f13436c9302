"""What observers (metrics, tracing) hear about each finished call: one frozen record.

    remove = client.add_observer(lambda record: print(record.lane, record.latency_s))

The client builds a record only when someone observes, so unobserved calls pay one truthiness
check. Observers run in the event loop right after the call ends and must not raise or block.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

__all__ = ["CallRecord", "Observer"]


@dataclass(frozen=True, kw_only=True)
class CallRecord:
    """One finished call (all its attempts).

    ``error`` is the exception's class name when the call failed (``None`` when it succeeded);
    ``status`` the HTTP status of a refusal, when the server answered one. ``queued_s`` is the
    time spent waiting for slots; ``lane`` is ``None`` when the call failed before planning.
    For a stream, ``completion_tokens`` counts the text deltas received (vLLM sends one a token)
    and ``prompt_tokens`` is ``None``. Calls through ``client.openai()`` / ``client.httpx()``
    (:mod:`dsclient.client._transport`) give the tokens of the answer's ``usage`` instead (a
    stream's
    last chunk, when it carried one), and ``kind`` ``"embedding"`` for embeddings.
    """

    kind: Literal["completion", "chat", "embedding", "stream"]
    server: str
    lane: str | None
    group: str | None
    error: str | None
    status: int | None
    latency_s: float
    queued_s: float | None
    attempts: int
    prompt_tokens: int | None
    completion_tokens: int | None

    @property
    def ok(self) -> bool:
        return self.error is None


Observer = Callable[[CallRecord], None]
