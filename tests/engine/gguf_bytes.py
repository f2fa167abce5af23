"""GGUF files byte by byte, for crafting bad ones: every count, length, type and offset can
be set to a value the file does not back (the reference ``gguf`` writer checks what it
writes, so it cannot make most of them).

:func:`tiny_llama` describes a small but complete llama model that imports; tests change one
field of it and serialize it with :func:`gguf_bytes`; :func:`write_with_gguf_package` writes
the same model with the reference writer.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kunlun.engine.gguf_tokenizer import byte_alphabet

UINT8, INT8, UINT16, INT16, UINT32, INT32, FLOAT32, BOOL, STRING, ARRAY = range(10)
UINT64, INT64, FLOAT64 = 10, 11, 12
SCALAR_FORMATS = {
    UINT8: "<B",
    INT8: "<b",
    UINT16: "<H",
    INT16: "<h",
    UINT32: "<I",
    INT32: "<i",
    FLOAT32: "<f",
    BOOL: "<?",
    UINT64: "<Q",
    INT64: "<q",
    FLOAT64: "<d",
}
F32, F16, Q4_0, Q4_1, Q8_0 = 0, 1, 2, 3, 8


@dataclass
class Array:
    """A metadata array: its item type and items (an :class:`Array` per item when nested)."""

    item_type: int
    items: list[Any]
    count: int | None = None
    """The count written (default: ``len(items)``)."""


@dataclass
class Raw:
    """A value written as these bytes, whatever its type says."""

    data: bytes


def nested_array(depth: int) -> Raw:
    """An array holding an array ... ``depth`` levels deep, innermost ``[1]`` (u8)."""
    return Raw(struct.pack("<IQ", ARRAY, 1) * (depth - 1) + struct.pack("<IQB", UINT8, 1, 1))


@dataclass
class KV:
    key: str
    value_type: int
    value: Any


@dataclass
class Tensor:
    name: str
    dims: list[int]
    """File order: fastest-varying first."""
    ggml_type: int
    data: bytes = b""
    offset: int | None = None
    """Offset from the start of the data section (default: packed, aligned)."""


@dataclass
class GGUF:
    kvs: list[KV]
    tensors: list[Tensor]
    magic: bytes = b"GGUF"
    version: int = 3
    alignment: int = 32
    num_kv: int | None = None
    num_tensors: int | None = None
    string_lengths: dict[str, int] = field(default_factory=dict)
    """Override the length written before a string (key or value) with this text."""

    def kv(self, key: str) -> KV:
        return next(kv for kv in self.kvs if kv.key == key)

    def tensor(self, name: str) -> Tensor:
        return next(t for t in self.tensors if t.name == name)


def _string(text: str, lengths: dict[str, int]) -> bytes:
    data = text.encode("utf-8", errors="surrogatepass")
    return struct.pack("<Q", lengths.get(text, len(data))) + data


def _value(value_type: int, value: Any, lengths: dict[str, int]) -> bytes:
    if isinstance(value, Raw):
        return value.data
    if value_type in SCALAR_FORMATS:
        return struct.pack(SCALAR_FORMATS[value_type], value)
    if value_type == STRING:
        return _string(value, lengths)
    if value_type == ARRAY:
        count = len(value.items) if value.count is None else value.count
        head = struct.pack("<IQ", value.item_type, count)
        return head + b"".join(_value(value.item_type, item, lengths) for item in value.items)
    raise ValueError(f"value type {value_type} needs a Raw value")


def gguf_bytes(model: GGUF) -> bytes:
    """The file ``model`` describes, with its counts, lengths and offsets as given."""
    lengths = model.string_lengths
    out = bytearray(model.magic)
    out += struct.pack("<I", model.version)
    out += struct.pack("<Q", len(model.tensors) if model.num_tensors is None else model.num_tensors)
    out += struct.pack("<Q", len(model.kvs) if model.num_kv is None else model.num_kv)
    for kv in model.kvs:
        out += _string(kv.key, lengths) + struct.pack("<I", kv.value_type)
        out += _value(kv.value_type, kv.value, lengths)
    offsets, position = [], 0
    for tensor in model.tensors:
        offsets.append(position if tensor.offset is None else tensor.offset)
        position += -(-len(tensor.data) // model.alignment) * model.alignment
    for tensor, offset in zip(model.tensors, offsets, strict=True):
        out += _string(tensor.name, lengths) + struct.pack("<I", len(tensor.dims))
        out += b"".join(struct.pack("<Q", dim) for dim in tensor.dims)
        out += struct.pack("<IQ", tensor.ggml_type, offset)
    out += bytes(-len(out) % model.alignment)
    for tensor in model.tensors:
        out += tensor.data + bytes(-len(tensor.data) % model.alignment)
    return bytes(out)


HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, LAYERS = 64, 4, 2, 16, 128, 1
TOKENS = [*byte_alphabet().values(), "ĠĠ", "ĠĠĠĠ", "<|endoftext|>", "<|im_start|>"]
MERGES = ["Ġ Ġ", "ĠĠ ĠĠ"]


def llama_tensors(seed: int = 0) -> dict[str, np.ndarray]:
    """The tiny llama's weights by GGUF name, torch shape, float32."""
    rng = np.random.default_rng(seed)
    shapes = {
        "token_embd.weight": (len(TOKENS), HIDDEN),
        "output_norm.weight": (HIDDEN,),
        "output.weight": (len(TOKENS), HIDDEN),
    }
    for index in range(LAYERS):
        shapes |= {
            f"blk.{index}.attn_norm.weight": (HIDDEN,),
            f"blk.{index}.ffn_norm.weight": (HIDDEN,),
            f"blk.{index}.attn_q.weight": (HEADS * HEAD_DIM, HIDDEN),
            f"blk.{index}.attn_k.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
            f"blk.{index}.attn_v.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
            f"blk.{index}.attn_output.weight": (HIDDEN, HEADS * HEAD_DIM),
            f"blk.{index}.ffn_gate.weight": (FFN, HIDDEN),
            f"blk.{index}.ffn_up.weight": (FFN, HIDDEN),
            f"blk.{index}.ffn_down.weight": (HIDDEN, FFN),
        }
    return {name: rng.standard_normal(shape).astype(np.float32) for name, shape in shapes.items()}


