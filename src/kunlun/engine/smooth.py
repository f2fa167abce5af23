"""Activation smoothing for ``w8a8`` (SmoothQuant), folded into the floating weights.

Per-token int8 activations lose most where a few input channels carry far larger values than
the rest (the per-token scale follows the outliers, every other channel gets a coarse step).
For each quantized linear layer ``y = x W^T`` and each input channel ``j``, smoothing divides
``x_j`` by ``s_j = max|x_j| ** alpha / max|W[:, j]| ** (1 - alpha)`` and multiplies column
``j`` of ``W`` by it: the product is unchanged, the activations are flatter, the weights
(quantized per output row) take the difference. The division is folded into what produces
``x``, so the model computes the same function and the on-disk format does not change:

- q/k/v (one ``s`` over the three): into ``input_layernorm.weight``;
- gate/up: into ``post_attention_layernorm.weight``;
- down_proj: into the rows of ``up_proj`` (its input is ``silu(gate) * up``, linear in up);
- o_proj: into the rows of ``v_proj``. Input channel ``(h, d)`` of o_proj is ``d`` of query
  head ``h``'s attention output, a mix of rows ``(g, d)`` of v_proj for the KV head ``g`` that
  ``h`` reads; under grouped-query attention several query heads read one KV head, so one
  factor is shared by the channels ``(h, d)`` of the heads of a group (taken over all of
  them), which keeps the fold exact.

The statistics (per-input-channel ``max|x|`` of each layer) come from one forward pass of the
floating model, in float32 on the CPU, over :data:`CALIBRATION_TEXT` (a few hundred tokens of
varied English written for this; not any text the quality tests measure on).

:func:`smoothed_tensors` is the one entry point: every path that quantizes a floating
checkpoint to ``w8a8`` (:func:`kunlun.engine.convert.write_quantized` and the loader's
quantize-while-loading) takes the replacement tensors it returns in place of the
checkpoint's.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from kunlun.engine.config import ModelConfig
from kunlun.engine.loader import checkpoint_files
from kunlun.engine.quant import QuantSpec, read_spec
from kunlun.engine.tokenizer import Tokenizer

#: Migration strength per layer: 0 leaves the activations alone, 1 moves all their range to
#: the weights. Chosen on the demo model (docs/quantization.md gives the measurements).
ALPHAS: dict[str, float] = {"qkv_proj": 0.6, "o_proj": 0.6, "gate_up_proj": 0.6, "down_proj": 0.5}
#: Floor of a channel's statistics (a channel never seen non-zero keeps factor 1).
_EPS = 1e-5

CALIBRATION_TEXT = """\
The old lighthouse keeper climbed the spiral stairs every evening at dusk, carrying a tin \
of oil and a cloth for the great lens. Ships passing the rocky point had relied on his lamp \
for forty years, and he had never once let it go dark.

To bake a simple loaf of bread, mix four cups of flour with a teaspoon of salt, a packet of \
yeast and one and a half cups of warm water. Knead the dough for ten minutes, let it rise \
for an hour, shape it, and bake at 220 degrees Celsius for about thirty minutes.

Question: Why do leaves change colour in autumn?
Answer: As the days grow shorter, trees stop making chlorophyll, the green pigment that \
captures sunlight. When it fades, yellow and orange pigments that were there all along \
become visible, and some trees also produce red pigments from the sugars left in the leaf.

The mitochondrion is often called the powerhouse of the cell. It converts the energy \
stored in glucose into adenosine triphosphate, a molecule that drives most of the chemical \
work inside living things.

def average(values):
    \"\"\"Return the arithmetic mean of a non-empty list of numbers.\"\"\"
    total = 0
    for value in values:
        total += value
    return total / len(values)

Dear Margaret, thank you for your kind letter. The garden is full of tulips this spring, \
and the children have planted a row of beans along the fence. We hope you can visit us in \
June, when the roses are in bloom.

In 1969, the Apollo 11 mission carried three astronauts to the Moon. Neil Armstrong and \
Buzz Aldrin walked on the surface for about two and a half hours while Michael Collins \
orbited above in the command module.

User: Can you suggest three names for a small grey cat?
Assistant: Of course! How about Smoke, Pebble or Misty? Each one suits a quiet, curious cat.

Rivers shape the land over thousands of years. They carve valleys, carry sand and silt \
toward the sea, and build wide deltas where they finally slow down. Many of the world's \
great cities, from Cairo to Paris, grew up along their banks.

1. Preheat the oven. 2. Grease the pan. 3. Pour in the batter. 4. Bake until golden.

