"""Activation smoothing for w8a8 (:mod:`kunlun.engine.smooth`): the folded weights compute
the same function as the checkpoint's (exactly, up to float rounding, with grouped-query
attention and biases), flatten the activations the int8 quantizer sees, and are used only
where a floating checkpoint is quantized to w8a8."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tests.engine.conftest import TinyFactory

from kunlun.engine.convert import write_quantized
from kunlun.engine.loader import load_weights
from kunlun.engine.model_runner import ModelRunner, StepSeq
from kunlun.engine.quant import make_spec
from kunlun.engine.smooth import smoothed_tensors

TOKENS = list(range(5, 45))


def _logits(runner: ModelRunner, tokens: list[int]) -> torch.Tensor:
    seq = StepSeq(tokens, 0, len(tokens), list(range(runner.num_blocks)), want_prompt_logits=True)
    out = runner.execute([seq]).prompt_logits[0]
    assert out is not None
    return out


@pytest.mark.parametrize(
    ("arch", "options"),
    [
        ("LlamaForCausalLM", {"heads": (4, 2)}),  # two query heads per KV head
        ("LlamaForCausalLM", {"heads": (4, 1), "attention_bias": True}),  # v_proj bias
        ("Qwen3ForCausalLM", {}),  # q/k norms
    ],
)
def test_smoothed_weights_compute_the_same_function(
    make_tiny_model: TinyFactory, arch: str, options: dict[str, object]
) -> None:
    source = make_tiny_model(arch, **options)
    smoothed = smoothed_tensors(source, make_spec("w8a8"))
    layer = "model.layers.0"
    for name in ("input_layernorm.weight", "post_attention_layernorm.weight",
                 "self_attn.v_proj.weight", "self_attn.o_proj.weight", "mlp.up_proj.weight",
                 "mlp.down_proj.weight"):  # fmt: skip
        assert f"{layer}.{name}" in smoothed
    runner = ModelRunner(source, num_blocks=8)
    before = _logits(runner, TOKENS)
    original = runner.model.model.layers[0].input_layernorm.weight.clone()
    load_weights(runner.model, source, smoothed)
    assert not torch.allclose(runner.model.model.layers[0].input_layernorm.weight, original)
    after = _logits(runner, TOKENS)
    torch.testing.assert_close(after, before, rtol=1e-4, atol=1e-4)


def test_smoothing_flattens_the_activations_of_the_demo(demo_model_dir: Path) -> None:
    """The largest input channel of q/k/v stands out far less from the typical one."""
    smoothed = smoothed_tensors(demo_model_dir, make_spec("w8a8"))
    runner = ModelRunner(demo_model_dir, num_blocks=8)
    seen: list[torch.Tensor] = []
    module = runner.model.model.layers[3].self_attn.qkv_proj
    handle = module.register_forward_pre_hook(lambda _m, args: seen.append(args[0].abs()))
    try:
        for weights in ({}, smoothed):
            load_weights(runner.model, demo_model_dir, weights)
            _logits(runner, TOKENS)
    finally:
        handle.remove()
    ratios = []
    for inputs in seen:
        per_channel = inputs.amax(dim=0)
        ratios.append(float(per_channel.max() / per_channel.median()))
    print(f"\nq/k/v input max / median channel: {ratios[0]:.1f} -> {ratios[1]:.1f}")
    assert ratios[1] < ratios[0] / 2


def test_only_a_floating_checkpoint_quantized_to_w8a8_is_smoothed(
    make_tiny_model: TinyFactory, tmp_path: Path
) -> None:
    source = make_tiny_model("LlamaForCausalLM")
    for scheme in ("none", "w8a16", "w4a16"):
        assert smoothed_tensors(source, make_spec(scheme)) == {}
    spec = make_spec("w8a8")
    write_quantized(source, tmp_path / "q", None, spec, link_files=False)
    assert smoothed_tensors(tmp_path / "q", spec) == {}  # already quantized (and smoothed)
