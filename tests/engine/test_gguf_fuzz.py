"""Crafted and fuzzed GGUF files: each bad one is a :class:`ModelError` naming the key or
tensor at fault, never another exception, a hang, or an allocation the file does not back.

The crafted cases change one field of a small complete llama GGUF (:mod:`gguf_bytes`) and
import it with :func:`import_gguf`, the path ``kunlun-cli model import-gguf`` and the daemon
take. The fuzzers import structurally valid-ish files with mutated fields, and random byte
flips and truncations of the same model written by the reference ``gguf`` package; the only
outcomes allowed are an import or a :class:`ModelError`.
"""

from __future__ import annotations

import itertools
import os
import shutil
import struct
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from tests.engine.gguf_bytes import (
    ARRAY,
    FLOAT32,
    GGUF,
    INT32,
    KV,
    Q4_1,
    STRING,
    UINT8,
    UINT32,
    UINT64,
    Array,
    Raw,
    gguf_bytes,
    nested_array,
    tiny_llama,
    write_with_gguf_package,
)

from kunlun.engine.gguf import import_gguf
from kunlun.engine.gguf_reader import GGUFFile
from kunlun.errors import CorruptWeights, ModelError

Q_PROJ = "blk.0.attn_q.weight"


def set_kv(key: str, value_type: int, value: Any) -> Callable[[GGUF], None]:
    def change(model: GGUF) -> None:
        model.kvs = [kv for kv in model.kvs if kv.key != key] + [KV(key, value_type, value)]

    return change


def set_tensor(name: str, **fields: Any) -> Callable[[GGUF], None]:
    def change(model: GGUF) -> None:
        model.tensors = [replace(t, **fields) if t.name == name else t for t in model.tensors]

    return change


def set_model(**fields: Any) -> Callable[[GGUF], None]:
    def change(model: GGUF) -> None:
        for name, value in fields.items():
            setattr(model, name, value)

    return change


def drop_tensor(name: str) -> Callable[[GGUF], None]:
    def change(model: GGUF) -> None:
        model.tensors = [t for t in model.tensors if t.name != name]

    return change


def duplicate_tensor(name: str) -> Callable[[GGUF], None]:
    def change(model: GGUF) -> None:
        model.tensors.append(model.tensor(name))

    return change


def overlap(model: GGUF) -> None:
    model.tensors[1].offset = 32  # inside the first tensor's data (at 0, 66 KiB long)


