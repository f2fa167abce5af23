"""JSON at the edges: the depth scan agrees with the parsed value's depth on any JSON, deep
or unencodable input is a 400 naming the limit or the field, and lines always encode."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kunlun.errors import Location, RequestError
from kunlun.json_text import MAX_DEPTH, dumps_line, loads, nesting_depth

TEXT = st.text(alphabet=st.sampled_from('ab"\\[]{}é\n\u2028'), max_size=8)
VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | TEXT,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(TEXT, inner, max_size=3),
    max_leaves=30,
)


def depth_of(value: Any) -> int:
    if isinstance(value, list):
        return 1 + max((depth_of(v) for v in value), default=0)
    if isinstance(value, dict):
        return 1 + max((depth_of(v) for v in value.values()), default=0)
    return 0


@settings(max_examples=300, deadline=None)
@given(VALUES, st.booleans())
def test_the_depth_scan_matches_the_parsed_depth(value: Any, ascii_only: bool) -> None:
    raw = json.dumps(value, ensure_ascii=ascii_only).encode()
    assert nesting_depth(raw) == depth_of(value)
    assert loads(raw) == value


def test_deep_and_unclosed_nesting_is_refused_naming_the_limit() -> None:
    # a megabyte of openings closed a hundred times: the scan is linear in any shape (it
    # once removed one innermost pair per level per pass, 2.7 s for this on the event loop)
    lopsided = b"[" * (1 << 20) + b"]" * 100
    assert nesting_depth(lopsided) == MAX_DEPTH + 1
    for raw in (b"[" * 5000 + b"]" * 5000, b"[" * 5000, b'{"a":' * 100 + b"1" + b"}" * 100,
                lopsided):  # fmt: skip
        with pytest.raises(RequestError) as caught:
            loads(raw, "in.jsonl", 7)
        assert f"at most {MAX_DEPTH} levels" in caught.value.message
        assert caught.value.location == Location("in.jsonl", 7)
    at_limit = b"[" * MAX_DEPTH + b"]" * MAX_DEPTH
    assert depth_of(loads(at_limit)) == MAX_DEPTH


@pytest.mark.parametrize(
    ("raw", "field"),
    [
        (b'{"model": "\\ud800"}', "model"),
        (b'{"messages": [{"content": "ok"}, {"content": "x\\udfff"}]}', "messages.1.content"),
        (b'{"a": {"\\ud800": 1}}', "a.\\ud800"),
        (b'{"m": "\xed\xa0\x80"}', "m"),  # a surrogate as raw bytes
    ],
)
def test_unencodable_text_is_refused_naming_the_field(raw: bytes, field: str) -> None:
    with pytest.raises(RequestError) as caught:
        loads(raw)
    assert caught.value.location == Location("request", field=field)
    assert "not valid Unicode" in caught.value.message


def test_surrogate_pairs_are_text_and_lines_always_encode() -> None:
    assert loads(b'{"e": "\\ud83d\\ude00"}') == {"e": "\U0001f600"}
    line = dumps_line({"m": "\ud800", "e": "é"})
    assert line.endswith(b"\n") and json.loads(line) == {"m": "\ud800", "e": "é"}
