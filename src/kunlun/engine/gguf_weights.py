"""A GGUF file's tensors as a Hugging Face state dict, in the form the importer writes.

Two forms of a tensor:

- **w4a16**, for the weight of a decoder layer's linear projection stored as Q4_0, Q4_1 or
  Q4_K, when asked (``keep_quantized``): the 4-bit values and the per-32 scale and minimum
  of each block are written as they are (:class:`~kunlun.engine.gguf_blocks.Q4Fields`,
  no float round trip) under ``<prefix>.weight_packed`` (uint8 ``[out, in // 2]``, column
  ``2j`` in the low nibble), ``<prefix>.weight_scale`` and ``<prefix>.weight_min`` (float32
  ``[out, in // 32]``), so that ``w[o, i] = q[o, i] * scale[o, i // 32] + min[o, i // 32]``.
- **floating point** in the chosen dtype for everything else (embeddings, norms, the LM head,
  biases, and projections of any other type, dequantized first).

llama's Q and K rows are un-permuted in either form (whole rows move, so the packed values,
scales and minimums move together).
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from kunlun.engine.gguf_blocks import W4A16_GROUP, W4A16_TYPES
from kunlun.engine.gguf_model import Architecture, hf_name, is_linear_weight, qk_heads, unpermute
from kunlun.engine.gguf_reader import GGUFFile
from kunlun.engine.quant import QUANT_METHOD

W4A16_SCHEME = "w4a16"


def quantization_config(group_size: int = W4A16_GROUP) -> dict[str, Any]:
    """The ``quantization_config`` of a directory holding w4a16 tensors."""
    return {
        "quant_method": QUANT_METHOD,
        "scheme": W4A16_SCHEME,
        "group_size": group_size,
        "bits": 4,
    }


def keeps_quantized(gguf: GGUFFile, name: str) -> bool:
    """Tensor ``name`` can be written as w4a16: a linear weight of a 4-bit type."""
    return is_linear_weight(name) and gguf.tensors[name].ggml_type in W4A16_TYPES


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """uint8 values 0..15 ``[rows, 2n]`` -> ``[rows, n]``, column ``2j`` in the low nibble."""
    return q[:, 0::2] | (q[:, 1::2] << 4)


def hf_state_dict(
    gguf: GGUFFile,
    config: dict[str, Any],
    arch: Architecture,
    *,
    dtype: torch.dtype = torch.float32,
    keep_quantized: bool = False,
    progress: bool = False,
) -> dict[str, torch.Tensor]:
    """Every tensor of ``gguf`` under its Hugging Face name: w4a16 where ``keep_quantized``
    and :func:`keeps_quantized`, else dequantized and cast to ``dtype``. ``progress`` draws a
    bar (tqdm, on stderr) over the bytes converted."""
    names = [name for name in gguf.tensors if hf_name(name) is not None]
    bar = _progress_bar(sum(gguf.tensors[n].num_bytes for n in names), progress)
    tensors: dict[str, torch.Tensor] = {}
    try:
        for name in names:
            target = hf_name(name)
            assert target is not None
            heads = qk_heads(name, config, arch)
            if keep_quantized and keeps_quantized(gguf, name):
                tensors.update(_w4a16(gguf, name, target.removesuffix(".weight"), heads))
            else:
                tensor = gguf.load(name)
                if heads is not None:
                    tensor = unpermute(tensor, heads)
                tensors[target] = tensor.to(dtype).contiguous()
            if bar is not None:
                bar.update(gguf.tensors[name].num_bytes)
    finally:
        if bar is not None:
            bar.close()
    return tensors


def _w4a16(gguf: GGUFFile, name: str, prefix: str, heads: int | None) -> dict[str, torch.Tensor]:
    fields = gguf.load_q4(name)
    q, scale, minimum = fields.q, fields.scale, fields.min
    if heads is not None:
        q, scale, minimum = (unpermute(t, heads) for t in (q, scale, minimum))
    return {
        f"{prefix}.weight_packed": pack_nibbles(q).contiguous(),
        f"{prefix}.weight_scale": scale.contiguous(),
        f"{prefix}.weight_min": minimum.contiguous(),
    }


def _progress_bar(total: int, show: bool) -> Any:
    if not show:
        return None
    from tqdm import tqdm

    return tqdm(
        total=total, desc="import-gguf", unit="B", unit_scale=True, file=sys.stderr, leave=False
    )
