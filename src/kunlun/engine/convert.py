"""Casting (and quantizing) a checkpoint once for a plan, so later starts load it directly.

:func:`prepare_weights` returns the directory the engine should load: the model's own when its
floating-point weights are already in the plan's dtype and quantization, else ``target`` (an
entry of the plan cache), filled on the first start with every safetensors file cast to that
dtype (and its decoder linear layers quantized, :mod:`kunlun.engine.quant`; for ``w8a8``
after the smoothing of :mod:`kunlun.engine.smooth`) and links to the
model's other files (tokenizer; a quantized copy writes its own ``config.json``). The
directory appears atomically (built aside, then renamed), so a start that died half-way leaves
nothing that looks complete. Its record (``conversion.json``) holds the SHA-256 of every file
written, taken as it was made: with ``--require-signed`` the daemon checks the directory
against them before sealing it (:meth:`kunlun.offline.integrity.ModelGuard.seal`). The
returned line says which of the three happened; the worker logs it as ``conversion: ...``.
:func:`write_quantized` is the same conversion for ``kunlun-cli model quantize``, which keeps
the result as a model of its own.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import time
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from kunlun.engine.loader import INDEX_FILE, checkpoint_files
from kunlun.engine.quant import (
    QuantSpec,
    fit_group_size,
    is_quantized_linear,
    make_spec,
    quantize,
    read_spec,
)
from kunlun.engine.smooth import smoothed_tensors
from kunlun.paths import CONVERSION_RECORD, remove_tree

#: Plan dtype -> (torch dtype, safetensors header dtype).
DTYPES: dict[str, tuple[torch.dtype, str]] = {
    "fp32": (torch.float32, "F32"),
    "bf16": (torch.bfloat16, "BF16"),
    "fp16": (torch.float16, "F16"),
}
_FLOATING = {"F64", "F32", "F16", "BF16"}
RECORD = CONVERSION_RECORD


def floating_dtypes(model_dir: str | Path) -> set[str]:
    """The safetensors dtypes (F32, BF16, ...) of the floating-point tensors, from the headers
    only (no tensor is read); quantization scales, which stay float32, do not count."""
    found: set[str] = set()
    for header in _headers(model_dir):
        found |= {v["dtype"] for k, v in header.items() if _castable(k)} & _FLOATING
    return found


def prepare_weights(
    model_dir: str | Path,
    target: Path,
    dtype: str,
    quantization: str = "none",
    group_size: int | None = None,
) -> tuple[Path, str]:
    """``(directory to load, log line)`` for running ``model_dir`` in ``dtype``, its linear
    layers quantized as ``quantization`` (``group_size`` for w4a16; a checkpoint already
    quantized keeps its scheme, see :func:`~kunlun.engine.quant.resolve_spec`)."""
    source = Path(model_dir)
    spec = make_spec(quantization, group_size)
    if read_spec(source) is not None:
        spec = None  # already quantized: only cast what is floating
    if spec is None and floating_dtypes(source) <= {DTYPES[dtype][1]}:
        return source, f"conversion: none (weights are already {dtype})"
    if (target / RECORD).is_file():
        what = dtype if spec is None else f"{dtype}, {spec.scheme}"
        return target, f"conversion: reused {target} ({what} weights from an earlier start)"
    record = write_quantized(source, target, dtype, spec, link_files=True)
    done = f"cast {record['num_tensors']} tensors to {dtype}"
    if spec is not None:
        done = f"quantized {record['num_quantized']} layers to {record['quantization']}, " + done
    return target, f"conversion: {done} in {record['seconds']:.2f} s -> {target}"


def write_quantized(
    source: Path, target: Path, dtype: str | None, spec: QuantSpec | None, *, link_files: bool
) -> dict[str, Any]:
    """Write ``source``'s checkpoint into ``target`` (replaced atomically): floating tensors
    cast to ``dtype`` (None: kept), decoder linear weights quantized by ``spec`` (the group size
    fitted to the layers), ``config.json`` with its ``quantization_config``. The model's other
    files are linked (``link_files``) or copied. Returns the record kept in ``target``."""
    started = time.perf_counter()
    if spec is not None:
        spec = fit_group_size(spec, _linear_widths(source))
    staging = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    num_tensors = num_quantized = 0
    index: dict[str, str] = {}
    replacements = smoothed_tensors(source, spec)
    for path in checkpoint_files(source):
        tensors = {}
        with safe_open(str(path), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 - safe_open has no __iter__
                tensor = replacements.get(name)
                if tensor is None:
                    tensor = handle.get_tensor(name)
                if spec is not None and is_quantized_linear(name):
                    prefix = name.removesuffix(".weight")
                    parts = quantize(tensor, spec).items()
                    tensors.update({f"{prefix}.{suffix}": part for suffix, part in parts})
                    num_quantized += 1
                elif dtype is not None and tensor.is_floating_point() and _castable(name):
                    tensors[name] = tensor.to(DTYPES[dtype][0])
                else:
                    tensors[name] = tensor
        save_file(tensors, str(staging / path.name), metadata={"format": "pt"})
        index.update(dict.fromkeys(tensors, path.name))
        num_tensors += len(tensors)
    rewritten = {"config.json"} if spec is not None else set()
    for entry in source.iterdir():
        if entry.suffix == ".safetensors" or entry.name in {INDEX_FILE, RECORD, *rewritten}:
            continue
        if link_files:
            (staging / entry.name).symlink_to(entry.resolve())
        elif entry.is_file():
            shutil.copyfile(entry, staging / entry.name)
    if (source / INDEX_FILE).is_file():
        (staging / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": index}))
    if spec is not None:
        config = json.loads((source / "config.json").read_text(encoding="utf-8"))
        config["quantization_config"] = spec.config()
        (staging / "config.json").write_text(json.dumps(config, indent=2))
    written = sorted(p for p in staging.iterdir() if p.is_file() and not p.is_symlink())
    hashes = {p.name: _sha256(p) for p in written}  # as made (the daemon's seal checks them)
    record = {"source": str(source), "dtype": dtype, "num_tensors": num_tensors,
              "quantization": None if spec is None else spec.describe(),
              "num_quantized": num_quantized, "seconds": time.perf_counter() - started,
              "sha256": hashes}  # fmt: skip
    (staging / RECORD).write_text(json.dumps(record))
    remove_tree(target)  # also a conversion the daemon sealed read-only
    os.replace(staging, target)
    return record


def _sha256(path: Path) -> str:
    with path.open("rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


def _castable(name: str) -> bool:
    """Whether a floating tensor follows the plan dtype (quantization scales stay float32)."""
    return name != "__metadata__" and not name.endswith((".weight_scale", ".weight_min"))


def _headers(model_dir: str | Path) -> list[dict[str, Any]]:
    headers = []
    for path in checkpoint_files(model_dir):
        with path.open("rb") as handle:
            (size,) = struct.unpack("<Q", handle.read(8))
            headers.append(json.loads(handle.read(size)))
    return headers


def _linear_widths(model_dir: Path) -> dict[str, int]:
    """Input width of every decoder linear weight, from the headers."""
    return {
        name: entry["shape"][1]
        for header in _headers(model_dir)
        for name, entry in header.items()
        if is_quantized_linear(name)
    }
