"""What llama.cpp serves for a plan: an unquantized GGUF written from the demo's Q4_1 file
for ``quantization: none``, the file itself for a plan quantized as its kept blocks.

The export is checked against the source with the GGUF reader of the llama.cpp project:
every metadata key carried over (the file type now says all-float), every tensor in a float
type, and each quantized tensor equal to its dequantized values.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
from tests.engines.test_engine_commands import QWEN

from kunlun.device.inventory import build_inventory
from kunlun.engine.gguf import demo_gguf_path
from kunlun.engine.gguf_source import MARKER
from kunlun.engines.builtin import LlamaCppEngine
from kunlun.engines.gguf_export import export_q8_0, export_unquantized
from kunlun.errors import ConfigError
from kunlun.planner.plan import ExecutionPlan
from kunlun.workload.placement import place
from kunlun.workload.spec import WorkloadSpec


def cpu_plan(quantization: str = "none") -> ExecutionPlan:
    """A plan on this machine's CPU (live discovery)."""
    spec = WorkloadSpec(model="Qwen2-0.5B", device="cpu:0", dtype="fp32", max_model_len=2048,
                        max_num_seqs=4, quantization=quantization)  # type: ignore[arg-type]  # fmt: skip
    return place(spec, build_inventory(), QWEN).plans[0]


FLOATS = {gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16}


def test_the_fp32_export_holds_the_dequantized_tensors_and_every_key(tmp_path: Path) -> None:
    source = demo_gguf_path()
    out = tmp_path / "model-fp32.gguf"
    assert export_unquantized(source, out, "fp32") is True
    assert export_unquantized(source, out, "fp32") is False  # recorded: not written again
    before, after = gguf.GGUFReader(source), gguf.GGUFReader(out)
    keys = lambda r: {f.name for f in r.fields.values() if not f.name.startswith("GGUF.")}  # noqa: E731
    assert keys(after) == keys(before)
    assert after.get_field(gguf.Keys.General.FILE_TYPE).contents() == 0  # type: ignore[union-attr]
    assert after.get_field(gguf.Keys.Tokenizer.CHAT_TEMPLATE).contents() == (  # type: ignore[union-attr]
        before.get_field(gguf.Keys.Tokenizer.CHAT_TEMPLATE).contents()  # type: ignore[union-attr]
    )
    assert [t.name for t in after.tensors] == [t.name for t in before.tensors]
    assert {t.tensor_type for t in after.tensors} <= FLOATS
    quantized = [t for t in before.tensors if t.tensor_type not in FLOATS]
    assert quantized, "the demo file has block-quantized tensors"
    by_name = {t.name: t for t in after.tensors}
    for tensor in quantized[:4]:
        expected = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        np.testing.assert_array_equal(np.asarray(by_name[tensor.name].data), expected)


def test_llama_cpp_serves_what_the_plan_says(tmp_path: Path) -> None:
    engine, source = LlamaCppEngine(), Path("/models/demo.Q4_1.gguf")
    model_dir, plan_dir = tmp_path / "model", tmp_path / "plan"
    model_dir.mkdir()
    (model_dir / MARKER).write_text(json.dumps({"source": str(source)}))  # a float import
    served, first = engine.prepare_model(cpu_plan(), source, model_dir, plan_dir)
    assert served == plan_dir / "llama-cpp-fp32.gguf"
    assert first == [sys.executable, "-m", "kunlun.engines.gguf_export", "--source",
                     str(source), "--out", str(served), "--dtype", "fp32", "--"]  # fmt: skip
    with pytest.raises(ConfigError) as refused:
        engine.prepare_model(cpu_plan("w8a8"), source, model_dir, plan_dir)
    assert str(refused.value).startswith("quantization: engine llama.cpp cannot run")
    (model_dir / MARKER).write_text(json.dumps({"source": str(source), "output": {
        "dtype": "bf16", "keep_quantized": True}}))  # fmt: skip
    kept = cpu_plan("w4a16")
    assert engine.prepare_model(kept, source, model_dir, plan_dir) == (source, [])


def test_the_q8_0_export_holds_every_weight_in_8_bit_blocks(
    tiny_model: Path, tmp_path: Path
) -> None:
    """The 8-bit file of an int8 comparison with llama.cpp (``benchmarks/engine.py``): every
    2-D weight whose rows split into blocks of 32 in Q8_0 within half a step of its block's scale,
    the rest as it was, every key carried over, the file type Q8_0."""
    from tests.engine.gguf_files import write_hf_gguf

    source = write_hf_gguf(tmp_path / "tiny-f32.gguf", tiny_model, None)
    out = tmp_path / "tiny-q8_0.gguf"
    assert export_q8_0(source, out) is True
    assert export_q8_0(source, out) is False  # recorded: not written again
    before, after = gguf.GGUFReader(source), gguf.GGUFReader(out)
    keys = [f for f in before.fields if not f.startswith("GGUF.")]
    assert [f for f in after.fields if not f.startswith("GGUF.")] == [*keys, "general.file_type"]
    assert after.get_field(gguf.Keys.General.FILE_TYPE).contents() == 7  # type: ignore[union-attr]
    q8 = gguf.GGMLQuantizationType.Q8_0
    by_name = {t.name: t for t in after.tensors}
    for tensor in before.tensors:
        mine = by_name[tensor.name]
        original = np.asarray(tensor.data, dtype=np.float32)
        if original.ndim == 2 and original.shape[1] % 32 == 0:
            assert mine.tensor_type == q8, tensor.name
            values = gguf.quants.dequantize(mine.data, q8)
            assert values.shape == original.shape
            step = np.abs(original).reshape(-1, 32).max(axis=1, keepdims=True) / 127
            # half a step, and the f16 rounding of the block's scale times at most 127 steps
            assert (np.abs(values - original).reshape(-1, 32) <= step * 0.57).all()
        else:
            assert mine.tensor_type == tensor.tensor_type, tensor.name
            np.testing.assert_array_equal(np.asarray(mine.data), original)
