"""Tiny seeded random models for tests and benchmarks (needs ``transformers``).

:func:`build_tiny_model` saves a random transformers model of a supported architecture
(3 layers, hidden size 64, 4 heads, 2 KV heads by default) with a tokenizer, so the engine
loads it like any checkpoint. The tokenizer is either copied from another model directory
(the demo's) or, with no ``tokenizer_dir``, built in-process (:func:`build_tiny_tokenizer`:
a byte-level BPE with ChatML special tokens and chat template), so such a model needs no
file from anywhere. A forward step costs almost nothing, which makes it the workload for
measuring what surrounds the engine (``benchmarks/gateway.py --model tiny``), for the tests
that check plumbing rather than the quality of an answer, and for parity tests against
transformers. :func:`cached_tiny_model` builds one once per machine (a locked cache).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import random
import shutil
import tempfile
from pathlib import Path
from typing import Any

TINY_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
TINY_VOCAB_SIZE = 2048
"""Target size of the built-in tokenizer's vocabulary: large enough that a random model
rarely samples its end-of-sequence token, small enough to train in well under a second."""
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
"""Ids 0, 1 and 2 (unknown, bos, eos), as in the demo model's vocabulary."""
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
BUILDER_VERSION = 1
"""Part of :func:`cached_tiny_model`'s key: raise it when what the builders write changes."""

_SYLLABLES = ("ka", "lo", "mi", "ne", "su", "ra", "to", "vi", "de", "po", "an", "el", "or",
              "un", "is", "qu", "zh", "ex", "th", "ing", "er", "st", "ch", "ou")  # fmt: skip
_TEXT = (
    "The quick brown fox jumps over the lazy dog. Paris is the capital of France. "
    "one, two, three, four, five, six, seven, eight, nine, ten. 0123456789 "
    '{"name": "value", "count": 3, "ok": true, "none": null} [1, 2.5, -3e4] '
    "Hello! How are you today? def main(): return x + y * (z - 1) <tool_call> </tool_call>"
)


def build_tiny_tokenizer(out_dir: Path) -> int:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` of a small byte-level BPE
    (every byte is a token, so any text encodes; ChatML chat template) into ``out_dir`` and
    return its vocabulary size. Trained on a seeded synthetic text: the same on every run."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    rng = random.Random(0)
    words = ["".join(rng.choices(_SYLLABLES, k=rng.randint(1, 4))) for _ in range(20000)]
    corpus = [_TEXT] * 20 + [" ".join(words[i : i + 50]) for i in range(0, len(words), 50)]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TINY_VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus, trainer)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    unknown, bos, eos = SPECIAL_TOKENS
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": bos, "eos_token": eos,
              "unk_token": unknown, "pad_token": eos, "add_bos_token": False,
              "add_eos_token": False, "clean_up_tokenization_spaces": False,
              "chat_template": CHAT_TEMPLATE}  # fmt: skip
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return int(tokenizer.get_vocab_size())


def _tiny_config(
    arch: str,
    tie_word_embeddings: bool,
    llama3_rope: bool,
    attention_bias: bool = False,
    heads: tuple[int, int] = (4, 2),
    vocab_size: int = 49152,
    max_positions: int = 512,
) -> Any:
    import transformers

    num_heads, num_kv_heads = heads
    common: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=16 * num_heads,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_positions,
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
    arch: str,
    tie_word_embeddings: bool,
    out_dir: Path,
    tokenizer_dir: Path | None = None,
    **options: Any,
) -> Path:
    """Save a seeded random ``arch`` model plus a tokenizer in ``out_dir``: ``tokenizer_dir``'s
    (the vocabulary is then the demo's 49,152 ids), or the built-in one when it is None.

    Options: ``llama3_rope``, ``attention_bias``, ``sharded`` (bools), ``heads``, a
    ``(num_attention_heads, num_key_value_heads)`` pair (default (4, 2); the hidden size is
    16 per head), and ``max_positions`` (``max_position_embeddings``, default 512).
    """
    import torch
    import transformers

    out_dir.mkdir(parents=True, exist_ok=True)
    if tokenizer_dir is None:
        vocab_size = build_tiny_tokenizer(out_dir)
    else:
        vocab_size = 49152
        for name in TOKENIZER_FILES:
            shutil.copy(tokenizer_dir / name, out_dir / name)
    config = _tiny_config(
        arch,
        tie_word_embeddings,
        options.get("llama3_rope", False),
        options.get("attention_bias", False),
        options.get("heads", (4, 2)),
        vocab_size,
        options.get("max_positions", 512),
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
    return out_dir


def tiny_cache_root() -> Path:
    """Where :func:`cached_tiny_model` keeps its models: ``KUNLUN_BUILD_CACHE`` (the folder
    the llama-server build is cached in too), else ``~/.cache/kunlun``, plus ``tiny-models``."""
    root = os.environ.get("KUNLUN_BUILD_CACHE") or os.path.expanduser("~/.cache/kunlun")
    return Path(root) / "tiny-models"


def cached_tiny_model(
    arch: str = "LlamaForCausalLM", tie_word_embeddings: bool = False, **options: Any
) -> Path:
    """A tiny model with the built-in tokenizer, built once per machine and reused;
    ``max_positions`` defaults to 2048 here (room for the workloads' usual 1,024 tokens).

    The cache key holds the arguments, :data:`BUILDER_VERSION` and the transformers version;
    an ``flock`` lets one process build while others wait, and a model is renamed into place
    whole, so a reader never sees half of one.
    """
    import transformers

    options.setdefault("max_positions", 2048)
    key = json.dumps([BUILDER_VERSION, transformers.__version__, arch, tie_word_embeddings,
                      sorted((k, repr(v)) for k, v in options.items())])  # fmt: skip
    name = f"{arch}-{hashlib.sha256(key.encode()).hexdigest()[:12]}"
    root = tiny_cache_root()
    target = root / name
    if (target / "config.json").is_file():
        return target
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f".{name}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        with contextlib.ExitStack() as cleanup:
            cleanup.callback(fcntl.flock, lock, fcntl.LOCK_UN)
            if (target / "config.json").is_file():
                return target
            staging = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=root))
            cleanup.callback(shutil.rmtree, staging, ignore_errors=True)
            build_tiny_model(arch, tie_word_embeddings, staging, **options)
            os.replace(staging, target)
    return target
