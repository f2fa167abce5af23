"""One sequence being generated: its tokens, how far its KV is computed, and its blocks.

A request with ``n`` completions owns ``n`` sequences that share the same prompt. The
scheduler moves a sequence WAITING -> RUNNING -> FINISHED (and back to WAITING when it is
preempted); the block manager fills ``block_table``; the engine appends sampled tokens.
"""

from __future__ import annotations

import enum
import itertools
import time
from typing import TYPE_CHECKING, Any

from kunlun.engine.sampling_params import SamplingParams

if TYPE_CHECKING:  # torch is imported where a generator is made: the gateway reads outputs
    import torch

TopLogprobs = dict[int, float]
"""Token id -> logprob at one position: the chosen (or prompt) token plus the top ones."""

_seq_counter = itertools.count()


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """State of one sequence. ``token_ids`` is the prompt followed by the output so far.

    Invariants: ``num_computed <= num_tokens``; while RUNNING, ``block_table`` covers at least
    ``num_computed`` positions; a sequence whose ``num_computed == num_tokens - 1`` is
    decoding (its last sampled token is fed next step).
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        index: int = 0,
        arrival_time: float | None = None,
    ) -> None:
        self.seq_id = next(_seq_counter)
        """Unique across the process; breaks ties of equal arrival (FIFO)."""
        self.request_id = request_id
        self.index = index
        """Which of the request's ``n`` completions this is."""
        self.params = params
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.status = SequenceStatus.WAITING
        self.num_computed = 0
        """Tokens whose KV is in the cache (prefix-cache hits + computed chunks)."""
        self.block_table: list[int] = []
        self.block_hashes: list[bytes] = []
        """Chained hashes of the full blocks of ``token_ids`` (filled by the block manager)."""
        self.num_cached_tokens = 0
        """Prompt tokens served from the prefix cache at (first) admission."""
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.first_token_time: float | None = None
        self.first_scheduled_time: float | None = None
        """When the scheduler first admitted it (``time.monotonic``): its queue time ends."""
        self.finish_reason: str | None = None
        self.min_tokens_ban: list[int] = []
        """Token ids masked until ``params.min_tokens`` output tokens (end-of-sequence and
        stop tokens), set by the engine; empty without ``min_tokens``."""
        self.matcher: Any = None
        """The guided-decoding matcher of a request with a guide (:mod:`kunlun.engine.guided`)."""
        self.logprobs: list[TopLogprobs] = []
        self.cumulative_logprob = 0.0
        self.prompt_logprobs: list[TopLogprobs | None] = [None]
        self.generator: torch.Generator | None = None
        """Per-request random generator, created lazily on the logits' device from ``seed``."""
        self.num_preemptions = 0

    # ---- derived values ----
    @property
    def priority(self) -> int:
        return self.params.priority

    @property
    def sort_key(self) -> tuple[int, float, int]:
        """Order of service: priority class first, then arrival (FIFO)."""
        return (self.params.priority, self.arrival_time, self.seq_id)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def wants_prompt_logprobs(self) -> bool:
        """True while prompt logprobs were asked for and some are still missing (only the
        request's first sequence collects them; its siblings share its prompt)."""
        return (
            self.params.prompt_logprobs is not None
            and self.index == 0
            and len(self.prompt_logprobs) < self.num_prompt_tokens
        )

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)

    def seed_generator(self, device: torch.device) -> torch.Generator | None:
        """This sequence's generator on ``device`` (None when the request has no seed).

        Sequence ``i`` of a request seeded ``s`` uses a generator seeded from ``(s, i)``, so
        the ``n`` completions differ and each is reproducible.
        """
        if self.params.seed is None:
            return None
        if self.generator is None or self.generator.device != device:
            import torch

            self.generator = torch.Generator(device=device)
            seed = self.params.seed if self.index == 0 else hash((self.params.seed, self.index))
            self.generator.manual_seed(seed & 0x7FFF_FFFF_FFFF_FFFF)
        return self.generator

    def __repr__(self) -> str:
        return (
            f"Sequence(request_id={self.request_id!r}, index={self.index}, "
            f"status={self.status.value}, tokens={self.num_tokens}, computed={self.num_computed})"
        )
