"""Load Hugging Face safetensors checkpoints into the engine's models.

A checkpoint is either one ``model.safetensors`` or shards listed by
``model.safetensors.index.json``. Checkpoint names map onto the model's parameters through
``model.checkpoint_slot`` (q/k/v and gate/up are fused on the way). When the checkpoint has
no ``lm_head.weight``, or the config ties embeddings, the LM head shares the embedding.
Under tensor parallelism each rank reads only its slice of each tensor (modules that are
split say which through ``checkpoint_slice(leaf, shard) -> (dim, start, length)``).

Quantized layers (:class:`~kunlun.engine.models.quant_linear.QuantLinear`) take either the
canonical tensors of :mod:`kunlun.engine.quant` or a floating-point ``weight``, which is
quantized on the way in (per checkpoint shard, so fused projections are exact); once every
tensor is in, each layer repacks them for its kernel.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Collection
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from kunlun.engine.models.layers import FusedLinear
from kunlun.engine.models.llama import LlamaForCausalLM
from kunlun.engine.models.quant_linear import QuantLinear
from kunlun.engine.quant import quantize
from kunlun.errors import CorruptWeights, Location, ModelError, ModelFileMissing

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
LM_HEAD = "lm_head.weight"

_Slice = tuple[int, int, int]
"""``(dim, start, length)``: the part of a checkpoint tensor one tensor-parallel rank holds."""


def checkpoint_files(model_dir: str | Path) -> dict[Path, list[str] | None]:
    """The safetensors files of ``model_dir``, each with the tensor names the index gives it.

    A single-file checkpoint maps to ``None`` (every tensor in it). Raises
    :class:`ModelFileMissing` naming the directory when neither layout is present, or a shard
    the index names is absent; :class:`CorruptWeights` when the index is not valid JSON.
    """
    root = Path(model_dir)
    index_path = root / INDEX_FILE
    if index_path.is_file():
        try:
            weight_map = json.loads(index_path.read_text(encoding="utf-8"))["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise CorruptWeights(
                f"cannot read the shard index: {exc}", location=Location(str(index_path))
            ) from exc
        files: dict[Path, list[str] | None] = {}
        for name, file_name in weight_map.items():
            names = files.setdefault(root / file_name, [])
            assert names is not None
            names.append(name)
        for path in files:
            if not path.is_file():
                raise ModelFileMissing(
                    f"shard {path.name!r} listed in {INDEX_FILE} not found: {path}",
                    location=Location(str(index_path)),
                )
        return files
    single = root / SINGLE_FILE
    if single.is_file():
        return {single: None}
    raise ModelFileMissing(
        f"no weights in {root}: expected {SINGLE_FILE} or {INDEX_FILE}",
        location=Location(str(root)),
    )


def stored_quantized_layers(model_dir: str | Path) -> set[str]:
    """The checkpoint names of the layers ``model_dir`` stores quantized (those with a
    ``weight_scale``), from the safetensors headers only (no tensor is read)."""
    found: set[str] = set()
    for path in checkpoint_files(model_dir):
        try:
            with path.open("rb") as handle:
                (size,) = struct.unpack("<Q", handle.read(8))
                names = json.loads(handle.read(size))
        except (OSError, ValueError, struct.error) as exc:
            raise CorruptWeights(
                f"cannot read the safetensors header of {path}: {exc}",
                location=Location(str(path)),
            ) from exc
        found |= {n.removesuffix(".weight_scale") for n in names if n.endswith(".weight_scale")}
    return found


def load_weights(
    model: LlamaForCausalLM,
    model_dir: str | Path,
    replacements: dict[str, torch.Tensor] | None = None,
    native_ops: Collection[str] = (),
) -> None:
    """Copy every parameter of ``model`` from the checkpoint in ``model_dir``; a checkpoint
    name in ``replacements`` takes that tensor instead of the file's (the smoothed weights of
    :func:`kunlun.engine.smooth.smoothed_tensors`; whole tensors, one rank only). Quantized
    layers are then prepared for their kernels (``native_ops``:
    :meth:`~kunlun.engine.models.quant_linear.QuantLinear.prepare`).

    Raises :class:`CorruptWeights` naming the file when a safetensors header cannot be read,
    and :class:`ModelError` naming the tensor and file when a tensor is missing or has the
    wrong shape.
    """
    params: dict[str, torch.Tensor] = dict(model.named_parameters(remove_duplicate=False))
    for module_name, module in model.named_modules():
        if isinstance(module, QuantLinear):
            params.update({f"{module_name}.{k}": v for k, v in module.canonical().items()})
    filled: set[tuple[str, str | None]] = set()
    seen: set[str] = set()
    files = checkpoint_files(model_dir)
    for path in files:
        seen.update(_load_file(model, params, path, filled, replacements or {}))
    if LM_HEAD not in seen:
        model.lm_head.weight = model.model.embed_tokens.weight
        filled.add((LM_HEAD, None))
    elif model.config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    _check_complete(model, params, filled, files)
    for module in model.modules():
        if isinstance(module, QuantLinear):
            module.prepare(native_ops)


def _load_file(
    model: LlamaForCausalLM,
    params: dict[str, torch.Tensor],
    path: Path,
    filled: set[tuple[str, str | None]],
    replacements: dict[str, torch.Tensor],
) -> set[str]:
    """Copy the tensors of one safetensors file (or their ``replacements``); returns the
    checkpoint names it held."""
    try:
        handle = safe_open(str(path), framework="pt")
    except (SafetensorError, OSError, ValueError) as exc:
        raise CorruptWeights(
            f"cannot read safetensors file {path}: {exc}", location=Location(str(path))
        ) from exc
    names: set[str] = set()
    modules = dict(model.named_modules())
    with handle:
        for name in handle.keys():  # noqa: SIM118 - safe_open has no __iter__
            names.add(name)
            param_name, shard = model.checkpoint_slot(name)
            module_name, _, leaf = param_name.rpartition(".")
            param = params.get(param_name)
            module = modules.get(module_name)
            replaced = replacements.get(name)
            tensor: torch.Tensor | None = None
            if isinstance(module, QuantLinear) and leaf == "weight":
                tensor = _read(handle, name, path) if replaced is None else replaced
                if tensor.is_floating_point():
                    _check_shape(tensor, module.float_shape(shard), name, path)
                    for suffix, part in quantize(tensor, module.spec).items():
                        target = f"{module_name}.{suffix}"
                        _copy(params[target], shard, part, module, name, path)
                        filled.add((target, shard))
                    continue
            if param is None or module is None:
                continue  # buffers such as rotary_emb.inv_freq, or a head the model ties
            piece = _rank_slice(module, leaf, shard)
            if replaced is not None:
                tensor = replaced.to(param.dtype)
            elif tensor is None:  # a quantized layer's int8 weight is read above already
                tensor = _read(handle, name, path, piece)
            _copy(param, shard, tensor, module, name, path, piece)
            filled.add((param_name, shard))
    return names


def _rank_slice(module: torch.nn.Module, leaf: str, shard: str | None) -> _Slice | None:
    """The part of a checkpoint tensor this rank holds, from the module's
    ``checkpoint_slice`` (None: the whole tensor)."""
    method = getattr(module, "checkpoint_slice", None)
    part: _Slice | None = None if method is None else method(leaf, shard)
    return part


def _read(handle: Any, name: str, path: Path, part: _Slice | None = None) -> torch.Tensor:
    """Tensor ``name``, or only its ``part`` (read from the file without the rest)."""
    try:
        if part is None:
            return handle.get_tensor(name)
        dim, start, length = part
        view = handle.get_slice(name)
        shape = view.get_shape()
        if dim >= len(shape) or (start == 0 and length == shape[dim]):
            return handle.get_tensor(name)  # a wrong shape: the shape check reports it
        index = (slice(None),) * dim + (slice(start, start + length),)
        return view[index]
    except (SafetensorError, OSError, ValueError) as exc:
        raise CorruptWeights(
            f"cannot read tensor {name!r} from {path}: {exc}",
            location=Location(str(path), field=name),
        ) from exc


def _copy(
    param: torch.Tensor,
    shard: str | None,
    tensor: torch.Tensor,
    module: torch.nn.Module,
    name: str,
    path: Path,
    part: _Slice | None = None,
) -> None:
    """Copy ``tensor`` into ``param`` (into its rows for ``shard`` when fused; into the
    rows of this rank's ``part`` under tensor parallelism)."""
    target = param.data
    if shard is not None and isinstance(module, FusedLinear | QuantLinear) and module.shards:
        start, rows = module.shard_offset(shard)
        target = target.narrow(0, start, rows)
    elif part is not None and part[2] < target.shape[part[0]]:
        target = target.narrow(part[0], 0, part[2])  # the padded last block of the vocabulary
    where = "" if part is None else f" (rank slice {part[1]}:{part[1] + part[2]} of dim {part[0]})"
    _check_shape(tensor, tuple(target.shape), name, path, where)
    with torch.no_grad():
        target.copy_(tensor)


def _check_shape(
    tensor: torch.Tensor, expected: tuple[int, ...], name: str, path: Path, where: str = ""
) -> None:
    if tuple(tensor.shape) != expected:
        raise ModelError(
            f"tensor {name!r}{where} has shape {tuple(tensor.shape)}, the model expects {expected}",
            location=Location(str(path), field=name),
        )


def _check_complete(
    model: LlamaForCausalLM,
    params: dict[str, torch.Tensor],
    filled: set[tuple[str, str | None]],
    files: dict[Path, list[str] | None],
) -> None:
    where = ", ".join(str(path) for path in files)
    for param_name in params:
        module_name = param_name.rsplit(".", 1)[0]
        module = model.get_submodule(module_name)
        shards = getattr(module, "shards", None)
        expected = [None] if shards is None else list(shards)
        for shard in expected:
            if (param_name, shard) in filled:
                continue
            tensor = param_name if shard is None else _unfused_name(param_name, shard)
            raise ModelError(
                f"tensor {tensor!r} not found in {where}",
                location=Location(where, field=tensor),
            )


def _unfused_name(param_name: str, shard: str) -> str:
    parts = param_name.split(".")
    parts[-2] = shard
    return ".".join(parts)