# (id, change, error class, field the error names, message pattern)
CASES: list[tuple[str, Callable[[GGUF], None], type[ModelError], str, str]] = [
    ("zero_heads", set_kv("llama.attention.head_count", UINT32, 0), ModelError,
     "llama.attention.head_count", r"an integer >= 1, got 0"),
    ("dims_0_2p62", set_tensor(Q_PROJ, dims=[0, 2**62]), CorruptWeights, Q_PROJ,
     r"dimension of 0"),
    ("dims_64_2p62", set_tensor(Q_PROJ, dims=[64, 2**62]), CorruptWeights, Q_PROJ,
     r"runs past the end of the file"),
    ("q4_k_rows_of_64", set_tensor(Q_PROJ, ggml_type=12, data=bytes(144)), CorruptWeights,
     Q_PROJ, r"Q4_K has rows of 64 elements, not a multiple of its block of 256"),
    ("q8_0_infinite_scale", set_tensor("blk.0.ffn_down.weight", ggml_type=8,
     data=(b"\x00\x7c" + bytes(32)) * 256), CorruptWeights, "blk.0.ffn_down.weight",
     r"\(Q8_0\) block 0 has a scale that is infinite or NaN"),
    ("q4_1_partial_block", set_tensor("output_norm.weight", dims=[48], ggml_type=Q4_1,
     data=bytes(40)), CorruptWeights, "output_norm.weight",
     r"Q4_1 has rows of 48 elements, not a multiple of its block of 32"),
    ("arrays_nested_50000", set_kv("general.nested", ARRAY, nested_array(50_000)), CorruptWeights,
     "general.nested", r"nested more than 8 deep"),
    ("offset_past_end", set_tensor(Q_PROJ, offset=2**40), CorruptWeights, Q_PROJ,
     r"runs past the end of the file"),
    ("offset_misaligned", set_tensor(Q_PROJ, offset=7), CorruptWeights, Q_PROJ,
     r"offset 7 is not a multiple of 32"),
    ("overlapping_tensors", overlap, CorruptWeights, "output_norm.weight", r"overlaps tensor"),
    ("huge_string_length", set_model(string_lengths={"llama": 2**62}), CorruptWeights,
     "general.architecture", r"truncated"),
    ("array_count_past_file", set_kv("tokenizer.ggml.merges", ARRAY,
     Array(STRING, [], count=2**23)), CorruptWeights, "tokenizer.ggml.merges",
     r"array items: 8388608 of them need at least 67108864 bytes"),
    ("huge_array_count", set_kv("tokenizer.ggml.merges", ARRAY, Array(STRING, [], count=2**40)),
     CorruptWeights, "tokenizer.ggml.merges", r"array of 1099511627776 items; at most"),
    ("unknown_value_type", set_kv("general.odd", 99, Raw(b"")), CorruptWeights, "general.odd",
     r"unknown GGUF metadata value type 99"),
    ("unknown_ggml_type", set_tensor(Q_PROJ, ggml_type=99), CorruptWeights, Q_PROJ,
     r"unknown ggml type 99"),
    ("five_dims", set_tensor(Q_PROJ, dims=[64, 64, 1, 1, 1]), CorruptWeights, Q_PROJ,
     r"5 dimensions; 1 to 4"),
    ("kv_count_past_file", set_model(num_kv=2**40), CorruptWeights, "", r"kv_count"),
    ("tensor_count_past_file", set_model(num_tensors=2**40), CorruptWeights, "",
     r"tensor_count"),
    ("alignment_zero", set_kv("general.alignment", UINT32, 0), CorruptWeights,
     "general.alignment", r"power of two"),
    ("duplicate_key", lambda m: m.kvs.append(m.kv("llama.block_count")), CorruptWeights,
     "llama.block_count", r"appears twice"),
    ("duplicate_tensor", duplicate_tensor("output_norm.weight"), CorruptWeights,
     "output_norm.weight", r"appears twice"),
    ("heads_a_string", set_kv("llama.attention.head_count", STRING, "4"), ModelError,
     "llama.attention.head_count", r"an integer >= 1, got '4'"),
    ("kv_heads_not_divisor", set_kv("llama.attention.head_count_kv", UINT32, 3), ModelError,
     "llama.attention.head_count_kv", r"a divisor of 4"),
    ("hidden_not_multiple", set_kv("llama.embedding_length", UINT32, 66), ModelError,
     "llama.embedding_length", r"a multiple of 4"),
    ("eps_negative", set_kv("llama.attention.layer_norm_rms_epsilon", FLOAT32, -1.0),
     ModelError, "llama.attention.layer_norm_rms_epsilon", r"positive finite"),
    ("block_count_2p62", set_kv("llama.block_count", UINT64, 2**62), ModelError,
     "llama.block_count", r"at most 1 for a file of 12 tensors"),
    ("shape_mismatch", set_tensor(Q_PROJ, dims=[64, 32], data=bytes(64 * 32 * 4)), ModelError,
     Q_PROJ, r"has shape \[32, 64\]; .* implies \[64, 64\]"),
    ("missing_tensor", drop_tensor("blk.0.ffn_down.weight"), ModelError,
     "blk.0.ffn_down.weight", r"is missing"),
    ("layer_past_block_count", lambda m: m.tensors.append(replace(
        m.tensor("blk.0.attn_norm.weight"), name="blk.7.attn_norm.weight")), ModelError,
     "blk.7.attn_norm.weight", r"not part of a llama model of 1 layers"),
    ("bos_out_of_range", set_kv("tokenizer.ggml.bos_token_id", UINT32, 10**6), ModelError,
     "tokenizer.ggml.bos_token_id", r"a token id in \[0, 260\)"),
    ("tokens_not_strings", set_kv("tokenizer.ggml.tokens", ARRAY, Array(INT32, [1, 2])),
     ModelError, "tokenizer.ggml.tokens", r"only strings; item 0 is 1"),
    ("merge_not_a_pair", set_kv("tokenizer.ggml.merges", ARRAY, Array(STRING, ["ĠĠ"])),
     ModelError, "tokenizer.ggml.merges", r"item 0 'ĠĠ' is not 'LEFT RIGHT'"),
    ("merge_outside_vocab", set_kv("tokenizer.ggml.merges", ARRAY, Array(STRING, ["zz qq"])),
     ModelError, "tokenizer.ggml.merges", r"do not fit the vocabulary"),
    ("bad_magic", set_model(magic=b"GGUG"), CorruptWeights, "", r"bad magic"),
    ("version_1", set_model(version=1), CorruptWeights, "", r"version 1 is not supported"),
]  # fmt: skip


