"""Degradation on deadline against the real vLLM server: a call whose answer cannot come in time
sends a smaller ``max_tokens`` and says so; one that fits is left alone."""

from __future__ import annotations

import pytest

from dsclient import AsyncClient, Degrade
from dsclient.client._degrade import MIN_SAMPLES

pytestmark = [pytest.mark.integration, pytest.mark.anyio]


async def test_a_call_that_cannot_finish_in_time_is_degraded_and_says_so(vllm_server) -> None:
    async with AsyncClient(vllm_server, timeout=120) as client:
        warm = [
            await client.generate("Once upon a time", max_tokens=48, ignore_eos=True)
            for _ in range(MIN_SAMPLES + 1)
        ]
        per_token = sum(r.latency_s - r.queued_s for r in warm) / sum(
            r.usage.completion_tokens for r in warm
        )
        full = 1500
        # Half of what the full answer needs at the pace just seen: it cannot fit, 16 tokens do.
        timeout = max(1.0, per_token * full / 2)
        degraded = await client.generate(
            "Once upon a time",
            max_tokens=full,
            ignore_eos=True,
            timeout=timeout,
            degrade=Degrade(max_tokens=16),
        )
        plain = await client.generate(
            "Once upon a time", max_tokens=8, timeout=120, degrade=Degrade(max_tokens=4)
        )
    assert degraded.degraded is not None, (per_token, timeout)
    assert degraded.degraded.startswith(f"max_tokens {full} -> 16")
    assert degraded.max_tokens == 16 and degraded.usage.completion_tokens == 16
    assert degraded.latency_s < timeout
    assert plain.degraded is None and plain.max_tokens == 8
