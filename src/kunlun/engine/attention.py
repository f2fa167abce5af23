"""Paged attention over a block-structured KV cache, in plain torch ops.

Each layer owns two cache tensors, ``k_cache`` and ``v_cache``, of shape
``[num_blocks, block_size, num_kv_heads, head_dim]``. A step's tokens, from all its sequences,
are one flat batch; :class:`AttentionContext` says where each new token's key/value is stored
(``slot_mapping``, a flat index ``block_id * block_size + offset``) and how the batch splits
into sequences.

Sequences come in two groups, in this order in the flat batch:

* **decode**: one new token each. They run as one batch: their keys and values are
  gathered through a padded block table, and a mask hides the padding when lengths differ.
* **prefill**: several new tokens each (a prompt, or a chunk of one). Each runs alone;
  query ``i`` sees key positions ``<= num_computed + i``. When nothing is cached yet the new
  keys are used directly, without a gather.

Masked and prefill attention group the queries per key/value head
(``[kv_heads, queries_per_kv, ...]``), so grouped-query attention needs no copy of the keys
and stays on SDPA's fast kernel (``enable_gqa`` with a mask falls back to a slow path on
CPU). Unmasked decode makes transformers' own call (``enable_gqa``, one query per head), so
greedy output matches it token for token in bfloat16 too.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class PrefillSegment:
    """One sequence that computes several tokens this step."""

    query_start: int
    """Index of its first new token in the flat batch."""
    num_new: int
    """Tokens it computes this step."""
    num_computed: int
    """Tokens already in the cache before this step (positions ``[0, num_computed)``)."""
    block_table: torch.Tensor | None
    """Block ids covering ``[0, num_computed + num_new)`` (long, on the device); ``None``
    when ``num_computed == 0`` and attention can use the new keys directly."""


@dataclass
class DecodeBatch:
    """The sequences that compute exactly one token this step; they lead the flat batch."""

    block_tables: torch.Tensor
    """Padded block tables [num_seqs, max_blocks] (long, on the device)."""
    max_context_len: int
    """Longest context in the batch; keys past it are never looked at."""
    mask: torch.Tensor | None
    """Additive mask [num_seqs, 1, 1, max_context_len]: 0 where a key exists, -inf on
    padding, in the model's dtype; ``None`` when every context has the same length."""

    @property
    def num_seqs(self) -> int:
        """Sequences in the batch."""
        return self.block_tables.shape[0]


@dataclass
class AttentionContext:
    """Per-step metadata every attention layer reads."""

    slot_mapping: torch.Tensor
    """Cache slot of each new token [num_tokens] (long, on the device)."""
    decode: DecodeBatch | None = None
    """The decode group (first ``decode.num_seqs`` tokens), or ``None``."""
    prefills: list[PrefillSegment] = field(default_factory=list)
    """The prefill segments, after the decode group."""


class PagedAttention(nn.Module):
    """Scaled dot-product attention reading and writing a paged KV cache.

    The runner sets ``k_cache`` and ``v_cache`` before the first step.
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: AttentionContext
    ) -> torch.Tensor:
        """Attend ``q`` [T, heads, head_dim] given new ``k``/``v`` [T, kv_heads, head_dim].

        Stores ``k``/``v`` in the cache at ``ctx.slot_mapping`` and returns [T, heads * head_dim].
        """
        self._store(k, v, ctx.slot_mapping)
        out = torch.empty_like(q)
        start = 0
        if ctx.decode is not None:
            start = ctx.decode.num_seqs
            out[:start] = self._decode(q[:start], ctx.decode)
        for seg in ctx.prefills:
            end = seg.query_start + seg.num_new
            out[seg.query_start : end] = self._prefill(
                q[seg.query_start : end], k[seg.query_start : end], v[seg.query_start : end], seg
            )
        return out.flatten(1)

    def _store(self, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        k_flat = self.k_cache.view(-1, self.num_kv_heads, self.head_dim)
        v_flat = self.v_cache.view(-1, self.num_kv_heads, self.head_dim)
        k_flat.index_copy_(0, slot_mapping, k)
        v_flat.index_copy_(0, slot_mapping, v)

    def _gather(self, cache: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
        """Rows of the blocks in ``block_table`` [n] or [b, n] -> [..., n * block_size, kv, d].

        ``index_select`` on the flattened table: far cheaper on CPU than advanced indexing.
        """
        blocks = cache.index_select(0, block_table.reshape(-1))
        return blocks.view(*block_table.shape[:-1], -1, self.num_kv_heads, self.head_dim)

    def _decode(self, q: torch.Tensor, batch: DecodeBatch) -> torch.Tensor:
        num_seqs = q.shape[0]
        length = batch.max_context_len
        keys = self._gather(self.k_cache, batch.block_tables)[:, :length].transpose(1, 2)
        values = self._gather(self.v_cache, batch.block_tables)[:, :length].transpose(1, 2)
        if batch.mask is None:
            out = F.scaled_dot_product_attention(
                q.unsqueeze(2), keys, values, scale=self.scale, enable_gqa=True
            )
            return out.reshape(num_seqs, self.num_heads, self.head_dim)
        # [B, kv, group, d]: the queries that share each key/value head
        queries = q.view(num_seqs, self.num_kv_heads, -1, self.head_dim)
        out = F.scaled_dot_product_attention(
            queries, keys, values, attn_mask=batch.mask, scale=self.scale
        )
        return out.reshape(num_seqs, self.num_heads, self.head_dim)

    def _prefill(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seg: PrefillSegment
    ) -> torch.Tensor:
        num_new = seg.num_new
        context_len = seg.num_computed + num_new
        if seg.block_table is not None:
            k = self._gather(self.k_cache, seg.block_table)[:context_len]
            v = self._gather(self.v_cache, seg.block_table)[:context_len]
        group = self.num_heads // self.num_kv_heads
        # [kv, group, n, d] queries against [kv, group (broadcast view), S, d] keys
        queries = q.transpose(0, 1).reshape(self.num_kv_heads, group, num_new, self.head_dim)
        shape = (self.num_kv_heads, group, context_len, self.head_dim)
        keys = k.transpose(0, 1).unsqueeze(1).expand(shape)
        values = v.transpose(0, 1).unsqueeze(1).expand(shape)
        if seg.block_table is None:
            out = F.scaled_dot_product_attention(
                queries, keys, values, is_causal=True, scale=self.scale
            )
        else:
            key_pos = torch.arange(context_len, device=q.device)
            query_pos = torch.arange(num_new, device=q.device) + seg.num_computed
            mask = key_pos[None, :] <= query_pos[:, None]
            out = F.scaled_dot_product_attention(
                queries, keys, values, attn_mask=mask, scale=self.scale
            )
        return out.reshape(self.num_heads, num_new, self.head_dim).transpose(0, 1)
