"""The cross-engine numerics check's reading and verdict (``kunlun.validate.cross_engine``),
on answers in the two logprobs shapes the engines give (recorded from the demo model: the
embedded engine's legacy completions shape, llama-server's chat-like ``content`` list). The
check end to end, on both engines behind a real daemon: tests/daemon/test_validate_engines.py.
"""

from __future__ import annotations

from typing import Any

from kunlun.validate.cross_engine import (
    END,
    Decode,
    Walk,
    _verdict,
    end_spellings,
    flip_gap,
    read_decode,
)
from kunlun.validate.matrix import Status
from kunlun.validate.numerics import GREEDY_TOKENS, NEAR_TIE

KUNLUN = {
    "usage": {"prompt_tokens": 5, "completion_tokens": 3},
    "choices": [{"text": "53.", "finish_reason": "stop", "logprobs": {
        "tokens": ["5", "3", ".", "<|im_end|>"],
        "token_logprobs": [-1.5339, -1.9651, -0.7756, -0.1677],
        "top_logprobs": [{"5": -1.5339, "1": -1.625}, {"3": -1.9651, "8": -2.156},
                         {".": -0.7756, "\n": -2.183}, {"<|im_end|>": -0.1677, "\n": -2.876}],
    }}],
}  # fmt: skip
LLAMA_CPP = {
    "usage": {"prompt_tokens": 5, "completion_tokens": 3},
    "choices": [{"text": "53.", "finish_reason": "stop", "logprobs": {"content": [
        {"token": "5", "logprob": -1.5343, "top_logprobs": [
            {"token": "5", "logprob": -1.5343}, {"token": "1", "logprob": -1.625}]},
        {"token": "3", "logprob": -1.9656, "top_logprobs": [
            {"token": "3", "logprob": -1.9656}, {"token": "8", "logprob": -2.156}]},
        {"token": ".", "logprob": -0.7757, "top_logprobs": [
            {"token": ".", "logprob": -0.7757}, {"token": "\n", "logprob": -2.182}]},
        {"token": "", "logprob": -0.1674, "top_logprobs": [
            {"token": "", "logprob": -0.1674}, {"token": "\n", "logprob": -2.879}]},
    ]}}],
}  # fmt: skip


def decode_of(answer: dict[str, Any]) -> Decode:
    return read_decode(answer, answer["choices"][0])


def test_both_shapes_read_alike_with_the_end_token_spelled_once() -> None:
    mine, ref = decode_of(LLAMA_CPP), decode_of(KUNLUN)
    assert (mine.end, ref.end) == ("", "<|im_end|>") and mine.num_prompt == ref.num_prompt == 5
    ends = end_spellings(mine, ref)
    mine, ref = mine.spelled(ends), ref.spelled(ends)
    assert mine.tokens == ref.tokens == ["5", "3", ".", END]
    assert all(abs(a - b) < 1e-3 for a, b in zip(mine.logprobs, ref.logprobs, strict=True))
    assert mine.top[3].keys() == ref.top[3].keys() == {END, "\n"}


def test_a_flip_at_a_near_tie_is_near_on_both_sides_and_a_real_one_is_not() -> None:
    ref = decode_of(KUNLUN)
    tie = Decode(6, ["1"], [-1.52], [{"1": -1.52, "5": -1.60}])  # the other at position 0
    choice, gap = flip_gap(tie, ref, 0)
    assert choice == "1" and gap is not None and gap < NEAR_TIE
    absent = Decode(6, ["7"], [-0.1], [{"7": -0.1, "2": -3.0}])  # ref's token not in its top
    assert flip_gap(absent, ref, 0) == ("7", None)
    assert flip_gap(Decode(6), ref, 0) == (END, None)  # it ended where the reference went on


def test_the_verdict_holds_deltas_and_flips_to_numerics_limits() -> None:
    close = Walk(deltas=[0.001] * 90)
    assert _verdict(close, [GREEDY_TOKENS] * 3, "the reference").status is Status.PASS
    near = Walk(deltas=[0.001] * 90, flips=[("p", 12, " a", 0.05)])
    cell = _verdict(near, [12, GREEDY_TOKENS, GREEDY_TOKENS], "the reference")
    assert cell.status is Status.PASS and "first divergence at 12" in cell.figure
    real = Walk(deltas=[0.001] * 90, flips=[("p", 12, " a", None)])
    assert _verdict(real, [12, 32, 32], "the reference").status is Status.FAIL
    drift = Walk(deltas=[0.001] * 89 + [0.9])  # one token far off: above MAX_ABS_MAX
    assert _verdict(drift, [32] * 3, "the reference").status is Status.FAIL
    assert _verdict(Walk(cut=["x"]), [0] * 3, "the reference").figure == "nothing compared"
