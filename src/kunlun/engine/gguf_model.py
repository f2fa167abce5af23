"""What a GGUF file says its model is: the Hugging Face config, tensor names and shapes.

Three ``general.architecture`` values are imported (:data:`ARCHITECTURES`), each read from
its own ``<arch>.*`` metadata keys and mapped onto a transformers architecture:

- ``llama``: optional biases on q/k/v/o. llama.cpp's converter stores the rows of each Q and
  K head interleaved for its rotary kernel (:func:`unpermute` undoes it).
- ``qwen2``: q/k/v biases (required), none on the output projection; rotary halves are kept
  apart by llama.cpp (NeoX style), so nothing is permuted.
- ``qwen3``: per-head RMSNorm of queries and keys (``attn_q_norm``/``attn_k_norm``, required),
  no biases, a head width of its own (``attention.key_length``); not permuted either.

The output head is tied to the embedding when the file has no ``output.weight``. Every value
is checked: :class:`ModelError` names the key or tensor, the value and the file.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kunlun.engine.gguf_reader import GGUFFile
from kunlun.engine.gguf_tokenizer import special_token_id, token_list
from kunlun.errors import Location, ModelError, UnsupportedArchitecture


@dataclass(frozen=True)
class Architecture:
    """How one ``general.architecture`` maps onto a transformers model."""

    name: str
    """``general.architecture`` (and the prefix of its metadata keys)."""
    hf_architecture: str
    """``architectures[0]`` of the written ``config.json``."""
    model_type: str
    """``model_type`` of the written ``config.json``."""
    permuted_qk: bool
    """llama.cpp interleaved the rows of each Q and K head (undone on import)."""
    qkv_bias: bool
    """q/k/v carry a bias that the model requires."""
    qk_norm: bool
    """Per-head RMSNorm of queries and keys (``attn_q_norm``/``attn_k_norm``)."""


#: ``general.architecture`` -> how it imports.
ARCHITECTURES: dict[str, Architecture] = {
    "llama": Architecture("llama", "LlamaForCausalLM", "llama", True, False, False),
    "qwen2": Architecture("qwen2", "Qwen2ForCausalLM", "qwen2", False, True, False),
    "qwen3": Architecture("qwen3", "Qwen3ForCausalLM", "qwen3", False, False, True),
}

LAYER_TENSORS: dict[str, str] = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}
"""GGUF name of a decoder-layer tensor (``blk.N.<name>``) -> its Hugging Face module."""
_COMMON_LAYER_TENSORS = tuple(LAYER_TENSORS)[:9]
"""The tensors every layer of every architecture has (norms and projections)."""
LINEAR_TENSORS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
"""The decoder layers' linear projections (the tensors quantization applies to)."""
_GLOBAL_TENSORS: dict[str, str] = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_SKIPPED = {"rope_freqs.weight"}


def architecture(gguf: GGUFFile) -> Architecture:
    """The file's :class:`Architecture`; :class:`UnsupportedArchitecture` names any other."""
    name = gguf.metadata.get("general.architecture")
    found = ARCHITECTURES.get(name) if isinstance(name, str) else None
    if found is None:
        raise UnsupportedArchitecture(
            f"GGUF architecture {name!r} cannot be imported; supported: "
            + ", ".join(ARCHITECTURES),
            location=Location(str(gguf.path), field="general.architecture"),
        )
    return found


def _bad(gguf: GGUFFile, key: str, wanted: str, value: Any) -> ModelError:
    shown = repr(value)
    shown = shown if len(shown) <= 80 else shown[:77] + "..."
    return ModelError(
        f"GGUF metadata {key} must be {wanted}, got {shown}",
        location=Location(str(gguf.path), field=key),
    )


def _int(gguf: GGUFFile, key: str, default: int | None = None, *, minimum: int = 1) -> int:
    """Metadata ``key`` as an integer of at least ``minimum`` (``default`` when absent)."""
    value = gguf.metadata.get(key, default)
    if value is None:
        raise ModelError(
            f"GGUF metadata key {key!r} is missing", location=Location(str(gguf.path), field=key)
        )
    if type(value) is not int or value < minimum:
        raise _bad(gguf, key, f"an integer >= {minimum}", value)
    return value


def _positive_float(gguf: GGUFFile, key: str, default: float) -> float:
    value = gguf.metadata.get(key, default)
    if type(value) not in (int, float) or not 0 < value < float("inf"):
        raise _bad(gguf, key, "a positive finite number", value)
    return float(value)


