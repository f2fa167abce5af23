"""How a tensor-parallel group splits a decoder: heads, MLP rows and vocabulary per rank.

The one owner of the splitting rule, shared by the engine's model code and loader and by the
torch-free planner (this module imports neither torch nor anything that does).

* **Attention**, split at key/value-head granularity. When ``num_key_value_heads >= tp``,
  the KV heads are split into contiguous runs whose sizes differ by at most one (the first
  ranks take the extra heads) and each rank takes the query heads that share its KV heads,
  so 9 heads / 3 KV heads over 2 ranks is 6 + 3. When ``num_key_value_heads < tp``, each KV
  head is replicated on ``tp // num_key_value_heads`` consecutive ranks, which split its query
  heads evenly; that needs ``tp`` to be a multiple of ``num_key_value_heads`` and the query
  heads per KV head to be a multiple of the replication factor, and is refused otherwise.
* **MLP** intermediate rows (and any other split dimension) as evenly as possible.
* **Vocabulary** in equal blocks of ``ceil(vocab / tp)`` rows; the last block is padded.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Span:
    """A contiguous range ``[start, start + size)`` of heads or rows."""

    start: int
    size: int

    def scaled(self, factor: int) -> Span:
        """The same range in units ``factor`` times smaller (heads -> rows of ``head_dim``)."""
        return Span(self.start * factor, self.size * factor)


@dataclass(frozen=True)
class HeadSplit:
    """The attention heads one rank holds."""

    q: Span
    """Its query heads."""
    kv: Span
    """Its key/value heads (one replicated head when there are fewer KV heads than ranks)."""


def even_split(total: int, parts: int, index: int) -> Span:
    """Part ``index`` of ``total`` split in ``parts`` contiguous runs differing by at most one."""
    base, extra = divmod(total, parts)
    start = index * base + min(index, extra)
    return Span(start, base + (1 if index < extra else 0))


def head_split_problem(num_heads: int, num_kv_heads: int, tp: int) -> str | None:
    """Why ``tp`` ranks cannot split ``num_heads`` query / ``num_kv_heads`` KV heads, or None."""
    if tp < 1:
        return f"tensor_parallel_size={tp} must be >= 1"
    if num_kv_heads < 1 or num_heads % num_kv_heads:
        return f"num_attention_heads={num_heads} is not a multiple of num_key_value_heads={num_kv_heads}"
    if num_kv_heads >= tp:
        return None
    if tp % num_kv_heads:
        return (
            f"tensor_parallel_size={tp} is larger than num_key_value_heads={num_kv_heads} "
            "and not a multiple of it, so the KV heads cannot be replicated evenly"
        )
    replicas = tp // num_kv_heads
    group = num_heads // num_kv_heads
    if group % replicas:
        return (
            f"tensor_parallel_size={tp}: each of the {num_kv_heads} KV heads is replicated on "
            f"{replicas} ranks, which cannot split its {group} query heads "
            f"(num_attention_heads={num_heads})"
        )
    return None


def quantized_split_problem(quantization: str, tp: int) -> str | None:
    """Why ``tp`` ranks cannot run weights quantized as ``quantization``, or None: the engine
    splits floating weights only (a quantized model runs with ``tp`` 1)."""
    if tp > 1 and quantization != "none":
        return (
            f"tp={tp}: the embedded engine runs {quantization} weights on one rank only "
            "(it splits floating weights)"
        )
    return None


def head_split(num_heads: int, num_kv_heads: int, tp: int, rank: int) -> HeadSplit:
    """The heads of ``rank``; raises ValueError with :func:`head_split_problem`'s reason."""
    problem = head_split_problem(num_heads, num_kv_heads, tp)
    if problem is not None:
        raise ValueError(problem)
    group = num_heads // num_kv_heads
    if num_kv_heads >= tp:
        kv = even_split(num_kv_heads, tp, rank)
        return HeadSplit(q=kv.scaled(group), kv=kv)
    replicas = tp // num_kv_heads
    kv_head, part = divmod(rank, replicas)
    per_rank = group // replicas
    return HeadSplit(q=Span(kv_head * group + part * per_rank, per_rank), kv=Span(kv_head, 1))


def max_kv_heads_per_rank(num_heads: int, num_kv_heads: int, tp: int) -> int:
    """KV heads on the rank that holds the most (sizes every rank's KV cache alike)."""
    return max(head_split(num_heads, num_kv_heads, tp, r).kv.size for r in range(tp))


def vocab_span(vocab_size: int, tp: int, rank: int) -> tuple[Span, int]:
    """``(rows of the checkpoint rank holds, padded rows per rank)``; rows may be fewer than
    the padded count on the last ranks (or zero when ``tp`` exceeds the vocabulary)."""
    per_rank = -(-vocab_size // tp)
    start = min(rank * per_rank, vocab_size)
    return Span(start, min(per_rank, vocab_size - start)), per_rank
