"""Incremental detokenization and stop conditions, with the demo model's real tokenizer."""

from __future__ import annotations

from pathlib import Path

import pytest

from kunlun.engine.detokenizer import Detokenizer
from kunlun.engine.sampling_params import SamplingParams
from kunlun.engine.tokenizer import Tokenizer

PROMPT = "Write something:"


@pytest.fixture(scope="module")
def tokenizer(demo_model_dir: Path) -> Tokenizer:
    return Tokenizer(demo_model_dir)


def stream(
    tokenizer: Tokenizer, text: str, params: SamplingParams, *, max_tokens: int = 10_000
) -> tuple[list[str], Detokenizer, list[int]]:
    """Feed ``text``'s tokens one by one; return the deltas, the detokenizer and the ids."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = Detokenizer(
        tokenizer,
        params,
        tokenizer.encode(PROMPT),
        eos_token_ids=tokenizer.eos_token_ids,
        max_tokens=max_tokens,
    )
    deltas = []
    for token_id in ids:
        reason = detok.update(token_id)
        deltas.append(detok.take_delta())
        if reason is not None:
            break
    return deltas, detok, ids


def test_deltas_add_up_to_the_full_decode(tokenizer: Tokenizer) -> None:
    text = "def add(a, b):\n    return a + b  # sum, café naïve résumé ✓ 🙂\n"
    deltas, detok, ids = stream(tokenizer, text, SamplingParams())
    assert "".join(deltas) == tokenizer.decode(ids) == text
    assert detok.finish_reason is None


def test_streamed_chinese_never_yields_a_replacement_character(tokenizer: Tokenizer) -> None:
    text = "长江是中国最长的河流，全长约六千三百公里。我们明天去北京看长城吧！"
    ids = tokenizer.encode(text, add_special_tokens=False)
    # the test means something only if some characters span several tokens
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids)
    deltas, _, _ = stream(tokenizer, text, SamplingParams())
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == text


def test_a_stop_string_split_across_tokens_is_never_emitted(tokenizer: Tokenizer) -> None:
    text = "The answer is forty-two. THE_END_MARKER and then more text follows here."
    stop = "_END_MAR"
    ids = tokenizer.encode(text, add_special_tokens=False)
    pieces = [tokenizer.decode([i]) for i in ids]
    assert not any(stop in p for p in pieces), "the stop string must span several tokens"
    deltas, detok, _ = stream(tokenizer, text, SamplingParams(stop=[stop]))
    emitted = "".join(deltas)
    assert emitted == "The answer is forty-two. THE"
    assert detok.finish_reason == "stop" and detok.stop_reason == stop
    assert all(stop[:2] not in d for d in deltas)


def test_a_possible_stop_prefix_is_held_back_then_released(tokenizer: Tokenizer) -> None:
    params = SamplingParams(stop=["Hello world!"])
    detok = Detokenizer(tokenizer, params, [], max_tokens=100)
    outputs = []
    for token_id in tokenizer.encode(" Hello world, friend", add_special_tokens=False):
        detok.update(token_id)
        outputs.append(detok.take_delta())
    assert "".join(outputs) == " Hello world, friend"
    num_hello = len(tokenizer.encode(" Hello", add_special_tokens=False))
    assert "".join(outputs[:num_hello]) == " "  # "Hello" could begin the stop string: held


def test_stop_token_ids_eos_and_ignore_eos(tokenizer: Tokenizer) -> None:
    eos = next(iter(tokenizer.eos_token_ids))
    hello = tokenizer.encode("Hello", add_special_tokens=False)

    def finish(params: SamplingParams, ids: list[int]) -> Detokenizer:
        detok = Detokenizer(tokenizer, params, [], eos_token_ids={eos}, max_tokens=100)
        for token_id in ids:
            if detok.update(token_id):
                break
        return detok

    stopped = finish(SamplingParams(stop_token_ids=[hello[0]]), [*hello, eos])
    assert (stopped.finish_reason, stopped.stop_reason, stopped.text) == ("stop", hello[0], "")
    at_eos = finish(SamplingParams(), [*hello, eos, *hello])
    assert (at_eos.finish_reason, at_eos.text) == ("stop", "Hello")
    ignored = finish(SamplingParams(ignore_eos=True), [*hello, eos, *hello])
    assert ignored.finish_reason is None and ignored.text == "HelloHello"


def test_max_tokens_finishes_with_length(tokenizer: Tokenizer) -> None:
    deltas, detok, _ = stream(
        tokenizer, "one two three four five six", SamplingParams(), max_tokens=3
    )
    assert detok.finish_reason == "length" and detok.num_tokens == 3
    assert "".join(deltas) == "one two three"


def test_an_end_text_rule_ends_the_sequence_where_it_says(tokenizer: Tokenizer) -> None:
    """The serving layer's rule on the text (a repeated tool call, issue 32): the sequence
    ends with ``stop`` and its text is cut where the rule says; nothing after the cut is
    handed out."""
    from kunlun.protocol.tool_formats import Hermes

    call = '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'
    other = '<tool_call>\n{"name": "f", "arguments": {"x": 2}}\n</tool_call>'
    text = "\n".join([call, other, call, other])
    deltas, detok, _ = stream(tokenizer, text, SamplingParams(end_text=Hermes().repeat_end))
    assert detok.finish_reason == "stop" and detok.stop_reason is None
    assert detok.text == f"{call}\n{other}"
    sent = "".join(deltas)
    assert sent.startswith(detok.text) and len(sent) < len(f"{call}\n{other}\n{call}")