Mathematics is the study of quantity, structure, space and change. The sum of the angles \
of a triangle is 180 degrees, and the square of 12 is 144.
"""


def smoothed_tensors(
    model_dir: str | Path, spec: QuantSpec | None, *, alphas: dict[str, float] | None = None
) -> dict[str, torch.Tensor]:
    """Checkpoint name -> float32 tensor to use in place of the checkpoint's, so that
    quantizing ``model_dir`` by ``spec`` quantizes the smoothed model.

    Empty unless ``spec`` is ``w8a8`` and ``model_dir`` holds floating-point weights (a
    quantized checkpoint was smoothed, or not, when it was written). Replaces the two
    RMSNorm weights and the q/k/v, o, gate/up and down weights of every decoder layer (and
    the v_proj and up_proj biases where the checkpoint has them).
    """
    if spec is None or spec.scheme != "w8a8" or read_spec(model_dir) is not None:
        return {}
    alpha = ALPHAS if alphas is None else alphas
    config, stats = _calibrate(Path(model_dir))
    group = config.num_attention_heads // config.num_key_value_heads
    head_dim = config.head_dim
    out: dict[str, torch.Tensor] = {}
    tensors = _read_layer_tensors(Path(model_dir))
    for index in range(config.num_hidden_layers):
        layer = f"model.layers.{index}"
        attn, mlp = f"{layer}.self_attn", f"{layer}.mlp"

        def get(name: str) -> torch.Tensor:
            return (out[name] if name in out else tensors[name]).float()

        qkv = [f"{attn}.{p}.weight" for p in ("q_proj", "k_proj", "v_proj")]
        s = _factors(stats[f"{attn}.qkv_proj"], [get(n) for n in qkv], alpha["qkv_proj"])
        out[f"{layer}.input_layernorm.weight"] = get(f"{layer}.input_layernorm.weight") / s
        out.update({name: get(name) * s for name in qkv})

        gate_up = [f"{mlp}.{p}.weight" for p in ("gate_proj", "up_proj")]
        s = _factors(stats[f"{mlp}.gate_up_proj"], [get(n) for n in gate_up], alpha["gate_up_proj"])
        norm = f"{layer}.post_attention_layernorm.weight"
        out[norm] = get(norm) / s
        out.update({name: get(name) * s for name in gate_up})

        down = f"{mlp}.down_proj.weight"
        s = _factors(stats[f"{mlp}.down_proj"], [get(down)], alpha["down_proj"])
        out[down] = get(down) * s
        _divide_rows(out, tensors, f"{mlp}.up_proj", s)

        o_proj = f"{attn}.o_proj.weight"
        weight = get(o_proj)
        x_max = stats[f"{attn}.o_proj"].view(-1, group, head_dim).amax(dim=1)
        w_max = weight.abs().amax(dim=0).view(-1, group, head_dim).amax(dim=1)
        s_kv = _from_maxima(x_max, w_max, alpha["o_proj"]).reshape(-1)  # per v_proj row
        s = s_kv.view(-1, 1, head_dim).expand(-1, group, head_dim).reshape(-1)
        out[o_proj] = weight * s
        _divide_rows(out, tensors, f"{attn}.v_proj", s_kv)
    return out


def _calibrate(model_dir: Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """The model's config, and the per-input-channel ``max|x|`` of every linear layer under
    ``model.layers`` over one float32 forward pass of :data:`CALIBRATION_TEXT` on the CPU."""
    from kunlun.engine.model_runner import ModelRunner, StepSeq

    config = ModelConfig.from_dir(model_dir)
    ids = Tokenizer(model_dir).encode(CALIBRATION_TEXT)[: config.max_position_embeddings]
    block_size = 16
    blocks = math.ceil(len(ids) / block_size)
    runner = ModelRunner(model_dir, dtype=torch.float32, block_size=block_size,
                         num_blocks=blocks, max_model_len=len(ids))  # fmt: skip
    stats: dict[str, torch.Tensor] = {}
    handles = []

    def record(name: str) -> Callable[[nn.Module, tuple[torch.Tensor, ...]], None]:
        def hook(_module: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
            seen = args[0].detach().float().abs().reshape(-1, args[0].shape[-1]).amax(dim=0)
            stats[name] = seen if name not in stats else torch.maximum(stats[name], seen)

        return hook

    for name, module in runner.model.named_modules():
        if isinstance(module, nn.Linear) and ".layers." in f".{name}":
            handles.append(module.register_forward_pre_hook(record(name)))
    try:
        runner.execute([StepSeq(ids, 0, len(ids), list(range(blocks)))])
    finally:
        for handle in handles:
            handle.remove()
    return runner.config, stats


def _read_layer_tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    """The decoder layers' tensors of the checkpoint in ``model_dir``, by name."""
    tensors: dict[str, torch.Tensor] = {}
    for path in checkpoint_files(model_dir):
        with safe_open(str(path), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 - safe_open has no __iter__
                if name.startswith("model.layers."):
                    tensors[name] = handle.get_tensor(name)
    return tensors


def _factors(x_max: torch.Tensor, weights: list[torch.Tensor], alpha: float) -> torch.Tensor:
    """Per-input-channel factors for activations with maxima ``x_max`` feeding ``weights``
    (one or more [out, in] weights that read the same input)."""
    w_max = torch.cat([w.abs() for w in weights]).amax(dim=0)
    return _from_maxima(x_max, w_max, alpha)


def _from_maxima(x_max: torch.Tensor, w_max: torch.Tensor, alpha: float) -> torch.Tensor:
    x_max, w_max = x_max.float().clamp(min=_EPS), w_max.float().clamp(min=_EPS)
    return (x_max.pow(alpha) / w_max.pow(1 - alpha)).clamp(min=_EPS)


def _divide_rows(
    out: dict[str, torch.Tensor], tensors: dict[str, torch.Tensor], prefix: str, s: torch.Tensor
) -> None:
    """Divide the output rows of projection ``prefix`` (weight and bias) by ``s``."""
    for suffix, shape in (("weight", (-1, 1)), ("bias", (-1,))):
        name = f"{prefix}.{suffix}"
        current = out.get(name, tensors.get(name))
        if current is not None:
            out[name] = current.float() / s.view(shape)
