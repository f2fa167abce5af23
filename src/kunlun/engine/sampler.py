"""Choose the next token of each sequence from its logits, in one batched pass.

Order (as ``transformers.generate``): repetition penalty (HF semantics, over prompt and
output), presence and frequency penalties (OpenAI semantics, over output tokens), then
temperature, top-k, top-p and min-p (the HF warpers' exact semantics). Temperature 0 is
greedy (argmax of the penalized logits). Sampling uses the exponential race
(``argmax(p / q)`` with ``q ~ Exp(1)``), drawing ``q`` from the sequence's own generator
when the request has a seed, so a seeded row does not depend on the rest of the batch.

A guided row (a request with a :class:`~kunlun.engine.guided.Guide`) has every token its
grammar does not allow set to -inf after the penalties, and its matcher consumes the chosen
token; rows and batches without a guide skip both.

Logprobs are ``log_softmax`` of the raw model logits, before penalties and temperature
(vLLM's default): they describe the model, not the sampling rule.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kunlun.engine.guided import GuidedDecoding
from kunlun.engine.sampling_params import SamplingParams
from kunlun.engine.sequence import Sequence, TopLogprobs

_NEG_INF = float("-inf")


@dataclass
class SamplerOutput:
    """Per row: the chosen token, and its logprob entry when the request asked for one."""

    token_ids: list[int]
    logprobs: list[TopLogprobs | None]


class Sampler:
    """Stateless apart from the shared generator used by requests without a seed."""

    def __init__(
        self, generator: torch.Generator | None = None, guided: GuidedDecoding | None = None
    ) -> None:
        self.generator = generator
        self.guided = guided

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> SamplerOutput:
        """Sample one token per row of ``logits`` ([len(seqs), vocab], float32)."""
        params = [s.params for s in seqs]
        scores = logits
        if any(p.needs_penalties for p in params):
            scores = apply_penalties(logits.clone(), seqs)
        early = [i for i, s in enumerate(seqs)
                 if s.min_tokens_ban and s.num_output_tokens < s.params.min_tokens]  # fmt: skip
        if early:
            scores = scores.clone() if scores is logits else scores
            for i in early:
                scores[i, seqs[i].min_tokens_ban] = _NEG_INF
        guided = [(s.matcher, i) for i, s in enumerate(seqs) if s.matcher is not None]
        if guided and self.guided is not None:
            scores = scores.clone() if scores is logits else scores
            self.guided.mask(scores, guided)
        greedy = [p.temperature == 0 for p in params]
        if all(greedy):
            token_ids = scores.argmax(dim=-1).tolist()
        else:
            token_ids = self._sample(scores, seqs, greedy)
        for matcher, i in guided:
            matcher.consume_token(token_ids[i])
        logprobs: list[TopLogprobs | None] = [None] * len(seqs)
        rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        if rows:
            entries = top_logprobs(
                torch.log_softmax(logits[rows].float(), dim=-1),
                [token_ids[i] for i in rows],
                [params[i].logprobs or 0 for i in rows],
            )
            for i, entry in zip(rows, entries, strict=True):
                logprobs[i] = entry
        return SamplerOutput(token_ids, logprobs)

    def _sample(self, scores: torch.Tensor, seqs: list[Sequence], greedy: list[bool]) -> list[int]:
        probs = torch.softmax(warp(scores, [s.params for s in seqs]), dim=-1)
        q = torch.empty_like(probs)
        unseeded = [i for i, s in enumerate(seqs) if s.params.seed is None]
        if unseeded:
            q[unseeded] = torch.empty_like(probs[unseeded]).exponential_(generator=self.generator)
        for i, seq in enumerate(seqs):
            if seq.params.seed is not None:
                q[i].exponential_(generator=seq.seed_generator(probs.device))
        sampled = (probs / q).argmax(dim=-1)
        if any(greedy):
            mask = torch.tensor(greedy, device=scores.device)
            sampled = torch.where(mask, scores.argmax(dim=-1), sampled)
        return sampled.tolist()


def warp(scores: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p, per row (HF's warpers in HF's order).

    Returns new logits where filtered tokens are -inf; rows with temperature 0 are left
    at temperature 1 (they are decoded greedily anyway).
    """
    temperatures = [p.temperature if p.temperature > 0 else 1.0 for p in params]
    divisor = torch.tensor(temperatures, dtype=scores.dtype, device=scores.device)
    warped = scores / divisor[:, None]
    if any(p.top_k is not None for p in params):
        warped = apply_top_k(warped, [p.top_k for p in params])
    if any(p.top_p < 1.0 for p in params):
        warped = apply_top_p(warped, [p.top_p for p in params])
    if any(p.min_p > 0.0 for p in params):
        warped = apply_min_p(warped, [p.min_p for p in params])
    return warped


