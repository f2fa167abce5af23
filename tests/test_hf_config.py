"""The shared config.json reader: what the planner and the engine both see, read once."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers

from kunlun.engine.config import ModelConfig
from kunlun.errors import ModelError
from kunlun.hf_config import HFConfig
from kunlun.planner.model_info import inspect_model

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "models"
BASE = {
    "hidden_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 4,
    "intermediate_size": 32,
    "vocab_size": 50,
}


@pytest.mark.parametrize("name", ["Llama-3-8B", "Qwen2-0.5B", "Qwen2.5-7B", "Qwen3-8B"])
def test_planner_and_engine_read_the_same_shape(name: str) -> None:
    info = inspect_model(EXAMPLES / name)
    config = ModelConfig.from_dir(EXAMPLES / name)
    assert (info.hidden_size, info.num_layers, info.num_kv_heads, info.head_dim) == (
        config.hidden_size,
        config.num_hidden_layers,
        config.num_key_value_heads,
        config.head_dim,
    )
    assert info.max_context == config.max_position_embeddings
    assert info.checkpoint_dtype == "bf16" and config.torch_dtype == torch.bfloat16


@pytest.mark.parametrize(
    "arch", ["LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"]
)
def test_bias_flags_are_what_transformers_builds(arch: str) -> None:
    """``attention_bias``/``mlp_bias`` only where the architecture honours them (Mistral never,
    Qwen2 always on q/k/v), checked against transformers' own modules."""
    raw = {**BASE, "attention_bias": True, "mlp_bias": True}
    config = HFConfig.from_dict({"architectures": [arch], **raw})
    with torch.device("meta"):
        model = getattr(transformers, arch)(getattr(transformers, arch[:-11] + "Config")(**raw))
    layer = model.model.layers[0]
    assert config.attention_bias == (layer.self_attn.q_proj.bias is not None)
    assert config.o_proj_bias == (layer.self_attn.o_proj.bias is not None)
    assert config.mlp_bias == (layer.mlp.up_proj.bias is not None)
    assert config.qk_norm == hasattr(layer.self_attn, "q_norm")


def test_null_is_absent_and_both_spellings_are_read() -> None:
    v4 = HFConfig.from_dict(
        {
            "architectures": ["LlamaForCausalLM"],
            **BASE,
            "num_key_value_heads": None,
            "rms_norm_eps": None,
            "torch_dtype": "float16",
            "rope_theta": 5e5,
        }
    )
    assert v4.num_key_value_heads == 4 and v4.rms_norm_eps == 1e-6 and v4.dtype == "float16"
    v5 = HFConfig.from_dict(
        {
            "architectures": ["LlamaForCausalLM"],
            **BASE,
            "dtype": "bfloat16",
            "rope_parameters": {"rope_type": "default", "rope_theta": 5e5},
        }
    )
    assert v5.rope_theta == v4.rope_theta == 5e5 and v5.rope_scaling is None
    assert v5.dtype == "bfloat16"


@pytest.mark.parametrize(
    ("changes", "field", "message"),
    [
        ({"rms_norm_eps": "small"}, "rms_norm_eps", "rms_norm_eps='small' is not a number"),
        ({"eos_token_id": [2, "x"]}, "eos_token_id", "is not a token id or a list"),
        ({"head_dim": 0}, "head_dim", "head_dim=0 is not a positive integer"),
        ({"rope_scaling": "linear"}, "rope_scaling", "is not an object"),
    ],
)
def test_bad_fields_name_the_file_and_field(
    tmp_path: Path, changes: dict, field: str, message: str
) -> None:
    raw = {"architectures": ["Qwen2ForCausalLM"], **BASE, **changes}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    for read in (HFConfig.from_dir, ModelConfig.from_dir, inspect_model):
        with pytest.raises(ModelError) as caught:
            read(tmp_path)
        assert message in caught.value.message
        assert caught.value.location is not None
        assert caught.value.location.path == str(tmp_path / "config.json")
        assert caught.value.location.field == field
