"""Casting a checkpoint once to the dtype a plan runs in, so later starts load it directly.

:func:`prepare_weights` returns the directory the engine should load: the model's own when its
floating-point weights are already in the plan's dtype, else ``target`` (an entry of the plan
cache), filled on the first start with every safetensors file cast to that dtype and links to
the model's other files (config, tokenizer). The directory appears atomically (built aside,
then renamed), so a start that died half-way leaves nothing that looks complete. The returned
line says which of the three happened; the worker logs it as ``conversion: ...``.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import time
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from kunlun.engine.loader import INDEX_FILE, checkpoint_files

#: Plan dtype -> (torch dtype, safetensors header dtype).
DTYPES: dict[str, tuple[torch.dtype, str]] = {
    "fp32": (torch.float32, "F32"),
    "bf16": (torch.bfloat16, "BF16"),
    "fp16": (torch.float16, "F16"),
}
_FLOATING = {"F64", "F32", "F16", "BF16"}
RECORD = "conversion.json"


def floating_dtypes(model_dir: str | Path) -> set[str]:
    """The safetensors dtypes (F32, BF16, ...) of the floating-point tensors, from the headers
    only (no tensor is read)."""
    found: set[str] = set()
    for path in checkpoint_files(model_dir):
        with path.open("rb") as handle:
            (size,) = struct.unpack("<Q", handle.read(8))
            header = json.loads(handle.read(size))
        found |= {v["dtype"] for k, v in header.items() if k != "__metadata__"} & _FLOATING
    return found


def prepare_weights(model_dir: str | Path, target: Path, dtype: str) -> tuple[Path, str]:
    """``(directory to load, log line)`` for running ``model_dir`` in ``dtype``."""
    source = Path(model_dir)
    torch_dtype, header_dtype = DTYPES[dtype]
    if floating_dtypes(source) <= {header_dtype}:
        return source, f"conversion: none (weights are already {dtype})"
    if (target / RECORD).is_file():
        return target, f"conversion: reused {target} ({dtype} weights cast on an earlier start)"
    started = time.perf_counter()
    staging = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    num_tensors = 0
    for path in checkpoint_files(source):
        tensors = {}
        with safe_open(str(path), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 - safe_open has no __iter__
                tensor = handle.get_tensor(name)
                tensors[name] = tensor.to(torch_dtype) if tensor.is_floating_point() else tensor
        save_file(tensors, str(staging / path.name), metadata={"format": "pt"})
        num_tensors += len(tensors)
    for entry in source.iterdir():
        if entry.suffix != ".safetensors" and entry.name != INDEX_FILE:
            (staging / entry.name).symlink_to(entry.resolve())
    if (source / INDEX_FILE).is_file():
        shutil.copyfile(source / INDEX_FILE, staging / INDEX_FILE)  # not its mode
    seconds = time.perf_counter() - started
    record = {"source": str(source), "dtype": dtype, "num_tensors": num_tensors, "seconds": seconds}
    (staging / RECORD).write_text(json.dumps(record))
    shutil.rmtree(target, ignore_errors=True)
    os.replace(staging, target)
    return target, (
        f"conversion: cast {num_tensors} tensors to {dtype} in {seconds:.2f} s -> {target}"
    )
