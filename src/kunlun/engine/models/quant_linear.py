"""Quantized linear layers, and the kernel each scheme runs on each device.

A :class:`QuantLinear` holds the canonical tensors of :mod:`kunlun.engine.quant` (filled by
the loader, shard by shard for fused projections), then :meth:`QuantLinear.prepare` repacks
them for the kernel that runs on the module's device. Kernels, chosen by measurement on the
2-vCPU x86 machine without native bf16 (torch 2.13 CPU, best of 5, microseconds per call;
fp32 ``F.linear`` in brackets; demo-model shapes ``[out x in]``, one token and 16 tokens)::

                              1536x576 1 tok   576x1536 1 tok   1536x576 16 tok
    fp32 F.linear                  [79]            [71]            [550]
    _weight_int8pack_mm, fp32 x     862             913           20386   (reference path)
    _weight_int8pack_mm, bf16 x      77              76             821
    _int_mm (w8a8, int8 x)         1393             977           20795
    dequantize, then F.linear      4841             298             921
    int4pack_mm_for_cpu, fp32 x    1925            1744           28848
    int4pack_mm_for_cpu, bf16 x     147             125             769

So on the CPU:

- ``w8a16``: ``torch._weight_int8pack_mm`` with the activations cast to bf16 (its fp32 path
  is a slow reference loop); scales are applied in float32 afterwards (the kernel gets unit
  scales), so only the activations and the kernel's output are rounded to bf16.
- ``w8a8``: activations quantized per token, symmetric, to int8 values; the same int8pack
  kernel multiplies them (int8 values are exact in bf16, products accumulate in float32),
  then the row and column scales are applied in float32. ``torch._int_mm`` is 15-25 times
  slower than that on this CPU.
- ``w4a16``: Kunlun's own int4 kernel (``torch.ops.kunlun.int4_matmul`` of the compiled
  library, :mod:`kunlun.engine.native`: weights in tiles of 32 rows widened to float32 in
  registers, float32 activations and sums; past 48 tokens (16 on AVX2), tiles dequantized for
  ``torch.mm``) where the library is loaded and its measurement on the CPU found it faster
  than torch's (needs ``out % 32 == 0``); else ``_convert_weight_to_int4pack_for_cpu`` +
  ``_weight_int4pack_mm_for_cpu`` with bf16 activations (needs ``out % 16 == 0``); else the
  fallback. Which one a process may run is the ``native_ops`` :meth:`QuantLinear.prepare`
  is given (the reference path, ``decode_path=python``, runs torch's).

The LM head of a quantized model (a floating tensor in every checkpoint, often tied to the
embedding) runs through the same int8pack kernel on the CPU (:class:`Int8Rows`): it is the
largest single matrix of a small model (49152 x 576 in the demo, ~10 ms of a 45 ms w8a16
decode step in fp32), and int8 rows with a per-row scale cost nothing measurable in
perplexity. The embedding lookup keeps the floating table.

Elsewhere: ``w8a8`` uses ``torch._int_mm`` on CUDA-like devices for more than 16 tokens
(its own constraint) and the fallback below that; ``w8a16`` and ``w4a16`` use the fallback,
which dequantizes the weight to the activation dtype and calls ``F.linear`` (every device
runs it; it saves memory but not time). ``w8a8``'s fallback quantizes the activations the
same way, so every path computes the same numbers up to rounding. Which kernel a layer gets
on its device is the registry's choice (:mod:`kunlun.engine.kernels`), the one the planner
reports.
"""

from __future__ import annotations

from collections.abc import Collection

import torch
import torch.nn.functional as F
from torch import nn

from kunlun.engine.kernels import candidates
from kunlun.engine.native import DEQUANTIZE_FROM_TOKENS
from kunlun.engine.quant import (
    INT4_TILE_ROWS,
    QuantSpec,
    dequantize,
    int4_tiles,
    quantize,
    unpack_int4,
)
from kunlun.engine.schemes import INT8_SCHEMES

DEQUANTIZE_BLOCK = 1 << 20
"""Weights per block dequantized at once on that path (4 MiB of float32): the LM head's
49152 x 576 never exists whole in float32."""