def apply_penalties(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """Apply repetition, presence and frequency penalties in place; return ``logits``."""
    vocab_size = logits.shape[-1]
    device = logits.device
    for i, seq in enumerate(seqs):
        p = seq.params
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(seq.token_ids, dtype=torch.long, device=device)
            seen = seen[seen < vocab_size]
            score = logits[i, seen]
            score = torch.where(
                score < 0, score * p.repetition_penalty, score / p.repetition_penalty
            )
            logits[i, seen] = score
        if (p.presence_penalty != 0.0 or p.frequency_penalty != 0.0) and seq.num_output_tokens:
            out = torch.tensor(seq.output_token_ids, dtype=torch.long, device=device)
            counts = torch.bincount(out[out < vocab_size], minlength=vocab_size)
            counts = counts.to(logits.dtype)
            logits[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0)
    return logits


def apply_top_k(scores: torch.Tensor, top_k: list[int | None]) -> torch.Tensor:
    """HF ``TopKLogitsWarper`` per row (ties with the k-th score are kept); None: no-op."""
    vocab_size = scores.shape[-1]
    ks = [min(k, vocab_size) if k is not None else vocab_size for k in top_k]
    k_max = max(k for k, given in zip(ks, top_k, strict=True) if given is not None)
    values = torch.topk(scores, k_max, dim=-1).values
    index = torch.tensor([min(k, k_max) - 1 for k in ks], device=scores.device)
    threshold = values.gather(1, index[:, None])
    off = torch.tensor([k is None for k in top_k], device=scores.device)
    threshold = threshold.masked_fill(off[:, None], _NEG_INF)
    return scores.masked_fill(scores < threshold, _NEG_INF)


def apply_top_p(scores: torch.Tensor, top_p: list[float]) -> torch.Tensor:
    """HF ``TopPLogitsWarper`` per row: drop the least likely tokens whose total mass is at
    most ``1 - top_p``; the most likely token always stays. ``top_p == 1``: no-op."""
    sorted_logits, sorted_index = torch.sort(scores, descending=False)
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    limit = torch.tensor([1 - p for p in top_p], dtype=scores.dtype, device=scores.device)
    remove_sorted = cumulative <= limit[:, None]
    remove_sorted[:, -1] = False
    remove = remove_sorted.scatter(1, sorted_index, remove_sorted)
    return scores.masked_fill(remove, _NEG_INF)


def apply_min_p(scores: torch.Tensor, min_p: list[float]) -> torch.Tensor:
    """HF ``MinPLogitsWarper`` per row: drop tokens whose probability is below ``min_p``
    times the top probability; the most likely token always stays. ``min_p == 0``: no-op."""
    probs = torch.softmax(scores, dim=-1)
    top = probs.amax(dim=-1, keepdim=True)
    factor = torch.tensor(min_p, dtype=scores.dtype, device=scores.device)[:, None]
    remove = probs < factor * top
    remove.scatter_(-1, torch.topk(probs, 1, dim=-1).indices, False)
    return scores.masked_fill(remove, _NEG_INF)


def top_logprobs(
    logprobs: torch.Tensor, chosen: list[int], num_top: list[int]
) -> list[TopLogprobs]:
    """Per row of ``logprobs`` ([rows, vocab]): {chosen token: logprob} plus the row's
    ``num_top`` most likely tokens. Only two host transfers for the whole batch."""
    index = torch.tensor(chosen, dtype=torch.long, device=logprobs.device)
    chosen_values = logprobs.gather(1, index[:, None])[:, 0].tolist()
    k_max = max(num_top)
    top_values: list[list[float]] = [[] for _ in chosen]
    top_ids: list[list[int]] = [[] for _ in chosen]
    if k_max > 0:
        top = torch.topk(logprobs, k_max, dim=-1)
        top_values, top_ids = top.values.tolist(), top.indices.tolist()
    entries: list[TopLogprobs] = []
    for row, token_id in enumerate(chosen):
        entry = {token_id: chosen_values[row]}
        for j in range(num_top[row]):
            entry.setdefault(top_ids[row][j], top_values[row][j])
        entries.append(entry)
    return entries
