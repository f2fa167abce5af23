"""SSE framing as the battery judges it."""

from __future__ import annotations

from kunlun.validate.client import parse_sse

GOOD = b'data: {"a":1}\n\ndata: {"a":2}\n\ndata: [DONE]\n\n'


def test_openai_framing_has_no_problem() -> None:
    assert parse_sse(GOOD) == (['{"a":1}', '{"a":2}', "[DONE]"], [])


def test_crlf_and_comments_are_allowed() -> None:
    raw = b': keep-alive\r\n\r\ndata: {"a":1}\r\n\r\ndata: [DONE]\r\n\r\n'
    assert parse_sse(raw) == (['{"a":1}', "[DONE]"], [])


def test_single_newlines_merge_events() -> None:
    events, problems = parse_sse(b'data: {"a":1}\ndata: {"a":2}\ndata: [DONE]\n')
    assert any("3 data lines in one event" in p for p in problems)
    assert any("does not end with a blank line" in p for p in problems)
    assert any("no 'data: [DONE]'" in p for p in problems)


def test_missing_done_and_events_after_it() -> None:
    assert parse_sse(b'data: {"a":1}\n\n')[1] == ["no 'data: [DONE]' event"]
    problems = parse_sse(b'data: [DONE]\n\ndata: {"a":1}\n\n')[1]
    assert problems == ["1 event(s) after [DONE]"]


def test_foreign_lines_are_named() -> None:
    problems = parse_sse(b'event: message\ndata: {"a":1}\n\ndata: [DONE]\n\n')[1]
    assert problems == ["a line that is not 'data:': 'event: message'"]
