"""The engine: requests in, tokens out, one scheduled step at a time.

:class:`LLMEngine` ties the pieces together. Each :meth:`LLMEngine.step` asks the scheduler
for a batch, runs the model on it, samples, advances the sequences and turns new tokens into
text deltas. When the model fails on a step, the batch is retried one sequence at a time and
only the requests the model fails on end, with an :class:`EngineError` in their output; the
engine keeps serving. :class:`kunlun.engine.llm.LLM` is the
synchronous, offline front.

Bad input (a prompt longer than the context or the KV cache, invalid sampling parameters,
out-of-vocabulary token ids) raises a :class:`RequestError` for that request only, before it
touches any engine state (the checks are :mod:`kunlun.engine.request`'s).
"""

from __future__ import annotations

import copy
import logging
import time
import uuid
from pathlib import Path
from typing import Any

import torch

from kunlun.engine.block_manager import BlockManager
from kunlun.engine.detokenizer import Detokenizer
from kunlun.engine.engine_config import EngineConfig
from kunlun.engine.guided import GuidedDecoding, guide_gave_up
from kunlun.engine.model_runner import ModelRunner, StepOutput, StepSeq
from kunlun.engine.outputs import EngineStats, RequestOutputDelta
from kunlun.engine.preflight import preflight
from kunlun.engine.request import (
    Prompt,
    Request,
    collect_prompt_logprobs,
    final_output,
    output_limit,
    prompt_token_ids,
)
from kunlun.engine.sampler import Sampler
from kunlun.engine.sampling_params import SamplingParams
from kunlun.engine.scheduler import Scheduler, SchedulerOutput, StepLimits
from kunlun.engine.sequence import Sequence, TopLogprobs
from kunlun.engine.step_profiler import NO_TRACE, StepProfiler
from kunlun.engine.tp_group import RankGroup, rank_threads
from kunlun.errors import (
    ConfigError,
    EngineError,
    KunlunError,
    Location,
    RequestError,
)

logger = logging.getLogger(__name__)

_Sampled = tuple[int, TopLogprobs | None]
"""A sampled token and, when asked for, its logprob entry."""


