"""A reader for GGUF v2/v3 files: header, metadata, tensor table, and dequantization.

The layout (little-endian): ``b"GGUF"``, ``version`` u32, ``tensor_count`` u64,
``kv_count`` u64; then ``kv_count`` key/value pairs (key string, value type u32, value); then
``tensor_count`` tensor infos (name, ``n_dims`` u32, dims u64 each with the fastest-varying
first, ggml type u32, data offset u64); then, aligned to ``general.alignment`` (32 by
default), the tensor data, which is memory-mapped rather than read.
"""

from __future__ import annotations

import mmap
import struct
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kunlun.errors import CorruptWeights, Location, ModelError

MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32

# metadata value types
_SCALARS: dict[int, str] = {
    0: "<B",
    1: "<b",
    2: "<H",
    3: "<h",
    4: "<I",
    5: "<i",
    6: "<f",
    7: "<?",
    10: "<Q",
    11: "<q",
    12: "<d",
}
_STRING = 8
_ARRAY = 9

#: ggml tensor type id -> name, for the types this module knows how to size or name.
GGML_TYPE_NAMES: dict[int, str] = {
    0: "F32",
    1: "F16",
    2: "Q4_0",
    3: "Q4_1",
    6: "Q5_0",
    7: "Q5_1",
    8: "Q8_0",
    9: "Q8_1",
    10: "Q2_K",
    11: "Q3_K",
    12: "Q4_K",
    13: "Q5_K",
    14: "Q6_K",
    15: "Q8_K",
    30: "BF16",
}

#: ggml type -> (elements per block, bytes per block) for the types :func:`dequantize` reads.
_BLOCKS: dict[int, tuple[int, int]] = {
    0: (1, 4),
    1: (1, 2),
    30: (1, 2),
    2: (32, 18),
    3: (32, 20),
    8: (32, 34),
}


@dataclass(frozen=True)
class GGUFTensorInfo:
    """One entry of the tensor table."""

    name: str
    """Tensor name, llama.cpp style (``blk.0.attn_q.weight``)."""
    shape: tuple[int, ...]
    """Shape in torch order (slowest-varying first), i.e. the file's dims reversed."""
    ggml_type: int
    """ggml type id (see :data:`GGML_TYPE_NAMES`)."""
    offset: int
    """Byte offset of the data from the start of the file."""

    @property
    def type_name(self) -> str:
        """The ggml type's name, or ``"type<N>"`` for an unknown id."""
        return GGML_TYPE_NAMES.get(self.ggml_type, f"type{self.ggml_type}")

    @property
    def num_elements(self) -> int:
        """Elements in the tensor."""
        count = 1
        for dim in self.shape:
            count *= dim
        return count


