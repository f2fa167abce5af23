"""The garbage detector on the failure texts it names, and on text that is fine."""

from __future__ import annotations

import pytest

from kunlun.validate.garbage import garbage_reasons, repetition

FINE = [
    "The capital of France is Paris.",
    'Sure! Here is a JSON object: {"a": [1, 2, 3]}',
    "café, naïve, 中文, €5 - Größe",
    "Once upon a time, a cat named Tom lived in a small house by the river. Every morning he "
    "walked to the market, where the baker gave him a piece of bread and the fishmonger a fish.",
    "Wow!!! That is great.",
]


@pytest.mark.parametrize("text", FINE)
def test_language_is_not_garbage(text: str) -> None:
    assert garbage_reasons(text) == []


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("", "empty answer"),
        ("  \n\t", "empty answer"),
        ("!!!!!!!!!!!!!!!!", "a run of 16 '!'"),
        ("The answer is !!!!!!", "a run of 6 '!'"),
        ("caf\u00c3\u00a9 au lait", "mojibake 'Ã©'"),
        ("it\u00e2\u20ac\u2122s here", "mojibake 'â€™'"),
        ("broken \ufffd\ufffd bytes", "2 U+FFFD"),
        ("bell \x07 here", "control character U+0007"),
        ("Paris is the capital. " * 8, "runaway repetition"),
        ("中文" * 40, "runaway repetition"),
    ],
)
def test_each_failure_is_named(text: str, reason: str) -> None:
    reasons = garbage_reasons(text)
    assert any(reason in r for r in reasons), reasons


def test_short_repetition_is_not_judged() -> None:
    ratio, num_tokens = repetition("yes yes yes yes yes yes")
    assert ratio == 0.75 and num_tokens == 6
    assert garbage_reasons("yes yes yes yes yes yes") == []


def test_a_character_cut_by_the_length_limit_is_not_mojibake() -> None:
    assert garbage_reasons("The emoji is \ufffd") == []
    assert garbage_reasons("in the middle \ufffd of it") == ["1 U+FFFD replacement character(s)"]
    assert garbage_reasons("\ufffd\ufffd\ufffd") == ["3 U+FFFD replacement character(s)"]