class QuantLinear(nn.Module):
    """A linear layer with quantized weights; ``shards`` as in
    :class:`~kunlun.engine.models.layers.FusedLinear` when it stacks projections."""

    weight: torch.Tensor
    """int8 [out, in] (w8a8, w8a16)."""
    weight_packed: torch.Tensor
    """uint8 [out, in // 2] (w4a16)."""
    weight_scale: torch.Tensor
    """float32 [out] (int8 schemes) or [out, in // group_size] (w4a16)."""
    weight_min: torch.Tensor
    """float32 [out, in // group_size] (w4a16)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        spec: QuantSpec,
        *,
        bias: bool,
        dtype: torch.dtype,
        device: torch.device,
        shards: dict[str, int] | None = None,
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.spec = spec
        self.shards = None if shards is None else dict(shards)
        self.kernel = "unprepared"
        """The path :meth:`forward` takes: int8pack, int_mm, int4, int4pack or dequantize."""
        for suffix, (shape, tensor_dtype) in self._canonical_shapes().items():
            self.register_buffer(suffix, torch.empty(shape, dtype=tensor_dtype, device=device))
        self.bias = (
            nn.Parameter(torch.empty(out_features, dtype=dtype, device=device)) if bias else None
        )
        self._packed: torch.Tensor | None = None
        self._scales_zeros: torch.Tensor | None = None
        self._unit_scale: torch.Tensor | None = None

    def _canonical_shapes(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        out_f, in_f = self.out_features, self.in_features
        if self.spec.scheme in INT8_SCHEMES:
            return {
                "weight": ((out_f, in_f), torch.int8),
                "weight_scale": ((out_f,), torch.float32),
            }
        groups = in_f // (self.spec.group_size or in_f)
        return {
            "weight_packed": ((out_f, in_f // 2), torch.uint8),
            "weight_scale": ((out_f, groups), torch.float32),
            "weight_min": ((out_f, groups), torch.float32),
        }

    def canonical(self) -> dict[str, torch.Tensor]:
        """The stored tensors by suffix (as in the checkpoint)."""
        return {suffix: getattr(self, suffix) for suffix in self.spec.tensor_suffixes}

    def shard_offset(self, name: str) -> tuple[int, int]:
        """``(first_row, num_rows)`` of shard ``name`` in the stacked rows."""
        start = 0
        for shard, rows in (self.shards or {}).items():
            if shard == name:
                return start, rows
            start += rows
        raise KeyError(name)

    def float_shape(self, shard: str | None) -> tuple[int, int]:
        """Shape of the floating-point checkpoint weight of ``shard`` (or of the whole layer)."""
        rows = (
            self.out_features
            if shard is None or self.shards is None
            else self.shard_offset(shard)[1]
        )
        return rows, self.in_features

    def prepare(self, native_ops: Collection[str] = ()) -> None:
        """Choose the kernel for this device and repack the loaded tensors for it (once,
        after loading); ``native_ops`` are Kunlun's own operators this process runs
        (:func:`kunlun.engine.native.native_ops`; none: torch's kernels)."""
        device = self.weight_scale.device
        found = candidates("matmul", device.type, self.spec.scheme, _has_function, native_ops)
        self.kernel = next(k.key for k in found if self._fits(k.key))
        if self.kernel == "int4":
            group_size = self.spec.group_size or self.in_features
            self._packed, self._scales_zeros = int4_tiles(
                self.weight_packed, self.weight_scale, self.weight_min, group_size
            )
            for suffix in self.spec.tensor_suffixes:  # the kernel's copy replaces them
                setattr(self, suffix, torch.empty(0, device=device))
        elif self.kernel == "int8pack":
            self._unit_scale = torch.ones(self.out_features, dtype=torch.bfloat16, device=device)
        elif self.kernel == "int4pack":
            values = unpack_int4(self.weight_packed).to(torch.int32)
            self._packed = torch._convert_weight_to_int4pack_for_cpu(values, 1)
            # the kernel computes (q - 8) * scale + zero, so zero = min + 8 * scale
            zero = self.weight_min + 8 * self.weight_scale
            pairs = torch.stack((self.weight_scale.t(), zero.t()), dim=-1)
            self._scales_zeros = pairs.to(torch.bfloat16).contiguous()
            for suffix in self.spec.tensor_suffixes:  # the kernel's copy replaces them
                setattr(self, suffix, torch.empty(0, device=device))

    def _fits(self, kernel: str) -> bool:
        """Whether this layer's shape and scales suit ``kernel``."""
        if kernel == "int4":  # tiles of 32 rows; float16 scales and minimums
            finite = bool(torch.isfinite(self.weight_scale.half()).all()) and bool(
                torch.isfinite(self.weight_min.half()).all()
            )
            return self.out_features % INT4_TILE_ROWS == 0 and finite
        return kernel != "int4pack" or self.out_features % 16 == 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` [T, in] -> [T, out] in ``x``'s dtype."""
        if self.kernel == "int4":
            group_size = self.spec.group_size or self.in_features
            out = torch.ops.kunlun.int4_matmul(x, self._packed, self._scales_zeros, group_size)
            return out if self.bias is None else out + self.bias
        if self.kernel == "int8pack":
            out = self._int8pack(x)
        elif self.kernel == "int_mm" and x.shape[0] > 16:
            x_int, x_scale = _quantize_tokens(x)
            out = torch._int_mm(x_int, self.weight.t()).float() * x_scale * self.weight_scale
        elif self.kernel == "int4pack":
            assert self._packed is not None and self._scales_zeros is not None
            group_size = self.spec.group_size or self.in_features
            out = torch._weight_int4pack_mm_for_cpu(
                x.to(torch.bfloat16), self._packed, group_size, self._scales_zeros
            )
        else:
            weight = dequantize(self.canonical(), self.spec).to(x.dtype)
            if self.spec.scheme == "w8a8":
                x_int, x_scale = _quantize_tokens(x)
                x = (x_int.float() * x_scale).to(x.dtype)
            out = F.linear(x, weight)
        out = out.to(x.dtype)
        return out if self.bias is None else out + self.bias

    def _int8pack(self, x: torch.Tensor) -> torch.Tensor:
        assert self._unit_scale is not None
        if self.spec.scheme == "w8a16":
            return _int8_matmul(x, self.weight, self._unit_scale) * self.weight_scale
        x_int, x_scale = _quantize_tokens(x)
        return _int8_matmul(x_int, self.weight, self._unit_scale) * x_scale * self.weight_scale

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"{self.spec.describe()}, kernel={self.kernel}"
        )


def int8pack_runs_on(device: torch.device) -> bool:
    """Whether the packed int8 weight kernel serves ``device`` (the CPU, when torch has it)."""
    return candidates("matmul", device.type, "w8a16", _has_function)[0].key == "int8pack"


def _has_function(name: str) -> bool:
    """Whether this torch build has the private function ``torch.<name>``."""
    return hasattr(torch, name)


def _int8pack_mm(x: torch.Tensor, weight: torch.Tensor, unit_scale: torch.Tensor) -> torch.Tensor:
    """``x`` [T, in] (cast to bf16) times int8 ``weight`` [out, in]^T, in float32, unscaled."""
    return torch._weight_int8pack_mm(x.to(torch.bfloat16), weight, unit_scale).float()


def _int8_matmul(x: torch.Tensor, weight: torch.Tensor, unit_scale: torch.Tensor) -> torch.Tensor:
    """``x`` [T, in] times int8 ``weight`` [out, in]^T, in float32, unscaled: the int8pack
    kernel below :data:`DEQUANTIZE_FROM_TOKENS` tokens (decode); from there (prefill), the
    int8 rows as float32 block by block into ``F.linear``, about twice as fast there and no
    coarser (the activations are not rounded to bf16; int8 values are exact either way)."""
    if x.shape[0] < DEQUANTIZE_FROM_TOKENS:
        return _int8pack_mm(x, weight, unit_scale)
    x = x.float()
    out = torch.empty(x.shape[0], weight.shape[0], dtype=torch.float32, device=x.device)
    rows = max(1, DEQUANTIZE_BLOCK // weight.shape[1])
    for start in range(0, weight.shape[0], rows):
        out[:, start : start + rows] = F.linear(x, weight[start : start + rows].float())
    return out


class Int8Rows:
    """A floating matrix [out, in] kept as int8 rows with a float32 scale per row, for
    the int8pack kernel (the LM head of a quantized model on the CPU)."""

    def __init__(self, weight: torch.Tensor) -> None:
        tensors = quantize(weight, QuantSpec("w8a16"))
        self.weight = tensors["weight"]
        self.scale = tensors["weight_scale"]
        self._unit_scale = torch.ones(
            self.weight.shape[0], dtype=torch.bfloat16, device=weight.device
        )

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` [T, in] -> [T, out] in ``x``'s dtype."""
        return (_int8_matmul(x, self.weight, self._unit_scale) * self.scale).to(x.dtype)


def _quantize_tokens(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-token int8 quantization: ``(int8 [T, in], float32 scale [T, 1])``."""
    scale = x.float().abs().amax(dim=-1, keepdim=True).clamp_(min=1e-12) / 127.0
    return torch.round(x.float() / scale).clamp_(-127, 127).to(torch.int8), scale


def quantize_linears(
    model: nn.Module, spec: QuantSpec, dtype: torch.dtype, only: set[str] | None = None
) -> int:
    """Replace every linear layer under ``model.layers`` (or only the modules named in
    ``only``) by an empty :class:`QuantLinear` on the same device (the loader fills it);
    returns how many were replaced."""
    replaced = 0
    for name, module in list(model.named_modules()):
        if not (isinstance(module, nn.Linear) and ".layers." in f".{name}"):
            continue
        if only is not None and name not in only:
            continue
        parent_name, _, child = name.rpartition(".")
        quantized = QuantLinear(
            module.in_features,
            module.out_features,
            spec,
            bias=module.bias is not None,
            dtype=dtype,
            device=module.weight.device,
            shards=getattr(module, "shards", None),
        )
        setattr(model.get_submodule(parent_name), child, quantized)
        replaced += 1
    return replaced
