"""GGUF files of Hugging Face checkpoints, written llama.cpp style with the reference ``gguf``
writer, in any mix of tensor types, including the K-quants the ``gguf`` package cannot write.

- :func:`write_hf_gguf`: a checkpoint directory (a tiny random model) as a llama, qwen2 or
  qwen3 GGUF, with a vocabulary taken from another GGUF file.
- :func:`write_gguf`: tensors given by GGUF name (any shapes) plus hyperparameters.
- :func:`quantize_q4_k`, :func:`quantize_q6_k`: small numpy quantizers (plain rounding,
  correct block format; not llama.cpp's search for the best scales).
- :func:`reference`: every tensor of a file dequantized by the ``gguf`` package;
  :func:`unpack`: a w4a16 tensor of an imported directory back to float32, by the format's
  definition (``w = q * scale + min``).
- :func:`write_demo_kquant_gguf`: the demo model, from its float32 import, as a K-quant GGUF
  the way llama.cpp quantizes it (the K type where a row is a multiple of 256, a fallback
  type elsewhere). A serving test can call it to get a K-quant file of a real model.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import gguf as gguf_py
import numpy as np
import torch

QT = gguf_py.GGMLQuantizationType
QK_K = 256

_GGUF_NAMES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's ``convert_hf_to_gguf`` permutation of a llama Q/K weight (or bias)."""
    rows = weight.shape[0]
    grouped = weight.reshape(num_heads, 2, rows // num_heads // 2, *weight.shape[1:])
    return grouped.swapaxes(1, 2).reshape(weight.shape)


def gguf_name(hf_name: str) -> str:
    if hf_name.startswith("model.layers."):
        _, _, index, rest = hf_name.split(".", 3)
        module, suffix = rest.rsplit(".", 1)
        return f"blk.{index}.{_GGUF_NAMES[module]}.{suffix}"
    return {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }[hf_name]


def _f16(values: np.ndarray) -> np.ndarray:
    """float16 of ``values`` [n] as bytes [n, 2]."""
    return values.astype(np.float16).reshape(-1, 1).view(np.uint8)


def _ratio(numerator: np.ndarray, denominator: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(denominator == 0, 0.0, numerator / denominator)


def quantize_q4_k(rows: np.ndarray) -> np.ndarray:
    """Q4_K blocks of float32 ``rows`` [n, k * 256] -> uint8 [n, k * 144].

    Each sub-block of 32 gets ``scale = (max - min) / 15`` and ``min`` (clamped to <= 0); the
    eight scales and minimums are rounded to 6 bits against the block's ``d`` and ``dmin``.
    """
    blocks = rows.astype(np.float32).reshape(-1, 8, 32)
    low = np.minimum(blocks.min(axis=-1), 0.0)
    scale = (blocks.max(axis=-1) - low) / 15.0
    d = (scale.max(axis=-1) / 63.0).astype(np.float16).astype(np.float32)
    dmin = (-low.min(axis=-1) / 63.0).astype(np.float16).astype(np.float32)
    sc = np.clip(np.rint(_ratio(scale, d[:, None])), 0, 63).astype(np.uint8)
    m = np.clip(np.rint(_ratio(-low, dmin[:, None])), 0, 63).astype(np.uint8)
    step = d[:, None] * sc
    offset = dmin[:, None] * m
    q = np.clip(np.rint(_ratio(blocks + offset[..., None], step[..., None])), 0, 15)
    q = q.astype(np.uint8).reshape(-1, 4, 2, 32)
    qs = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(-1, 128)
    packed = np.concatenate(
        [
            sc[:, :4] | ((sc[:, 4:] >> 4) << 6),
            m[:, :4] | ((m[:, 4:] >> 4) << 6),
            (sc[:, 4:] & 0x0F) | ((m[:, 4:] & 0x0F) << 4),
        ],
        axis=1,
    )
    out = np.concatenate([_f16(d), _f16(dmin), packed, qs], axis=1)
    return out.reshape(rows.shape[0], -1)


def quantize_q6_k(rows: np.ndarray) -> np.ndarray:
    """Q6_K blocks of float32 ``rows`` [n, k * 256] -> uint8 [n, k * 210]: 16 sub-blocks of
    16 with an int8 scale against the block's ``d``, values -32..31."""
    blocks = rows.astype(np.float32).reshape(-1, 16, 16)
    scale = np.abs(blocks).max(axis=-1) / 31.0
    d = (scale.max(axis=-1) / 127.0).astype(np.float16).astype(np.float32)
    sc = np.clip(np.rint(_ratio(scale, d[:, None])), -128, 127).astype(np.int8)
    step = d[:, None] * sc
    q = np.clip(np.rint(_ratio(blocks, step[..., None])), -32, 31) + 32
    q = q.astype(np.uint8).reshape(-1, 2, 128)
    ql = (q[:, :, :64] & 0x0F) | ((q[:, :, 64:] & 0x0F) << 4)
    high = (q >> 4).reshape(-1, 2, 4, 32)
    qh = high[:, :, 0] | (high[:, :, 1] << 2) | (high[:, :, 2] << 4) | (high[:, :, 3] << 6)
    out = np.concatenate(
        [ql.reshape(-1, 128), qh.reshape(-1, 64), sc.view(np.uint8), _f16(d)], axis=1
    )
    return out.reshape(rows.shape[0], -1)


def quantize(array: np.ndarray, qtype: QT) -> np.ndarray:
    """``array`` (2-D, float32) in ``qtype``'s blocks (the ``gguf`` package's quantizers, plus
    ours for Q4_K and Q6_K)."""
    if qtype == QT.Q4_K:
        return quantize_q4_k(array)
    if qtype == QT.Q6_K:
        return quantize_q6_k(array)
    return gguf_py.quants.quantize(np.ascontiguousarray(array), qtype)


def write_gguf(
    path: Path,
    architecture: str,
    hparams: dict[str, Any],
    tensors: dict[str, np.ndarray],
    types: dict[str, QT] | None = None,
    vocab_source: Any = None,
    add_bos_token: bool = False,
) -> Path:
    """Write ``tensors`` (GGUF names, torch shapes, float32) as ``architecture`` with
    ``hparams`` (HF config keys) and ``types`` per tensor (default F32). The vocabulary is
    ``vocab_source``'s (a :class:`GGUFFile`), or a tiny byte-level one when it is None."""
    writer = gguf_py.GGUFWriter(str(path), architecture)
    writer.add_block_count(hparams["num_hidden_layers"])
    writer.add_context_length(hparams.get("max_position_embeddings", 512))
    writer.add_embedding_length(hparams["hidden_size"])
    writer.add_feed_forward_length(hparams["intermediate_size"])
    writer.add_head_count(hparams["num_attention_heads"])
    writer.add_head_count_kv(hparams["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(hparams.get("rms_norm_eps", 1e-6))
    theta = hparams.get("rope_theta") or (hparams.get("rope_parameters") or {}).get("rope_theta")
    writer.add_rope_freq_base(theta or 10000.0)
    head_dim = hparams.get("head_dim") or hparams["hidden_size"] // hparams["num_attention_heads"]
    if architecture == "llama":
        writer.add_rope_dimension_count(head_dim)
    else:  # what llama.cpp's converter writes when the config has a head_dim
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    writer.add_vocab_size(hparams["vocab_size"])
    _add_vocabulary(writer, vocab_source, add_bos_token)
    for name, array in tensors.items():
        qtype = (types or {}).get(name, QT.F32)
        if qtype == QT.F32:
            writer.add_tensor(name, np.ascontiguousarray(array, dtype=np.float32))
        elif qtype in (QT.F16, QT.BF16):
            writer.add_tensor(
                name, gguf_py.quants.quantize(array.astype(np.float32), qtype), raw_dtype=qtype
            )
        else:
            writer.add_tensor(name, quantize(array, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _add_vocabulary(writer: Any, source: Any, add_bos_token: bool) -> None:
    if source is None:
        from tests.engine.gguf_bytes import MERGES, TOKENS

        tokens, token_types, merges, pre = list(TOKENS), [1] * len(TOKENS), list(MERGES), "smollm"
        bos, eos, pad, template = len(TOKENS) - 1, len(TOKENS) - 2, None, None
    else:
        meta = source.metadata
        tokens, token_types = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"]
        merges, pre = meta["tokenizer.ggml.merges"], meta["tokenizer.ggml.pre"]
        bos, eos, template = 1, 2, meta.get("tokenizer.chat_template")
        pad = meta.get("tokenizer.ggml.padding_token_id")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(token_types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(bos)
    writer.add_eos_token_id(eos)
    writer.add_add_bos_token(add_bos_token)
    if pad is not None:
        writer.add_pad_token_id(pad)
    if template is not None:
        writer.add_chat_template(template)


def hf_tensors(model_dir: Path, architecture: str) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """``(config, tensors by GGUF name)`` of the checkpoint in ``model_dir``, llama's Q/K
    permuted as llama.cpp's converter does."""
    from safetensors.torch import load_file

    config = json.loads((model_dir / "config.json").read_text())
    tensors = {}
    for name, tensor in load_file(str(model_dir / "model.safetensors")).items():
        array = tensor.float().numpy()
        if architecture == "llama" and ".q_proj." in name:
            array = permute(array, config["num_attention_heads"])
        elif architecture == "llama" and ".k_proj." in name:
            array = permute(array, config["num_key_value_heads"])
        tensors[gguf_name(name)] = array
    return config, tensors


def write_hf_gguf(
    path: Path,
    model_dir: Path,
    vocab_source: Any,
    types: dict[str, QT] | None = None,
    architecture: str = "llama",
    add_bos_token: bool = False,
) -> Path:
    """Write the HF checkpoint in ``model_dir`` as an ``architecture`` GGUF, llama.cpp style."""
    config, tensors = hf_tensors(model_dir, "llama" if architecture == "gpt2" else architecture)
    return write_gguf(path, architecture, config, tensors, types, vocab_source, add_bos_token)


def kquant_types(
    tensors: dict[str, np.ndarray], linear_type: QT, fallback: QT, embedding_type: QT
) -> dict[str, QT]:
    """llama.cpp's choice for a K-quant file: ``linear_type`` for the decoder's projections
    whose rows are a multiple of 256, ``fallback`` for the others, ``embedding_type`` for the
    embedding and output head, F32 for norms."""
    types = {}
    for name, array in tensors.items():
        if name.startswith(("token_embd.", "output.")):
            types[name] = embedding_type
        elif array.ndim == 2:
            types[name] = linear_type if array.shape[1] % QK_K == 0 else fallback
    return types


def write_demo_kquant_gguf(
    path: Path,
    demo_model_dir: Path,
    demo_gguf: Path,
    linear_type: QT = QT.Q4_K,
    fallback: QT = QT.Q5_0,
    embedding_type: QT = QT.Q8_0,
) -> Path:
    """The demo model (its float32 import in ``demo_model_dir``) as a K-quant GGUF at
    ``path``, with the demo GGUF's own vocabulary and chat template.

    SmolLM2-135M's hidden size (576) is not a multiple of 256: as in llama.cpp's Q4_K_M of
    it, only ``ffn_down`` (rows of 1536) takes ``linear_type``; the other projections take
    ``fallback`` (llama.cpp's: Q5_0 for Q4_K, Q8_0 for Q6_K; Q4_0 makes every projection
    4-bit) and the embedding ``embedding_type``.
    """
    from kunlun.engine.gguf_reader import GGUFFile

    config, tensors = hf_tensors(demo_model_dir, "llama")
    types = kquant_types(tensors, linear_type, fallback, embedding_type)
    return write_gguf(path, "llama", config, tensors, types, GGUFFile(demo_gguf))


def reference(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of ``path`` dequantized by the ``gguf`` package, in torch shape."""
    out = {}
    for tensor in gguf_py.GGUFReader(str(path)).tensors:
        values = gguf_py.quants.dequantize(tensor.data, tensor.tensor_type)
        shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
        out[tensor.name] = torch.from_numpy(np.array(values, dtype=np.float32)).reshape(shape)
    return out


def unpack(prefix: str, state: dict[str, torch.Tensor]) -> torch.Tensor:
    """``w = q * scale + min`` of a w4a16 tensor, by the format's definition."""
    packed = state[f"{prefix}.weight_packed"]
    q = torch.stack((packed & 0x0F, packed >> 4), dim=-1).reshape(packed.shape[0], -1)
    groups = q.reshape(q.shape[0], -1, 32).float()
    scale, minimum = state[f"{prefix}.weight_scale"], state[f"{prefix}.weight_min"]
    return (groups * scale.unsqueeze(-1) + minimum.unsqueeze(-1)).reshape(q.shape)
