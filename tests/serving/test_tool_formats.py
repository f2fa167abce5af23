"""The tool-call formats' text rules, on their own: where an answer of calls ends at a
repeated call, and what an answer cut inside a call's tag leaves (issue 32)."""

from __future__ import annotations

from kunlun.protocol.tool_formats import Hermes, Llama3Json


def hermes(arguments: str, name: str = "get_time") -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>'


def test_hermes_ends_at_the_first_call_that_repeats_an_earlier_one() -> None:
    tokyo, london = hermes('{"zone": "Tokyo"}'), hermes('{"zone": "London"}')
    fmt = Hermes()
    assert fmt.repeat_end(tokyo) is None
    assert fmt.repeat_end(f"{tokyo}\n{london}") is None  # two different calls
    assert fmt.repeat_end(f"{tokyo}\n{london}\n<tool_call>\n{{") is None  # not closed yet
    spaced = hermes('{ "zone" :  "Tokyo" }')  # the same call, spelled otherwise
    assert fmt.repeat_end(f"{tokyo}\n{london}\n{spaced}\n") == len(f"{tokyo}\n{london}")
    other_name = hermes('{"zone": "Tokyo"}', name="get_weather")
    assert fmt.repeat_end(f"{tokyo}\n{other_name}") is None
    content, calls = fmt.parse(f"{tokyo}\n{london}\n{spaced}"[: len(f"{tokyo}\n{london}")])
    assert content is None and [c.arguments for c in calls] == ['{"zone": "Tokyo"}',
                                                                 '{"zone": "London"}']  # fmt: skip


def test_llama3_json_ends_at_a_repeat_once_its_separator_is_written() -> None:
    one, two = '{"name": "f", "parameters": {"a": "x; y"}}', '{"name": "f", "parameters": {"a": 2}}'
    fmt = Llama3Json()
    assert fmt.repeat_end(f"{one}; {two}") is None
    assert fmt.repeat_end(f"{one}; {two}; ") is None
    assert fmt.repeat_end(f"{one}; {two}; {one}") is None  # the separator ends a call
    assert fmt.repeat_end(f"{one}; {two}; {one}; ") == len(f"{one}; {two}")


def test_an_answer_cut_inside_a_calls_tag_leaves_no_markup() -> None:
    """A non-streamed answer cut at ``max_tokens`` right after two calls, in the first
    characters of a third tag: the calls, and no ``<tool_`` as content."""
    first, second = hermes("{}"), hermes('{"zone": "UTC"}')
    calls_text = f"{first}\n{second}\n<tool_"
    content, calls = Hermes().parse(calls_text, cut=True)
    assert content is None and len(calls) == 2
    content, calls = Hermes().parse("It is noon <tool_", cut=True)
    assert content == "It is noon" and not calls
    content, _ = Hermes().parse("a <b", cut=False)  # not cut: text that may look like a tag
    assert content == "a <b"
