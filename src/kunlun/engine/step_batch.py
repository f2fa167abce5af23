"""A validated step as the forward pass takes it: its rows, decode rows first, and the order
they came in. Small and picklable: rank 0 of a tensor-parallel group sends it to the others
(:mod:`kunlun.engine.tp_group`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kunlun.engine.model_runner import StepSeq


@dataclass
class StepRow:
    """One sequence of a step as the forward pass needs it (no full token history)."""

    new_token_ids: list[int]
    """The tokens computed this step."""
    num_computed: int
    """Tokens already in the KV cache."""
    block_table: list[int]
    """Block ids covering ``[0, num_computed + len(new_token_ids))``, no more."""
    want_prompt_logits: bool


@dataclass
class StepBatch:
    """A validated step, decode rows first: what rank 0 sends the other ranks of a
    tensor-parallel group (small and picklable)."""

    rows: list[StepRow]
    order: list[int]
    """For each row, the index of its sequence in the caller's list."""
    num_decode: int
    """Rows with one new token; they lead."""
    pool: bool = False
    """A pooling step: the forward pass returns hidden states, not logits."""

    def compiles(self) -> bool:
        """Whether the compiled decoder can run this step: decodes only, logits only."""
        return (
            self.num_decode == len(self.rows)
            and not self.pool
            and not any(row.want_prompt_logits for row in self.rows)
        )

    @classmethod
    def of(cls, seqs: list[StepSeq], block_size: int, pool: bool = False) -> StepBatch:
        decode = [i for i, seq in enumerate(seqs) if seq.num_new == 1]
        order = decode + [i for i, seq in enumerate(seqs) if seq.num_new != 1]
        rows = []
        for i in order:
            seq = seqs[i]
            end = seq.num_computed + seq.num_new
            rows.append(StepRow(seq.token_ids[seq.num_computed : end], seq.num_computed,
                                seq.block_table[: -(-end // block_size)],
                                seq.want_prompt_logits))  # fmt: skip
        return cls(rows, order, len(decode), pool)
