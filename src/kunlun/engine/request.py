"""One request inside the engine: its checks, its record while it runs, and its final output.

:meth:`~kunlun.engine.llm_engine.LLMEngine.make_request` checks a request with
:func:`prompt_token_ids` (text encoded, or token ids that must be ids of the model) and
:func:`output_limit` (the prompt and ``max_tokens`` must fit the context window and the KV
cache), raising a :class:`RequestError` before the request touches any engine state.
:class:`Request` is what the engine keeps of it while it runs; each step adds the logprobs of
the prompt tokens a chunk predicted (:func:`collect_prompt_logprobs`), and a finished request
becomes a :class:`~kunlun.engine.outputs.RequestOutput` (:func:`final_output`). Kept apart
from the engine, which runs the steps, as functions of their arguments only.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kunlun.engine.detokenizer import Detokenizer
from kunlun.engine.outputs import CompletionOutput, RequestOutput
from kunlun.engine.sampler import top_logprobs
from kunlun.engine.sampling_params import SamplingParams
from kunlun.engine.sequence import Sequence
from kunlun.engine.tokenizer import Tokenizer
from kunlun.errors import KunlunError, PromptTooLong, RequestError

Prompt = str | list[int]
"""Text (encoded with the model's special tokens) or token ids (used as given)."""


@dataclass
class Request:
    """A validated request: its sequences (one per completion) and their detokenizers."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    detokenizers: list[Detokenizer]
    arrival_time: float
    finish_time: float | None = field(default=None)

    @property
    def finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)


def prompt_token_ids(tokenizer: Tokenizer, vocab_size: int, prompt: Prompt) -> list[int]:
    """The prompt's token ids: text encoded with the special tokens, or the ids given, each
    checked to be below ``vocab_size``."""
    if isinstance(prompt, str):
        token_ids = tokenizer.encode(prompt, add_special_tokens=True)
    elif isinstance(prompt, list | tuple):
        token_ids = list(prompt)
        for i, t in enumerate(token_ids):
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size:
                raise RequestError(
                    f"prompt token {i} is {t!r}: expected an id in [0, {vocab_size})"
                )
    else:
        raise RequestError(
            f"prompt must be text or a list of token ids, not {type(prompt).__name__}"
        )
    if not token_ids:
        raise RequestError("prompt is empty: it must have at least one token")
    return token_ids


def output_limit(
    num_prompt: int, params: SamplingParams, max_model_len: int, kv_capacity: int
) -> int:
    """The output limit of a request, after checking that it fits the context window
    (``max_model_len``) and the KV cache (``kv_capacity`` tokens: a sequence longer than the
    whole cache could never run)."""
    limit, what = min((max_model_len, "max_model_len"), (kv_capacity, "KV cache size"))
    if num_prompt >= limit:
        raise PromptTooLong(
            f"prompt has {num_prompt} tokens but the {what} is {limit} tokens; the prompt "
            "must leave room for at least one output token",
            hint="shorten the prompt"
            if what == "max_model_len"
            else "give the engine more KV memory",
        )
    if params.max_tokens is None:
        return limit - num_prompt
    if num_prompt + params.max_tokens > limit:
        raise RequestError(
            f"max_tokens={params.max_tokens} with a {num_prompt}-token prompt exceeds the "
            f"{what} of {limit} tokens",
            hint=f"ask for at most {limit - num_prompt} tokens",
        )
    return params.max_tokens


def collect_prompt_logprobs(seq: Sequence, num_new: int, logits: torch.Tensor) -> None:
    """Append the logprobs of prompt tokens predicted by this chunk's rows (row j predicts
    position ``num_computed + j + 1``)."""
    start = seq.num_computed
    first = max(start + 1, len(seq.prompt_logprobs))
    last = min(start + num_new, seq.num_prompt_tokens - 1)
    if last < first:
        return
    rows = logits[first - start - 1 : last - start].float()
    targets = seq.token_ids[first : last + 1]
    k = seq.params.prompt_logprobs or 0
    seq.prompt_logprobs.extend(
        top_logprobs(torch.log_softmax(rows, -1), targets, [k] * len(targets))
    )


def final_output(request: Request, error: KunlunError | None) -> RequestOutput:
    """The whole result of a finished request (``error``: why it failed, if it did)."""
    outputs = []
    for seq, detok in zip(request.seqs, request.detokenizers, strict=True):
        wants = seq.params.logprobs is not None
        outputs.append(
            CompletionOutput(
                index=seq.index,
                text=detok.text,
                token_ids=seq.output_token_ids,
                finish_reason=seq.finish_reason,
                stop_reason=detok.stop_reason,
                logprobs=seq.logprobs if wants else None,
                cumulative_logprob=seq.cumulative_logprob if wants else None,
            )
        )
    first = request.seqs[0]
    return RequestOutput(
        request_id=request.request_id,
        prompt_token_ids=request.prompt_token_ids,
        outputs=outputs,
        prompt_logprobs=first.prompt_logprobs
        if request.params.prompt_logprobs is not None
        else None,
        num_cached_tokens=first.num_cached_tokens,
        error=error,
        arrival_time=request.arrival_time,
        first_scheduled_time=min(
            (s.first_scheduled_time for s in request.seqs if s.first_scheduled_time), default=None
        ),
        first_token_time=min(
            (s.first_token_time for s in request.seqs if s.first_token_time), default=None
        ),
        finish_time=request.finish_time,
    )
