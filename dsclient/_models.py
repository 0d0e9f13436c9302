"""Typed results: what ``generate()``, ``chat()`` and ``map()`` return."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, TypeVar

from pydantic import BaseModel, ConfigDict, PrivateAttr

if TYPE_CHECKING:
    # Importing openai costs about 0.8 s; only ``raw`` needs it, so it loads on first use.
    from openai.types import Completion
    from openai.types.chat import ChatCompletion

__all__ = ["ChatResult", "CompletionResult", "Failure", "Result", "Usage"]

# Frozen models are built as pydantic's own model_construct does, by setting the four slots
# every model has: through the descriptors BaseModel defines for them, called directly
# (``object.__setattr__`` looked each up through the class, half the cost of building a result
# on the client's hot path).
_new = object.__new__  # BaseModel defines no __new__
_set_dict = BaseModel.__dict__["__dict__"].__set__
_set_fields = BaseModel.__dict__["__pydantic_fields_set__"].__set__
_set_extra = BaseModel.__dict__["__pydantic_extra__"].__set__
_set_private = BaseModel.__dict__["__pydantic_private__"].__set__


class Usage(BaseModel):
    """Token counts the server reported."""

    model_config = ConfigDict(frozen=True)

    prompt_tokens: int = 0
    completion_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    @classmethod
    def _trusted(cls, prompt_tokens: int, completion_tokens: int) -> Usage:
        """Build from values already checked, without pydantic's per-field machinery."""
        usage = _new(cls)
        _set_dict(usage, {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens})
        _set_fields(usage, {"prompt_tokens", "completion_tokens"})
        _set_extra(usage, None)
        _set_private(usage, None)
        return usage


_R = TypeVar("_R", bound="Result")


class Result(BaseModel):
    """One finished request.

    ``text`` is the generated text, ``latency_s`` the time from the call to the answer (waiting
    for a slot included), ``queued_s`` the part of it spent waiting in the client's governor,
    ``attempts`` how many tries it took, ``max_tokens`` what was sent, ``lane`` which lane
    carried it, ``server`` the root URL of the server that answered, and ``degraded`` what was
    changed to meet the call's deadline (``None``: nothing; see ``Degrade``). ``raw`` is the
    server's answer as openai's own type.
    """

    model_config = ConfigDict(frozen=True)

    text: str
    finish_reason: str | None
    usage: Usage
    latency_s: float
    queued_s: float = 0.0
    attempts: int = 1
    max_tokens: int | None = None
    lane: str = "short"
    index: int | None = None
    server: str | None = None
    degraded: str | None = None
    _raw_data: dict[str, Any] = PrivateAttr(default_factory=dict)

    @property
    def ok(self) -> bool:
        return True

    def _repr_html_(self) -> str:  # notebooks
        from ._display import result_html

        return result_html(self)

    @classmethod
    def _rebuilt(cls: type[_R], raw_data: dict[str, Any], **fields: Any) -> _R:
        """Build from ``fields``, validated as the constructor does, with ``raw_data`` as the
        server's answer that ``raw`` is read from (a result rebuilt from a results file).

            Result._rebuilt(body, text="Paris", finish_reason="stop", usage=usage, latency_s=0.0)
        """
        result = cls(**fields)
        result._raw_data = raw_data
        return result

    @classmethod
    def _trusted(
        cls: type[_R],
        *,
        text: str,
        finish_reason: str | None,
        usage: Usage,
        latency_s: float,
        queued_s: float,
        attempts: int,
        max_tokens: int | None,
        lane: str,
        index: int | None,
        raw_data: dict[str, Any],
        server: str | None = None,
        degraded: str | None = None,
    ) -> _R:
        """Build from values the client has already checked (every field given).

        What ``model_construct`` does, without its per-field loop: on the client's hot path it
        cost more than the rest of building a result. ``tests/test_models.py`` checks that the
        two build equal objects.
        """
        result = _new(cls)
        _set_dict(
            result,
            {
                "text": text,
                "finish_reason": finish_reason,
                "usage": usage,
                "latency_s": latency_s,
                "queued_s": queued_s,
                "attempts": attempts,
                "max_tokens": max_tokens,
                "lane": lane,
                "index": index,
                "server": server,
                "degraded": degraded,
            },
        )
        _set_fields(result, set(_RESULT_FIELDS))
        _set_extra(result, None)
        _set_private(result, {"_raw_data": raw_data, "_raw": None})
        return result


class CompletionResult(Result):
    """The result of ``generate()`` (the completions endpoint)."""

    _raw: Completion | None = PrivateAttr(default=None)

    @property
    def raw(self) -> Completion:
        """The response as ``openai.types.Completion`` (validated on first access)."""
        if self._raw is None:
            from openai.types import Completion

            self._raw = Completion.model_validate(self._raw_data)
        return self._raw


class ChatResult(Result):
    """The result of ``chat()`` (the chat completions endpoint)."""

    _raw: ChatCompletion | None = PrivateAttr(default=None)

    @property
    def raw(self) -> ChatCompletion:
        """The response as ``openai.types.chat.ChatCompletion`` (validated on first access)."""
        if self._raw is None:
            from openai.types.chat import ChatCompletion

            self._raw = ChatCompletion.model_validate(self._raw_data)
        return self._raw


_RESULT_FIELDS = frozenset(Result.model_fields)


class Failure(BaseModel):
    """An item of a batch that failed: its input ``index``, ``id`` and the ``error``.

    ``text`` is always ``None`` so code that reads ``result.text`` over a batch keeps working.
    """

    model_config = ConfigDict(frozen=True, arbitrary_types_allowed=True)

    index: int
    id: str | None = None
    error: BaseException
    attempts: int = 1
    text: None = None

    @property
    def ok(self) -> bool:
        return False

    @property
    def error_type(self) -> str:
        return type(self.error).__name__

    def __repr__(self) -> str:
        return f"Failure(index={self.index}, id={self.id!r}, error={self.error_type}: {self.error})"
