"""Weight quantization on tiny random models: kernels against dequantized weights, the file
format, fused shards, plan-cache conversion and the errors that name what is wrong."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from tests.engine.conftest import TinyFactory

from kunlun.engine import native
from kunlun.engine.config import ModelConfig
from kunlun.engine.convert import prepare_weights, write_quantized
from kunlun.engine.llm import LLM
from kunlun.engine.model_runner import ModelRunner, StepSeq
from kunlun.engine.models.quant_linear import QuantLinear
from kunlun.engine.native import native_ops
from kunlun.engine.quant import (
    QuantSpec,
    _int8_scales,
    dequantize,
    fit_group_size,
    make_spec,
    pack_int4,
    quantize,
    read_spec,
    resolve_spec,
    unpack_int4,
)
from kunlun.engine.sampling_params import SamplingParams
from kunlun.errors import ConfigError, ModelError
from kunlun.hf_config import HFConfig
from kunlun.planner.model_info import inspect_model

SPECS = [QuantSpec("w8a8"), QuantSpec("w8a16"), QuantSpec("w4a16", 32), QuantSpec("w4a16", 128)]
IDS = [s.describe() for s in SPECS]


def _layer(
    weight: torch.Tensor, spec: QuantSpec, bias: torch.Tensor | None, kernel: str | None = None
) -> QuantLinear:
    """A loaded layer, prepared for this CPU's kernel, or set to use ``kernel``."""
    out_features, in_features = weight.shape
    layer = QuantLinear(in_features, out_features, spec, bias=bias is not None,
                        dtype=torch.float32, device=torch.device("cpu"))  # fmt: skip
    for suffix, tensor in quantize(weight, spec).items():
        getattr(layer, suffix).copy_(tensor)
    if bias is not None and layer.bias is not None:
        layer.bias.data.copy_(bias)
    if kernel is None:
        layer.prepare()
    else:
        layer.kernel = kernel
    return layer


