"""Model code for the portable engine, and the registry from architecture name to class.

Every model takes a :class:`~kunlun.engine.config.ModelConfig`, runs
``forward(input_ids [T], positions [T], ctx) -> hidden [T, hidden]`` over a flat batch of
tokens from many sequences, and ``compute_logits(hidden) -> logits``.
"""

from __future__ import annotations

import torch

from kunlun.engine.config import SUPPORTED_ARCHITECTURES, ModelConfig
from kunlun.engine.models.llama import LlamaForCausalLM
from kunlun.engine.parallel import SINGLE, TPGroup
from kunlun.errors import UnsupportedArchitecture

#: Architecture name (``config.json`` ``architectures[0]``) -> model class.
MODEL_REGISTRY: dict[str, type[LlamaForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
}


def build_model(
    config: ModelConfig, max_positions: int | None = None, group: TPGroup = SINGLE
) -> LlamaForCausalLM:
    """An uninitialized model for ``config``, this rank's slices of it under tensor
    parallelism (weights come from the loader)."""
    cls = MODEL_REGISTRY.get(config.architecture)
    if cls is None:
        raise UnsupportedArchitecture(
            f"architecture {config.architecture!r} is not supported; supported: "
            + ", ".join(SUPPORTED_ARCHITECTURES)
        )
    return cls(config, max_positions, group)


def materialize(model: torch.nn.Module, device: torch.device, dtype: torch.dtype) -> None:
    """Give a model built on the meta device real, uninitialized storage on ``device``, its
    floating-point tensors in ``dtype``: what ``to_empty`` and then ``to(dtype)`` do, without
    the float32 copy in between, and by ``torch.empty``. (``to_empty``'s ``empty_like`` of a
    meta tensor imports torch's symbolic-shape machinery and sympy: 0.3 s of CPU, a quarter
    of a tiny model's worker start.)"""

    def empty(tensor: torch.Tensor) -> torch.Tensor:
        kind = dtype if tensor.is_floating_point() else tensor.dtype
        return torch.empty(tensor.shape, dtype=kind, device=device)

    model._apply(empty)  # what to_empty runs too: parameters stay parameters


__all__ = ["MODEL_REGISTRY", "LlamaForCausalLM", "build_model", "materialize"]
