"""Degradation on deadline: what a call gives up, rather than miss its deadline. Pure policy.

    degrade = Degrade(model="tiny-small")             # another model (a smaller one, elsewhere)
    degrade = Degrade(max_tokens=64)                   # a shorter answer
    client = AsyncClient(urls, timeout=5, degrade=degrade)   # or per call: generate(..., degrade=)

A call with a timeout and a ``Degrade`` predicts how long its answer takes (:class:`Pace`: the
seconds per generated token of the model, from the answers seen, times ``max_tokens``) and
degrades when what is left of its timeout will not cover that:

* **before sending**, when the prediction is already over the time left;
* **while waiting for a slot**: it waits at most until ``deadline - prediction``; a call still
  waiting then leaves the queue and goes degraded (another model has its own queue and servers).

Nothing degrades silently: the result's ``degraded`` says what changed and why
(``"max_tokens 256 -> 64: about 3.1 s needed, 1.2 s left"``). An attempt already sent is never
cut short, and retries do not degrade. Before the model's first answers are seen (fewer than
:data:`MIN_SAMPLES`), the prediction is a fifth of the timeout.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["MIN_SAMPLES", "Degrade", "Pace", "predict_s"]

#: Answers of a model seen before its pace is trusted.
MIN_SAMPLES = 3

#: Before that, the answer is assumed to need this share of the call's timeout.
_UNKNOWN_SHARE = 0.2


@dataclass(frozen=True, kw_only=True)
class Degrade:
    """What a call may give up to meet its deadline (see the guide "Several servers").

    ``Degrade(model="small")``, ``Degrade(max_tokens=64)``, or both (the model changes, and
    ``max_tokens`` is cut too).

    Parameters:
        model: another model to ask instead (a smaller model on another replica, or a LoRA
            adapter of the same server); it must be served by one of the client's servers.
        max_tokens: the ``max_tokens`` to send instead, when smaller than the call's own.
    """

    model: str | None = None
    max_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.model is None and self.max_tokens is None:
            raise ValueError("Degrade needs model= or max_tokens= (what to give up)")
        if self.model is not None and (not isinstance(self.model, str) or not self.model):
            raise ValueError(f"Degrade.model must be a non-empty str, got {self.model!r}")
        if self.max_tokens is not None and (
            isinstance(self.max_tokens, bool)
            or not isinstance(self.max_tokens, int)
            or self.max_tokens < 1
        ):
            raise ValueError(f"Degrade.max_tokens must be an int >= 1, got {self.max_tokens!r}")


class Pace:
    """Seconds per generated token of each model: an exponentially weighted mean of the
    answers seen (service time, waiting for a slot excluded, over completion tokens)."""

    def __init__(self, weight: float = 0.2) -> None:
        if not 0 < weight <= 1:
            raise ValueError(f"weight must be in (0, 1], got {weight!r}")
        self._weight = weight
        self._mean: dict[str | None, float] = {}
        self._samples: dict[str | None, int] = {}

    def observe(self, model: str | None, service_s: float, tokens: int) -> None:
        if tokens < 1 or service_s <= 0:
            return
        per_token = service_s / tokens
        mean = self._mean.get(model)
        self._mean[model] = per_token if mean is None else mean + self._weight * (per_token - mean)
        self._samples[model] = self._samples.get(model, 0) + 1

    def per_token(self, model: str | None) -> float | None:
        """The model's seconds per token, once :data:`MIN_SAMPLES` answers were seen."""
        if self._samples.get(model, 0) < MIN_SAMPLES:
            return None
        return self._mean.get(model)


def predict_s(per_token: float | None, max_tokens: int, timeout: float) -> float:
    """Seconds an answer of ``max_tokens`` is predicted to take: ``per_token x max_tokens``, or
    a fifth of the ``timeout`` while the pace is unknown."""
    if per_token is None:
        return _UNKNOWN_SHARE * timeout
    return per_token * max_tokens
