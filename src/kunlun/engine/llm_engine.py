"""The engine: requests in, tokens out, one scheduled step at a time.

:class:`LLMEngine` ties the pieces together. Each :meth:`LLMEngine.step` asks the scheduler
for a batch, runs the model on it, samples, advances the sequences and turns new tokens into
text deltas; a step the model fails on fails the requests in that batch (with an
:class:`EngineError` in their output), not the engine. :class:`LLM` is the synchronous,
offline front: ``generate`` and ``chat`` run the engine until their requests finish.

Bad input (a prompt longer than the context or the KV cache, invalid sampling parameters,
out-of-vocabulary token ids) raises a :class:`RequestError` for that request only, before it
touches any engine state.
"""

from __future__ import annotations

import copy
import logging
import time
import uuid
from collections.abc import Mapping
from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kunlun.engine.block_manager import BlockManager
from kunlun.engine.detokenizer import Detokenizer
from kunlun.engine.model_runner import ModelRunner, StepSeq
from kunlun.engine.outputs import CompletionOutput, EngineStats, RequestOutput, RequestOutputDelta
from kunlun.engine.sampler import Sampler, SamplerOutput, top_logprobs
from kunlun.engine.sampling_params import SamplingParams
from kunlun.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from kunlun.engine.sequence import Sequence, TopLogprobs
from kunlun.errors import ConfigError, EngineError, KunlunError, PromptTooLong, RequestError

logger = logging.getLogger(__name__)

Prompt = str | list[int]
"""Text (encoded with the model's special tokens) or token ids (used as given)."""


@dataclass
class EngineConfig:
    """Everything needed to build an :class:`LLMEngine`."""

    model_dir: str | Path
    """A Hugging Face model directory (config.json, safetensors, tokenizer.json)."""
    device: str = "cpu"
    """Torch device string from the device plugin: cpu, cuda:0, npu:0, mlu:0, ..."""
    dtype: torch.dtype = torch.float32
    """Weights and KV dtype (float32, bfloat16, float16)."""
    block_size: int = 16
    """Token slots per KV block (>= 1)."""
    num_blocks: int | None = None
    """KV blocks; None: sized by the runner from ``kv_cache_memory_bytes`` or its default."""
    kv_cache_memory_bytes: int | None = None
    """Memory for the KV cache when ``num_blocks`` is None (> 0)."""
    max_model_len: int | None = None
    """Longest sequence (prompt + output); None: the model's max_position_embeddings."""
    max_num_seqs: int = 64
    """Most sequences running in one step (>= 1)."""
    max_num_batched_tokens: int = 1024
    """Token budget of one step, prefill chunks and decodes together (>= 1)."""
    enable_prefix_caching: bool = True
    """Reuse the KV of prompt prefixes already computed."""
    num_threads: int | None = None
    """CPU threads for torch; None leaves torch's default."""
    seed: int = 0
    """Seeds the generator shared by requests that bring no seed of their own."""

    def validate(self) -> EngineConfig:
        """Raise :class:`ConfigError` naming the first bad field and its value."""
        positive = {
            "block_size": self.block_size,
            "max_num_seqs": self.max_num_seqs,
            "max_num_batched_tokens": self.max_num_batched_tokens,
        }
        optional = {
            "num_blocks": self.num_blocks,
            "kv_cache_memory_bytes": self.kv_cache_memory_bytes,
            "max_model_len": self.max_model_len,
            "num_threads": self.num_threads,
        }
        for name, value in [*positive.items(), *optional.items()]:
            if (value is not None or name in positive) and not (
                isinstance(value, int) and not isinstance(value, bool) and value >= 1
            ):
                raise ConfigError(
                    f"engine setting {name}={value!r} is invalid: expected an integer >= 1"
                )
        return self


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


