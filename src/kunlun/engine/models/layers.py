"""Building blocks shared by the decoder models: norm, rotary embedding, gated MLP, fused linear.

The arithmetic follows transformers' Llama code step for step (RMSNorm in float32 then cast
back, cos/sin computed in float32 then cast) so that results agree with it closely.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


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
    rows, in stacking order; :meth:`shard_offset` tells the loader where each one goes.
    """

    def __init__(self, in_features: int, shards: dict[str, int], bias: bool) -> None:
        super().__init__(in_features, sum(shards.values()), bias=bias)
        self.shards = dict(shards)

    def shard_offset(self, name: str) -> tuple[int, int]:
        """``(first_row, num_rows)`` of shard ``name`` in the fused weight."""
        start = 0
        for shard, rows in self.shards.items():
            if shard == name:
                return start, rows
            start += rows
        raise KeyError(name)


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