@pytest.mark.parametrize("spec", SPECS, ids=IDS)
@pytest.mark.parametrize("num_tokens", [1, 16])
def test_quantized_linear_agrees_with_dequantized_weights(spec: QuantSpec, num_tokens: int) -> None:
    torch.manual_seed(0)
    weight, bias = torch.randn(256, 384) * 0.05, torch.randn(256) * 0.1
    x = torch.randn(num_tokens, 384)
    canonical = quantize(weight, spec)
    dequantized = dequantize(canonical, spec)
    layer = _layer(weight, spec, bias)
    assert (
        layer.kernel == {"w8a8": "int8pack", "w8a16": "int8pack", "w4a16": "int4pack"}[spec.scheme]
    )
    # what the kernel is documented to compute: activations rounded to bf16 (w8a16, w4a16) or
    # quantized per token to int8 values (w8a8), products against the dequantized weights
    if spec.scheme == "w8a8":
        scale = x.abs().amax(-1, keepdim=True) / 127
        seen = torch.round(x / scale).clamp(-127, 127) * scale
    else:
        seen = x.bfloat16().float()
    want = F.linear(seen, dequantized, bias)
    got = layer(x)
    assert got.dtype == torch.float32 and got.shape == (num_tokens, 256)
    # the kernels round their output to bf16: relative error within a few bf16 ulps
    assert torch.allclose(got, want, rtol=2e-2, atol=2e-2 * want.abs().mean().item())
    # the fallback every device runs computes the same
    fallback = _layer(weight, spec, bias, kernel="dequantize")(x)
    exact = F.linear(x if spec.scheme != "w8a8" else seen, dequantized, bias)
    assert torch.allclose(fallback, exact, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("spec", SPECS, ids=IDS)
def test_quantization_error_is_within_half_a_step(spec: QuantSpec) -> None:
    torch.manual_seed(1)
    weight = torch.randn(64, 256)
    weight[3] = 0.0  # an all-zero row dequantizes to zeros
    canonical = quantize(weight, spec)
    error = (dequantize(canonical, spec) - weight).abs()
    if spec.scheme == "w4a16":
        assert spec.group_size is not None
        step = canonical["weight_scale"].repeat_interleave(spec.group_size, dim=1)
    else:
        step = canonical["weight_scale"][:, None].expand_as(weight)
    assert (error <= step / 2 + 1e-6).all()
    assert (dequantize(canonical, spec)[3] == 0).all()


def test_int8_scales_are_each_rows_best_clip_whatever_the_blocking() -> None:
    """The clip search runs over blocks of rows (a cache-sized block, 1 MiB): a matrix of
    many blocks gets, row for row, the scale of the row alone; that scale loses no more than
    the unclipped one (largest magnitude / 127) and is never above it."""
    torch.manual_seed(2)
    weight = torch.randn(700, 1000) * torch.rand(700, 1)  # 700 rows: 3 blocks
    weight[9] = 0.0
    scales = _int8_scales(weight)
    alone = torch.cat([_int8_scales(weight[i : i + 1]) for i in range(weight.shape[0])])
    assert torch.equal(scales, alone)

    def loss(scale: torch.Tensor) -> torch.Tensor:
        q = torch.round(weight / scale[:, None]).clamp(-127, 127)
        return ((q * scale[:, None] - weight) ** 2).sum(1)

    top = weight.abs().amax(dim=1).clamp(min=1e-30) / 127.0
    top[9] = 1 / 127.0
    assert (loss(scales) <= loss(top)).all() and (scales <= top).all()
    assert (scales < top * 0.99).sum() > 50 and scales[9] == top[9]  # Gaussian tails: clipped


def test_int4_packing_round_trips_low_nibble_first() -> None:
    values = torch.randint(0, 16, (5, 64), dtype=torch.uint8)
    packed = pack_int4(values)
    assert packed.shape == (5, 32) and packed.dtype == torch.uint8
    assert int(packed[0, 0]) == int(values[0, 0]) | int(values[0, 1]) << 4
    assert torch.equal(unpack_int4(packed), values)


@pytest.mark.parametrize("spec", SPECS, ids=IDS)
def test_fused_shards_quantized_apart_equal_the_whole(spec: QuantSpec) -> None:
    torch.manual_seed(2)
    shards = [torch.randn(rows, 256) for rows in (128, 32, 32)]
    whole = quantize(torch.cat(shards), spec)
    parts = [quantize(s, spec) for s in shards]
    for suffix, tensor in whole.items():
        assert torch.equal(tensor, torch.cat([p[suffix] for p in parts])), suffix


def test_group_size_fits_the_layers_and_names_the_one_it_does_not() -> None:
    assert fit_group_size(QuantSpec("w4a16"), {"q_proj": 256, "down_proj": 512}).group_size == 128
    assert fit_group_size(QuantSpec("w4a16"), {"q_proj": 576, "down_proj": 1536}).group_size == 32
    with pytest.raises(
        ConfigError, match=r"group_size=128 does not divide the input width 576 of q"
    ):
        fit_group_size(QuantSpec("w4a16", 128), {"q_proj": 576})
    with pytest.raises(ConfigError, match=r"group_size=64 is invalid for quantization=w4a16"):
        make_spec("w4a16", 64)
    with pytest.raises(ConfigError, match=r"quantization='int3' is not a quantization scheme"):
        make_spec("int3")


def _logits(runner: ModelRunner, token_ids: list[int]) -> torch.Tensor:
    blocks = list(range(-(-len(token_ids) // runner.block_size)))
    step = StepSeq(token_ids, 0, len(token_ids), blocks, want_prompt_logits=True)
    logits = runner.execute([step]).prompt_logits[0]
    assert logits is not None
    return logits


@pytest.mark.parametrize("scheme", ["w8a8", "w8a16", "w4a16"])
def test_written_format_loads_to_the_same_logits_as_quantizing_while_loading(
    make_tiny_model: TinyFactory, tmp_path: Path, scheme: str
) -> None:
    source = make_tiny_model("Qwen2ForCausalLM")  # q/k/v biases stay floating point
    spec = make_spec(scheme)
    assert spec is not None
    record = write_quantized(source, tmp_path / "q", None, spec, link_files=False)
    config = json.loads((tmp_path / "q" / "config.json").read_text())
    written = read_spec(tmp_path / "q")
    assert written is not None and config["quantization_config"] == written.config()
    assert config["quantization_config"]["quant_method"] == "kunlun"
    assert record["num_quantized"] == 3 * 7  # 3 layers, q/k/v/o/gate/up/down
    with safe_open(str(tmp_path / "q" / "model.safetensors"), framework="pt") as handle:
        names = set(handle.keys())  # noqa: SIM118
        prefix = "model.layers.0.self_attn.q_proj"
        assert f"{prefix}.bias" in names and f"{prefix}.weight_scale" in names
        assert handle.get_tensor("model.embed_tokens.weight").is_floating_point()
        if scheme == "w4a16":
            assert written.group_size == 32  # the tiny model's widths (64, 128) forbid 128
            packed = handle.get_tensor(f"{prefix}.weight_packed")
            assert packed.dtype == torch.uint8 and packed.shape == (64, 32)
            assert handle.get_tensor(f"{prefix}.weight_min").shape == (64, 2)
        else:
            assert handle.get_tensor(f"{prefix}.weight").dtype == torch.int8
            assert handle.get_tensor(f"{prefix}.weight_scale").shape == (64,)
    tokens = list(range(5, 40))
    from_file = ModelRunner(tmp_path / "q", num_blocks=8)
    on_load = ModelRunner(source, num_blocks=8, quantization=scheme)
    floating = ModelRunner(source, num_blocks=8)
    assert from_file.quant_spec == on_load.quant_spec == written
    assert torch.equal(_logits(from_file, tokens), _logits(on_load, tokens))
    # and it is still the same model: close to floating point, not equal
    close = _logits(floating, tokens)
    quantized = _logits(from_file, tokens)
    assert not torch.equal(close, quantized)
    floor = 0.8 if scheme == "w4a16" else 0.95  # 4 bits on random weights is coarse
    assert torch.nn.functional.cosine_similarity(close, quantized, dim=-1).min() > floor


def test_a_quantized_checkpoint_keeps_its_scheme_and_refuses_another(
    make_tiny_model: TinyFactory, tmp_path: Path
) -> None:
    source = make_tiny_model("LlamaForCausalLM")
    write_quantized(source, tmp_path / "q8", None, QuantSpec("w8a8"), link_files=True)
    config = ModelConfig.from_dir(tmp_path / "q8")
    assert resolve_spec(tmp_path / "q8", "none", None, config) == QuantSpec("w8a8")
    with pytest.raises(ConfigError, match=r"quantization=w4a16 was asked but .*q8 holds w8a8"):
        LLM(tmp_path / "q8", quantization="w4a16", num_blocks=8)
    llm = LLM(tmp_path / "q8", num_blocks=8)
    (out,) = llm.generate(["Hello"], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    assert len(out.outputs[0].token_ids) == 4
    # the planner reads the same config: the scheme, and bytes that shrink with the bits
    info = inspect_model(tmp_path / "q8")
    assert info.quantization is not None and info.quantization.scheme == "w8a8"
    assert info.weight_bytes("fp32", "w4a16") < info.weight_bytes("fp32", "w8a16")
    assert info.weight_bytes("fp32", "w8a16") == info.weight_bytes("fp32", "w8a8")
    assert info.weight_bytes("fp32", "w8a16") < info.weight_bytes("fp32", "none")


def test_other_quantization_formats_are_refused_naming_the_file(
    make_tiny_model: TinyFactory, tmp_path: Path
) -> None:
    source = make_tiny_model("LlamaForCausalLM")
    target = tmp_path / "gptq"
    target.mkdir()
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    (target / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelError, match=r"quant_method='gptq' cannot be loaded") as caught:
        read_spec(target)
    assert "config.json" in str(caught.value.location)
    hf = HFConfig.from_dict(config)
    assert hf.quantization is not None and hf.quantization.method == "gptq"


def test_prepare_weights_quantizes_once_into_the_plan_cache(
    make_tiny_model: TinyFactory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    source = make_tiny_model("Qwen3ForCausalLM")
    target = tmp_path / "plan" / "weights"
    loaded, line = prepare_weights(source, target, "fp32", "w4a16")
    assert loaded == target
    assert line.startswith("conversion: quantized 21 layers to w4a16 (group 32), cast ")
    assert read_spec(target) == QuantSpec("w4a16", 32)
    again, line = prepare_weights(source, target, "fp32", "w4a16")
    assert again == target and line.startswith("conversion: reused ")
    runner = ModelRunner(loaded, num_blocks=8, quantization="w4a16")
    kernels = {m.kernel for m in runner.model.modules() if isinstance(m, QuantLinear)}
    # Kunlun's int4 kernel where the compiled library's measurement on this CPU chose it
    measured = "int4" if "int4_matmul" in native_ops(None, "float32") else "int4pack"
    assert kernels == {measured}
    # the choice is the one measured for the model's dtype: on a CPU where torch's kernel
    # won with bf16 activations, a bf16 model runs it and a float32 one Kunlun's
    split = native.NativeChoice({"float32": ("int4_matmul",), "bfloat16": ()}, {}, "a split")
    monkeypatch.setattr(native, "choice", lambda: split)
    for dtype, kernel in ((torch.float32, "int4"), (torch.bfloat16, "int4pack")):
        runner = ModelRunner(loaded, num_blocks=8, quantization="w4a16", dtype=dtype)
        assert {m.kernel for m in runner.model.modules() if isinstance(m, QuantLinear)} == {
            kernel}  # fmt: skip
    # floating weights already in the plan dtype and no quantization: nothing to do
    assert prepare_weights(source, tmp_path / "other", "fp32")[0] == source
