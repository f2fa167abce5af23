"""Weight quantization: the schemes, and the on-disk format of a quantized model directory.

This module owns the scheme names (:data:`SCHEMES`) and the canonical tensors a quantized
checkpoint holds. Only the linear layers of the decoder blocks are quantized (q/k/v/o and
gate/up/down under their checkpoint names); embeddings, norms, biases and the LM head stay
floating point. ``config.json`` carries::

    "quantization_config": {"quant_method": "kunlun", "scheme": "w4a16", "group_size": 128,
                            "bits": 4}

Per linear layer ``<prefix>`` (e.g. ``model.layers.0.self_attn.q_proj``):

- ``w8a8`` and ``w8a16`` (symmetric, per output channel): ``<prefix>.weight`` int8
  [out, in] and ``<prefix>.weight_scale`` float32 [out]; ``w = weight * weight_scale[:, None]``.
- ``w4a16`` (asymmetric, groups of ``group_size`` along the input): ``<prefix>.weight_packed``
  uint8 [out, in // 2] (two 4-bit values per byte, column ``2j`` in the low nibble),
  ``<prefix>.weight_scale`` and ``<prefix>.weight_min`` float32 [out, in // group_size];
  ``w[o, i] = q[o, i] * scale[o, i // g] + min[o, i // g]``.

Every scale belongs to one output row, so quantizing the checkpoint shards of a fused
projection (q/k/v, gate/up) one by one and stacking the rows is exact. The engine's kernels
(:mod:`kunlun.engine.models.quant_linear`) repack these tensors at load time; the format does
not change with the kernel.

Importing this module does not import torch (the planner and the CLI read the scheme names);
the functions that work on tensors import it when called.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kunlun.engine import schemes
from kunlun.errors import ConfigError, Location, ModelError
from kunlun.hf_config import HFConfig

if TYPE_CHECKING:
    import torch

#: Weight quantization schemes, ``"none"`` first (named in :mod:`kunlun.engine.schemes`).
SCHEMES = schemes.SCHEMES
#: Group sizes ``w4a16`` takes.
GROUP_SIZES: tuple[int, ...] = (32, 128)
#: The group size the platform quantizes to when none is asked and the layers allow it.
DEFAULT_GROUP_SIZE = 128
#: ``quant_method`` of a checkpoint in this format.
QUANT_METHOD = "kunlun"
#: Bits per weight of each quantized scheme.
BITS: dict[str, int] = {"w8a8": 8, "w8a16": 8, "w4a16": 4}
#: Checkpoint projection names that are quantized.
LINEAR_NAMES: tuple[str, ...] = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
)
#: Fractions of a row's largest magnitude tried as its int8 clipping point (1.0 first).
_CLIP_RATIOS: tuple[float, ...] = tuple(1.0 - 0.02 * i for i in range(26))
_SCALE_BLOCK = 262_144
"""Weights per block of rows in :func:`_int8_scales` (1 MiB of float32)."""
_LINEAR_WEIGHT = re.compile(r"^model\.layers\.\d+\.(self_attn|mlp)\.(\w+)\.weight$")


@dataclass(frozen=True)
class QuantSpec:
    """One quantized scheme and, for ``w4a16``, its group size."""

    scheme: str
    """One of :data:`SCHEMES` other than ``"none"``."""
    group_size: int | None = None
    """Inputs per scale group (``w4a16`` only; one of :data:`GROUP_SIZES`)."""

    @property
    def bits(self) -> int:
        """Bits per stored weight."""
        return BITS[self.scheme]

    @property
    def tensor_suffixes(self) -> tuple[str, ...]:
        """Names after ``<prefix>.`` of the tensors one quantized linear layer stores."""
        if self.scheme == "w4a16":
            return ("weight_packed", "weight_scale", "weight_min")
        return ("weight", "weight_scale")

    def config(self) -> dict[str, Any]:
        """The ``quantization_config`` object of ``config.json``."""
        raw: dict[str, Any] = {"quant_method": QUANT_METHOD, "scheme": self.scheme}
        if self.group_size is not None:
            raw["group_size"] = self.group_size
        raw["bits"] = self.bits
        return raw

    def describe(self) -> str:
        """``w8a8`` or ``w4a16 (group 128)``."""
        return (
            self.scheme if self.group_size is None else f"{self.scheme} (group {self.group_size})"
        )


def make_spec(
    scheme: str, group_size: int | None = None, *, field: str = "quantization"
) -> QuantSpec | None:
    """The :class:`QuantSpec` for ``scheme`` (None for ``"none"``); raises :class:`ConfigError`
    naming ``field`` for an unknown scheme or a group size that is not allowed.

    A ``w4a16`` spec made without a group size keeps None: :func:`fit_group_size` chooses it
    from the model's layers.
    """
    if scheme not in SCHEMES:
        raise ConfigError(
            f"{field}={scheme!r} is not a quantization scheme; expected one of "
            + ", ".join(SCHEMES)
        )
    if group_size is not None and (scheme != "w4a16" or group_size not in GROUP_SIZES):
        allowed = ", ".join(map(str, GROUP_SIZES))
        raise ConfigError(
            f"group_size={group_size!r} is invalid for {field}={scheme}: only w4a16 takes a "
            f"group size ({allowed})"
        )
    return None if scheme == "none" else QuantSpec(scheme, group_size)


def fit_group_size(spec: QuantSpec, in_features: dict[str, int]) -> QuantSpec:
    """``spec`` with a group size every layer's input width divides (``w4a16`` only).

    ``in_features`` maps layer names to their input widths. Without a group size: 128 when
    every width divides by 128, else 32. Raises :class:`ConfigError` naming the first layer a
    group size does not divide.
    """
    if spec.scheme != "w4a16":
        return spec
    size = spec.group_size
    if size is None:
        size = DEFAULT_GROUP_SIZE
        if any(width % size for width in in_features.values()):
            size = min(GROUP_SIZES)
    for name, width in in_features.items():
        if width % size:
            raise ConfigError(
                f"w4a16 group_size={size} does not divide the input width {width} of {name}; "
                f"choose one of {', '.join(map(str, GROUP_SIZES))} that does"
            )
    return QuantSpec(spec.scheme, size)


def is_quantized_linear(name: str) -> bool:
    """Whether checkpoint tensor ``name`` is the weight of a decoder linear layer."""
    match = _LINEAR_WEIGHT.match(name)
    return match is not None and match.group(2) in LINEAR_NAMES


def quantize(weight: torch.Tensor, spec: QuantSpec) -> dict[str, torch.Tensor]:
    """The canonical tensors of ``weight`` [out, in] under ``spec``, by suffix.

    Scales are computed in float32 from the weight as given; an all-zero row or group gets
    scale 1 (it dequantizes to zeros exactly).
    """
    import torch

    w = weight.detach().float()
    if spec.scheme in schemes.INT8_SCHEMES:
        scale = _int8_scales(w)
        q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
        return {"weight": q.contiguous(), "weight_scale": scale.contiguous()}
    group = _group_size(spec)
    out_features, in_features = w.shape
    groups = w.reshape(out_features, in_features // group, group)
    low = groups.amin(dim=-1)
    scale = (groups.amax(dim=-1) - low) / 15.0
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round((groups - low[..., None]) / scale[..., None]).clamp_(0, 15).to(torch.uint8)
    return {
        "weight_packed": pack_int4(q.reshape(out_features, in_features)),
        "weight_scale": scale.contiguous(),
        "weight_min": low.contiguous(),
    }


def _int8_scales(w: torch.Tensor) -> torch.Tensor:
    """Per-row scales that minimise the squared rounding error: the row's largest magnitude
    over 127, or that clipped to one of :data:`_CLIP_RATIOS` of it when that loses less (a
    few outliers clipped buy a finer step for every other weight).

    The search runs over blocks of rows that stay in the CPU's cache (:data:`_SCALE_BLOCK`),
    each ratio's error computed in place: the same numbers as over the whole matrix at once,
    about 15x faster on a large one (the demo's 49152 x 576 LM head: 15 s -> 0.9 s on one
    core), which is most of a quantized model's load."""
    import torch

    top = w.abs().amax(dim=1)
    top = torch.where(top > 0, top, torch.ones_like(top))
    scales = torch.empty_like(top)
    rows = max(1, _SCALE_BLOCK // max(1, w.shape[1]))
    for start in range(0, w.shape[0], rows):
        block, block_top = w[start : start + rows], top[start : start + rows]
        work = torch.empty_like(block)
        best_scale, best_error = block_top / 127.0, None
        for ratio in _CLIP_RATIOS:
            scale = block_top * ratio / 127.0
            torch.div(block, scale[:, None], out=work)
            work.round_().clamp_(-127, 127).mul_(scale[:, None]).sub_(block)
            error = work.pow_(2).sum(1)
            if best_error is None:
                best_error = error
                continue
            better = error < best_error
            best_scale = torch.where(better, scale, best_scale)
            best_error = torch.where(better, error, best_error)
        scales[start : start + rows] = best_scale
    return scales


def dequantize(tensors: dict[str, torch.Tensor], spec: QuantSpec) -> torch.Tensor:
    """The float32 weight [out, in] the canonical ``tensors`` stand for."""

    scale = tensors["weight_scale"].float()
    if spec.scheme in schemes.INT8_SCHEMES:
        return tensors["weight"].float() * scale[:, None]
    group = _group_size(spec)
    q = unpack_int4(tensors["weight_packed"]).float()
    out_features, in_features = q.shape
    groups = q.reshape(out_features, in_features // group, group)
    weight = groups * scale[..., None] + tensors["weight_min"].float()[..., None]
    return weight.reshape(out_features, in_features)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """uint8 [out, in // 2] from values 0..15 [out, in]: column ``2j`` low nibble, ``2j+1`` high."""
    import torch

    q = q.to(torch.uint8)
    return (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous()


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """uint8 values 0..15 [out, 2 * n] from ``packed`` [out, n] (inverse of :func:`pack_int4`)."""
    import torch

    low = packed & 0x0F
    high = packed >> 4
    return torch.stack((low, high), dim=-1).reshape(packed.shape[0], -1)


INT4_TILE_ROWS = 32
"""Output rows per tile of the compiled int4 kernel (``decode.cpp``'s ``int4_matmul``)."""


def int4_tiles(
    packed: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor, group_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The compiled int4 kernel's layout of ``w4a16`` tensors (``out`` a multiple of
    :data:`INT4_TILE_ROWS`): uint8 tiles [out / 32, in, 16], byte ``j`` of column ``k`` holding
    row ``j`` of the tile at ``k`` in its low nibble and row ``j + 16`` in its high one; and
    float16 [out / 32, in / group_size, 2, 32], per tile and group the 32 rows' scales, then
    their minimums. The same 4 bits per weight (plus 4 bytes per row and group); float16
    holds a GGUF file's scales exactly."""
    import torch

    q = unpack_int4(packed)
    out_features, in_features = q.shape
    rows = q.reshape(out_features // INT4_TILE_ROWS, 2, INT4_TILE_ROWS // 2, in_features)
    tiles = (rows[:, 0] | (rows[:, 1] << 4)).transpose(1, 2).contiguous()
    pairs = torch.stack((scale, minimum)).reshape(
        2, out_features // INT4_TILE_ROWS, INT4_TILE_ROWS, in_features // group_size
    )
    return tiles, pairs.permute(1, 3, 0, 2).to(torch.float16).contiguous()


def read_spec(model_dir: str | Path) -> QuantSpec | None:
    """The scheme a model directory's ``config.json`` says its weights are in (None when it
    has no ``quantization_config``).

    Raises :class:`ModelError` naming the file and field when the config is quantized some
    other way (GPTQ, AWQ, ...) or its ``kunlun`` entry is malformed.
    """
    path = Path(model_dir) / "config.json"
    try:
        raw = json.loads(path.read_text(encoding="utf-8")).get("quantization_config")
    except (OSError, ValueError, AttributeError):
        return None  # the config's own reader reports an unreadable config.json
    if raw is None:
        return None
    where = Location(str(path), field="quantization_config")
    if not isinstance(raw, dict) or raw.get("quant_method") != QUANT_METHOD:
        method = raw.get("quant_method") if isinstance(raw, dict) else raw
        raise ModelError(
            f"weights quantized with quant_method={method!r} cannot be loaded by the engine; "
            f"it reads quant_method={QUANT_METHOD!r} (see kunlun-cli model quantize)",
            location=where,
        )
    scheme = raw.get("scheme")
    group = raw.get("group_size")
    if scheme not in BITS or (scheme == "w4a16") != (group in GROUP_SIZES):
        raise ModelError(
            f"quantization_config scheme={scheme!r} group_size={group!r} is invalid; expected "
            f"one of {', '.join(BITS)}, with group_size {GROUP_SIZES} for w4a16 only",
            location=where,
        )
    return QuantSpec(scheme, group if scheme == "w4a16" else None)


def _group_size(spec: QuantSpec) -> int:
    if spec.group_size is None:
        raise ConfigError("w4a16 needs a group size; fit_group_size chooses one for a model")
    return spec.group_size


def layer_widths(config: HFConfig) -> dict[str, int]:
    """Input width of each quantized projection of one decoder layer of ``config``."""
    attention = config.num_attention_heads * config.head_dim
    widths = {name: config.hidden_size for name in LINEAR_NAMES}
    return {**widths, "o_proj": attention, "down_proj": config.intermediate_size}


def resolve_spec(
    model_dir: str | Path, scheme: str, group_size: int | None, config: HFConfig
) -> QuantSpec | None:
    """The quantization the engine runs ``model_dir`` in, asked ``scheme`` / ``group_size``.

    A checkpoint in this module's format runs in its own scheme; asking ``"none"`` or the same
    scheme agrees with it, asking another raises :class:`ConfigError` naming both. A floating
    checkpoint runs as asked (quantized while loading), the group size fitted to the layers.
    """
    asked = make_spec(scheme, group_size)
    stored = read_spec(model_dir)
    if stored is not None:
        if asked is not None and (
            not schemes.agrees(asked.scheme, stored.scheme)
            or asked.group_size not in (None, stored.group_size)
        ):
            raise ConfigError(
                f"quantization={asked.describe()} was asked but {model_dir} holds "
                f"{stored.describe()} weights"
            )
        return stored
    return None if asked is None else fit_group_size(asked, layer_widths(config))
