"""The Llama-family decoder: Llama, Mistral, Qwen2 and Qwen3 through config switches.

Differences between the four are flags of :class:`~kunlun.engine.config.ModelConfig`:
``attention_bias`` (Qwen2's q/k/v bias), ``qk_norm`` (Qwen3's per-head RMSNorm on queries and
keys), ``rope_scaling`` (Llama 3) and ``tie_word_embeddings``. Parameter names follow the
Hugging Face checkpoints, except that q/k/v become one ``qkv_proj`` and gate/up one
``gate_up_proj`` (see :meth:`LlamaForCausalLM.checkpoint_slot`).

Under tensor parallelism (a :class:`~kunlun.engine.parallel.TPGroup` of more than one rank)
q/k/v and gate/up are column-parallel, o_proj and down_proj row-parallel (one all-reduce
each), the embedding and LM head vocabulary-parallel, heads split as
:mod:`kunlun.engine.tp_layout` says; each rank's modules hold only its slices.
"""

from __future__ import annotations

import torch
from torch import nn

from kunlun.engine.attention import AttentionContext, PagedAttention
from kunlun.engine.config import ModelConfig
from kunlun.engine.models.layers import (
    FusedLinear,
    ParallelLMHead,
    RMSNorm,
    RotaryEmbedding,
    RowParallelLinear,
    SiluAndMul,
    VocabParallelEmbedding,
    apply_rotary,
)
from kunlun.engine.parallel import SINGLE, TPGroup
from kunlun.engine.tp_layout import even_split, head_split

#: Checkpoint projection -> the fused module that holds it.
FUSED_PROJECTIONS: dict[str, str] = {
    "q_proj": "qkv_proj",
    "k_proj": "qkv_proj",
    "v_proj": "qkv_proj",
    "gate_proj": "gate_up_proj",
    "up_proj": "gate_up_proj",
}


class LlamaAttention(nn.Module):
    """Self-attention with fused q/k/v projection, RoPE, optional q/k norm and paged KV."""

    def __init__(self, config: ModelConfig, group: TPGroup = SINGLE) -> None:
        super().__init__()
        split = head_split(
            config.num_attention_heads, config.num_key_value_heads, group.size, group.rank
        )
        self.num_heads = split.q.size
        self.num_kv_heads = split.kv.size
        self.head_dim = config.head_dim
        q_rows, kv_rows = split.q.scaled(self.head_dim), split.kv.scaled(self.head_dim)
        self.qkv_proj = FusedLinear(
            config.hidden_size,
            {"q_proj": q_rows.size, "k_proj": kv_rows.size, "v_proj": kv_rows.size},
            bias=config.attention_bias,
            sources={"q_proj": q_rows.start, "k_proj": kv_rows.start, "v_proj": kv_rows.start},
        )
        self.o_proj = RowParallelLinear(
            q_rows, config.hidden_size, bias=config.o_proj_bias, group=group
        )
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, self.head_dim)

    def forward(
        self, hidden: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], ctx: AttentionContext
    ) -> torch.Tensor:
        """Attention output [T, hidden] for ``hidden`` [T, hidden]; ``rope`` is (cos, signed sin)."""
        num_tokens = hidden.shape[0]
        heads, kv_heads = self.num_heads, self.num_kv_heads
        qkv = self.qkv_proj(hidden).view(num_tokens, heads + 2 * kv_heads, self.head_dim)
        qk = qkv[:, : heads + kv_heads]
        if self.q_norm is not None and self.k_norm is not None:
            qk = torch.cat((self.q_norm(qk[:, :heads]), self.k_norm(qk[:, heads:])), dim=1)
        qk = apply_rotary(qk, *rope)
        out = self.attn(qk[:, :heads], qk[:, heads:], qkv[:, heads + kv_heads :], ctx)
        return self.o_proj(out)


class LlamaMLP(nn.Module):
    """Gated MLP: ``down(silu(gate(x)) * up(x))`` with gate and up fused."""

    def __init__(self, config: ModelConfig, group: TPGroup = SINGLE) -> None:
        super().__init__()
        rows = even_split(config.intermediate_size, group.size, group.rank)
        self.gate_up_proj = FusedLinear(
            config.hidden_size,
            {"gate_proj": rows.size, "up_proj": rows.size},
            bias=config.mlp_bias,
            sources={"gate_proj": rows.start, "up_proj": rows.start},
        )
        self.down_proj = RowParallelLinear(
            rows, config.hidden_size, bias=config.mlp_bias, group=group
        )
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """MLP output [T, hidden] for ``x`` [T, hidden]."""
        return self.down_proj(self.act(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    """Pre-norm residual block: attention then MLP."""

    def __init__(self, config: ModelConfig, group: TPGroup = SINGLE) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, group)
        self.mlp = LlamaMLP(config, group)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, hidden: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], ctx: AttentionContext
    ) -> torch.Tensor:
        """The residual stream after this layer."""
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), rope, ctx)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class LlamaModel(nn.Module):
    """Embedding, decoder layers and the final norm."""

    def __init__(self, config: ModelConfig, max_positions: int, group: TPGroup = SINGLE) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, group)
        self.rotary = RotaryEmbedding(
            config.head_dim, max_positions, config.rope_theta, config.rope_scaling
        )
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, group) for _ in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: AttentionContext
    ) -> torch.Tensor:
        """Final hidden states [T, hidden] of the flat batch ``input_ids`` [T]."""
        hidden = self.embed_tokens(input_ids)
        rope = self.rotary.table(positions)
        for layer in self.layers:
            hidden = layer(hidden, rope, ctx)
        return self.norm(hidden)


class LlamaForCausalLM(nn.Module):
    """Decoder plus LM head; the one model class behind every supported architecture."""

    def __init__(
        self, config: ModelConfig, max_positions: int | None = None, group: TPGroup = SINGLE
    ) -> None:
        super().__init__()
        self.config = config
        self.group = group
        self.model = LlamaModel(config, max_positions or config.max_position_embeddings, group)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, group)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: AttentionContext
    ) -> torch.Tensor:
        """Hidden states [num_tokens, hidden] for the flat batch of ``input_ids``."""
        return self.model(input_ids, positions, ctx)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [n, vocab] for hidden states [n, hidden] (gathered on every rank)."""
        return self.lm_head.logits(hidden)

    def attention_layers(self) -> list[PagedAttention]:
        """The paged-attention modules, one per layer, in order."""
        return [module for module in self.modules() if isinstance(module, PagedAttention)]

    def checkpoint_slot(self, name: str) -> tuple[str, str | None]:
        """Where checkpoint tensor ``name`` goes: ``(parameter name, shard or None)``.

        ``model.layers.0.self_attn.k_proj.weight`` -> ``("model.layers.0.self_attn.qkv_proj
        .weight", "k_proj")``; unfused names map to themselves with no shard.
        """
        parts = name.split(".")
        if len(parts) >= 2 and parts[-2] in FUSED_PROJECTIONS:
            shard = parts[-2]
            parts[-2] = FUSED_PROJECTIONS[shard]
            return ".".join(parts), shard
        return name, None
