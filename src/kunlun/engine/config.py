"""The model's shape as the engine needs it: :class:`~kunlun.hf_config.HFConfig` plus torch.

Reading and checking ``config.json`` is :mod:`kunlun.hf_config`'s (shared with the torch-free
planner); :class:`ModelConfig` adds only what concerns the engine: the checkpoint dtype as a
``torch.dtype``, and a check that the RoPE scaling is one the rotary embedding implements.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Self

import torch

from kunlun.errors import Location, ModelError
from kunlun.hf_config import SUPPORTED_ARCHITECTURES, HFConfig

#: RoPE scaling types the rotary embedding implements (``None`` is plain RoPE).
SUPPORTED_ROPE_TYPES: tuple[str, ...] = ("default", "llama3")

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}

#: What llama3 RoPE scaling computes its frequencies from.
_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


@dataclass(frozen=True)
class ModelConfig(HFConfig):
    """Shape and constants of a Llama-family decoder, for the model code, loader and runner.

    ``rope_scaling``, when not ``None``, has its ``rope_type`` in :data:`SUPPORTED_ROPE_TYPES`.

    Sliding-window attention (Mistral's ``sliding_window``, Qwen2's ``use_sliding_window``) is
    not implemented: every layer uses full causal attention, which is exact for any context
    up to the window size and is what transformers' sdpa path does for these models when the
    window is not reached.
    """

    @property
    def torch_dtype(self) -> torch.dtype | None:
        """The dtype the checkpoint was saved in, when the config says."""
        return _DTYPES.get(self.dtype or "")

    @property
    def num_queries_per_kv(self) -> int:
        """Query heads sharing one key/value head."""
        return self.num_attention_heads // self.num_key_value_heads

    @classmethod
    def from_dict(cls, raw: dict[str, Any], *, source: str = "config.json") -> Self:
        """Build from the parsed JSON of a ``config.json``; ``source`` names it in errors.

        Beyond :meth:`HFConfig.from_dict`'s checks, raises :class:`ModelError` when the RoPE
        scaling is not one of :data:`SUPPORTED_ROPE_TYPES` or lacks a parameter it needs.
        """
        config = super().from_dict(raw, source=source)
        scaling = config.rope_scaling
        if scaling is None:
            return config
        rope_type = scaling["rope_type"]
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ModelError(
                f"rope scaling type {rope_type!r} is not supported; supported: "
                + ", ".join(SUPPORTED_ROPE_TYPES),
                location=Location(source, field="rope_scaling"),
            )
        for key in _LLAMA3_KEYS:
            if key not in scaling:
                raise ModelError(
                    f"llama3 rope scaling needs {key!r}",
                    location=Location(source, field=f"rope_scaling.{key}"),
                )
        return config


__all__ = ["SUPPORTED_ARCHITECTURES", "SUPPORTED_ROPE_TYPES", "ModelConfig"]
