"""Model inspection from config.json alone: the shipped configurations of real models, and the
count checked against the engine's own model code for random shapes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from hypothesis import given, settings
from hypothesis import strategies as st

from kunlun.engine.config import SUPPORTED_ARCHITECTURES
from kunlun.errors import ModelError, UnsupportedArchitecture
from kunlun.planner.model_info import (
    ARCHITECTURES,
    find_example,
    inspect_config,
    inspect_model,
    locate_model,
)

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "models"


@pytest.mark.parametrize(
    ("name", "parameters", "kv_bf16"),
    [
        ("Llama-3-8B", 8.03e9, 131072),
        ("Qwen2-0.5B", 0.49e9, 12288),
        ("Qwen2.5-7B", 7.61e9, 57344),  # the model card's 7.61B
        ("Qwen3-8B", 8.19e9, 147456),  # the model card's 8.2B
    ],
)
def test_shipped_models(name: str, parameters: float, kv_bf16: int) -> None:
    info = inspect_model(EXAMPLES / name)
    assert info.num_parameters == pytest.approx(parameters, rel=0.01)
    assert info.kv_bytes_per_token("bf16") == kv_bf16
    assert info.kv_bytes_per_token("fp32") == 2 * kv_bf16
    assert info.weight_bytes("bf16") == 2 * info.num_parameters
    assert info.weight_bytes("fp32") == 4 * info.num_parameters


def test_llama3_8b_details() -> None:
    info = inspect_model(EXAMPLES / "Llama-3-8B")
    assert info.architecture == "LlamaForCausalLM" and info.max_context == 8192
    assert info.parameters["lm_head"] == info.parameters["embedding"] == 128256 * 4096
    assert info.checkpoint_dtype == "bf16" and info.quantization is None
    # w8a8 keeps embeddings and the LM head in 16 bits: about 1 byte per layer weight
    assert 8.0e9 < info.weight_bytes("bf16", "w8a8") < 9.2e9
    # w4a16: half a byte per layer weight plus a float32 scale and minimum per group of 128
    assert 5.9e9 < info.weight_bytes("bf16", "w4a16") < 6.1e9
    assert info.weight_bytes("bf16", "w8a16") == info.weight_bytes("bf16", "w8a8")


def test_qwen2_0_5b_is_tied_and_long() -> None:
    info = inspect_model(EXAMPLES / "Qwen2-0.5B")
    assert info.tie_word_embeddings and info.parameters["lm_head"] == 0
    assert info.max_context == 131072


def test_planner_architectures_match_the_engine() -> None:
    assert ARCHITECTURES == SUPPORTED_ARCHITECTURES


def test_planning_imports_no_torch() -> None:
    """The planner (and the config.json reader it shares with the engine) runs without torch;
    checked in a fresh interpreter, since this one has torch loaded already."""
    code = (
        "import sys, kunlun.planner.model_info, kunlun.workload.placement; "
        "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if 'torch' in m)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


@settings(max_examples=30, deadline=None)
@given(
    arch=st.sampled_from(SUPPORTED_ARCHITECTURES),
    kv_heads=st.sampled_from([1, 2, 4]),
    group=st.sampled_from([1, 2, 3]),
    head_dim=st.sampled_from([8, 16]),
    layers=st.integers(1, 3),
    inter=st.integers(8, 64),
    vocab=st.integers(16, 300),
    tied=st.booleans(),
    attention_bias=st.booleans(),
    mlp_bias=st.booleans(),
)
def test_count_equals_the_transformers_models_parameters(
    arch: str,
    kv_heads: int,
    group: int,
    head_dim: int,
    layers: int,
    inter: int,
    vocab: int,
    tied: bool,
    attention_bias: bool,
    mlp_bias: bool,
) -> None:
    """Inspection counts exactly what transformers builds for the same config.json."""
    heads = kv_heads * group
    raw = {
        "hidden_size": heads * head_dim * 2,  # head_dim given explicitly, not hidden / heads
        "head_dim": head_dim,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "num_hidden_layers": layers,
        "intermediate_size": inter,
        "vocab_size": vocab,
        "max_position_embeddings": 64,
        "tie_word_embeddings": tied,
        "attention_bias": attention_bias,
        "mlp_bias": mlp_bias,
    }
    info = inspect_config({"architectures": [arch], **raw}, "random")
    config_class = {"LlamaForCausalLM": transformers.LlamaConfig,
                    "MistralForCausalLM": transformers.MistralConfig,
                    "Qwen2ForCausalLM": transformers.Qwen2Config,
                    "Qwen3ForCausalLM": transformers.Qwen3Config}[arch]  # fmt: skip
    with torch.device("meta"):
        model = getattr(transformers, arch)(config_class(**raw))
    assert info.num_parameters == sum(p.numel() for p in model.parameters())
    assert info.kv_bytes_per_token("bf16") == 2 * layers * kv_heads * head_dim * 2


def test_quantization_config_is_read() -> None:
    base = json.loads((EXAMPLES / "Qwen2.5-7B" / "config.json").read_text())
    gptq = inspect_config({**base, "quantization_config": {"quant_method": "gptq", "bits": 4}}, "q")
    assert gptq.quantization is not None and gptq.quantization.scheme == "w4a16"
    ct = {
        "quant_method": "compressed-tensors",
        "config_groups": {
            "group_0": {"weights": {"num_bits": 8}, "input_activations": {"num_bits": 8}}
        },
    }
    w8a8 = inspect_config({**base, "quantization_config": ct}, "q")
    assert w8a8.quantization is not None and w8a8.quantization.scheme == "w8a8"
    with pytest.raises(ModelError, match="quantization_config"):
        inspect_config({**base, "quantization_config": {"bits": 4}}, "q", "cfg.json")


def test_bad_configs_name_the_field_and_file(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(UnsupportedArchitecture, match="GPT2LMHeadModel.*LlamaForCausalLM"):
        inspect_model(tmp_path)
    (tmp_path / "config.json").write_text(
        json.dumps({"architectures": ["LlamaForCausalLM"], "hidden_size": 64})
    )
    with pytest.raises(ModelError) as caught:
        inspect_model(tmp_path)
    assert "'num_attention_heads' is missing" in str(caught.value)
    assert str(tmp_path / "config.json") in str(caught.value)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelError, match="cannot parse config.json"):
        inspect_model(tmp_path)


def test_models_are_found_by_directory_or_shipped_name(tmp_path: Path) -> None:
    assert find_example("llama-3-8b") == EXAMPLES / "Llama-3-8B"
    name, path = locate_model(None, "qwen3-8b")
    assert (name, path) == ("Qwen3-8B", EXAMPLES / "Qwen3-8B")
    (tmp_path / "config.json").write_text((EXAMPLES / "Qwen2-0.5B" / "config.json").read_text())
    assert locate_model(None, str(tmp_path)) == (tmp_path.name, tmp_path.resolve())
    with pytest.raises(ModelError, match="no-such.*Llama-3-8B"):
        locate_model(None, "no-such")
