"""Building blocks shared by the decoder models: norm, rotary embedding, gated MLP, and the
linear and embedding layers, split across ranks under tensor parallelism.

The arithmetic follows transformers' Llama code step for step (RMSNorm in float32 then cast
back, cos/sin computed in float32 then cast) so that results agree with it closely.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kunlun.engine.models.quant_linear import Int8Rows, int8pack_runs_on
from kunlun.engine.parallel import SINGLE, TPGroup
from kunlun.engine.tp_layout import Span, vocab_span


class RMSNorm(nn.Module):
    """Root-mean-square norm over the last dimension, computed in float32.

    As in transformers: normalize in float32, cast back to the input dtype, then scale by
    ``weight`` in that dtype.
    """

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.size = (size,)
        self.weight = nn.Parameter(torch.ones(size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalize ``x`` [..., size] and scale by ``weight``; keeps ``x``'s dtype."""
        if x.dtype == torch.float32:
            return F.rms_norm(x, self.size, eps=self.eps) * self.weight
        return F.rms_norm(x.float(), self.size, eps=self.eps).to(x.dtype) * self.weight


class SiluAndMul(nn.Module):
    """``silu(gate) * up`` for an input holding ``[gate | up]`` on its last dimension."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Split ``x`` [..., 2 * n] in halves and return ``silu(first) * second`` [..., n]."""
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


class FusedLinear(nn.Linear):
    """A linear layer whose output rows stack several checkpoint projections.

    ``shards`` maps each checkpoint projection name (``"q_proj"``) to its number of output
    rows, in stacking order; :meth:`shard_offset` tells the loader where each one goes. Under
    tensor parallelism (column-parallel) each rank holds a slice of each projection's rows:
    ``sources`` gives the first checkpoint row of each shard's slice (0 when absent).
    """

    def __init__(
        self,
        in_features: int,
        shards: dict[str, int],
        bias: bool,
        sources: dict[str, int] | None = None,
    ) -> None:
        super().__init__(in_features, sum(shards.values()), bias=bias)
        self.shards = dict(shards)
        self.sources = dict(sources or {})

    def shard_offset(self, name: str) -> tuple[int, int]:
        """``(first_row, num_rows)`` of shard ``name`` in the fused weight."""
        start = 0
        for shard, rows in self.shards.items():
            if shard == name:
                return start, rows
            start += rows
        raise KeyError(name)

    def checkpoint_slice(self, leaf: str, shard: str | None) -> tuple[int, int, int] | None:
        """``(dim, start, length)`` of the checkpoint tensor this rank reads for ``shard``."""
        if shard is None:
            return None
        return 0, self.sources.get(shard, 0), self.shards[shard]