def llama_metadata() -> list[KV]:
    return [
        KV("general.architecture", STRING, "llama"),
        KV("llama.block_count", UINT32, LAYERS),
        KV("llama.context_length", UINT32, 256),
        KV("llama.embedding_length", UINT32, HIDDEN),
        KV("llama.feed_forward_length", UINT32, FFN),
        KV("llama.attention.head_count", UINT32, HEADS),
        KV("llama.attention.head_count_kv", UINT32, KV_HEADS),
        KV("llama.attention.layer_norm_rms_epsilon", FLOAT32, 1e-5),
        KV("llama.rope.freq_base", FLOAT32, 10000.0),
        KV("tokenizer.ggml.model", STRING, "gpt2"),
        KV("tokenizer.ggml.pre", STRING, "smollm"),
        KV("tokenizer.ggml.tokens", ARRAY, Array(STRING, list(TOKENS))),
        KV("tokenizer.ggml.token_type", ARRAY, Array(INT32, [1] * (len(TOKENS) - 2) + [3, 3])),
        KV("tokenizer.ggml.merges", ARRAY, Array(STRING, list(MERGES))),
        KV("tokenizer.ggml.bos_token_id", UINT32, len(TOKENS) - 1),
        KV("tokenizer.ggml.eos_token_id", UINT32, len(TOKENS) - 2),
    ]


def tiny_llama() -> GGUF:
    """A complete 1-layer llama GGUF (F32 weights) that imports."""
    tensors = [
        Tensor(name, list(reversed(array.shape)), F32, array.tobytes())
        for name, array in llama_tensors().items()
    ]
    return GGUF(llama_metadata(), tensors)


def write_with_gguf_package(path: Path) -> Path:
    """:func:`tiny_llama` written by the reference ``gguf`` writer."""
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    for kv in llama_metadata():
        if kv.key == "general.architecture":
            continue
        if kv.value_type == ARRAY:
            writer.add_array(kv.key, kv.value.items)
        elif kv.value_type == STRING:
            writer.add_string(kv.key, kv.value)
        elif kv.value_type == FLOAT32:
            writer.add_float32(kv.key, kv.value)
        else:
            writer.add_uint32(kv.key, kv.value)
    for name, array in llama_tensors().items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