def _head_dim(gguf: GGUFFile, arch: Architecture, hidden: int, heads: int) -> int:
    """Width of one head: llama's ``rope.dimension_count``, the others' ``key_length``
    (each defaulting to ``hidden / heads``), the same for keys and values, fully rotated."""
    prefix = arch.name
    primary = (
        f"{prefix}.rope.dimension_count" if arch.permuted_qk else f"{prefix}.attention.key_length"
    )
    if primary in gguf.metadata:
        head_dim = _int(gguf, primary)
    elif hidden % heads:
        raise _bad(gguf, f"{prefix}.embedding_length", f"a multiple of {heads} (heads)", hidden)
    else:
        head_dim = hidden // heads
    if not arch.permuted_qk:
        for key in (f"{prefix}.attention.value_length", f"{prefix}.rope.dimension_count"):
            if key in gguf.metadata and _int(gguf, key) != head_dim:
                raise _bad(
                    gguf,
                    key,
                    f"the head width {head_dim} (partial rotary or a value "
                    "width of its own is not imported)",
                    gguf.metadata[key],
                )
    if head_dim % 2:
        raise _bad(gguf, primary, "even (rotary pairs)", head_dim)
    return head_dim


def hf_config(gguf: GGUFFile, arch: Architecture) -> dict[str, Any]:
    """The ``config.json`` of ``arch`` from the ``<arch>.*`` metadata, every value checked
    (:class:`ModelError` names the key and the value). Weights are float32 here; the importer
    sets ``torch_dtype`` and ``quantization_config`` for what it writes."""
    prefix = arch.name
    heads = _int(gguf, f"{prefix}.attention.head_count")
    kv_heads = _int(gguf, f"{prefix}.attention.head_count_kv", heads)
    if heads % kv_heads:
        raise _bad(
            gguf, f"{prefix}.attention.head_count_kv", f"a divisor of {heads} (heads)", kv_heads
        )
    hidden = _int(gguf, f"{prefix}.embedding_length")
    head_dim = _head_dim(gguf, arch, hidden, heads)
    scaling = gguf.metadata.get(f"{prefix}.rope.scaling.type", "none")
    if scaling != "none":
        raise _bad(
            gguf, f"{prefix}.rope.scaling.type", "'none' (RoPE scaling is not imported)", scaling
        )
    tokens = token_list(gguf)
    vocab_size = _int(gguf, f"{prefix}.vocab_size", len(tokens) or None)
    if len(tokens) > vocab_size:  # token ids past the embedding's rows: every request fails
        raise _bad(gguf, f"{prefix}.vocab_size",
                   f"at least the {len(tokens)} tokens of tokenizer.ggml.tokens", vocab_size)  # fmt: skip
    config: dict[str, Any] = {
        "architectures": [arch.hf_architecture],
        "model_type": arch.model_type,
        "hidden_act": "silu",
        "hidden_size": hidden,
        "intermediate_size": _int(gguf, f"{prefix}.feed_forward_length"),
        "num_hidden_layers": _int(gguf, f"{prefix}.block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "max_position_embeddings": _int(gguf, f"{prefix}.context_length", 2048),
        "rms_norm_eps": _positive_float(gguf, f"{prefix}.attention.layer_norm_rms_epsilon", 1e-6),
        "rope_theta": _positive_float(gguf, f"{prefix}.rope.freq_base", 10000.0),
        "vocab_size": vocab_size,
        "tie_word_embeddings": "output.weight" not in gguf.tensors,
        "bos_token_id": special_token_id(gguf, "bos_token_id", vocab_size),
        "eos_token_id": special_token_id(gguf, "eos_token_id", vocab_size),
        "pad_token_id": special_token_id(gguf, "padding_token_id", vocab_size),
        "torch_dtype": "float32",
    }
    if arch.qk_norm:
        config["attention_bias"] = False
    return config


def expected_shapes(config: dict[str, Any], arch: Architecture) -> dict[str, tuple[int, ...]]:
    """GGUF tensor name -> the torch shape ``config`` implies, for every tensor an ``arch``
    checkpoint may have (optional ones included: see :func:`optional_tensor`)."""
    hidden, vocab = config["hidden_size"], config["vocab_size"]
    head_dim = config["head_dim"]
    q_rows = config["num_attention_heads"] * head_dim
    kv_rows = config["num_key_value_heads"] * head_dim
    ffn = config["intermediate_size"]
    shapes: dict[str, tuple[int, ...]] = {
        "token_embd.weight": (vocab, hidden),
        "output_norm.weight": (hidden,),
        "output.weight": (vocab, hidden),
    }
    layer: dict[str, tuple[int, ...]] = {
        "attn_norm.weight": (hidden,),
        "ffn_norm.weight": (hidden,),
        "attn_q.weight": (q_rows, hidden),
        "attn_k.weight": (kv_rows, hidden),
        "attn_v.weight": (kv_rows, hidden),
        "attn_output.weight": (hidden, q_rows),
        "ffn_gate.weight": (ffn, hidden),
        "ffn_up.weight": (ffn, hidden),
        "ffn_down.weight": (hidden, ffn),
    }
    if arch.permuted_qk or arch.qkv_bias:
        layer |= {"attn_q.bias": (q_rows,), "attn_k.bias": (kv_rows,), "attn_v.bias": (kv_rows,)}
    if arch.permuted_qk:
        layer["attn_output.bias"] = (hidden,)
    if arch.qk_norm:
        layer |= {"attn_q_norm.weight": (head_dim,), "attn_k_norm.weight": (head_dim,)}
    for index in range(config["num_hidden_layers"]):
        shapes.update({f"blk.{index}.{name}": shape for name, shape in layer.items()})
    return shapes


def optional_tensor(name: str, arch: Architecture) -> bool:
    """A tensor the model may lack: the untied output head, and llama's biases."""
    return name == "output.weight" or (arch.permuted_qk and name.endswith(".bias"))


def check_tensors(gguf: GGUFFile, config: dict[str, Any], arch: Architecture) -> None:
    """Every tensor the model needs is present with the shape ``config`` implies, before
    any is dequantized; :class:`ModelError` names the tensor, its shape and the keys."""
    layers = config["num_hidden_layers"]
    per_layer = len(_COMMON_LAYER_TENSORS)  # bounds the table below by the file's size
    if layers * per_layer > len(gguf.tensors):
        raise _bad(
            gguf,
            f"{arch.name}.block_count",
            f"at most {len(gguf.tensors) // per_layer} for a file of "
            f"{len(gguf.tensors)} tensors ({per_layer} per layer)",
            layers,
        )
    shapes = expected_shapes(config, arch)
    for name, info in gguf.tensors.items():
        wanted = shapes.get(name)
        if wanted is None and hf_name(name) is not None:
            raise ModelError(
                f"tensor {name!r} is not part of a {arch.name} model of {layers} layers",
                location=Location(str(gguf.path), field=name),
            )
        if wanted is not None and info.shape != wanted:
            raise ModelError(
                f"tensor {name!r} has shape {list(info.shape)}; the {arch.name}.* metadata "
                f"(hidden {config['hidden_size']}, heads {config['num_attention_heads']}/"
                f"{config['num_key_value_heads']} of {config['head_dim']}, feed-forward "
                f"{config['intermediate_size']}, vocabulary {config['vocab_size']}) "
                f"implies {list(wanted)}",
                location=Location(str(gguf.path), field=name),
            )
    for name in shapes:
        if name not in gguf.tensors and not optional_tensor(name, arch):
            raise ModelError(
                f"tensor {name!r} is missing ({arch.name}.block_count is {layers})",
                location=Location(str(gguf.path), field=name),
            )


def hf_name(name: str) -> str | None:
    """The Hugging Face name of GGUF tensor ``name``, or ``None`` for one that is dropped."""
    if name in _SKIPPED:
        return None
    stem, _, suffix = name.rpartition(".")
    if stem in _GLOBAL_TENSORS:
        return f"{_GLOBAL_TENSORS[stem]}.{suffix}"
    parts = stem.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in LAYER_TENSORS:
        return f"model.layers.{parts[1]}.{LAYER_TENSORS[parts[2]]}.{suffix}"
    return None


def is_linear_weight(name: str) -> bool:
    """``name`` is the weight of a decoder layer's linear projection (``blk.N.attn_q.weight``)."""
    parts = name.split(".")
    return (
        len(parts) == 4
        and parts[0] == "blk"
        and parts[2] in LINEAR_TENSORS
        and parts[3] == "weight"
    )


def unpermute(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's rotary permutation of the rows of a Q or K weight (or bias, or any
    tensor with one row per output channel) with ``num_heads``.

    llama.cpp writes each head's rows as interleaved pairs ``(0, d/2, 1, d/2 + 1, ...)``;
    Hugging Face keeps the halves apart ``(0, 1, ..., d/2 - 1, d/2, ...)``.
    """
    rows = weight.shape[0]
    half = rows // num_heads // 2
    grouped = weight.reshape(num_heads, half, 2, *weight.shape[1:])
    return grouped.transpose(1, 2).reshape(weight.shape).contiguous()


def qk_heads(name: str, config: dict[str, Any], arch: Architecture) -> int | None:
    """The head count to un-permute tensor ``name`` by, or ``None`` when it is not permuted."""
    if not arch.permuted_qk:
        return None
    if ".attn_q." in name:
        return int(config["num_attention_heads"])
    if ".attn_k." in name:
        return int(config["num_key_value_heads"])
    return None