class LLMEngine:
    """Continuous-batching engine over one :class:`ModelRunner`. Not thread-safe: drive it
    from one thread (see :class:`kunlun.engine.async_engine.AsyncLLMEngine`), except
    :meth:`make_request`, which only reads."""

    def __init__(self, config: EngineConfig, *, runner: ModelRunner | None = None) -> None:
        """Load the model (or use ``runner``, already loaded) and size the KV cache."""
        self.config = config.validate()
        self.runner = runner or ModelRunner(
            config.model_dir,
            device=config.device,
            dtype=config.dtype,
            block_size=config.block_size,
            num_blocks=config.num_blocks,
            kv_cache_memory_bytes=config.kv_cache_memory_bytes,
            max_model_len=config.max_model_len,
            num_threads=config.num_threads,
        )
        self.tokenizer = self.runner.tokenizer
        self.max_model_len = self.runner.max_model_len
        self.block_manager = BlockManager(
            self.runner.num_blocks,
            self.runner.block_size,
            enable_prefix_caching=config.enable_prefix_caching,
        )
        self.scheduler = Scheduler(
            SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens), self.block_manager
        )
        generator = torch.Generator(device=self.runner.device)
        generator.manual_seed(config.seed)
        self.sampler = Sampler(generator)
        self._requests: dict[str, Request] = {}
        self._num_steps = 0
        self._num_generated = 0
        self._num_failed_steps = 0

    @classmethod
    def from_model(cls, model_dir: str | Path, **settings: Any) -> LLMEngine:
        """Build from a model directory and :class:`EngineConfig` fields as keywords."""
        return cls(EngineConfig(model_dir, **settings))

    # ---- requests ----
    def make_request(
        self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None
    ) -> Request:
        """Validate and tokenize a request without queuing it (safe from any thread).

        Raises :class:`RequestError` (:class:`PromptTooLong` for length) naming the problem.
        """
        params = copy.deepcopy(params or SamplingParams()).validate()
        token_ids = self._prompt_ids(prompt)
        max_tokens = self._max_tokens(len(token_ids), params)
        request_id = request_id or uuid.uuid4().hex
        arrival = time.monotonic()
        seqs = [Sequence(request_id, token_ids, params, index=i, arrival_time=arrival)
                for i in range(params.n)]  # fmt: skip
        eos = set(self.tokenizer.eos_token_ids)
        detokenizers = [
            Detokenizer(self.tokenizer, params, token_ids, eos_token_ids=eos, max_tokens=max_tokens)
            for _ in seqs
        ]
        return Request(request_id, token_ids, params, seqs, detokenizers, arrival)

    def add(self, request: Request) -> None:
        """Queue a request built by :meth:`make_request`."""
        if request.request_id in self._requests:
            raise RequestError(f"request_id {request.request_id!r} is already in use")
        self._requests[request.request_id] = request
        self.scheduler.add(request.seqs)

    def add_request(
        self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None
    ) -> str:
        """Validate and queue a request; return its id."""
        request = self.make_request(prompt, params, request_id)
        self.add(request)
        return request.request_id

    def abort_request(self, request_id: str) -> list[RequestOutputDelta]:
        """Stop a request now and free its blocks; returns its closing deltas (none if the
        id is unknown or already finished)."""
        return self._end_request(request_id, None)

    def abort_all(self) -> list[RequestOutputDelta]:
        """Abort every unfinished request (e.g. after an unexpected failure)."""
        return [
            d for request_id in list(self._requests) for d in self._end_request(request_id, None)
        ]

    def has_unfinished(self) -> bool:
        return bool(self._requests)

    # ---- the step loop ----
    def step(self) -> list[RequestOutputDelta]:
        """Run one scheduled step; return what each touched completion gained."""
        batch = self.scheduler.schedule()
        if not batch.seqs:
            return []
        try:
            sampled = self._run(batch)
        except Exception as exc:  # the model failed: fail this batch's requests, keep serving
            return self._fail(batch, exc)
        self.scheduler.postprocess(batch, [s[0] if s else None for s in sampled])
        return self._outputs(batch, sampled)

    def stats(self) -> EngineStats:
        blocks = self.block_manager.stats()
        return EngineStats(
            num_blocks_total=blocks.num_blocks,
            num_blocks_free=blocks.num_free_blocks,
            num_blocks_used=blocks.num_used_blocks,
            num_cached_blocks=blocks.num_cached_blocks,
            num_preemptions=self.scheduler.num_preemptions,
            prefix_cache_hit_tokens=blocks.prefix_hit_tokens,
            prefix_cache_query_tokens=blocks.prefix_query_tokens,
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_unfinished_requests=len(self._requests),
            num_steps=self._num_steps,
            num_generated_tokens=self._num_generated,
            num_failed_steps=self._num_failed_steps,
        )

    # ---- internals: validation ----
    def _prompt_ids(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            token_ids = self.tokenizer.encode(prompt, add_special_tokens=True)
        elif isinstance(prompt, list | tuple):
            token_ids = list(prompt)
            vocab_size = self.runner.config.vocab_size
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

    def _max_tokens(self, num_prompt: int, params: SamplingParams) -> int:
        """The output limit of a request, after checking that it fits the context window
        and the KV cache (a sequence longer than the whole cache could never run)."""
        kv_capacity = self.block_manager.num_blocks * self.block_manager.block_size
        limit, what = min((self.max_model_len, "max_model_len"), (kv_capacity, "KV cache size"))
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

    # ---- internals: one step ----
    def _run(self, batch: SchedulerOutput) -> list[tuple[int, TopLogprobs | None] | None]:
        """Execute the model and sample; return (token, logprobs) per sequence that finished
        its prompt this step, None for the others."""
        step_seqs = [
            StepSeq(s.token_ids, s.num_computed, n, s.block_table, s.wants_prompt_logprobs)
            for s, n in zip(batch.seqs, batch.num_new_tokens, strict=True)
        ]
        out = self.runner.execute(step_seqs)
        self._num_steps += 1
        for seq, num_new, logits in zip(
            batch.seqs, batch.num_new_tokens, out.prompt_logits, strict=True
        ):
            if logits is not None and seq.wants_prompt_logprobs:
                _collect_prompt_logprobs(seq, num_new, logits)
        rows = [i for i, (s, n) in enumerate(zip(batch.seqs, batch.num_new_tokens, strict=True))
                if s.num_computed + n == s.num_tokens]  # fmt: skip
        result: list[tuple[int, TopLogprobs | None] | None] = [None] * len(batch)
        if rows:
            logits = out.logits if len(rows) == len(batch) else out.logits[rows]
            sampled: SamplerOutput = self.sampler(logits, [batch.seqs[i] for i in rows])
            for j, i in enumerate(rows):
                result[i] = (sampled.token_ids[j], sampled.logprobs[j])
        return result

    def _outputs(
        self, batch: SchedulerOutput, sampled: list[tuple[int, TopLogprobs | None] | None]
    ) -> list[RequestOutputDelta]:
        now = time.monotonic()
        deltas: list[RequestOutputDelta] = []
        for seq, item in zip(batch.seqs, sampled, strict=True):
            if item is None or seq.is_finished:
                continue
            token_id, logprobs = item
            self._num_generated += 1
            request = self._requests[seq.request_id]
            if seq.first_token_time is None:
                seq.first_token_time = now
            if logprobs is not None:
                seq.logprobs.append(logprobs)
                seq.cumulative_logprob += logprobs[token_id]
            reason = request.detokenizers[seq.index].update(token_id)
            if reason is not None:
                self.scheduler.finish(seq, reason)
            deltas.append(self._delta(request, seq, [token_id], logprobs))
        return deltas

    def _delta(
        self,
        request: Request,
        seq: Sequence,
        token_ids: list[int],
        logprobs: TopLogprobs | None,
        error: KunlunError | None = None,
    ) -> RequestOutputDelta:
        delta = RequestOutputDelta(
            request_id=request.request_id,
            index=seq.index,
            text=request.detokenizers[seq.index].take_delta(),
            token_ids=token_ids,
            logprobs=None if logprobs is None else [logprobs],
            finish_reason=seq.finish_reason,
            num_prompt_tokens=len(request.prompt_token_ids),
            num_cached_tokens=request.seqs[0].num_cached_tokens,
            error=error,
        )
        if request.finished and request.request_id in self._requests:
            request.finish_time = time.monotonic()
            delta.final = _final_output(request, error)
            del self._requests[request.request_id]
        return delta

    def _fail(self, batch: SchedulerOutput, exc: Exception) -> list[RequestOutputDelta]:
        logger.exception("model step failed; failing %d sequence(s)", len(batch))
        self._num_failed_steps += 1
        error = EngineError(
            f"the model failed on this request's step: {type(exc).__name__}: {exc}",
            hint="other requests are unaffected; retry, or report the error if it repeats",
        )
        deltas: list[RequestOutputDelta] = []
        for request_id in dict.fromkeys(s.request_id for s in batch.seqs):
            deltas += self._end_request(request_id, error)
        return deltas

    def _end_request(self, request_id: str, error: KunlunError | None) -> list[RequestOutputDelta]:
        request = self._requests.get(request_id)
        if request is None:
            return []
        aborted = self.scheduler.abort(request_id)
        for seq in aborted:
            request.detokenizers[seq.index].finish("abort")
        # the last delta closes the request (and carries its final output)
        return [self._delta(request, seq, [], None, error) for seq in reversed(aborted)][::-1]


class LLM:
    """Offline, synchronous use of the engine: ``generate`` and ``chat`` block until done."""

    def __init__(self, model_dir: str | Path | None = None, *, engine: LLMEngine | None = None,
                 **settings: Any) -> None:  # fmt: skip
        """Build an engine from ``model_dir`` and :class:`EngineConfig` keywords, or wrap
        ``engine``."""
        if engine is None:
            if model_dir is None:
                raise ConfigError("LLM needs a model_dir or an engine")
            engine = LLMEngine.from_model(model_dir, **settings)
        self.engine = engine
        self.tokenizer = engine.tokenizer

    def generate(
        self,
        prompts: Prompt | SequenceOf[Prompt],
        sampling_params: SamplingParams | SequenceOf[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in the prompts' order.

        Every prompt is validated before any runs: a bad one raises :class:`RequestError`
        and nothing is queued. ``sampling_params`` is one for all or one per prompt.
        """
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        params_list = _per_prompt(sampling_params, len(prompts))
        requests = [
            self.engine.make_request(p, sp) for p, sp in zip(prompts, params_list, strict=True)
        ]  # type: ignore[arg-type]
        for request in requests:
            self.engine.add(request)
        results: dict[str, RequestOutput] = {}
        while len(results) < len(requests) and self.engine.has_unfinished():
            for delta in self.engine.step():
                if delta.final is not None:
                    results[delta.request_id] = delta.final
        return [results[r.request_id] for r in requests]

    def chat(
        self,
        messages: SequenceOf[Mapping[str, Any]] | SequenceOf[SequenceOf[Mapping[str, Any]]],
        sampling_params: SamplingParams | SequenceOf[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them, formatted with the
        model's chat template (with the generation prompt)."""
        conversations = [messages] if messages and isinstance(messages[0], Mapping) else messages
        prompts: list[Prompt] = []
        for conversation in conversations:
            text = self.tokenizer.apply_chat_template(conversation, add_generation_prompt=True)
            prompts.append(self.tokenizer.encode(text, add_special_tokens=False))
        return self.generate(prompts, sampling_params)


def _per_prompt(
    params: SamplingParams | SequenceOf[SamplingParams] | None, count: int
) -> list[SamplingParams | None]:
    if params is None or isinstance(params, SamplingParams):
        return [params] * count
    if len(params) != count:
        raise RequestError(f"got {len(params)} sampling_params for {count} prompts")
    return list(params)


def _collect_prompt_logprobs(seq: Sequence, num_new: int, logits: torch.Tensor) -> None:
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


def _final_output(request: Request, error: KunlunError | None) -> RequestOutput:
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
        first_token_time=min(
            (s.first_token_time for s in request.seqs if s.first_token_time), default=None
        ),
        finish_time=request.finish_time,
    )
