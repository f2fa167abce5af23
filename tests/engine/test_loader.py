"""Model config parsing and checkpoint loading: layouts, tied heads and every bad input."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kunlun.engine.config import SUPPORTED_ARCHITECTURES, ModelConfig
from kunlun.engine.loader import load_weights
from kunlun.engine.model_runner import ModelRunner, StepSeq
from kunlun.engine.models import build_model
from kunlun.errors import CorruptWeights, ModelError, ModelFileMissing, UnsupportedArchitecture

BASE = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "intermediate_size": 128,
    "vocab_size": 100,
    "max_position_embeddings": 256,
}


def copy_model(source: Path, target: Path) -> Path:
    shutil.copytree(source, target)
    return target


def write_config(folder: Path, **changes: object) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({**BASE, **changes}))
    return folder


def test_config_derives_and_normalizes_fields(tmp_path: Path) -> None:
    config = ModelConfig.from_dir(write_config(tmp_path, eos_token_id=[2, 7], dtype="bfloat16"))
    assert config.head_dim == 16 and config.num_key_value_heads == 4
    assert config.eos_token_ids == (2, 7) and config.torch_dtype == torch.bfloat16
    assert config.rope_scaling is None and config.rope_theta == 10000.0
    qwen3 = ModelConfig.from_dict({**BASE, "architectures": ["Qwen3ForCausalLM"], "head_dim": 32})
    assert qwen3.qk_norm and qwen3.head_dim == 32 and not qwen3.attention_bias
    assert ModelConfig.from_dict({**BASE, "architectures": ["Qwen2ForCausalLM"]}).attention_bias
    llama3 = ModelConfig.from_dict(
        {
            **BASE,
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 128,
            },
        }
    )
    assert llama3.rope_theta == 500000.0 and llama3.rope_scaling["rope_type"] == "llama3"


def test_unsupported_architecture_names_it_and_the_supported_ones(tmp_path: Path) -> None:
    write_config(tmp_path, architectures=["GPTNeoXForCausalLM"])
    with pytest.raises(UnsupportedArchitecture) as info:
        ModelConfig.from_dir(tmp_path)
    message = str(info.value)
    assert "GPTNeoXForCausalLM" in message and str(tmp_path / "config.json") in message
    assert all(name in message for name in SUPPORTED_ARCHITECTURES)


@pytest.mark.parametrize(
    ("changes", "pattern"),
    [
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "'yarn' is not supported"),
        ({"num_key_value_heads": 3}, "not a multiple of num_key_value_heads=3"),
        ({"hidden_size": -1}, "hidden_size=-1 is not a positive integer"),
        ({"num_hidden_layers": None}, "'num_hidden_layers' is missing"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "needs 'low_freq_factor'"),
    ],
)
def test_bad_config_fields_are_named(tmp_path: Path, changes: dict, pattern: str) -> None:
    with pytest.raises(ModelError, match=pattern) as info:
        ModelConfig.from_dir(write_config(tmp_path, **changes))
    assert str(tmp_path / "config.json") in str(info.value)


def test_missing_and_unparsable_config(tmp_path: Path) -> None:
    with pytest.raises(ModelFileMissing, match="config.json"):
        ModelConfig.from_dir(tmp_path)
    (tmp_path / "config.json").write_text("{oops")
    with pytest.raises(ModelError, match="cannot parse"):
        ModelConfig.from_dir(tmp_path)


def test_sharded_checkpoint_loads_like_single_file(make_tiny_model) -> None:
    single = make_tiny_model("Qwen2ForCausalLM", False)
    sharded = make_tiny_model("Qwen2ForCausalLM", False, sharded=True)
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("model-*.safetensors"))) > 1
    prompt = list(range(200, 230))
    outputs = [
        ModelRunner(folder, block_size=8, num_blocks=8).execute(
            [StepSeq(prompt, 0, 30, [0, 1, 2, 3])]
        )
        for folder in (single, sharded)
    ]
    torch.testing.assert_close(outputs[0].logits, outputs[1].logits, atol=0, rtol=0)


def test_tied_and_untied_heads(make_tiny_model, tmp_path: Path) -> None:
    tied_dir = make_tiny_model("LlamaForCausalLM", True)
    assert "lm_head.weight" not in load_file(str(tied_dir / "model.safetensors"))
    model = ModelRunner(tied_dir, num_blocks=4).model
    assert model.lm_head.weight is model.model.embed_tokens.weight
    # an untied config whose checkpoint lacks the head: the head shares the embedding
    folder = copy_model(make_tiny_model("LlamaForCausalLM", False), tmp_path / "headless")
    weights = load_file(str(folder / "model.safetensors"))
    del weights["lm_head.weight"]
    save_file(weights, str(folder / "model.safetensors"))
    model = ModelRunner(folder, num_blocks=4).model
    assert model.lm_head.weight is model.model.embed_tokens.weight
    untied = ModelRunner(make_tiny_model("LlamaForCausalLM", False), num_blocks=4).model
    assert untied.lm_head.weight is not untied.model.embed_tokens.weight


def test_missing_tensor_is_named(make_tiny_model, tmp_path: Path) -> None:
    folder = copy_model(make_tiny_model("Qwen3ForCausalLM", False), tmp_path / "gap")
    weights = load_file(str(folder / "model.safetensors"))
    del weights["model.layers.1.self_attn.k_proj.weight"]
    del weights["model.layers.0.self_attn.q_norm.weight"]
    save_file(weights, str(folder / "model.safetensors"))
    with pytest.raises(ModelError, match=r"model\.layers\.\d\.self_attn\.(k_proj|q_norm)") as info:
        ModelRunner(folder, num_blocks=4)
    assert str(folder / "model.safetensors") in str(info.value)


def test_wrong_shape_is_named(make_tiny_model, tmp_path: Path) -> None:
    folder = copy_model(make_tiny_model("LlamaForCausalLM", False), tmp_path / "shape")
    weights = load_file(str(folder / "model.safetensors"))
    weights["model.layers.0.mlp.up_proj.weight"] = torch.zeros(3, 3)
    save_file(weights, str(folder / "model.safetensors"))
    with pytest.raises(ModelError, match=r"up_proj\.weight.*\(3, 3\).*\(128, 64\)"):
        ModelRunner(folder, num_blocks=4)


@pytest.mark.parametrize("damage", ["truncate", "garbage_header", "empty"])
def test_corrupt_safetensors_names_the_file(make_tiny_model, tmp_path: Path, damage: str) -> None:
    folder = copy_model(make_tiny_model("LlamaForCausalLM", False), tmp_path / damage)
    path = folder / "model.safetensors"
    data = path.read_bytes()
    if damage == "truncate":
        path.write_bytes(data[: len(data) // 2])
    elif damage == "garbage_header":
        path.write_bytes(len(b"{not json at all").to_bytes(8, "little") + b"{not json at all")
    else:
        path.write_bytes(b"")
    with pytest.raises(CorruptWeights) as info:
        ModelRunner(folder, num_blocks=4)
    assert str(path) in str(info.value)


def test_missing_weights_and_shards(make_tiny_model, tmp_path: Path) -> None:
    folder = copy_model(make_tiny_model("LlamaForCausalLM", False), tmp_path / "empty")
    (folder / "model.safetensors").unlink()
    with pytest.raises(ModelFileMissing, match="model.safetensors") as info:
        ModelRunner(folder, num_blocks=4)
    assert str(folder) in str(info.value)
    sharded = copy_model(
        make_tiny_model("Qwen2ForCausalLM", False, sharded=True), tmp_path / "shards"
    )
    victim = sorted(sharded.glob("model-*.safetensors"))[0]
    victim.unlink()
    with pytest.raises(ModelFileMissing, match=victim.name):
        ModelRunner(sharded, num_blocks=4)
    (sharded / "model.safetensors.index.json").write_text("[]")
    with pytest.raises(CorruptWeights, match="index"):
        ModelRunner(sharded, num_blocks=4)


def test_missing_tokenizer(make_tiny_model, tmp_path: Path) -> None:
    folder = copy_model(make_tiny_model("LlamaForCausalLM", False), tmp_path / "notok")
    (folder / "tokenizer.json").unlink()
    with pytest.raises(ModelFileMissing, match="tokenizer.json") as info:
        ModelRunner(folder, num_blocks=4)
    assert str(folder / "tokenizer.json") in str(info.value)


def test_loader_fuses_projections_in_order(make_tiny_model) -> None:
    folder = make_tiny_model("Qwen2ForCausalLM", False)
    config = ModelConfig.from_dir(folder)
    model = build_model(config)
    load_weights(model, folder)
    weights = load_file(str(folder / "model.safetensors"))
    attention = model.model.layers[1].self_attn.qkv_proj
    expected = torch.cat([weights[f"model.layers.1.self_attn.{p}_proj.weight"] for p in "qkv"])
    assert torch.equal(attention.weight, expected)
    expected_bias = torch.cat([weights[f"model.layers.1.self_attn.{p}_proj.bias"] for p in "qkv"])
    assert torch.equal(attention.bias, expected_bias)
    mlp = model.model.layers[0].mlp.gate_up_proj.weight
    gate_up = [weights[f"model.layers.0.mlp.{p}_proj.weight"] for p in ("gate", "up")]
    assert torch.equal(mlp, torch.cat(gate_up))