def crafted(tmp_path: Path, change: Callable[[GGUF], None] | None = None) -> Path:
    model = tiny_llama()
    if change is not None:
        change(model)
    path = tmp_path / "crafted.gguf"
    path.write_bytes(gguf_bytes(model))
    return path


def test_tiny_llama_imports(tmp_path: Path) -> None:
    out = import_gguf(crafted(tmp_path), tmp_path / "out")
    assert (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file()


@pytest.mark.parametrize(
    ("change", "error", "field", "pattern"),
    [case[1:] for case in CASES],
    ids=[case[0] for case in CASES],
)
def test_crafted_gguf_is_a_clear_error(
    tmp_path: Path,
    change: Callable[[GGUF], None],
    error: type[ModelError],
    field: str,
    pattern: str,
) -> None:
    path = crafted(tmp_path, change)
    with pytest.raises(error, match=pattern) as info:
        import_gguf(path, tmp_path / "out")
    assert str(path) in str(info.value)
    assert field in str(info.value)
    assert info.value.location is not None and info.value.location.field == (field or None)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("size", [0, 3, 4, 8, 23, 100, 5000, 200_000])
def test_truncated_gguf_is_a_clear_error(tmp_path: Path, size: int) -> None:
    path = tmp_path / "short.gguf"
    path.write_bytes(gguf_bytes(tiny_llama())[:size])
    with pytest.raises(CorruptWeights, match=r"empty|truncated|bad magic|past the end") as info:
        import_gguf(path, tmp_path / "out")
    assert str(path) in str(info.value)


# ---- fuzzing ----

FUZZ_EXAMPLES = int(os.environ.get("KUNLUN_FUZZ_EXAMPLES", "300"))
"""Examples per fuzzer (about 35 s for both on a loaded 2-core machine)."""
FUZZ = settings(
    max_examples=FUZZ_EXAMPLES,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
_names = itertools.count()


def import_or_model_error(folder: Path, data: bytes) -> None:
    """Import ``data``: the only outcomes allowed are an import or a :class:`ModelError`
    naming the file."""
    index = next(_names)
    path, out = folder / f"fuzz-{index}.gguf", folder / f"out-{index}"
    path.write_bytes(data)
    try:
        import_gguf(path, out)
        event("imported")
    except ModelError as exc:
        assert exc.location is not None and str(path) in str(exc)
        event(f"refused: {exc.code}")
    finally:
        path.unlink()
        shutil.rmtree(out, ignore_errors=True)


def _tiny_llama_fields() -> list[tuple[str, int]]:
    """``(kind, index)`` of every field a mutation can hit."""
    model = tiny_llama()
    return [("kv", i) for i in range(len(model.kvs))] + [
        ("tensor", i) for i in range(len(model.tensors))
    ]


EDGE_INTS = st.sampled_from([0, 1, 2, 3, 31, 32, 33, 255, 2**31, 2**32 - 1, 2**32, 2**62])
UINT64S = st.one_of(EDGE_INTS, st.integers(0, 2**64 - 1))
SCALARS = st.one_of(
    st.tuples(st.just(UINT32), st.integers(0, 2**32 - 1)),
    st.tuples(st.just(INT32), st.integers(-(2**31), 2**31 - 1)),
    st.tuples(st.just(UINT64), UINT64S),
    st.tuples(st.just(FLOAT32), st.floats(width=32)),
    st.tuples(st.just(STRING), st.text(max_size=8)),
    st.tuples(st.just(UINT8), st.integers(0, 255)),
)
VALUES = st.one_of(
    SCALARS,
    st.tuples(
        st.just(ARRAY),
        st.builds(
            Array,
            st.sampled_from([UINT8, UINT32, STRING, ARRAY, 13, 99]),
            st.just([]),
            st.one_of(st.none(), UINT64S),
        ),
    ),
    st.integers(1, 200).map(lambda depth: (ARRAY, nested_array(depth))),
)


@st.composite
def mutated_tiny_llama(draw: st.DrawFn) -> bytes:
    model = tiny_llama()
    fields = _tiny_llama_fields()
    for _ in range(draw(st.integers(1, 3))):
        kind, index = draw(st.sampled_from(fields))
        if kind == "kv":
            kv = model.kvs[index]
            value_type, value = draw(VALUES)
            model.kvs[index] = KV(kv.key, value_type, value)
        else:
            tensor = model.tensors[index]
            choice = draw(st.sampled_from(["dims", "type", "offset", "data", "name"]))
            if choice == "dims":
                tensor.dims = draw(st.lists(UINT64S, max_size=6))
            elif choice == "type":
                tensor.ggml_type = draw(st.integers(0, 45))
            elif choice == "offset":
                tensor.offset = draw(UINT64S)
            elif choice == "data":
                tensor.data = tensor.data[: draw(st.integers(0, len(tensor.data)))]
            else:
                tensor.name = model.tensors[draw(st.integers(0, len(model.tensors) - 1))].name
    if draw(st.booleans()):
        setattr(model, draw(st.sampled_from(["num_kv", "num_tensors"])), draw(UINT64S))
    if draw(st.integers(0, 9)) == 0:
        model.version = draw(st.integers(0, 5))
    if draw(st.integers(0, 9)) == 0:
        model.string_lengths = {model.kvs[0].key: draw(UINT64S)}
    return gguf_bytes(model)


@FUZZ
@given(data=mutated_tiny_llama())
def test_fuzz_mutated_fields(data: bytes, tmp_path: Path) -> None:
    import_or_model_error(tmp_path, data)


@pytest.fixture(scope="module")
def reference_gguf(tmp_path_factory: pytest.TempPathFactory) -> tuple[bytes, int]:
    """The tiny llama as the ``gguf`` package writes it, and where its tensor data starts."""
    path = write_with_gguf_package(tmp_path_factory.mktemp("reference") / "tiny.gguf")
    return path.read_bytes(), GGUFFile(path).data_start


@FUZZ
@given(
    flips=st.lists(st.tuples(st.floats(0, 1, exclude_max=True), st.integers(0, 255)), max_size=8),
    header_bias=st.booleans(),
    cut=st.one_of(st.none(), st.floats(0, 1)),
)
def test_fuzz_byte_flips_of_reference_file(
    reference_gguf: tuple[bytes, int],
    tmp_path: Path,
    flips: list[tuple[float, int]],
    header_bias: bool,
    cut: float | None,
) -> None:
    original, data_start = reference_gguf
    data = bytearray(original)
    span = data_start if header_bias else len(data)  # mostly the header: that is what is parsed
    for where, value in flips:
        data[int(where * span)] = value
    if cut is not None:
        del data[int(cut * len(data)) :]
    import_or_model_error(tmp_path, bytes(data))


def test_reference_file_flipped_in_a_count_is_a_clear_error(
    reference_gguf: tuple[bytes, int], tmp_path: Path
) -> None:
    data = bytearray(reference_gguf[0])
    data[16:24] = struct.pack("<Q", 2**63)  # kv_count
    path = tmp_path / "count.gguf"
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptWeights, match=r"kv_count"):
        GGUFFile(path)
