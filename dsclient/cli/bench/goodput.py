"""Goodput: answered requests per second that met every service-level objective.

    slo = parse_goodput("ttft:500,tpot:50")        # milliseconds, as vllm bench serve takes them
    slo.met(ttft_s=0.31, latency_s=1.9, output_tokens=64)   # True: 310 <= 500, 25.4 <= 50
    goodput_rps(samples, slo, duration_s=10.0)

The definition is ``vllm bench serve --goodput``'s (``vllm/benchmarks/serve.py``,
``calculate_metrics`` in vLLM 0.32): among the successful requests, one is good when each
objective given is at least its figure (``<=``, inclusive): TTFT, TPOT ``(latency - TTFT) /
(output tokens - 1)``, taken as 0 for an answer of one token or none, and end-to-end latency
``e2el``; goodput is the good ones over the benchmark's duration. A failed request is never good.
One difference, on the strict side: vLLM counts a stream that carried no text with a TTFT of 0;
here it has none, and misses a TTFT objective.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

__all__ = ["Slo", "goodput_rps", "parse_goodput", "vllm_tpot_s"]

#: The objectives ``vllm bench serve --goodput`` takes, in milliseconds.
NAMES = ("ttft", "tpot", "e2el")


def vllm_tpot_s(latency_s: float, ttft_s: float, output_tokens: int) -> float:
    """TPOT as ``vllm bench serve`` counts it for goodput: 0 for fewer than 2 output tokens."""
    if output_tokens < 2:
        return 0.0
    return (latency_s - ttft_s) / (output_tokens - 1)


@dataclass(frozen=True, kw_only=True)
class Slo:
    """Service-level objectives in milliseconds; ``None`` is no objective on that figure.

    ``Slo(ttft_ms=500, tpot_ms=50)``: first token within 0.5 s and 50 ms per token after it.
    """

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2el_ms: float | None = None

    def __post_init__(self) -> None:
        given = {n: getattr(self, f"{n}_ms") for n in NAMES}
        if all(v is None for v in given.values()):
            raise ValueError("goodput needs at least one objective: ttft, tpot or e2el")
        for name, value in given.items():
            if value is not None and not (value >= 0 and math.isfinite(value)):
                raise ValueError(f"goodput's {name} must be a number of ms >= 0, got {value!r}")

    def met(self, *, ttft_s: float | None, latency_s: float, output_tokens: int) -> bool:
        """Whether one successful request met every objective given."""
        # Compared in seconds against ms / 1000, as vLLM does, so a figure on the objective
        # lands on the same side of it.
        if self.ttft_ms is not None and (ttft_s is None or ttft_s > self.ttft_ms / 1000):
            return False
        if self.tpot_ms is not None:
            if ttft_s is None:
                return False
            if vllm_tpot_s(latency_s, ttft_s, output_tokens) > self.tpot_ms / 1000:
                return False
        return self.e2el_ms is None or latency_s <= self.e2el_ms / 1000

    def text(self) -> str:
        """The objectives as ``--goodput`` takes them: ``"ttft:500,tpot:50"``."""
        return ",".join(
            f"{n}:{value:g}" for n in NAMES if (value := getattr(self, f"{n}_ms")) is not None
        )


def parse_goodput(text: str) -> Slo:
    """``"ttft:500,tpot:50"`` (commas or spaces between pairs) -> :class:`Slo`.

    Raises ``ValueError`` naming the pair that is not ``NAME:MS`` or a name that is not one of
    ttft, tpot, e2el.
    """
    found: dict[str, float] = {}
    for pair in text.replace(",", " ").split():
        name, sep, value = pair.partition(":")
        name = name.strip().lower()
        if not sep or name not in NAMES:
            raise ValueError(
                f"goodput objective {pair!r} is not NAME:MS with NAME one of {', '.join(NAMES)}"
            )
        if name in found:
            raise ValueError(f"goodput objective {name} is given twice")
        try:
            found[name] = float(value)
        except ValueError:
            raise ValueError(f"goodput objective {pair!r}: {value!r} is not a number") from None
    if not found:
        raise ValueError("goodput needs at least one objective, e.g. ttft:500,tpot:50")
    return Slo(**{f"{name}_ms": value for name, value in found.items()})


def goodput_rps(
    samples: Iterable[tuple[bool, float | None, float, int]], slo: Slo, duration_s: float
) -> tuple[int, float]:
    """``(good requests, good requests per second)`` of ``(ok, ttft_s, latency_s, output
    tokens)`` samples over ``duration_s``."""
    good = sum(
        ok and slo.met(ttft_s=ttft, latency_s=latency, output_tokens=tokens)
        for ok, ttft, latency, tokens in samples
    )
    return good, round(good / max(duration_s, 1e-9), 4)
