"""The sampler against transformers' own logits processors, and its randomness contract."""

from __future__ import annotations

import math

import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from kunlun.engine.sampler import (
    Sampler,
    apply_min_p,
    apply_penalties,
    apply_top_k,
    apply_top_p,
    warp,
)
from kunlun.engine.sampling_params import SamplingParams
from kunlun.engine.sequence import Sequence

VOCAB = 1000


def random_logits(rows: int, seed: int, vocab: int = VOCAB) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=generator) * 3
    logits[0, :10] = logits[0, 10]  # ties at the top of row 0
    return logits


def make_seq(params: SamplingParams, prompt: list[int] | None = None, output=()) -> Sequence:
    seq = Sequence("r", prompt or [1, 2, 3], params)
    for token in output:
        seq.append_token(token)
    return seq


def same_filter(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    """Same surviving tokens and (up to float rounding) the same surviving logits."""
    assert torch.equal(torch.isinf(ours), torch.isinf(theirs))
    kept = ~torch.isinf(theirs)
    torch.testing.assert_close(ours[kept], theirs[kept], rtol=0, atol=0)


@pytest.mark.parametrize("k", [1, 5, 50, VOCAB, VOCAB + 7])
def test_top_k_matches_transformers(k: int) -> None:
    logits = random_logits(4, seed=k)
    same_filter(apply_top_k(logits, [k] * 4), TopKLogitsWarper(k)(None, logits))


@pytest.mark.parametrize("p", [0.01, 0.3, 0.9, 0.999])
def test_top_p_matches_transformers(p: float) -> None:
    logits = random_logits(4, seed=int(p * 1000))
    same_filter(apply_top_p(logits, [p] * 4), TopPLogitsWarper(p)(None, logits))


@pytest.mark.parametrize("min_p", [0.0, 0.05, 0.5, 1.0])
def test_min_p_matches_transformers(min_p: float) -> None:
    logits = random_logits(4, seed=int(min_p * 100))
    same_filter(apply_min_p(logits, [min_p] * 4), MinPLogitsWarper(min_p)(None, logits))


@pytest.mark.parametrize("temperature", [0.3, 1.0, 1.7])
def test_temperature_matches_transformers(temperature: float) -> None:
    logits = random_logits(3, seed=7)
    params = [SamplingParams(temperature=temperature)] * 3
    same_filter(warp(logits, params), TemperatureLogitsWarper(temperature)(None, logits))


def test_rows_use_their_own_parameters_in_hf_order() -> None:
    """A mixed batch: each row equals HF's chain temperature -> top-k -> top-p -> min-p."""
    settings = [
        dict(temperature=0.7, top_k=40, top_p=0.9, min_p=0.05),
        dict(temperature=1.3),
        dict(temperature=1.0, top_p=0.5),
        dict(temperature=0.5, top_k=3),
        dict(temperature=2.0, min_p=0.2, top_p=0.95),
    ]
    logits = random_logits(len(settings), seed=3)
    ours = warp(logits, [SamplingParams(**s) for s in settings])
    for row, s in enumerate(settings):
        theirs = logits[row : row + 1]
        theirs = TemperatureLogitsWarper(s["temperature"])(None, theirs)
        if "top_k" in s:
            theirs = TopKLogitsWarper(s["top_k"])(None, theirs)
        if "top_p" in s:
            theirs = TopPLogitsWarper(s["top_p"])(None, theirs)
        if "min_p" in s:
            theirs = MinPLogitsWarper(s["min_p"])(None, theirs)
        same_filter(ours[row : row + 1], theirs)


@pytest.mark.parametrize("penalty", [0.5, 1.3, 2.0])
def test_repetition_penalty_matches_transformers(penalty: float) -> None:
    logits = random_logits(2, seed=11)
    prompts = [[5, 17, 17, 300], [999, 0]]
    outputs = [[42, 5], [7]]
    seqs = [
        make_seq(SamplingParams(repetition_penalty=penalty), p, o)
        for p, o in zip(prompts, outputs, strict=True)
    ]
    ours = apply_penalties(logits.clone(), seqs)
    for row, seq in enumerate(seqs):
        ids = torch.tensor([seq.token_ids])
        theirs = RepetitionPenaltyLogitsProcessor(penalty)(ids, logits[row : row + 1].clone())
        torch.testing.assert_close(ours[row : row + 1], theirs, rtol=0, atol=0)


def test_presence_and_frequency_penalties_follow_openai() -> None:
    """logit -= frequency * count(output) + presence * [count > 0]; the prompt is ignored."""
    logits = random_logits(1, seed=5)
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    seq = make_seq(params, prompt=[9, 9, 9], output=[4, 4, 4, 8])
    ours = apply_penalties(logits.clone(), [seq])
    expected = logits.clone()
    expected[0, 4] -= 3 * 0.25 + 0.5
    expected[0, 8] -= 1 * 0.25 + 0.5
    torch.testing.assert_close(ours, expected)
    assert ours[0, 9] == logits[0, 9]


def test_greedy_takes_the_penalized_argmax() -> None:
    logits = torch.zeros(2, VOCAB)
    logits[:, 10] = 5.0
    logits[:, 20] = 4.0
    seqs = [
        make_seq(SamplingParams(temperature=0)),
        make_seq(SamplingParams(temperature=0, repetition_penalty=2.0), prompt=[10]),
    ]
    assert Sampler()(logits, seqs).token_ids == [10, 20]


def test_sampled_tokens_follow_the_filtered_distribution() -> None:
    """Empirical frequencies of sampled tokens match HF's top-p distribution."""
    logits = torch.tensor([[2.0, 1.5, 1.0, 0.5, 0.0, -1.0, -2.0, -3.0]])
    params = SamplingParams(temperature=0.8, top_p=0.8, seed=1234)
    expected = torch.softmax(
        TopPLogitsWarper(0.8)(None, TemperatureLogitsWarper(0.8)(None, logits)), dim=-1
    )[0]
    seq = make_seq(params)
    sampler = Sampler()
    draws = 4000
    counts = torch.zeros(8)
    for _ in range(draws):
        counts[sampler(logits, [seq]).token_ids[0]] += 1
    assert counts[expected == 0].sum() == 0  # filtered tokens are never drawn
    observed = counts / draws
    tolerance = 4 * torch.sqrt(expected * (1 - expected) / draws) + 1e-3
    assert torch.all((observed - expected).abs() <= tolerance), (observed, expected)


def test_same_seed_same_tokens_whatever_the_batch() -> None:
    """A seeded request draws from its own generator: other rows do not change its tokens."""
    logits = random_logits(6, seed=21)
    params = SamplingParams(temperature=1.0, seed=77)

    def run(batch_rows: list[int], others_seeded: bool) -> list[int]:
        mine = make_seq(params)
        tokens = []
        for step in range(20):
            seqs, rows = [], []
            for row in batch_rows:
                other = SamplingParams(temperature=1.0, seed=step if others_seeded else None)
                seqs.append(make_seq(other))
                rows.append(row)
            position = len(seqs) // 2
            seqs.insert(position, mine)
            rows.insert(position, 0)
            out = Sampler(torch.Generator().manual_seed(step))(logits[rows], seqs)
            tokens.append(out.token_ids[position])
        return tokens

    alone = run([], False)
    assert run([1, 2, 3], False) == alone
    assert run([4, 5], True) == alone
    other_seed = make_seq(SamplingParams(temperature=1.0, seed=78))
    assert [Sampler()(logits[:1], [other_seed]).token_ids[0] for _ in range(20)] != alone


def test_logprobs_are_raw_log_softmax_with_top_entries() -> None:
    logits = random_logits(2, seed=9)
    seqs = [
        make_seq(SamplingParams(temperature=0, logprobs=3, repetition_penalty=1.5)),
        make_seq(SamplingParams(temperature=0)),
    ]
    out = Sampler()(logits, seqs)
    raw = torch.log_softmax(logits, dim=-1)
    entry = out.logprobs[0]
    assert entry is not None and out.logprobs[1] is None
    chosen = out.token_ids[0]
    assert math.isclose(entry[chosen], raw[0, chosen].item(), rel_tol=1e-6)
    top = torch.topk(raw[0], 3)
    for value, index in zip(top.values.tolist(), top.indices.tolist(), strict=True):
        assert math.isclose(entry[index], value, rel_tol=1e-6)
    assert len(entry) <= 4
