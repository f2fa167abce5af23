"""K-quants against the reference ``gguf`` package: block dequantization bit for bit on
random valid blocks, bad scales refused, the tests' own K-quantizers checked, and K-quant
GGUFs of the demo model imported with the real ``kunlun-cli model import-gguf``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import gguf as gguf_py
import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from tests.engine.gguf_files import (
    QT,
    quantize_q4_k,
    quantize_q6_k,
    reference,
    unpack,
    write_demo_kquant_gguf,
)

from kunlun.engine.gguf import import_gguf
from kunlun.engine.gguf_blocks import SCALE_FIELDS
from kunlun.engine.gguf_reader import GGUFFile
from kunlun.errors import CorruptWeights

BLOCK_TYPES = [QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.Q8_0]
BLOCK_TYPES += [QT.Q2_K, QT.Q3_K, QT.Q4_K, QT.Q5_K, QT.Q6_K]
BIN = Path(sys.executable).parent


def random_blocks(qtype: QT, num_blocks: int, seed: int) -> np.ndarray:
    """Random but valid blocks: random bytes, finite float16 scales of either sign."""
    _, block_bytes = gguf_py.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (num_blocks, block_bytes), dtype=np.uint8)
    for start in SCALE_FIELDS[int(qtype)]:
        scales = rng.standard_normal(num_blocks) * 10.0 ** rng.integers(-6, 3, num_blocks)
        raw[:, start : start + 2] = scales.astype(np.float16).reshape(-1, 1).view(np.uint8)
    return raw


def write_raw(path: Path, tensors: dict[str, tuple[QT, np.ndarray, tuple[int, int]]]) -> Path:
    """A GGUF of raw blocks: name -> (type, blocks, torch shape)."""
    writer = gguf_py.GGUFWriter(str(path), "llama")
    for name, (qtype, blocks, shape) in tensors.items():
        writer.add_tensor(name, blocks.reshape(shape[0], -1), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("seed", [0, 1])
def test_block_dequantization_is_bit_identical_to_reference(tmp_path: Path, seed: int) -> None:
    tensors = {}
    for qtype in BLOCK_TYPES:
        block_elements, _ = gguf_py.GGML_QUANT_SIZES[qtype]
        rows, cols = 6, 2 * max(block_elements, 256)
        blocks = random_blocks(qtype, rows * cols // block_elements, seed)
        tensors[f"t.{qtype.name}"] = (qtype, blocks, (rows, cols))
    path = write_raw(tmp_path / "blocks.gguf", tensors)
    expected = reference(path)
    ours = GGUFFile(path)
    for name, want in expected.items():
        got = ours.load(name)
        assert got.dtype == torch.float32 and got.shape == want.shape, name
        assert torch.equal(got, want), name
        assert ours.tensors[name].type_name == name.split(".")[1]


def test_non_finite_scale_names_tensor_and_block(tmp_path: Path) -> None:
    blocks = random_blocks(QT.Q4_K, 8, 0)
    blocks[5, 2:4] = np.array([np.inf], dtype=np.float16).view(np.uint8)  # dmin of block 5
    path = write_raw(tmp_path / "inf.gguf", {"w": (QT.Q4_K, blocks, (4, 512))})
    with pytest.raises(
        CorruptWeights, match=r"tensor 'w' \(Q4_K\) block 5 .*infinite or NaN"
    ) as info:
        GGUFFile(path).load("w")
    assert str(path) in str(info.value)


@pytest.mark.parametrize(
    ("qtype", "quantizer", "tolerance"),
    [
        (QT.Q4_K, quantize_q4_k, 0.12),
        (QT.Q6_K, quantize_q6_k, 0.03),
    ],
)
def test_test_quantizers_write_the_reference_format(qtype, quantizer, tolerance) -> None:
    """The K-quantizers the tests use are right: the reference reads back what was meant."""
    rows = np.random.default_rng(3).standard_normal((16, 1024)).astype(np.float32)
    rows[0] = np.abs(rows[0])  # all positive: min clamps to 0
    rows[1] = 0.0
    blocks = quantizer(rows)
    assert blocks.shape == (16, 1024 // 256 * gguf_py.GGML_QUANT_SIZES[qtype][1])
    back = gguf_py.quants.dequantize(blocks, qtype)
    error = np.sqrt(((back - rows) ** 2).mean()) / np.sqrt((rows**2).mean())
    assert error < tolerance
    assert np.array_equal(back[1], rows[1])


# ---- a K-quant demo, through the real CLI ----------------------------------------------------


@pytest.fixture(scope="module")
def demo_q4_k_gguf(demo_model_dir: Path, demo_gguf: Path, tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("demo-kquant")
    return write_demo_kquant_gguf(folder / "smollm2-q4_k.gguf", demo_model_dir, demo_gguf)


def cli(home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "KUNLUN_ENDPOINT"}
    env["KUNLUN_HOME"] = str(home)
    return subprocess.run(
        [str(BIN / "kunlun-cli"), *args], env=env, capture_output=True, text=True, timeout=600
    )


def test_q4_k_demo_imports_with_the_cli_close_to_fp32(
    demo_q4_k_gguf: Path, demo_model_dir: Path, tmp_path: Path
) -> None:
    kinds = {info.type_name for info in GGUFFile(demo_q4_k_gguf).tensors.values()}
    assert kinds == {"Q4_K", "Q5_0", "Q8_0", "F32"}
    proc = cli(
        tmp_path / "home",
        "model",
        "import-gguf",
        str(demo_q4_k_gguf),
        "--name",
        "q4k",
        "--progress",
    )
    assert proc.returncode == 0, proc.stderr
    assert "import-gguf" in proc.stderr  # the progress bar, asked for
    out = tmp_path / "home" / "models" / "q4k"
    assert f"model q4k -> {out}" in proc.stdout
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"]["scheme"] == "w4a16"
    state = load_file(str(out / "model.safetensors"))
    fp32 = load_file(str(demo_model_dir / "model.safetensors"))
    quantized = [name for name in state if name.endswith(".weight_packed")]
    assert len(quantized) == 30 and all(".mlp.down_proj." in name for name in quantized)
    for name, want in fp32.items():
        prefix = name.removesuffix(".weight")
        got = unpack(prefix, state) if f"{prefix}.weight_packed" in state else state[name].float()
        error = float((got - want).norm() / want.norm())
        if f"{prefix}.weight_packed" in state:
            bound = 0.04  # Q4_K (about 0.02 here)
        elif ".mlp." in name or ".self_attn." in name:
            bound = 0.08  # Q5_0, dequantized to bf16 (about 0.05)
        else:
            bound = 0.01  # Q8_0 embedding and F32 norms, as bf16
        assert error < bound, (name, error)
    again = cli(tmp_path / "home", "model", "import-gguf", str(demo_q4_k_gguf), "--name", "q4k")
    assert again.returncode == 0 and again.stderr == ""  # cached; no bar off a terminal


def test_q6_k_demo_dequantizes_close_to_fp32(
    demo_model_dir: Path, demo_gguf: Path, tmp_path: Path
) -> None:
    path = write_demo_kquant_gguf(
        tmp_path / "q6_k.gguf", demo_model_dir, demo_gguf, QT.Q6_K, QT.Q8_0, QT.Q8_0
    )
    ours = GGUFFile(path)
    fp32 = load_file(str(demo_model_dir / "model.safetensors"))
    down = "model.layers.3.mlp.down_proj.weight"
    assert ours.tensors["blk.3.ffn_down.weight"].type_name == "Q6_K"
    got = ours.load("blk.3.ffn_down.weight")
    assert float((got - fp32[down]).norm() / fp32[down].norm()) < 0.03


def test_cli_refuses_a_bad_dtype(demo_gguf: Path, tmp_path: Path) -> None:
    proc = cli(tmp_path / "home", "model", "import-gguf", str(demo_gguf), "--dtype", "fp64")
    assert proc.returncode == 2
    assert "--dtype" in proc.stderr and "'fp64'" in proc.stderr and "Traceback" not in proc.stderr


def test_demo_default_import_is_w4a16_equal_to_its_fp32_import(
    demo_gguf: Path, demo_model_dir: Path, tmp_path: Path
) -> None:
    """The demo's own Q4_1 projections kept 4-bit give back exactly its float32 import."""
    out = import_gguf(demo_gguf, tmp_path / "demo-w4a16")
    state = load_file(str(out / "model.safetensors"))
    fp32 = load_file(str(demo_model_dir / "model.safetensors"))
    packed = [name for name in state if name.endswith(".weight_packed")]
    assert len(packed) == 30 * 7
    for name in packed:
        prefix = name.removesuffix(".weight_packed")
        assert torch.equal(unpack(prefix, state), fp32[f"{prefix}.weight"]), prefix
    embedding = "model.embed_tokens.weight"
    assert torch.equal(state[embedding], fp32[embedding].to(torch.bfloat16))
    size = (out / "model.safetensors").stat().st_size
    assert size < (demo_model_dir / "model.safetensors").stat().st_size / 3
