"""Iteration-level scheduling: which sequences run this step, and how many tokens each.

Every step the scheduler fills a token budget (``max_num_batched_tokens``). Running
sequences go first, most important first (lower priority value, then earlier arrival): a
decoding sequence takes one token, a sequence still in its prompt takes the next chunk
(chunked prefill). Waiting sequences are then admitted in the same order while the budget,
``max_num_seqs`` and the KV blocks allow; a prefix-cache hit sets how much of the prompt is
already computed. When a running sequence cannot get a block, the least important running
sequence (highest priority value, newest) is preempted: its blocks are freed and it waits
again at the head of its class, to be recomputed (its computed blocks usually stay in the
prefix cache, so the recompute is cheap). No sequence is admitted in a step that preempted.

A request with ``n > 1`` completions enters as its first sequence; the others are admitted
once that one's prompt is computed, so they find the prompt's full blocks in the prefix cache
and share them.
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass, field

from kunlun.engine.block_manager import NO_MATCH, BlockManager
from kunlun.engine.sequence import Sequence, SequenceStatus


@dataclass(frozen=True)
class StepLimits:
    """Limits of one step, as the engine's :class:`~kunlun.engine.engine_config.EngineConfig`
    sets them (the owner of their defaults)."""

    max_num_seqs: int
    """Most sequences running at once (>= 1)."""
    max_num_batched_tokens: int
    """Most tokens computed in one step, prefill chunks and decodes together (>= 1)."""


@dataclass
class SchedulerOutput:
    """The sequences of one step and how many new tokens each computes."""

    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    num_preempted: int = 0

    def __len__(self) -> int:
        return len(self.seqs)

    @property
    def num_batched_tokens(self) -> int:
        return sum(self.num_new_tokens)


class Scheduler:
    """Decides each step's batch; owns the waiting and running queues."""

    def __init__(self, config: StepLimits, block_manager: BlockManager) -> None:
        self.config = config
        self.block_manager = block_manager
        self.waiting: list[Sequence] = []
        """Sorted by ``Sequence.sort_key``."""
        self.running: list[Sequence] = []
        self._forks: dict[int, list[Sequence]] = {}
        """seq_id of a request's first sequence -> its siblings, held until its prompt is done."""
        self.num_preemptions = 0

    # ---- queue changes ----
    def add(self, seqs: list[Sequence]) -> None:
        """Queue a request's sequences (all of the same prompt)."""
        first, *siblings = seqs
        self._enqueue(first)
        if siblings:
            self._forks[first.seq_id] = siblings

    def finish(self, seq: Sequence, reason: str) -> None:
        """Mark a running sequence finished and free its blocks."""
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        if seq in self.running:
            self.running.remove(seq)
        self.block_manager.deallocate(seq)
        self._release_forks(seq)

    def abort(self, request_id: str) -> list[Sequence]:
        """Remove every unfinished sequence of ``request_id``, freeing its blocks at once."""
        aborted = [s for s in self.running + self.waiting if s.request_id == request_id]
        for first_id in [k for k, v in self._forks.items() if v[0].request_id == request_id]:
            aborted += self._forks.pop(first_id)
        for seq in aborted:
            if seq in self.running:
                self.running.remove(seq)
            elif seq in self.waiting:
                self.waiting.remove(seq)
            self.block_manager.deallocate(seq)
            seq.status = SequenceStatus.FINISHED
            seq.finish_reason = "abort"
        return aborted

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self._forks)

    # ---- one step ----
    def schedule(self) -> SchedulerOutput:
        """Choose this step's sequences; blocks for their new tokens are allocated."""
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        budget = self._schedule_running(out, budget)
        if out.num_preempted == 0:
            self._schedule_waiting(out, budget)
        return out

    def postprocess(self, out: SchedulerOutput, sampled: list[int | None]) -> None:
        """Advance ``num_computed`` by what the step computed and append sampled tokens.

        ``sampled[i]`` is the token sampled for ``out.seqs[i]``, or None when that sequence
        only computed part of its prompt.
        """
        for seq, num_new, token_id in zip(out.seqs, out.num_new_tokens, sampled, strict=True):
            if seq.status is not SequenceStatus.RUNNING:
                continue
            seq.num_computed += num_new
            self.block_manager.cache_full_blocks(seq, num_new)
            if token_id is not None:
                seq.append_token(token_id)
            if seq.num_computed >= seq.num_prompt_tokens:
                self._release_forks(seq)

    # ---- internals ----
    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        self.running.sort(key=lambda s: s.sort_key)
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_new = min(seq.num_tokens - seq.num_computed, budget)
            while not self.block_manager.can_append(seq, num_new):
                victim = self.running[-1]
                self._preempt(victim)
                out.num_preempted += 1
                if victim is seq:
                    break
            else:
                self.block_manager.append(seq, num_new)
                out.seqs.append(seq)
                out.num_new_tokens.append(num_new)
                budget -= num_new
                i += 1
        return budget

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        manager = self.block_manager
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            match = NO_MATCH if seq.wants_prompt_logprobs else manager.match_prefix(seq)
            num_new = min(seq.num_tokens - match.num_tokens, budget)
            if not manager.can_allocate(match, num_new):
                break
            self.waiting.pop(0)
            manager.allocate(seq, match, num_new)
            seq.num_computed = match.num_tokens
            if seq.num_preemptions == 0:
                seq.num_cached_tokens = match.num_tokens
                seq.first_scheduled_time = time.monotonic()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.seqs.append(seq)
            out.num_new_tokens.append(num_new)
            budget -= num_new

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.block_manager.deallocate(seq)
        seq.num_computed = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self._enqueue(seq)

    def _enqueue(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        bisect.insort(self.waiting, seq, key=lambda s: s.sort_key)

    def _release_forks(self, seq: Sequence) -> None:
        for sibling in self._forks.pop(seq.seq_id, []):
            self._enqueue(sibling)
