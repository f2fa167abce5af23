"""The importer's output forms and the qwen2/qwen3 architectures, against the reference
``gguf`` package: w4a16 written straight from Q4_0/Q4_1/Q4_K blocks, bf16/fp16/fp32 for the
rest, options that key the cache, and tiny qwen2/qwen3 GGUFs that run in the engine exactly
like the checkpoints they were written from."""

from __future__ import annotations

import json
from pathlib import Path

import gguf as gguf_py
import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from tests.engine.gguf_files import (
    QT,
    permute,
    reference,
    unpack,
    write_gguf,
    write_hf_gguf,
)

from kunlun.engine.gguf import FP32_IMPORT, ImportOptions, import_gguf
from kunlun.engine.gguf_reader import GGUFFile
from kunlun.engine.model_runner import ModelRunner, StepSeq
from kunlun.errors import ConfigError, ModelError

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


def test_a_vocabulary_larger_than_the_embedding_is_refused(
    tiny_model: Path, demo_gguf: Path, tmp_path: Path
) -> None:
    """The tiny model's 2048-row embedding under the demo's 49152-token vocabulary: every
    token id past 2047 would fail a request; the import says so instead."""
    path = write_hf_gguf(tmp_path / "m.gguf", tiny_model, GGUFFile(demo_gguf))
    wanted = (
        r"llama\.vocab_size must be at least the 49152 tokens of tokenizer\.ggml\.tokens, got 2048"
    )
    with pytest.raises(ModelError, match=wanted) as info:
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
