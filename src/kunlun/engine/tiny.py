"""Tiny seeded random models for tests and benchmarks (needs ``transformers``).

:func:`build_tiny_model` saves a random transformers model of a supported architecture
(3 layers, hidden size 64, 4 heads, 2 KV heads by default) with a real tokenizer copied from another
model directory (the demo's), so the engine loads it like any checkpoint. A forward step
costs almost nothing, which makes it the workload for measuring what surrounds the engine
(``benchmarks/gateway.py --model tiny``) and for parity tests against transformers.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

TINY_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def _tiny_config(
    arch: str,
    tie_word_embeddings: bool,
    llama3_rope: bool,
    attention_bias: bool = False,
    heads: tuple[int, int] = (4, 2),
) -> Any:
    import transformers

    num_heads, num_kv_heads = heads
    common: dict[str, Any] = dict(
        vocab_size=49152,
        hidden_size=16 * num_heads,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
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
    arch: str, tie_word_embeddings: bool, out_dir: Path, tokenizer_dir: Path, **options: Any
) -> Path:
    """Save a seeded random ``arch`` model plus ``tokenizer_dir``'s tokenizer in ``out_dir``.

    Options: ``llama3_rope``, ``attention_bias``, ``sharded`` (bools) and ``heads``, a
    ``(num_attention_heads, num_key_value_heads)`` pair (default (4, 2); the hidden size is
    16 per head).
    """
    import torch
    import transformers

    config = _tiny_config(
        arch,
        tie_word_embeddings,
        options.get("llama3_rope", False),
        options.get("attention_bias", False),
        options.get("heads", (4, 2)),
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
