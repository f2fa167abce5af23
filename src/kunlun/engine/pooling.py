"""Embeddings: the engine's pooling path.

A model served for embeddings (``task: embed``) answers with one vector per input instead of
generated tokens. The vector is the model's final-norm hidden states (the tensor its LM head
reads) over the input's tokens, pooled (``mean`` over every token, or the ``last`` token's),
then L2-normalised.

The path is the engine's prefill and nothing more. :class:`Pooler` packs the waiting inputs
of every pending :class:`PoolingJob` (the inputs of one request, and of concurrent requests)
into one forward pass of at most ``max_num_batched_tokens`` tokens (an input longer than that
runs alone) and as many KV blocks as are free; it takes the blocks from the engine's block
manager for that step only (attention writes each token's keys and values there) and gives
them back straight after, unpublished, so the prefix cache never sees them. The runner's
:meth:`~kunlun.engine.model_runner.ModelRunner.hidden_states` runs that step on every rank of
a tensor-parallel group, without the LM head. Pooling runs on the device in float32 whatever
the model's dtype; only the pooled vectors come back to the host.

:class:`~kunlun.engine.async_engine.AsyncLLMEngine` runs one pooling step per turn of its
loop, between generation steps, so embeddings and generation can share an engine; an input
that cannot get its blocks (generation holds them) waits for the next turn.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import logging
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from kunlun.engine.block_manager import NO_MATCH
from kunlun.engine.launch import Pooling
from kunlun.engine.llm_engine import LLMEngine
from kunlun.engine.model_runner import StepSeq
from kunlun.engine.sampling_params import SamplingParams
from kunlun.engine.sequence import Sequence
from kunlun.errors import EngineError, PromptTooLong, RequestError

logger = logging.getLogger(__name__)

_job_ids = itertools.count()


@dataclass
class PoolingJob:
    """The inputs of one embeddings request; ``done`` gets their vectors (float32, on the
    host, unit norm) in order, or the :class:`EngineError` that ended them."""

    inputs: list[list[int]]
    method: Pooling
    done: concurrent.futures.Future[list[torch.Tensor]] = field(
        default_factory=concurrent.futures.Future
    )
    job_id: int = field(default_factory=lambda: next(_job_ids))
    vectors: dict[int, torch.Tensor] = field(default_factory=dict)
    next_input: int = 0
    """Inputs before this one have run (or are running)."""


def input_limit(engine: LLMEngine) -> tuple[int, str]:
    """The most tokens one input may have, and what sets it: ``max_model_len`` or the KV
    cache (an embedding needs no room for output tokens)."""
    manager = engine.block_manager
    kv_capacity = manager.num_blocks * manager.block_size
    return min((engine.max_model_len, "max_model_len"), (kv_capacity, "KV cache size"))


def check_input(engine: LLMEngine, token_ids: list[int]) -> None:
    """Raise :class:`RequestError` (:class:`PromptTooLong` for length) for an input the
    pooling path cannot run: empty, too long, or holding an id outside the vocabulary."""
    if not token_ids:
        raise RequestError("the input is empty: it must have at least one token")
    limit, what = input_limit(engine)
    if len(token_ids) > limit:
        raise PromptTooLong(
            f"the input has {len(token_ids)} tokens but the {what} is {limit} tokens",
            hint="shorten the input, or split it into several inputs",
        )
    vocab = engine.vocab_size
    bad = next((i for i, t in enumerate(token_ids) if not 0 <= t < vocab), None)
    if bad is not None:
        raise RequestError(f"token {bad} is {token_ids[bad]}: expected an id in [0, {vocab})")


def pool(hidden: torch.Tensor, method: Pooling) -> torch.Tensor:
    """The unit-norm float32 vector of one input's hidden states [tokens, hidden]."""
    rows = hidden.float()
    vector = rows.mean(0) if method == "mean" else rows[-1]
    return F.normalize(vector, dim=0)


class Pooler:
    """Runs :class:`PoolingJob` inputs through the engine's model, a step at a time (drive
    it from the engine's thread, like the engine itself)."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.jobs: list[PoolingJob] = []
        self.max_step_tokens = engine.config.max_num_batched_tokens

    @property
    def pending(self) -> bool:
        return bool(self.jobs)

    def add(self, jobs: list[PoolingJob]) -> None:
        self.jobs += jobs

    def fail_all(self, error: BaseException) -> None:
        jobs, self.jobs = self.jobs, []
        for job in jobs:
            if not job.done.done():
                job.done.set_exception(error)

    def step(self) -> None:
        """Run one forward pass over as many waiting inputs as fit, taken one per request in
        turn: a request of 2,048 inputs shares each step with the one-input requests behind
        it (a health probe among them) instead of holding them until it is done."""
        manager = self.engine.block_manager
        picked: list[tuple[PoolingJob, int, Sequence]] = []
        tokens = 0
        waiting = [job for job in self.jobs if job.next_input < len(job.inputs)]
        try:
            while waiting:
                job = waiting.pop(0)
                ids = job.inputs[job.next_input]
                over_budget = picked and tokens + len(ids) > self.max_step_tokens
                if over_budget or not manager.can_allocate(NO_MATCH, len(ids)):
                    break
                seq = Sequence(f"embed-{job.job_id}", ids, SamplingParams(max_tokens=1))
                manager.allocate(seq, NO_MATCH, len(ids))
                picked.append((job, job.next_input, seq))
                job.next_input += 1
                tokens += len(ids)
                if job.next_input < len(job.inputs):
                    waiting.append(job)  # its next input after the others' next ones
            if picked:
                self.engine._num_steps += 1  # a step like any other: health checks see progress
                self._run(picked)
        finally:
            for _, _, seq in picked:
                manager.deallocate(seq)
        self._resolve()

    def _run(self, picked: list[tuple[PoolingJob, int, Sequence]]) -> None:
        steps = [StepSeq(s.token_ids, 0, s.num_tokens, s.block_table) for _, _, s in picked]
        method_of = [job.method for job, _, _ in picked]
        try:
            hidden = self.engine.runner.hidden_states(steps)
            vectors = torch.stack(
                [pool(h, m) for h, m in zip(hidden, method_of, strict=True)]
            ).cpu()
        except Exception as exc:
            logger.error("a pooling step failed", exc_info=exc)
            error = EngineError(
                f"the model failed on an embeddings step: {type(exc).__name__}: {exc}",
                hint="retry the request; report the error if it repeats",
            )
            for job in {id(j): j for j, _, _ in picked}.values():
                if not job.done.done():
                    job.done.set_exception(error)
            return
        for row, (job, index, _) in enumerate(picked):
            job.vectors[index] = vectors[row]

    def _resolve(self) -> None:
        waiting = []
        for job in self.jobs:
            if job.done.done():
                continue
            if len(job.vectors) == len(job.inputs):
                job.done.set_result([job.vectors[i] for i in range(len(job.inputs))])
            else:
                waiting.append(job)
        self.jobs = waiting
