"""Item ids are a file format: pinned by golden values, so an output file written by one version
of dsclient resumes under the next.

If one of these fails, old output files would silently stop resuming (every item would run
again and be written twice): change the id only with a migration, never by accident.
"""

from __future__ import annotations

import hashlib
import json

import pytest

from dsclient.batch._jsonl import derive_id, item_id

GOLDEN = [
    ("Hello", 0, "0-c25bf945aaff"),
    ("Once upon a time", 41, "41-d26049627369"),
    ({"prompt": "x", "max_tokens": 8}, 3, "3-1047a1f39412"),
    ({"max_tokens": 8, "prompt": "x"}, 3, "3-1047a1f39412"),  # key order does not matter
    ([{"role": "user", "content": "héllo ✓"}], 7, "7-7c1ef51489e9"),
    ({"b": 1, "a": [1.5, None, True]}, 0, "0-c987ffa2d30c"),
    ({"id": "row-9", "prompt": "p"}, 5, "5-95a3fc858149"),
]


@pytest.mark.parametrize(("item", "index", "expected"), GOLDEN)
def test_derive_id_golden_values(item, index, expected):
    assert derive_id(item, index) == expected


def test_the_golden_values_follow_the_documented_recipe():
    # "<index>-<first 12 hex of sha256 of the canonical JSON>", canonical: sorted keys, no spaces,
    # UTF-8 as is. Computed here by hand, not through derive_id.
    canonical = json.dumps([{"content": "héllo ✓", "role": "user"}], separators=(",", ":"))
    canonical = canonical.encode().decode("unicode_escape").encode("utf-8")
    assert canonical == '[{"content":"héllo ✓","role":"user"}]'.encode()
    assert f"7-{hashlib.sha256(canonical).hexdigest()[:12]}" == "7-7c1ef51489e9"


@pytest.mark.parametrize(
    ("item", "expected"),
    [
        ({"id": "row-9", "prompt": "p"}, "row-9"),
        ({"custom_id": 12, "prompt": "p"}, "12"),
        ({"id": "a", "custom_id": "b"}, "a"),
        ({"id": True, "prompt": "p"}, "5-de44f59d00d2"),  # a bool is not an id
        ("plain prompt", "5-7f4f3f4361da"),
    ],
)
def test_item_id_prefers_the_items_own_id(item, expected):
    assert item_id(item, 5) == expected
