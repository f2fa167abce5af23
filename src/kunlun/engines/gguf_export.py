"""An unquantized GGUF from a quantized one, for llama.cpp plans with ``quantization: none``.

A Kunlun plan says the dtype its engine computes in and the quantization of its weights.
llama.cpp computes in a GGUF file's own tensor types (and, for block-quantized weights,
quantizes the activations to 8 bits inside its dot products), so serving the demo's Q4_1
file under a plan that says ``fp32, quantization none`` would run something else than the
plan says. For such a plan the llama.cpp adapter serves this module's output instead: the
same GGUF (every metadata key, the tokenizer, the chat template) with each block-quantized
tensor dequantized to the plan's dtype (``fp32`` -> F32, ``fp16`` -> F16, ``bf16`` -> BF16);
tensors already in a float type keep theirs. It is written once per plan into the plan's
cache directory, next to a record of the source file's identity, and redone when the source
changes.

``python -m kunlun.engines.gguf_export --source S --out O --dtype D -- PROGRAM ARGS...``
writes ``O`` if needed, says so on stdout (the workload's log), then replaces itself with
``PROGRAM`` (llama-server): the conversion runs in the replica's own process, not in the
daemon, and the node agent supervises one process throughout.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from kunlun.engine.gguf_source import import_key

FLOAT_TYPES = {"fp32": ("F32", np.float32), "fp16": ("F16", np.float16), "bf16": ("BF16", None)}
"""Kunlun dtype -> (GGML tensor type, numpy dtype; None: written as raw bf16 bits)."""
#: ``general.file_type`` (llama.cpp's LLAMA_FTYPE) of an all-float file, per dtype.
FILE_TYPES = {"fp32": 0, "fp16": 1, "bf16": 32}
Q8_0_FILE_TYPE = 7
"""LLAMA_FTYPE_MOSTLY_Q8_0."""
FLOATS = (0, 1, 30)
"""GGML tensor types F32, F16 and BF16."""


def _bf16_bits(values: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns (round to nearest even), as uint16."""
    bits = values.astype(np.float32).view(np.uint32)
    rounded = bits + 0x7FFF + ((bits >> 16) & 1)
    return (rounded >> 16).astype(np.uint16)


def export_unquantized(source: Path, out: Path, dtype: str) -> bool:
    """Write ``out``: ``source`` with its quantized tensors in ``dtype``. False when ``out``
    is already that (its record matches the source's identity), True when written."""
    import gguf  # the GGUF reader and writer of the llama.cpp project (PyPI gguf)

    type_name, np_dtype = FLOAT_TYPES[dtype]
    target_type = gguf.GGMLQuantizationType[type_name]

    def convert(tensor: Any) -> tuple[np.ndarray, Any] | None:
        if tensor.tensor_type in FLOATS:
            return None
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        return (_bf16_bits(values) if np_dtype is None else values.astype(np_dtype)), target_type

    return _rewrite(source, out, dtype, FILE_TYPES[dtype], convert)


def export_q8_0(source: Path, out: Path) -> bool:
    """Write ``out``: ``source`` with every 2-D weight whose rows split into blocks of 32 in
    Q8_0 (llama.cpp's 8-bit type: a scale per 32 values), the others as they are; the 8-bit
    file llama.cpp would serve for an int8 comparison. False when ``out`` is already that."""
    import gguf

    q8 = gguf.GGMLQuantizationType.Q8_0

    def convert(tensor: Any) -> tuple[np.ndarray, Any] | None:
        shape = [int(n) for n in tensor.shape]  # GGUF order: the row length first
        if len(shape) != 2 or shape[0] % 32 or tensor.tensor_type == q8:
            return None
        values = (np.asarray(tensor.data, dtype=np.float32) if tensor.tensor_type in FLOATS
                  else gguf.quants.dequantize(tensor.data, tensor.tensor_type))  # fmt: skip
        return gguf.quants.quantize(values.reshape(shape[1], shape[0]), q8), q8

    return _rewrite(source, out, "q8_0", Q8_0_FILE_TYPE, convert)


def _rewrite(
    source: Path, out: Path, kind: str, file_type: int,
    convert: Callable[[Any], tuple[np.ndarray, Any] | None],
) -> bool:  # fmt: skip
    """``source`` written again as ``out`` with each tensor ``convert`` returns new data and a
    type for (None: kept as it is); skipped when ``out``'s record says it is that already."""
    import gguf

    record = out.with_suffix(".json")
    identity = {"source": str(source.resolve()), "dtype": kind, **import_key(source)}
    try:
        if out.is_file() and json.loads(record.read_text()) == identity:
            return False
    except (OSError, ValueError):
        pass
    reader = gguf.GGUFReader(source)
    arch = reader.get_field(gguf.Keys.General.ARCHITECTURE)
    if arch is None:
        raise ValueError(f"{source}: no {gguf.Keys.General.ARCHITECTURE} key")
    staging = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    writer = gguf.GGUFWriter(staging, str(arch.contents()), endianess=reader.endianess)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue  # written by the writer itself
        value = file_type if field.name == gguf.Keys.General.FILE_TYPE else field.contents()
        value_type = field.types[0]
        sub = field.types[-1] if value_type == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, value, value_type, sub_type=sub)
    if gguf.Keys.General.FILE_TYPE not in reader.fields:  # say what the file now holds
        writer.add_file_type(file_type)
    tensors = []
    for tensor in reader.tensors:
        converted = convert(tensor)
        data, ggml_type = converted or (np.asarray(tensor.data), tensor.tensor_type)
        writer.add_tensor_info(tensor.name, data.shape, data.dtype, data.nbytes, ggml_type)
        tensors.append(data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for data in tensors:
        writer.write_tensor_data(data)
    writer.close()
    os.replace(staging, out)
    record.write_text(json.dumps(identity, indent=2))
    return True


def main(argv: list[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if "--" not in args:
        raise SystemExit("usage: gguf_export --source S --out O --dtype D -- PROGRAM [ARGS...]")
    split = args.index("--")
    parser = argparse.ArgumentParser(prog="kunlun-gguf-export")
    parser.add_argument("--source", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--dtype", choices=sorted(FLOAT_TYPES), required=True)
    opts = parser.parse_args(args[:split])
    program = args[split + 1 :]
    started = time.monotonic()
    try:
        written = export_unquantized(opts.source, opts.out, opts.dtype)
    except (OSError, ValueError, KeyError, NotImplementedError) as exc:
        print(f"error: cannot write an unquantized {opts.dtype} GGUF from {opts.source}: "
              f"{type(exc).__name__}: {exc}", flush=True)  # fmt: skip
        raise SystemExit(2) from None
    what = "written" if written else "cached"
    print(f"conversion: {opts.source.name} -> {opts.out} ({opts.dtype}, {what}) in "
          f"{time.monotonic() - started:.2f} s", flush=True)  # fmt: skip
    if program:
        os.execv(program[0], program)


if __name__ == "__main__":
    main()