class LLMEngine:
    """Continuous-batching engine over one :class:`ModelRunner`. Not thread-safe: drive it
    from one thread (see :class:`kunlun.engine.async_engine.AsyncLLMEngine`), except
    :meth:`make_request`, which only reads."""

    def __init__(
        self,
        config: EngineConfig,
        *,
        runner: ModelRunner | None = None,
        rank_group: RankGroup | None = None,
    ) -> None:
        """Load the model (or use ``runner``, already loaded) and size the KV cache.

        With ``tensor_parallel_size > 1`` this process is rank 0 of a group: ``rank_group``
        when the caller started it (the worker does, before its sandbox forbids new
        processes), else one started here; :meth:`close` ends it. Whatever
        :func:`~kunlun.engine.preflight.preflight` refuses (heads that do not split over the
        ranks, quantized weights split over ranks, a bad setting) is a :class:`ConfigError`
        before any rank starts or any weight is read.
        """
        self.config = config
        self.rank_group = rank_group
        try:
            preflight(config)
        except ConfigError:
            self.close()  # a group the caller started
            raise
        if runner is None and config.tensor_parallel_size > 1:
            runner = self._start_group(config)
        self.runner = runner or ModelRunner(
            config.model_dir,
            device=config.device,
            dtype=config.dtype,
            block_size=config.block_size,
            num_blocks=config.num_blocks,
            kv_cache_memory_bytes=config.kv_cache_memory_bytes,
            max_model_len=config.max_model_len,
            num_threads=config.num_threads,
            quantization=config.quantization,
            group_size=config.group_size,
            decode_path=config.decode_path,
            graph_batch_sizes=tuple(config.graph_batch_sizes),
        )
        self.tokenizer = self.runner.tokenizer
        if config.chat_template is not None:  # the workload's own, over the model's
            self.tokenizer.chat_template = config.chat_template
        self.max_model_len = self.runner.max_model_len
        self.block_manager = BlockManager(
            self.runner.num_blocks,
            self.runner.block_size,
            enable_prefix_caching=config.enable_prefix_caching,
        )
        self.scheduler = Scheduler(
            StepLimits(config.max_num_seqs, config.max_num_batched_tokens), self.block_manager
        )
        generator = torch.Generator(device=self.runner.device)
        generator.manual_seed(config.seed)
        self.vocab_size: int = self.runner.config.vocab_size
        """Width of the model's logits: every token id is below it."""
        self.guided = GuidedDecoding(self.tokenizer, self.vocab_size)
        self.sampler = Sampler(generator, self.guided)
        self._requests: dict[str, Request] = {}
        self._num_steps = 0
        self._num_generated = 0
        self._num_failed_steps = 0
        self.profiler: StepProfiler | None = None
        """Traces sampled steps when set (``advanced_profiling``); see :meth:`set_profiler`."""

    def _start_group(self, config: EngineConfig) -> ModelRunner:
        """Rank 0's runner of a tensor-parallel group, once every rank has loaded."""
        group = self.rank_group = self.rank_group or RankGroup(
            config.tensor_parallel_size, config.distributed_backend or "", str(config.device)
        )
        try:
            group.load(config)
            runner = ModelRunner(
                config.model_dir, device=config.device, dtype=config.dtype,
                block_size=config.block_size, num_blocks=config.num_blocks,
                kv_cache_memory_bytes=config.kv_cache_memory_bytes,
                max_model_len=config.max_model_len, num_threads=rank_threads(config),
                quantization=config.quantization, group_size=config.group_size,
                group=group.group,
            )  # fmt: skip
            group.attach(runner)
            group.wait_ready()
        except BaseException:
            group.close()
            raise
        return runner

    def close(self) -> None:
        """Stop the other ranks of a tensor-parallel group (a no-op with one rank)."""
        if self.rank_group is not None:
            self.rank_group.close()

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
        for i, token in enumerate(params.stop_token_ids):
            if token >= self.vocab_size:
                raise RequestError(
                    f"stop_token_ids.{i} is {token}, not an id of this model (< {self.vocab_size})",
                    location=Location("request", field=f"stop_token_ids.{i}"),
                )
        token_ids = prompt_token_ids(self.tokenizer, self.vocab_size, prompt)
        if params.truncate_prompt_tokens is not None:
            token_ids = token_ids[-params.truncate_prompt_tokens :]
        kv_capacity = self.block_manager.num_blocks * self.block_manager.block_size
        max_tokens = output_limit(len(token_ids), params, self.max_model_len, kv_capacity)
        request_id = request_id or uuid.uuid4().hex
        arrival = time.monotonic()
        seqs = [Sequence(request_id, token_ids, params, index=i, arrival_time=arrival)
                for i in range(params.n)]  # fmt: skip
        if params.guide is not None:  # a bad schema, regex or grammar is refused here
            for seq in seqs:
                seq.matcher = self.guided.matcher(params.guide)
        eos = set(self.tokenizer.eos_token_ids)
        if params.min_tokens:  # the tokens that would end the answer early are masked
            banned = set(params.stop_token_ids) | (set() if params.ignore_eos else eos)
            for seq in seqs:
                seq.min_tokens_ban = sorted(banned)
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

    def flush_prefix_cache(self) -> int:
        """Forget every cached prefix, but only while no request is unfinished (a running
        one may be reading shared blocks); returns the unfinished requests that prevented
        it (0: flushed). Call between steps."""
        if self._requests:
            return len(self._requests)
        self.block_manager.reset_prefix_cache()
        return 0

    # ---- the step loop ----
    def set_profiler(self, profiler: StepProfiler | None) -> None:
        """Trace sampled steps with ``profiler`` (None: stop). Call between steps."""
        self.profiler = profiler

    def step(self) -> list[RequestOutputDelta]:
        """Run one scheduled step; return what each touched completion gained."""
        trace = self.profiler.begin() if self.profiler is not None else NO_TRACE
        started = time.perf_counter()
        batch = self.scheduler.schedule()
        if not batch.seqs:
            if batch.num_preempted == 0 and self.scheduler.has_unfinished():
                raise EngineError("the scheduler could not place any waiting sequence")
            return []
        trace.mark("schedule")
        self.runner.trace = trace
        sampled, failures = self._run(batch)
        trace.mark("sample")
        deltas = self._fail(failures)
        self.scheduler.postprocess(batch, [s[0] if s else None for s in sampled])
        trace.mark("postprocess")
        deltas += self._outputs(batch, sampled)
        trace.mark("detokenize")
        trace.end(batch.num_new_tokens)
        if all(n == 1 for n in batch.num_new_tokens):
            self.runner.decode_time.steps += 1
            self.runner.decode_time.wall_s += time.perf_counter() - started
        return deltas

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
            decode=self.runner.decode_time.copy(),
        )

    # ---- internals: one step ----
    def _run(self, batch: SchedulerOutput) -> tuple[list[_Sampled | None], dict[str, Exception]]:
        """Execute the model and sample; never raises.

        Returns (token, logprobs) per sequence that completed its known tokens (None for a
        prompt chunk), and the requests that failed, with the exception. A batch the model
        fails on is retried one sequence at a time, so only the failing requests are lost
        (recomputing a position rewrites the same KV slots, so the retry is safe).
        """
        step_seqs = [
            StepSeq(s.token_ids, s.num_computed, n, s.block_table, s.wants_prompt_logprobs)
            for s, n in zip(batch.seqs, batch.num_new_tokens, strict=True)
        ]
        self._num_steps += 1
        failures: dict[str, Exception] = {}
        try:
            outputs = [(list(range(len(step_seqs))), self.runner.execute(step_seqs))]
        except Exception as exc:
            outputs = []
            if len(step_seqs) == 1:
                failures[batch.seqs[0].request_id] = exc
            else:
                logger.warning("a batched step failed (%s); retrying each sequence alone", exc)
                for i, step_seq in enumerate(step_seqs):
                    try:
                        outputs.append(([i], self.runner.execute([step_seq])))
                    except Exception as alone_exc:
                        failures[batch.seqs[i].request_id] = alone_exc
        result: list[_Sampled | None] = [None] * len(batch)
        for indices, out in outputs:
            try:
                self._sample(batch, indices, out, result)
            except Exception as exc:
                failures.update({batch.seqs[i].request_id: exc for i in indices})
        return result, failures

    def _sample(
        self,
        batch: SchedulerOutput,
        indices: list[int],
        out: StepOutput,
        result: list[_Sampled | None],
    ) -> None:
        """Sample for ``batch.seqs[indices]`` from ``out`` (whose rows follow ``indices``)."""
        seqs = [batch.seqs[i] for i in indices]
        num_new = [batch.num_new_tokens[i] for i in indices]
        for seq, count, logits in zip(seqs, num_new, out.prompt_logits, strict=True):
            if logits is not None and seq.wants_prompt_logprobs:
                collect_prompt_logprobs(seq, count, logits)
        rows = [k for k, s in enumerate(seqs) if s.num_computed + num_new[k] == s.num_tokens]
        if not rows:
            return
        logits = out.logits if len(rows) == len(seqs) else out.logits[rows]
        sampled = self.sampler(logits, [seqs[k] for k in rows])
        for j, k in enumerate(rows):
            result[indices[k]] = (sampled.token_ids[j], sampled.logprobs[j])

    def _outputs(
        self, batch: SchedulerOutput, sampled: list[_Sampled | None]
    ) -> list[RequestOutputDelta]:
        now = time.monotonic()
        deltas: list[RequestOutputDelta] = []
        gave_up: dict[str, KunlunError] = {}
        for seq, item in zip(batch.seqs, sampled, strict=True):
            if item is None or seq.is_finished or seq.request_id in gave_up:
                continue
            if seq.matcher is not None and seq.matcher.is_error():
                # the grammar engine hit one of its limits: its mask (end of sequence only)
                # says nothing of the constraint, so the answer must not end as "stop"
                guide = self._requests[seq.request_id].params.guide
                gave_up[seq.request_id] = guide_gave_up(guide, seq.matcher.get_error())
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
            if reason is None and seq.matcher is not None and seq.matcher.is_stopped():
                reason = "stop"  # the guide's grammar is complete: nothing more may follow
            if reason is not None:
                self.scheduler.finish(seq, reason)
            deltas.append(self._delta(request, seq, [token_id], logprobs))
        for request_id, error in gave_up.items():
            deltas += self._end_request(request_id, error)
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
            delta.final = final_output(request, error)
            del self._requests[request.request_id]
        return delta

    def _fail(self, failures: dict[str, Exception]) -> list[RequestOutputDelta]:
        """End each failed request with an :class:`EngineError` output."""
        deltas: list[RequestOutputDelta] = []
        for request_id, exc in failures.items():
            logger.error("request %s failed in the model step", request_id, exc_info=exc)
            error = EngineError(
                f"the model failed on request {request_id}: {type(exc).__name__}: {exc}",
                hint="other requests are unaffected; retry, or report the error if it repeats",
            )
            deltas += self._end_request(request_id, error)
        self._num_failed_steps += bool(failures)
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
