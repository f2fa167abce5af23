"""ggml's block formats: dequantization to float32, and 4-bit blocks as w4a16 fields.

A quantized ggml tensor is a run of blocks along each row; a block holds ``block_elements``
values in ``block_bytes`` bytes (:data:`~kunlun.engine.gguf_reader.GGML_TYPES`). Every
function here takes the blocks of one tensor as a uint8 tensor ``[num_blocks, block_bytes]``
and returns one row per block, in the order the values have in the row. The arithmetic
follows ggml's reference dequantization (``ggml-quants.c``) operation for operation, so the
results are bit-identical to it: every product of a scale and a quantized value is exact in
float32, and at most one addition rounds.

The types with 4-bit unsigned values and a scale and a minimum per group of 32 (Q4_0, Q4_1,
Q4_K; :data:`W4A16_TYPES`) can also be read as :class:`Q4Fields`, which is exactly the
w4a16 format's ``w = q * scale + min`` without going through floats.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

QK_K = 256
"""Elements per K-quant super-block."""
W4A16_GROUP = 32
"""Elements per scale/min group of the 4-bit types read as :class:`Q4Fields`."""

# ggml type ids (ggml.h)
F32, F16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 = 0, 1, 2, 3, 6, 7, 8
Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, BF16 = 10, 11, 12, 13, 14, 30


@dataclass(frozen=True)
class Q4Fields:
    """4-bit blocks as unsigned values and one scale and minimum per group of 32:
    ``w[b, i] = q[b, i] * scale[b, i // 32] + min[b, i // 32]``."""

    q: torch.Tensor
    """uint8 ``[num_blocks, block_elements]``, values 0..15, in row order."""
    scale: torch.Tensor
    """float32 ``[num_blocks, block_elements // 32]``."""
    min: torch.Tensor
    """float32 ``[num_blocks, block_elements // 32]``."""

    def dequantize(self) -> torch.Tensor:
        """The float32 values ``[num_blocks, block_elements]``."""
        groups = self.q.reshape(self.q.shape[0], -1, W4A16_GROUP).float()
        values = groups * self.scale.unsqueeze(-1) + self.min.unsqueeze(-1)
        return values.reshape(self.q.shape)


def _half(raw: torch.Tensor, start: int) -> torch.Tensor:
    """Bytes ``[start, start + 2)`` of each block read as float16, as float32 ``[blocks, 1]``."""
    return raw[:, start : start + 2].contiguous().view(torch.float16).float()


def _bits(raw: torch.Tensor, shifts: tuple[int, ...], mask: int) -> torch.Tensor:
    """``(raw >> shift) & mask`` for each shift: ``[blocks, groups, len(shifts), width]`` from
    ``raw`` shaped ``[blocks, groups, width]``."""
    shift = torch.tensor(shifts, dtype=torch.uint8).reshape(1, 1, -1, 1)
    return (raw.unsqueeze(2) >> shift) & mask


def _nibbles(raw: torch.Tensor) -> torch.Tensor:
    """The 32 4-bit values of each block's 16 bytes: low nibbles first, then high."""
    return torch.cat((raw & 0x0F, raw >> 4), dim=1)


def _high_bits(raw: torch.Tensor, count: int) -> torch.Tensor:
    """Bit ``i`` of the little-endian bit string in ``raw`` for ``i < count``, as uint8
    ``[blocks, count]`` (Q5_0/Q5_1's ``qh``)."""
    bits = _bits(raw.reshape(raw.shape[0], -1, 1), tuple(range(8)), 1)
    return bits.reshape(raw.shape[0], -1)[:, :count]


def _q8_0(raw: torch.Tensor) -> torch.Tensor:
    return _half(raw, 0) * raw[:, 2:].contiguous().view(torch.int8).float()


def _q4_0(raw: torch.Tensor) -> torch.Tensor:
    return _half(raw, 0) * (_nibbles(raw[:, 2:]).float() - 8.0)


def _q4_1(raw: torch.Tensor) -> torch.Tensor:
    return _half(raw, 0) * _nibbles(raw[:, 4:]).float() + _half(raw, 2)


def _q5_0(raw: torch.Tensor) -> torch.Tensor:
    q = _nibbles(raw[:, 6:]) | (_high_bits(raw[:, 2:6], 32) << 4)
    return _half(raw, 0) * (q.float() - 16.0)


def _q5_1(raw: torch.Tensor) -> torch.Tensor:
    q = _nibbles(raw[:, 8:]) | (_high_bits(raw[:, 4:8], 32) << 4)
    return _half(raw, 0) * q.float() + _half(raw, 2)


def _k_scales(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The eight 6-bit scales and minimums of Q4_K/Q5_K packed in 12 bytes, as float32."""
    parts = packed.reshape(-1, 3, 4)
    low, high, both = parts[:, 0], parts[:, 1], parts[:, 2]
    scales = torch.cat((low & 0x3F, (both & 0x0F) | ((low >> 2) & 0x30)), dim=1)
    mins = torch.cat((high & 0x3F, (both >> 4) | ((high >> 2) & 0x30)), dim=1)
    return scales.float(), mins.float()


def _q4_k_fields(raw: torch.Tensor) -> Q4Fields:
    scales, mins = _k_scales(raw[:, 4:16])
    q = _bits(raw[:, 16:].reshape(-1, 4, 32), (0, 4), 0x0F).reshape(-1, QK_K)
    return Q4Fields(q, _half(raw, 0) * scales, -(_half(raw, 2) * mins))


def _q4_k(raw: torch.Tensor) -> torch.Tensor:
    return _q4_k_fields(raw).dequantize()


def _q5_k(raw: torch.Tensor) -> torch.Tensor:
    scales, mins = _k_scales(raw[:, 4:16])
    low = _bits(raw[:, 48:].reshape(-1, 4, 32), (0, 4), 0x0F).reshape(-1, 8, 32)
    high = _bits(raw[:, 16:48].reshape(-1, 1, 32), tuple(range(8)), 1).reshape(-1, 8, 32)
    q = (low | (high << 4)).float()
    scale = (_half(raw, 0) * scales).unsqueeze(-1)
    offset = (_half(raw, 2) * mins).unsqueeze(-1)
    return (scale * q - offset).reshape(-1, QK_K)


def _q6_k(raw: torch.Tensor) -> torch.Tensor:
    low = _bits(raw[:, :128].reshape(-1, 2, 64), (0, 4), 0x0F).reshape(-1, 8, 32)
    high = _bits(raw[:, 128:192].reshape(-1, 2, 32), (0, 2, 4, 6), 3).reshape(-1, 8, 32)
    q = ((low | (high << 4)).to(torch.int8) - 32).float().reshape(-1, 16, 16)
    scale = (_half(raw, 208) * raw[:, 192:208].contiguous().view(torch.int8).float()).unsqueeze(-1)
    return (scale * q).reshape(-1, QK_K)


def _q2_k(raw: torch.Tensor) -> torch.Tensor:
    packed = raw[:, :16]
    scale = (_half(raw, 80) * (packed & 0x0F).float()).unsqueeze(-1)
    offset = (_half(raw, 82) * (packed >> 4).float()).unsqueeze(-1)
    q = _bits(raw[:, 16:80].reshape(-1, 2, 32), (0, 2, 4, 6), 3).reshape(-1, 16, 16).float()
    return (scale * q - offset).reshape(-1, QK_K)


def _q3_k(raw: torch.Tensor) -> torch.Tensor:
    low_scales = _bits(raw[:, 96:104].reshape(-1, 1, 8), (0, 4), 0x0F).reshape(-1, 16)
    high_scales = _bits(raw[:, 104:108].reshape(-1, 1, 4), (0, 2, 4, 6), 3).reshape(-1, 16)
    scales = ((low_scales | (high_scales << 4)).to(torch.int8) - 32).float()
    scale = (_half(raw, 108) * scales).unsqueeze(-1)
    low = _bits(raw[:, 32:96].reshape(-1, 2, 32), (0, 2, 4, 6), 3).reshape(-1, 16, 16)
    mask = _bits(raw[:, :32].reshape(-1, 1, 32), tuple(range(8)), 1).reshape(-1, 16, 16)
    # a set bit of the high mask means no offset; a clear one subtracts 4
    q = (low.to(torch.int8) - ((mask ^ 1) << 2).to(torch.int8)).float()
    return (scale * q).reshape(-1, QK_K)


#: ggml type id -> its block decoder (blocks ``[n, block_bytes]`` -> float32 ``[n, elements]``).
DEQUANTIZE: dict[int, Callable[[torch.Tensor], torch.Tensor]] = {
    F32: lambda raw: raw.contiguous().view(torch.float32).clone(),
    F16: lambda raw: raw.contiguous().view(torch.float16).float(),
    BF16: lambda raw: raw.contiguous().view(torch.bfloat16).float(),
    Q4_0: _q4_0,
    Q4_1: _q4_1,
    Q5_0: _q5_0,
    Q5_1: _q5_1,
    Q8_0: _q8_0,
    Q2_K: _q2_k,
    Q3_K: _q3_k,
    Q4_K: _q4_k,
    Q5_K: _q5_k,
    Q6_K: _q6_k,
}

#: ggml type id -> byte offsets of its float16 scale fields in a block (checked finite).
SCALE_FIELDS: dict[int, tuple[int, ...]] = {
    Q4_0: (0,),
    Q4_1: (0, 2),
    Q5_0: (0,),
    Q5_1: (0, 2),
    Q8_0: (0,),
    Q2_K: (80, 82),
    Q3_K: (108,),
    Q4_K: (0, 2),
    Q5_K: (0, 2),
    Q6_K: (208,),
}


def _q4_0_fields(raw: torch.Tensor) -> Q4Fields:
    scale = _half(raw, 0)
    return Q4Fields(_nibbles(raw[:, 2:]), scale, scale * -8.0)


def _q4_1_fields(raw: torch.Tensor) -> Q4Fields:
    return Q4Fields(_nibbles(raw[:, 4:]), _half(raw, 0), _half(raw, 2))


#: ggml type id -> its blocks as :class:`Q4Fields` (the types w4a16 holds without loss).
W4A16_TYPES: dict[int, Callable[[torch.Tensor], Q4Fields]] = {
    Q4_0: _q4_0_fields,
    Q4_1: _q4_1_fields,
    Q4_K: _q4_k_fields,
}


def first_non_finite_scale(ggml_type: int, raw: torch.Tensor) -> int | None:
    """Index of the first block of ``raw`` whose float16 scale or minimum is infinite or
    NaN (no valid quantizer writes one), or ``None``."""
    fields = SCALE_FIELDS.get(ggml_type, ())
    if not fields:
        return None
    scales = torch.cat([_half(raw, start) for start in fields], dim=1)
    bad = ~torch.isfinite(scales).all(dim=1)
    return int(bad.nonzero()[0, 0]) if bool(bad.any()) else None