class _Cursor:
    """Sequential little-endian reads from a memory-mapped file, with errors naming it."""

    def __init__(self, buffer: mmap.mmap, path: Path) -> None:
        self.buffer = buffer
        self.path = path
        self.pos = 0

    def _need(self, size: int) -> None:
        if self.pos + size > len(self.buffer):
            raise CorruptWeights(
                f"GGUF file is truncated at byte {self.pos}", location=Location(str(self.path))
            )

    def read(self, size: int) -> bytes:
        self._need(size)
        data = self.buffer[self.pos : self.pos + size]
        self.pos += size
        return data

    def unpack(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        self._need(size)
        value = struct.unpack_from(fmt, self.buffer, self.pos)[0]
        self.pos += size
        return value

    def string(self) -> str:
        return self.read(self.unpack("<Q")).decode("utf-8", errors="replace")

    def _strings(self, count: int) -> list[str]:
        """``count`` strings in a row (vocabularies: a tight loop, this is the slow part)."""
        buffer, pos, end = self.buffer, self.pos, len(self.buffer)
        unpack_from = struct.unpack_from
        items: list[str] = []
        append = items.append
        for _ in range(count):
            if pos + 8 > end:
                break
            (size,) = unpack_from("<Q", buffer, pos)
            pos += 8
            append(buffer[pos : pos + size].decode("utf-8", errors="replace"))
            pos += size
        self.pos = pos
        if len(items) != count or pos > end:
            self._need(end + 1 - self.pos)
        return items

    def value(self, value_type: int) -> Any:
        if value_type in _SCALARS:
            return self.unpack(_SCALARS[value_type])
        if value_type == _STRING:
            return self.string()
        if value_type == _ARRAY:
            item_type = self.unpack("<I")
            count = self.unpack("<Q")
            if item_type in _SCALARS:
                fmt = _SCALARS[item_type]
                size = struct.calcsize(fmt)
                return list(struct.unpack(f"<{count}{fmt[1]}", self.read(size * count)))
            if item_type == _STRING:
                return self._strings(count)
            return [self.value(item_type) for _ in range(count)]
        raise CorruptWeights(
            f"unknown GGUF metadata value type {value_type}", location=Location(str(self.path))
        )


class GGUFFile:
    """A parsed GGUF file: ``metadata`` (key -> value) and ``tensors`` (name -> info)."""

    def __init__(self, path: str | Path) -> None:
        """Parse the header of ``path``; raises :class:`CorruptWeights` naming the file."""
        self.path = Path(path)
        try:
            with self.path.open("rb") as handle:
                self._map = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError) as exc:
            raise CorruptWeights(
                f"cannot map GGUF file: {exc}", location=Location(str(path))
            ) from exc
        cursor = _Cursor(self._map, self.path)
        if cursor.read(4) != MAGIC:
            raise CorruptWeights("not a GGUF file (bad magic)", location=Location(str(path)))
        self.version: int = cursor.unpack("<I")
        if self.version not in SUPPORTED_VERSIONS:
            raise CorruptWeights(
                f"GGUF version {self.version} is not supported; supported: "
                + ", ".join(map(str, SUPPORTED_VERSIONS)),
                location=Location(str(path)),
            )
        num_tensors = cursor.unpack("<Q")
        num_kv = cursor.unpack("<Q")
        self.metadata: dict[str, Any] = {}
        """Metadata key -> value (arrays as lists)."""
        for _ in range(num_kv):
            key = cursor.string()
            self.metadata[key] = cursor.value(cursor.unpack("<I"))
        infos = [self._tensor_info(cursor) for _ in range(num_tensors)]
        alignment = int(self.metadata.get("general.alignment", DEFAULT_ALIGNMENT))
        self.data_start = (cursor.pos + alignment - 1) // alignment * alignment
        self.tensors: dict[str, GGUFTensorInfo] = {
            name: GGUFTensorInfo(name, shape, ggml_type, self.data_start + offset)
            for name, shape, ggml_type, offset in infos
        }
        """Tensor name -> its entry in the tensor table."""

    @staticmethod
    def _tensor_info(cursor: _Cursor) -> tuple[str, tuple[int, ...], int, int]:
        name = cursor.string()
        num_dims = cursor.unpack("<I")
        dims = [cursor.unpack("<Q") for _ in range(num_dims)]
        return name, tuple(reversed(dims)), cursor.unpack("<I"), cursor.unpack("<Q")

    def raw(self, info: GGUFTensorInfo, num_bytes: int) -> torch.Tensor:
        """The tensor's bytes as a uint8 tensor viewing the memory-mapped file."""
        if info.offset + num_bytes > len(self._map):
            raise CorruptWeights(
                f"tensor {info.name!r} runs past the end of the file",
                location=Location(str(self.path), field=info.name),
            )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # read-only buffer: we never write to it
            return torch.frombuffer(
                self._map, dtype=torch.uint8, count=num_bytes, offset=info.offset
            )

    def load(self, name: str) -> torch.Tensor:
        """Tensor ``name`` dequantized to float32, in torch shape."""
        info = self.tensors[name]
        if info.ggml_type not in _BLOCKS:
            raise ModelError(
                f"tensor {name!r} has ggml type {info.type_name}, which cannot be dequantized; "
                "supported: F32, F16, BF16, Q8_0, Q4_0, Q4_1",
                location=Location(str(self.path), field=name),
            )
        block_elements, block_bytes = _BLOCKS[info.ggml_type]
        num_blocks = info.num_elements // block_elements
        raw = self.raw(info, num_blocks * block_bytes).view(num_blocks, block_bytes)
        return _DEQUANTIZE[info.ggml_type](raw).reshape(info.shape)


def _half(raw: torch.Tensor, start: int) -> torch.Tensor:
    """Column ``[start, start + 2)`` of each block, read as float16, as float32 [blocks, 1]."""
    return raw[:, start : start + 2].contiguous().view(torch.float16).float()


def _nibbles(raw: torch.Tensor) -> torch.Tensor:
    """The 32 4-bit values of each block's 16 bytes: low nibbles first, then high."""
    return torch.cat((raw & 0x0F, raw >> 4), dim=1).float()


def _q8_0(raw: torch.Tensor) -> torch.Tensor:
    return _half(raw, 0) * raw[:, 2:].contiguous().view(torch.int8).float()


def _q4_0(raw: torch.Tensor) -> torch.Tensor:
    return _half(raw, 0) * (_nibbles(raw[:, 2:]) - 8.0)


def _q4_1(raw: torch.Tensor) -> torch.Tensor:
    return _half(raw, 0) * _nibbles(raw[:, 4:]) + _half(raw, 2)


_DEQUANTIZE: dict[int, Callable[[torch.Tensor], torch.Tensor]] = {
    0: lambda raw: raw.contiguous().view(torch.float32).clone(),
    1: lambda raw: raw.contiguous().view(torch.float16).float(),
    30: lambda raw: raw.contiguous().view(torch.bfloat16).float(),
    2: _q4_0,
    3: _q4_1,
    8: _q8_0,
}
