"""K-quants, qwen2/qwen3 and the importer's output forms, against the reference ``gguf``
package: block dequantization bit for bit on random valid blocks, w4a16 written straight
from Q4_0/Q4_1/Q4_K blocks, bf16/fp16/fp32 for the rest, tiny qwen2/qwen3 GGUFs that run in
the engine exactly like their checkpoints, and a Q4_K GGUF of the demo model imported with
the real ``kunlun-cli model import-gguf``."""

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
    permute,
    quantize_q4_k,
    quantize_q6_k,
    write_demo_kquant_gguf,
    write_gguf,
    write_hf_gguf,
)

from kunlun.engine.gguf import FP32_IMPORT, ImportOptions, import_gguf
from kunlun.engine.gguf_blocks import SCALE_FIELDS
from kunlun.engine.gguf_reader import GGUFFile
from kunlun.engine.model_runner import ModelRunner, StepSeq
from kunlun.errors import ConfigError, CorruptWeights, ModelError

BLOCK_TYPES = [QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.Q8_0]
BLOCK_TYPES += [QT.Q2_K, QT.Q3_K, QT.Q4_K, QT.Q5_K, QT.Q6_K]
BIN = Path(sys.executable).parent


def reference(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of ``path`` dequantized by the ``gguf`` package, in torch shape."""
    out = {}
    for tensor in gguf_py.GGUFReader(str(path)).tensors:
        values = gguf_py.quants.dequantize(tensor.data, tensor.tensor_type)
        shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
        out[tensor.name] = torch.from_numpy(np.array(values, dtype=np.float32)).reshape(shape)
    return out


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


# ---- qwen2 / qwen3 ------------------------------------------------------------------------


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("arch", ["Qwen2ForCausalLM", "Qwen3ForCausalLM"])
def test_qwen_gguf_runs_like_its_checkpoint(
    make_tiny_model, demo_gguf: Path, tmp_path: Path, arch: str, tied: bool
) -> None:
    original_dir = make_tiny_model(arch, tied)
    name = "qwen2" if arch.startswith("Qwen2") else "qwen3"
    path = write_hf_gguf(tmp_path / "m.gguf", original_dir, GGUFFile(demo_gguf), architecture=name)
    imported = import_gguf(path, tmp_path / "imported", FP32_IMPORT)
    config = json.loads((imported / "config.json").read_text())
    assert config["architectures"] == [arch] and config["tie_word_embeddings"] is tied
    source = json.loads((original_dir / "config.json").read_text())
    width = source.get("head_dim") or source["hidden_size"] // source["num_attention_heads"]
    assert config["head_dim"] == width
    ours = load_file(str(imported / "model.safetensors"))
    theirs = load_file(str(original_dir / "model.safetensors"))
    assert set(ours) == set(theirs)  # biases (qwen2), q/k norms (qwen3); lm_head iff untied
    for key, tensor in theirs.items():
        assert torch.equal(ours[key], tensor.float()), key
    prompt = list(range(100, 132))
    step = [StepSeq(prompt, 0, 32, [0, 1, 2, 3], want_prompt_logits=True)]
    want = ModelRunner(original_dir, block_size=8, num_blocks=8).execute(step).prompt_logits[0]
    got = ModelRunner(imported, block_size=8, num_blocks=8).execute(step).prompt_logits[0]
    torch.testing.assert_close(got, want, atol=0, rtol=0)


def test_qwen2_without_biases_is_refused(make_tiny_model, demo_gguf: Path, tmp_path: Path) -> None:
    path = write_hf_gguf(
        tmp_path / "m.gguf",
        make_tiny_model("LlamaForCausalLM", False),
        GGUFFile(demo_gguf),
        architecture="qwen2",
    )
    with pytest.raises(ModelError, match=r"tensor 'blk\.0\.attn_q\.bias' is missing") as info:
        import_gguf(path, tmp_path / "out")
    assert str(path) in str(info.value)


def test_rope_scaling_is_refused_naming_the_key(
    make_tiny_model, demo_gguf: Path, tmp_path: Path
) -> None:
    path = tmp_path / "m.gguf"
    write_hf_gguf(
        path, make_tiny_model("Qwen2ForCausalLM", False), GGUFFile(demo_gguf), architecture="qwen2"
    )
    reader = gguf_py.GGUFReader(str(path))
    writer = gguf_py.GGUFWriter(str(tmp_path / "yarn.gguf"), "qwen2")
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        sub = field.types[1] if len(field.types) > 1 else None
        writer.add_key_value(key, field.contents(), field.types[0], sub)
    writer.add_rope_scaling_type(gguf_py.RopeScalingType.YARN)
    for tensor in reader.tensors:
        writer.add_tensor(tensor.name, np.array(tensor.data))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelError, match=r"qwen2\.rope\.scaling\.type must be 'none'.*'yarn'"):
        import_gguf(tmp_path / "yarn.gguf", tmp_path / "out")


# ---- output forms ---------------------------------------------------------------------------

HPARAMS = {
    "num_hidden_layers": 1,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 0,  # set from the tiny vocabulary
}
MIXED_TYPES = {
    "blk.0.attn_q.weight": QT.Q4_K,
    "blk.0.attn_k.weight": QT.Q4_0,
    "blk.0.attn_v.weight": QT.Q4_1,
    "blk.0.attn_output.weight": QT.Q4_K,
    "blk.0.ffn_gate.weight": QT.Q4_K,
    "blk.0.ffn_up.weight": QT.Q6_K,
    "blk.0.ffn_down.weight": QT.Q8_0,
    "token_embd.weight": QT.Q4_K,
    "output.weight": QT.F16,
}
W4A16 = {
    "attn_q": "q_proj",
    "attn_k": "k_proj",
    "attn_v": "v_proj",
    "attn_output": "o_proj",
    "ffn_gate": "gate_proj",
}


def mixed_model(path: Path, architecture: str) -> Path:
    """A one-layer model of width 256 in the types of :data:`MIXED_TYPES`."""
    from tests.engine.gguf_bytes import TOKENS

    hparams = HPARAMS | {"vocab_size": len(TOKENS)}
    hidden, ffn, head_dim = 256, 512, 64
    shapes = {
        "token_embd.weight": (len(TOKENS), hidden),
        "output_norm.weight": (hidden,),
        "output.weight": (len(TOKENS), hidden),
        "blk.0.attn_norm.weight": (hidden,),
        "blk.0.ffn_norm.weight": (hidden,),
        "blk.0.attn_q.weight": (4 * head_dim, hidden),
        "blk.0.attn_k.weight": (2 * head_dim, hidden),
        "blk.0.attn_v.weight": (2 * head_dim, hidden),
        "blk.0.attn_output.weight": (hidden, 4 * head_dim),
        "blk.0.ffn_gate.weight": (ffn, hidden),
        "blk.0.ffn_up.weight": (ffn, hidden),
        "blk.0.ffn_down.weight": (hidden, ffn),
    }
    if architecture == "qwen2":
        shapes |= {
            "blk.0.attn_q.bias": (4 * head_dim,),
            "blk.0.attn_k.bias": (2 * head_dim,),
            "blk.0.attn_v.bias": (2 * head_dim,),
        }
    rng = np.random.default_rng(7)
    tensors = {
        name: rng.standard_normal(shape).astype(np.float32) for name, shape in shapes.items()
    }
    return write_gguf(path, architecture, hparams, tensors, MIXED_TYPES)


def unpack(prefix: str, state: dict[str, torch.Tensor]) -> torch.Tensor:
    """``w = q * scale + min`` of a w4a16 tensor, by the format's definition."""
    packed = state[f"{prefix}.weight_packed"]
    q = torch.stack((packed & 0x0F, packed >> 4), dim=-1).reshape(packed.shape[0], -1)
    groups = q.reshape(q.shape[0], -1, 32).float()
    scale, minimum = state[f"{prefix}.weight_scale"], state[f"{prefix}.weight_min"]
    return (groups * scale.unsqueeze(-1) + minimum.unsqueeze(-1)).reshape(q.shape)


@pytest.mark.parametrize("architecture", ["llama", "qwen2"])
def test_default_import_writes_w4a16_from_q4_blocks_and_bf16_for_the_rest(
    tmp_path: Path, architecture: str
) -> None:
    path = mixed_model(tmp_path / "mixed.gguf", architecture)
    expected = reference(path)
    out = import_gguf(path, tmp_path / "out")
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"] == {
        "quant_method": "kunlun",
        "scheme": "w4a16",
        "group_size": 32,
        "bits": 4,
    }
    assert config["torch_dtype"] == "bfloat16"
    state = load_file(str(out / "model.safetensors"))
    for gguf_module, module in W4A16.items():
        section = "mlp" if gguf_module.startswith("ffn") else "self_attn"
        prefix = f"model.layers.0.{section}.{module}"
        want = expected[f"blk.0.{gguf_module}.weight"]
        if architecture == "llama" and gguf_module in ("attn_q", "attn_k"):
            heads = 4 if gguf_module == "attn_q" else 2
            want = torch.from_numpy(permute_back(want.numpy(), heads))
        rows, cols = want.shape
        assert state[f"{prefix}.weight_packed"].dtype == torch.uint8
        assert state[f"{prefix}.weight_packed"].shape == (rows, cols // 2)
        assert state[f"{prefix}.weight_scale"].shape == (rows, cols // 32)
        assert state[f"{prefix}.weight_min"].dtype == torch.float32
        assert f"{prefix}.weight" not in state
        assert torch.equal(unpack(prefix, state), want), prefix
    floating = {
        "model.layers.0.mlp.up_proj.weight": "blk.0.ffn_up.weight",  # Q6_K
        "model.layers.0.mlp.down_proj.weight": "blk.0.ffn_down.weight",  # Q8_0
        "model.embed_tokens.weight": "token_embd.weight",  # Q4_K, not a projection
        "lm_head.weight": "output.weight",  # F16
        "model.norm.weight": "output_norm.weight",  # F32
    }
    if architecture == "qwen2":
        floating["model.layers.0.self_attn.q_proj.bias"] = "blk.0.attn_q.bias"
    for name, source in floating.items():
        assert state[name].dtype == torch.bfloat16, name
        assert torch.equal(state[name], expected[source].to(torch.bfloat16)), name


def permute_back(weight: np.ndarray, heads: int) -> np.ndarray:
    """The inverse of :func:`permute` (llama.cpp's row order back to Hugging Face's)."""
    rows = weight.shape[0]
    grouped = weight.reshape(heads, rows // heads // 2, 2, *weight.shape[1:])
    return grouped.swapaxes(1, 2).reshape(weight.shape)


def test_permute_back_inverts_permute() -> None:
    weight = np.arange(8 * 64 * 3, dtype=np.float32).reshape(8 * 64, 3)
    assert np.array_equal(permute_back(permute(weight, 8), 8), weight)


@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16"])
def test_no_keep_quantized_dequantizes_everything_to_the_dtype(tmp_path: Path, dtype: str) -> None:
    path = mixed_model(tmp_path / "mixed.gguf", "qwen2")
    expected = reference(path)
    out = import_gguf(path, tmp_path / "out", ImportOptions(dtype=dtype, keep_quantized=False))
    config = json.loads((out / "config.json").read_text())
    torch_dtype = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[dtype]
    assert "quantization_config" not in config
    assert config["torch_dtype"] == str(torch_dtype).removeprefix("torch.")
    state = load_file(str(out / "model.safetensors"))
    assert all(t.dtype == torch_dtype for t in state.values())
    assert torch.equal(
        state["model.layers.0.self_attn.q_proj.weight"],
        expected["blk.0.attn_q.weight"].to(torch_dtype),
    )


def test_auto_dtype_is_fp16_for_an_f16_file_and_options_key_the_cache(tmp_path: Path) -> None:
    from tests.engine.gguf_bytes import write_with_gguf_package

    f32 = write_with_gguf_package(tmp_path / "f32.gguf")
    reader = gguf_py.GGUFReader(str(f32))
    writer = gguf_py.GGUFWriter(str(tmp_path / "f16.gguf"), "llama")
    for key, field in reader.fields.items():
        if not key.startswith("GGUF.") and key != "general.architecture":
            sub = field.types[1] if len(field.types) > 1 else None
            writer.add_key_value(key, field.contents(), field.types[0], sub)
    for tensor in reader.tensors:
        data = np.array(tensor.data)
        writer.add_tensor(tensor.name, data.astype(np.float16) if data.ndim == 2 else data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    out = import_gguf(tmp_path / "f16.gguf", tmp_path / "out")
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "float16"
    assert load_file(str(out / "model.safetensors"))["model.norm.weight"].dtype == torch.float16
    f32_out = import_gguf(f32, tmp_path / "f32-out")
    assert json.loads((f32_out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    marker = json.loads((f32_out / "kunlun-import.json").read_text())
    assert marker["output"] == {"dtype": "auto", "keep_quantized": True}
    import_gguf(f32, f32_out, FP32_IMPORT)  # other options: converted again
    assert json.loads((f32_out / "config.json").read_text())["torch_dtype"] == "float32"
    assert "output" not in json.loads((f32_out / "kunlun-import.json").read_text())


def test_bad_dtype_is_a_config_error_naming_the_option() -> None:
    with pytest.raises(
        ConfigError, match=r"--dtype \(dtype\): dtype 'fp64' is not one of auto, fp32, bf16, fp16"
    ):
        ImportOptions(dtype="fp64")


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
