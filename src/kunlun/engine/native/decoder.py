"""The compiled decode step of a loaded model: :class:`CompiledDecoder` hands the model's
tensors to ``torch.classes.kunlun.Decoder`` (``decode.cpp``) once, then runs each step whose
sequences all compute one token through it, with no Python per layer.

:func:`compiled_decoder` says whether a model qualifies, and why not: the C++ step reads the
tensors' memory directly, so it serves models on the CPU, in float32 or bfloat16, on one rank,
whose linear layers are floating or run the int8pack or int4pack kernel; anything else runs the reference
path (the model's own modules), which every step that prefills runs anyway.
"""

from __future__ import annotations

import torch
from torch import nn

from kunlun.engine.attention import PagedAttention
from kunlun.engine.kernels import candidates
from kunlun.engine.models.llama import LlamaForCausalLM
from kunlun.engine.models.quant_linear import DEQUANTIZE_FROM_TOKENS, QuantLinear

#: Linear kinds of decode.cpp, by the eager kernel they stand for.
KINDS = {"linear": 0, "w8a16": 1, "int4pack": 2, "w8a8": 3}


class CompiledDecoder:
    """A model's decode steps in C++ (the library must be loaded: :func:`native.load`)."""

    def __init__(self, model: LlamaForCausalLM) -> None:
        self._model = model
        config = model.config
        inner = model.model
        attention = model.attention_layers()
        self._decoder = torch.classes.kunlun.Decoder(
            attention[0].num_heads, attention[0].num_kv_heads, config.head_dim,
            config.rms_norm_eps, inner.embed_tokens.weight, inner.norm.weight,
            inner.rotary.cos, inner.rotary.sin,
        )  # fmt: skip
        for layer, attn in zip(inner.layers, attention, strict=True):
            mlp = layer.mlp
            for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, mlp.gate_up_proj,
                           mlp.down_proj):  # fmt: skip
                self._decoder.add_linear(*_linear_args(linear))
            q_norm, k_norm = layer.self_attn.q_norm, layer.self_attn.k_norm
            self._decoder.add_layer(
                layer.input_layernorm.weight, layer.post_attention_layernorm.weight,
                None if q_norm is None else q_norm.weight,
                None if k_norm is None else k_norm.weight, attn.k_cache, attn.v_cache,
            )  # fmt: skip

    def step(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
    ) -> torch.Tensor:
        """Final-norm hidden states [B, hidden] of ``B`` sequences computing one token each:
        their token ids, positions and cache slots [B], padded block tables [B, n] and
        context lengths [B] (long tensors)."""
        return self._decoder.step(input_ids, positions, slots, block_tables, context_lens)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits [B, vocab] of final hidden states [B, hidden]: an int8 LM head
        through the compiled int8 kernel (the eager int8pack kernel's results, faster), below
        :data:`DEQUANTIZE_FROM_TOKENS` rows as the eager path does; else the model's."""
        head = self._model.lm_head.int8
        if head is None or hidden.shape[0] >= DEQUANTIZE_FROM_TOKENS:
            return self._model.compute_logits(hidden).float()
        logits = torch.ops.kunlun.int8_matmul(hidden, head.weight, head.scale)
        return logits.to(hidden.dtype).float()  # rounded as the eager head rounds them


def _linear_args(linear: nn.Module) -> tuple[object, ...]:
    if isinstance(linear, QuantLinear):
        if linear.kernel == "int4pack":
            group = linear.spec.group_size or linear.in_features
            return KINDS["int4pack"], linear._packed, linear._scales_zeros, linear.bias, group
        return KINDS[linear.spec.scheme], linear.weight, linear.weight_scale, linear.bias, 0
    assert isinstance(linear, nn.Linear)
    return KINDS["linear"], linear.weight, None, linear.bias, 0


def unsupported(model: nn.Module, tp_size: int) -> str | None:
    """Why ``model`` cannot take the compiled decode step, or None when it can."""
    if not isinstance(model, LlamaForCausalLM):
        return f"{type(model).__name__} has no compiled decode step"
    weight = model.model.embed_tokens.weight
    if candidates("decode", weight.device.type, "none")[0].key != "compiled":
        return f"the compiled decode step does not run on {weight.device.type}"
    if weight.dtype not in (torch.float32, torch.bfloat16):
        return (
            f"the compiled decode step runs float32 and bfloat16 models; this one is {weight.dtype}"
        )
    if tp_size > 1:
        return f"the compiled decode step runs on one rank; this model is split over {tp_size}"
    if not all(isinstance(m, PagedAttention) for m in model.attention_layers()):
        return "an attention layer is not paged attention"
    for name, module in model.named_modules():
        if not isinstance(module, QuantLinear):
            continue
        if module.kernel not in ("int8pack", "int4pack"):
            return f"{name} runs the {module.kernel} kernel, which the compiled step lacks"
        if module.kernel == "int8pack" and module.in_features % 16:
            return f"{name} has {module.in_features} input features, not a multiple of 16"
    head = model.lm_head.int8
    if head is not None and head.weight.shape[1] % 16:
        return f"the LM head has {head.weight.shape[1]} input features, not a multiple of 16"
    return None