class RowParallelLinear(nn.Linear):
    """A linear layer whose input columns are split across ranks (o_proj, down_proj).

    Each rank multiplies its slice of the input by its columns of the weight; the partial
    outputs are summed over the ranks, then the (whole, replicated) bias is added once.
    """

    def __init__(
        self, columns: Span, out_features: int, bias: bool, group: TPGroup = SINGLE
    ) -> None:
        super().__init__(columns.size, out_features, bias=bias)
        self.columns = columns
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` [..., local in] -> [..., out], summed over the group."""
        if self.group.size == 1:
            return F.linear(x, self.weight, self.bias)
        out = self.group.all_reduce(F.linear(x, self.weight))
        return out if self.bias is None else out + self.bias

    def checkpoint_slice(self, leaf: str, shard: str | None) -> tuple[int, int, int] | None:
        """The weight's columns of this rank; the bias whole."""
        return (1, self.columns.start, self.columns.size) if leaf == "weight" else None


class VocabParallelEmbedding(nn.Module):
    """Token embedding whose rows (the vocabulary) are split in equal blocks across ranks.

    A rank looks up the ids in its block, zeroes the others, and the rows are summed over
    the ranks. The last block is padded; its padding rows are never looked up.
    """

    def __init__(self, vocab_size: int, hidden_size: int, group: TPGroup = SINGLE) -> None:
        super().__init__()
        self.rows, padded = vocab_span(vocab_size, group.size, group.rank)
        self.group = group
        self.weight = nn.Parameter(torch.empty(padded, hidden_size))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Embeddings [T, hidden] of ``input_ids`` [T]."""
        if self.group.size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.rows.start
        mine = (local >= 0) & (local < self.rows.size)
        out = F.embedding(local.masked_fill(~mine, 0), self.weight)
        out.masked_fill_(~mine.unsqueeze(-1), 0.0)
        return self.group.all_reduce(out)

    def checkpoint_slice(self, leaf: str, shard: str | None) -> tuple[int, int, int] | None:
        """The vocabulary rows of this rank."""
        return 0, self.rows.start, self.rows.size


class ParallelLMHead(VocabParallelEmbedding):
    """The LM head, split by vocabulary rows like the embedding (and tied to it when the
    model ties them); :meth:`logits` gathers every rank's columns, in rank order."""

    def __init__(self, vocab_size: int, hidden_size: int, group: TPGroup = SINGLE) -> None:
        super().__init__(vocab_size, hidden_size, group)
        self.vocab_size = vocab_size
        self.int8: Int8Rows | None = None
        """The int8 copy the logits use, once :meth:`quantize_int8` made it."""

    def quantize_int8(self) -> bool:
        """Compute the logits from an int8 copy of the weight (per-row scales) where the
        device has the int8pack kernel; returns whether it does. The weight itself stays (a
        tied embedding still looks rows up in it)."""
        if not int8pack_runs_on(self.weight.device):
            return False
        self.int8 = Int8Rows(self.weight)
        return True

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [n, vocab] of hidden states [n, hidden], on every rank."""
        local = F.linear(hidden, self.weight) if self.int8 is None else self.int8.matmul(hidden)
        if self.group.size == 1:
            return local
        return self.group.all_gather_last(local)[..., : self.vocab_size]


def rope_inverse_frequencies(
    head_dim: int, theta: float, scaling: dict[str, Any] | None
) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] of RoPE, with llama3 scaling when asked."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (theta**exponents)
    if scaling is None:
        return inv_freq
    factor = float(scaling["factor"])
    low = float(scaling["low_freq_factor"])
    high = float(scaling["high_freq_factor"])
    old_len = float(scaling["original_max_position_embeddings"])
    low_freq_wavelen = old_len / low
    high_freq_wavelen = old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Rotary position embedding with a precomputed table for every position.

    The table holds ``cos`` and a signed ``sin`` (``[-sin, sin]``) over the full head width,
    in the model's dtype, so a step only indexes it and rotation is four elementwise ops.
    """

    def __init__(
        self,
        head_dim: int,
        max_positions: int,
        theta: float,
        scaling: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.max_positions = max_positions
        self.theta = theta
        self.scaling = scaling
        self.cos: torch.Tensor
        self.sin: torch.Tensor
        self.register_buffer("cos", torch.empty(0), persistent=False)
        self.register_buffer("sin", torch.empty(0), persistent=False)
        self.build(torch.get_default_dtype())

    def build(self, dtype: torch.dtype) -> None:
        """(Re)compute the table in ``dtype`` on the device of ``cos`` (after ``to_empty``).

        Angles are computed in float32 and cast once, as transformers does.
        """
        device = self.cos.device
        if device.type == "meta":
            return
        inv_freq = rope_inverse_frequencies(self.head_dim, self.theta, self.scaling)
        positions = torch.arange(self.max_positions, dtype=torch.int64).float()
        freqs = torch.outer(positions, inv_freq)
        cos, sin = freqs.cos(), freqs.sin()
        self.cos = torch.cat((cos, cos), dim=-1).to(device=device, dtype=dtype)
        self.sin = torch.cat((-sin, sin), dim=-1).to(device=device, dtype=dtype)

    def table(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, signed sin)`` rows [num_tokens, 1, head_dim] for ``positions``."""
        cos = self.cos.index_select(0, positions).unsqueeze(1)
        sin = self.sin.index_select(0, positions).unsqueeze(1)
        return cos, sin


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` [num_tokens, heads, head_dim] by the half-split (Llama) convention.

    ``x * cos + rotate_half(x) * sin`` with ``rotate_half(x) = [-x2, x1]``, written as a roll
    times the signed sin table; the same products and sums as transformers, so the same
    rounding in low precision.
    """
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin
