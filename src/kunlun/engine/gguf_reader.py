"""A reader for GGUF v2/v3 files: header, metadata, tensor table, and dequantization.

The layout (little-endian): ``b"GGUF"``, ``version`` u32, ``tensor_count`` u64,
``kv_count`` u64; then ``kv_count`` key/value pairs (key string, value type u32, value); then
``tensor_count`` tensor infos (name, ``n_dims`` u32, dims u64 each with the fastest-varying
first, ggml type u32, data offset u64); then, aligned to ``general.alignment`` (32 by
default), the tensor data, which is memory-mapped rather than read.

The file is untrusted input. Every count and length read from it is checked against the
bytes left before anything is allocated from it; metadata arrays nest at most
:data:`MAX_ARRAY_DEPTH` deep and hold at most :data:`MAX_ARRAY_ITEMS` items; every tensor has at most :data:`MAX_DIMS` dimensions, none of
them 0, a known ggml type whose block divides its rows, an aligned offset, and data that
lies inside the file without overlapping another tensor's; every quantized block read has
finite scales. Whatever breaks a rule raises :class:`~kunlun.errors.CorruptWeights` naming the
file, the key or tensor, and the values. The block formats themselves are
:mod:`kunlun.engine.gguf_blocks`'.
"""

from __future__ import annotations

import mmap
import struct
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import torch

from kunlun.engine.gguf_blocks import (
    DEQUANTIZE,
    W4A16_TYPES,
    Q4Fields,
    first_non_finite_scale,
)
from kunlun.errors import CorruptWeights, Location, ModelError

MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_ARRAY_DEPTH = 8
"""Deepest nesting of metadata arrays read (llama.cpp itself reads no nested array)."""
MAX_ARRAY_ITEMS = 1 << 24
"""Most items a metadata array may have (a vocabulary has a few hundred thousand)."""
MAX_DIMS = 4
"""Most dimensions a tensor may have (ggml's ``GGML_MAX_DIMS``)."""
CHUNK_BLOCKS = 1 << 16
"""Blocks decoded at a time, which bounds the temporary memory of a large tensor."""

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
#: Fewest bytes a metadata value of each type takes (a string: its length; an array: item
#: type and count), to check a count against the bytes left before reading its items.
_MIN_SIZE: dict[int, int] = {
    **{kind: struct.calcsize(fmt) for kind, fmt in _SCALARS.items()},
    _STRING: 8,
    _ARRAY: 12,
}
_MIN_KV_BYTES = 8 + 4 + 1
"""Fewest bytes a key/value pair takes: key length, value type, a one-byte value."""
_MIN_TENSOR_INFO_BYTES = 8 + 4 + 4 + 8
"""Fewest bytes a tensor info takes: name length, n_dims, type, offset."""


@dataclass(frozen=True)
class GGMLType:
    """A ggml tensor type: its name and block layout."""

    name: str
    block_elements: int
    """Elements per block (1 for the plain float and integer types)."""
    block_bytes: int
    """Bytes per block."""


#: ggml type id -> its name and block size (ggml.h / ggml.c's type traits).
GGML_TYPES: dict[int, GGMLType] = {
    0: GGMLType("F32", 1, 4),
    1: GGMLType("F16", 1, 2),
    2: GGMLType("Q4_0", 32, 18),
    3: GGMLType("Q4_1", 32, 20),
    6: GGMLType("Q5_0", 32, 22),
    7: GGMLType("Q5_1", 32, 24),
    8: GGMLType("Q8_0", 32, 34),
    9: GGMLType("Q8_1", 32, 40),
    10: GGMLType("Q2_K", 256, 84),
    11: GGMLType("Q3_K", 256, 110),
    12: GGMLType("Q4_K", 256, 144),
    13: GGMLType("Q5_K", 256, 176),
    14: GGMLType("Q6_K", 256, 210),
    15: GGMLType("Q8_K", 256, 292),
    16: GGMLType("IQ2_XXS", 256, 66),
    17: GGMLType("IQ2_XS", 256, 74),
    18: GGMLType("IQ3_XXS", 256, 98),
    19: GGMLType("IQ1_S", 256, 50),
    20: GGMLType("IQ4_NL", 32, 18),
    21: GGMLType("IQ3_S", 256, 110),
    22: GGMLType("IQ2_S", 256, 82),
    23: GGMLType("IQ4_XS", 256, 136),
    24: GGMLType("I8", 1, 1),
    25: GGMLType("I16", 1, 2),
    26: GGMLType("I32", 1, 4),
    27: GGMLType("I64", 1, 8),
    28: GGMLType("F64", 1, 8),
    29: GGMLType("IQ1_M", 256, 56),
    30: GGMLType("BF16", 1, 2),
    34: GGMLType("TQ1_0", 256, 54),
    35: GGMLType("TQ2_0", 256, 66),
    39: GGMLType("MXFP4", 32, 17),
}


@dataclass(frozen=True)
class GGUFTensorInfo:
    """One entry of the tensor table (checked: known type, data inside the file)."""

    name: str
    """Tensor name, llama.cpp style (``blk.0.attn_q.weight``)."""
    shape: tuple[int, ...]
    """Shape in torch order (slowest-varying first), i.e. the file's dims reversed."""
    ggml_type: int
    """ggml type id (see :data:`GGML_TYPES`)."""
    offset: int
    """Byte offset of the data from the start of the file."""

    @property
    def type_name(self) -> str:
        """The ggml type's name, or ``"type<N>"`` for an unknown id."""
        known = GGML_TYPES.get(self.ggml_type)
        return known.name if known else f"type{self.ggml_type}"

    @property
    def num_elements(self) -> int:
        """Elements in the tensor."""
        count = 1
        for dim in self.shape:
            count *= dim
        return count

    @property
    def num_bytes(self) -> int:
        """Bytes of its data (its type must be known)."""
        kind = GGML_TYPES[self.ggml_type]
        return self.num_elements // kind.block_elements * kind.block_bytes


class _Cursor:
    """Sequential little-endian reads from a memory-mapped file, with errors naming it and
    what was being read (:attr:`field`: a metadata key or a tensor name)."""

    def __init__(self, buffer: mmap.mmap, path: Path) -> None:
        self.buffer = buffer
        self.path = path
        self.pos = 0
        self.field: str | None = None

    def fail(self, message: str) -> NoReturn:
        raise CorruptWeights(message, location=Location(str(self.path), field=self.field))

    @property
    def remaining(self) -> int:
        return len(self.buffer) - self.pos

    def _need(self, size: int) -> None:
        if size > self.remaining:
            self.fail(f"GGUF file is truncated at byte {self.pos} (needs {size} more bytes)")

    def fits(self, count: int, item_bytes: int, what: str) -> None:
        """Refuse ``count`` items of at least ``item_bytes`` each that the file cannot hold."""
        if count * item_bytes > self.remaining:
            self.fail(
                f"{what}: {count} of them need at least {count * item_bytes} bytes but only "
                f"{self.remaining} remain (GGUF file is truncated or the count is corrupt)"
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
        if len(items) != count or pos > end:
            self._need(end + 1 - self.pos)
        self.pos = pos
        return items

    def value(self, value_type: int, depth: int = 0) -> Any:
        if value_type in _SCALARS:
            return self.unpack(_SCALARS[value_type])
        if value_type == _STRING:
            return self.string()
        if value_type != _ARRAY:
            self.fail(f"unknown GGUF metadata value type {value_type}")
        if depth >= MAX_ARRAY_DEPTH:
            self.fail(f"metadata arrays nested more than {MAX_ARRAY_DEPTH} deep")
        item_type = self.unpack("<I")
        count = self.unpack("<Q")
        if item_type not in _MIN_SIZE:
            self.fail(f"unknown GGUF metadata value type {item_type} (array items)")
        if count > MAX_ARRAY_ITEMS:
            self.fail(f"metadata array of {count} items; at most {MAX_ARRAY_ITEMS} are read")
        self.fits(count, _MIN_SIZE[item_type], "array items")
        if item_type in _SCALARS:
            fmt = _SCALARS[item_type]
            return list(struct.unpack(f"<{count}{fmt[1]}", self.read(_MIN_SIZE[item_type] * count)))
        if item_type == _STRING:
            return self._strings(count)
        return [self.value(item_type, depth + 1) for _ in range(count)]


class GGUFFile:
    """A parsed GGUF file: ``metadata`` (key -> value) and ``tensors`` (name -> info)."""

    def __init__(self, path: str | Path) -> None:
        """Parse and check the header of ``path``; raises :class:`CorruptWeights` naming
        the file and the key or tensor at fault."""
        self.path = Path(path)
        try:
            with self.path.open("rb") as handle:
                self._map = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError) as exc:
            reason = "the file is empty" if isinstance(exc, ValueError) else str(exc)
            raise CorruptWeights(
                f"cannot map GGUF file: {reason}", location=Location(str(path))
            ) from None
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
        cursor.fits(num_kv, _MIN_KV_BYTES, "metadata keys (kv_count)")
        cursor.fits(num_tensors, _MIN_TENSOR_INFO_BYTES, "tensor infos (tensor_count)")
        self.metadata: dict[str, Any] = {}
        """Metadata key -> value (arrays as lists)."""
        for index in range(num_kv):
            cursor.field = f"metadata key #{index}"
            key = cursor.string()
            cursor.field = key
            if key in self.metadata:
                cursor.fail(f"metadata key {key!r} appears twice")
            self.metadata[key] = cursor.value(cursor.unpack("<I"))
        alignment = self._alignment(cursor)
        infos = [self._tensor_info(cursor, index) for index in range(num_tensors)]
        self.data_start = (cursor.pos + alignment - 1) // alignment * alignment
        self.tensors: dict[str, GGUFTensorInfo] = {}
        """Tensor name -> its entry in the tensor table."""
        for name, shape, ggml_type, offset in infos:
            cursor.field = name
            if name in self.tensors:
                cursor.fail(f"tensor {name!r} appears twice in the tensor table")
            if offset % alignment:
                cursor.fail(f"tensor {name!r} offset {offset} is not a multiple of {alignment}")
            info = GGUFTensorInfo(name, shape, ggml_type, self.data_start + offset)
            self.tensors[name] = info
        self._check_extents(cursor)

    def _alignment(self, cursor: _Cursor) -> int:
        value = self.metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if type(value) is not int or value <= 0 or value & (value - 1) or value > 1 << 30:
            cursor.field = "general.alignment"
            cursor.fail(f"general.alignment must be a power of two up to 2^30, got {value!r}")
        return value

    @staticmethod
    def _tensor_info(cursor: _Cursor, index: int) -> tuple[str, tuple[int, ...], int, int]:
        cursor.field = f"tensor #{index}"
        name = cursor.string()
        cursor.field = name
        num_dims = cursor.unpack("<I")
        if not 1 <= num_dims <= MAX_DIMS:
            cursor.fail(f"tensor {name!r} has {num_dims} dimensions; 1 to {MAX_DIMS} are valid")
        dims = [cursor.unpack("<Q") for _ in range(num_dims)]
        ggml_type = cursor.unpack("<I")
        offset = cursor.unpack("<Q")
        if 0 in dims:
            cursor.fail(f"tensor {name!r} has a dimension of 0 (dims {dims})")
        kind = GGML_TYPES.get(ggml_type)
        if kind is None:
            cursor.fail(f"tensor {name!r} has unknown ggml type {ggml_type}")
        if dims[0] % kind.block_elements:
            cursor.fail(
                f"tensor {name!r} of type {kind.name} has rows of {dims[0]} elements, not a "
                f"multiple of its block of {kind.block_elements}"
            )
        return name, tuple(reversed(dims)), ggml_type, offset

    def _check_extents(self, cursor: _Cursor) -> None:
        """Every tensor's data lies inside the file and overlaps no other tensor's."""
        end_of_previous, previous = self.data_start, None
        for info in sorted(self.tensors.values(), key=lambda t: t.offset):
            cursor.field = info.name
            end = info.offset + info.num_bytes
            if end > len(self._map):
                cursor.fail(
                    f"tensor {info.name!r} ({info.type_name}, shape {list(info.shape)}, "
                    f"{info.num_bytes} bytes at byte {info.offset}) runs past the end of the "
                    f"file ({len(self._map)} bytes)"
                )
            if info.offset < end_of_previous:
                cursor.fail(f"tensor {info.name!r} overlaps tensor {previous!r}")
            end_of_previous, previous = end, info.name

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
        """Tensor ``name`` dequantized to float32, in torch shape.

        Raises :class:`ModelError` naming the tensor and its type when the type cannot be
        dequantized, and :class:`CorruptWeights` when a block's scale is not finite.
        """
        info = self.tensors[name]
        decode = DEQUANTIZE.get(info.ggml_type)
        if decode is None:
            raise ModelError(
                f"tensor {name!r} has ggml type {info.type_name}, which cannot be dequantized; "
                "supported: " + ", ".join(GGML_TYPES[t].name for t in DEQUANTIZE),
                location=Location(str(self.path), field=name),
            )
        blocks = self.blocks(info)
        out = torch.empty(blocks.shape[0], GGML_TYPES[info.ggml_type].block_elements)
        for start in range(0, blocks.shape[0], CHUNK_BLOCKS):
            out[start : start + CHUNK_BLOCKS] = decode(blocks[start : start + CHUNK_BLOCKS])
        return out.reshape(info.shape)

    def load_q4(self, name: str) -> Q4Fields:
        """Tensor ``name``, of a type in :data:`W4A16_TYPES`, as its 4-bit values and
        per-32 scales and minimums, shaped ``[rows, columns]`` and ``[rows, columns // 32]``
        (a 2-D tensor; the caller checks its type and shape)."""
        info = self.tensors[name]
        fields = W4A16_TYPES[info.ggml_type](self.blocks(info))
        rows = info.shape[0]
        return Q4Fields(
            fields.q.reshape(rows, -1), fields.scale.reshape(rows, -1), fields.min.reshape(rows, -1)
        )

    def blocks(self, info: GGUFTensorInfo) -> torch.Tensor:
        """The tensor's blocks, uint8 ``[num_blocks, block_bytes]`` viewing the file, after
        checking that every block's scales are finite (:class:`CorruptWeights` naming the
        tensor and the block otherwise)."""
        kind = GGML_TYPES[info.ggml_type]
        num_blocks = info.num_elements // kind.block_elements
        raw = self.raw(info, info.num_bytes).view(num_blocks, kind.block_bytes)
        for start in range(0, num_blocks, CHUNK_BLOCKS):
            bad = first_non_finite_scale(info.ggml_type, raw[start : start + CHUNK_BLOCKS])
            if bad is not None:
                raise CorruptWeights(
                    f"tensor {info.name!r} ({kind.name}) block {start + bad} has a scale that "
                    "is infinite or NaN",
                    location=Location(str(self.path), field=info.name),
                )
        return raw
