"""The compiled decode step of a loaded model: :class:`CompiledDecoder` hands the model's
tensors to ``torch.classes.kunlun.Decoder`` (``decode.cpp``) once, then runs each step whose
sequences all compute one token through it, with no Python per layer.

:func:`compiled_decoder` says whether a model qualifies, and why not: the C++ step reads the
tensors' memory directly, so it serves models on the CPU, in float32 or bfloat16, on one rank,
whose linear layers are floating or run the int8pack, int4 or int4pack kernel; anything else runs the reference
path (the model's own modules), which every step that prefills runs anyway.
"""

from __future__ import annotations

import torch
from torch import nn

from kunlun.engine.kernels import candidates
from kunlun.engine.models.llama import LlamaDecoderLayer, LlamaForCausalLM
from kunlun.engine.models.quant_linear import QuantLinear
from kunlun.engine.native import DEQUANTIZE_FROM_TOKENS, NativeStatus, choice, load, wanted_path
from kunlun.errors import ConfigError

#: Linear kinds of decode.cpp, by the eager kernel they stand for.
KINDS = {"linear": 0, "w8a16": 1, "int4pack": 2, "w8a8": 3, "int4": 4}


class CompiledDecoder:
    """A model's decode steps in C++ (the library must be loaded: :func:`native.load`)."""

    def __init__(self, model: LlamaForCausalLM) -> None:
        self._model = model
        config = model.config
        inner = model.model
        attention = model.attention_layers()
        self._int8_rows_up_to = choice().int8_rows_up_to  # measured on this CPU
        self._decoder = torch.classes.kunlun.Decoder(
            attention[0].num_heads, attention[0].num_kv_heads, config.head_dim,
            config.rms_norm_eps, inner.embed_tokens.weight, inner.norm.weight,
            inner.rotary.cos, inner.rotary.sin, self._int8_rows_up_to,
        )  # fmt: skip
        for layer, attn in zip(inner.layers, attention, strict=True):
            assert isinstance(layer, LlamaDecoderLayer)
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

    def takes(self, count: int) -> bool:
        """Whether a decode step of ``count`` sequences runs here (every one does)."""
        return count >= 1

    def decode(
        self, tokens: list[int], positions: list[int], tables: list[list[int]], block_size: int
    ) -> torch.Tensor:
        """Float32 logits [B, vocab] of ``B`` sequences computing one token each: the token,
        its position (the tokens already cached) and the sequence's block table (covering
        that position) per sequence."""
        width = max(len(table) for table in tables)
        padded = [table + [0] * (width - len(table)) for table in tables]
        slots = [t[p // block_size] * block_size + p % block_size
                 for t, p in zip(padded, positions, strict=True)]  # fmt: skip
        device = self._model.model.embed_tokens.weight.device

        def long(values: list[int] | list[list[int]]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.long, device=device)

        hidden = self._decoder.step(long(tokens), long(positions), long(slots), long(padded),
                                    long([p + 1 for p in positions]))  # fmt: skip
        return self.logits(hidden)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits [B, vocab] of final hidden states [B, hidden], through the compiled
        kernels: an int8 LM head as the eager int8pack kernel computes it (below
        :data:`DEQUANTIZE_FROM_TOKENS` rows, as the eager path does; Kunlun's rows or torch's
        kernel, whichever was measured faster at the count), a floating one as
        ``F.linear`` does (``float_matmul``: its own kernel for a few rows)."""
        head = self._model.lm_head
        if head.int8 is None:
            return torch.ops.kunlun.float_matmul(hidden, head.weight, None).float()
        if hidden.shape[0] >= DEQUANTIZE_FROM_TOKENS:
            return self._model.compute_logits(hidden).float()
        logits = torch.ops.kunlun.int8_matmul(
            hidden, head.int8.weight, head.int8.scale, self._int8_rows_up_to
        )
        return logits.to(hidden.dtype).float()  # rounded as the eager head rounds them


def compiled_decoder(
    model: nn.Module, tp_size: int, setting: str | None
) -> tuple[NativeStatus, CompiledDecoder | None]:
    """Which decode path runs for ``model`` (on ``tp_size`` ranks) under the ``decode_path``
    setting, and the compiled decoder when it is the compiled one. ``compiled`` where the
    model cannot take it is a :class:`ConfigError` naming why."""
    why = unsupported(model, tp_size)
    wanted = wanted_path(setting)
    if why is not None and wanted != "python":
        if wanted == "compiled":
            raise ConfigError(f"decode_path=compiled: {why}")
        return NativeStatus("python", why), None
    status = load(setting)
    if not status.compiled:
        return status, None
    assert isinstance(model, LlamaForCausalLM)
    return status, CompiledDecoder(model)


def _linear_args(linear: nn.Module) -> tuple[object, ...]:
    if isinstance(linear, QuantLinear):
        if linear.kernel in ("int4pack", "int4"):
            group = linear.spec.group_size or linear.in_features
            return KINDS[linear.kernel], linear._packed, linear._scales_zeros, linear.bias, group
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
    for name, module in model.named_modules():
        if not isinstance(module, QuantLinear):
            continue
        if module.kernel not in ("int8pack", "int4pack", "int4"):
            return f"{name} runs the {module.kernel} kernel, which the compiled step lacks"
        if module.kernel == "int8pack" and module.in_features % 16:
            return f"{name} has {module.in_features} input features, not a multiple of 16"
    head = model.lm_head.int8
    if head is not None and head.weight.shape[1] % 16:
        return f"the LM head has {head.weight.shape[1]} input features, not a multiple of 16"
    return None
