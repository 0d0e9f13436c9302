"""The requests ``dsclient bench`` sends: a synthetic mix or a JSONL workload file."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

# Plain words (most cost one or two tokens in any English BPE vocabulary).
_WORD_TEXT = (
    "the a an one two three many few some every this that these those model server token "
    "request batch queue limit client engine cache memory prompt answer cat dog bird fish tree "
    "river stone cloud light night day morning evening winter summer run walk read write send "
    "wait start stop count measure build serve listen think fast slow small large quiet busy "
    "careful simple random tiny open closed early late and or but so because while when if "
    "then after before under over near far with without is are was were will can may must "
    "should could would has have had do does did user hello thanks please yes no maybe number "
    "time place world word"
)
_WORDS = _WORD_TEXT.split()


def prompt_of(rng: random.Random, tokens: int, tokens_per_word: float) -> str:
    """Random plain words costing about ``tokens`` tokens at ``tokens_per_word``."""
    count = max(1, round(tokens / max(tokens_per_word, 0.1)))
    return " ".join(rng.choice(_WORDS) for _ in range(count))


@dataclass(frozen=True, kw_only=True)
class BenchRequest:
    """One request of a workload: the endpoint and the body (no ``model``, no ``stream``)."""

    path: str
    body: Mapping[str, Any]
    kind: str = "file"


@dataclass(frozen=True, kw_only=True)
class SyntheticMix:
    """A mix of short and long completions: ``short_ratio`` of them short.

    ``SyntheticMix(short_ratio=0.75, short_prompt_tokens=64, long_prompt_tokens=1000,
    short_output=64, long_output=256)`` is the default.
    """

    short_ratio: float = 0.75
    short_prompt_tokens: int = 64
    long_prompt_tokens: int = 1000
    short_output: int = 64
    long_output: int = 256

    def __post_init__(self) -> None:
        if not 0 <= self.short_ratio <= 1:
            raise ValueError(f"short_ratio must be between 0 and 1, got {self.short_ratio!r}")
        for name in ("short_prompt_tokens", "long_prompt_tokens", "short_output", "long_output"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)!r}")

    def requests(
        self, rng: random.Random, tokens_per_word: float, *, ignore_eos: bool
    ) -> Iterator[BenchRequest]:
        """An endless stream of requests, fresh random words each (no prefix-cache hits)."""
        extra = {"ignore_eos": True} if ignore_eos else {}
        while True:
            short = rng.random() < self.short_ratio
            tokens = self.short_prompt_tokens if short else self.long_prompt_tokens
            body = {
                "prompt": prompt_of(rng, tokens, tokens_per_word),
                "max_tokens": self.short_output if short else self.long_output,
                **extra,
            }
            yield BenchRequest(path="/v1/completions", body=body, kind="short" if short else "long")


def load_workload_file(path: str, *, default_max_tokens: int) -> list[BenchRequest]:
    """The requests of a JSONL file: plain ``{"prompt"|"messages": ...}`` dicts or OpenAI batch
    lines (as ``dsclient map`` reads). ``model`` and ``stream`` in them are ignored; lines without
    ``max_tokens`` get ``default_max_tokens``. Raises ``ValueError`` naming a bad line."""
    from ..map import request_of

    requests: list[BenchRequest] = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
                if isinstance(obj, dict):
                    for holder in (obj, obj.get("body")):
                        if isinstance(holder, dict):
                            holder.pop("stream", None)
                            holder.pop("stream_options", None)
                body = request_of(obj, drop_model=True)
            except (ValueError, TypeError) as exc:
                raise ValueError(f"{path} line {lineno}: {exc}") from exc
            body.pop("custom_id", None)
            body.setdefault("max_tokens", default_max_tokens)
            chat = "messages" in body
            requests.append(
                BenchRequest(path="/v1/chat/completions" if chat else "/v1/completions", body=body)
            )
    if not requests:
        raise ValueError(f"{path} holds no requests")
    return requests


def _cycle(items: Sequence[BenchRequest]) -> Iterator[BenchRequest]:
    while True:
        yield from items
