"""Results built on the client's fast path are the same objects pydantic builds."""

from __future__ import annotations

import pickle

import pydantic
import pytest

from dsclient import ChatResult, CompletionResult, Usage

from .fakes import chat_body, completion_body

FIELDS = {
    "text": "Paris",
    "finish_reason": "length",
    "latency_s": 0.25,
    "queued_s": 0.05,
    "attempts": 2,
    "max_tokens": 8,
    "lane": "long",
    "index": 7,
    "server": "http://127.0.0.1:8000",
    "degraded": "max_tokens 256 -> 64",
}


@pytest.mark.parametrize(
    ("cls", "body"),
    [
        (CompletionResult, completion_body("Paris", prompt_tokens=3, completion_tokens=1)),
        (ChatResult, chat_body("Paris")),
    ],
)
def test_trusted_builds_what_validation_builds(cls, body):
    usage = Usage._trusted(3, 1)
    fast = cls._trusted(usage=usage, raw_data=body, **FIELDS)
    slow = cls._rebuilt(body, **FIELDS, usage={"prompt_tokens": 3, "completion_tokens": 1})

    assert usage == Usage(prompt_tokens=3, completion_tokens=1) and usage.total_tokens == 4
    assert fast == slow
    assert fast.model_dump() == slow.model_dump()
    assert repr(fast) == repr(slow)
    assert fast.model_fields_set == slow.model_fields_set == set(cls.model_fields)
    assert fast.raw.model_dump() == slow.raw.model_dump()
    assert fast.raw.choices[0] is not None
    assert fast.model_copy(update={"text": "Lyon"}).text == "Lyon"
    assert pickle.loads(pickle.dumps(fast)) == fast
    with pytest.raises(pydantic.ValidationError, match="frozen"):
        fast.text = "changed"
    with pytest.raises(pydantic.ValidationError, match="frozen"):
        usage.prompt_tokens = 9


def test_each_result_owns_its_fields_set():
    a = CompletionResult._trusted(usage=Usage._trusted(1, 1), raw_data={}, **FIELDS)
    b = CompletionResult._trusted(usage=Usage._trusted(1, 1), raw_data={}, **FIELDS)
    assert a.model_fields_set is not b.model_fields_set
