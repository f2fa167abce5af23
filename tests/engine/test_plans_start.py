"""The planner plans only what the engine starts.

On this machine's CPU (live discovery), every plan the planner makes for a tiny model under
every quantization scheme, with one rank and with two, is turned into a launch the way the
node agent does it (:func:`~kunlun.planner.plan.engine_launch`), and the engine starts from
that launch and generates. Where the planner refuses (quantized weights over two ranks), the
engine refuses the same settings with the same reason. On the recorded mixed node (Ascend,
Cambricon, NVIDIA), where no engine can start here, every plan for the shipped model configs
passes the engine's device-independent checks (:func:`~kunlun.engine.preflight.preflight`).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from tests.planner.conftest import MODELS, node

from kunlun.device.inventory import build_inventory
from kunlun.device.registry import load_plugins
from kunlun.engine.engine_config import EngineConfig
from kunlun.engine.llm_engine import LLMEngine
from kunlun.engine.preflight import preflight
from kunlun.engine.sampling_params import SamplingParams
from kunlun.engine.tp_layout import quantized_split_problem
from kunlun.errors import ConfigError
from kunlun.planner.launch import engine_launch
from kunlun.planner.model_info import inspect_model
from kunlun.workload.placement import place
from kunlun.workload.spec import WorkloadSpec

PLUGINS = load_plugins().plugins
SCHEMES = ("none", "w8a16", "w8a8", "w4a16")


@pytest.fixture(scope="module")
def cpu_inventory():  # noqa: ANN201
    return build_inventory()  # live discovery: this machine's CPU


@pytest.mark.parametrize("tp", [None, 2])
@pytest.mark.parametrize("quantization", SCHEMES)
def test_every_cpu_plan_starts_and_generates(
    make_tiny_model, cpu_inventory, tmp_path: Path, quantization: str, tp: int | None
) -> None:
    model_dir = make_tiny_model("LlamaForCausalLM")
    spec = WorkloadSpec(
        model="tiny", device="cpu:0", quantization=quantization, tensor_parallel_size=tp,
        max_model_len=128, max_num_seqs=2,
    )  # fmt: skip
    try:
        placement = place(spec, cpu_inventory, inspect_model(model_dir), starting=True)
    except ConfigError as refused:
        # the only refusal: quantized weights over two ranks; the engine says the same
        why = quantized_split_problem(quantization, tp or 1)
        assert why is not None and why in str(refused), str(refused)
        config = EngineConfig(
            model_dir, quantization=quantization, tensor_parallel_size=tp or 1,
            distributed_backend=PLUGINS["cpu"].distributed_backend,
        )  # fmt: skip
        with pytest.raises(ConfigError, match=why.replace("(", r"\(").replace(")", r"\)")):
            LLMEngine(config)
        return
    assert placement.plans, "a placement without plans"
    for plan in placement.plans:
        assert (plan.quantization, plan.tensor_parallel_size) == (quantization, tp or 1)
        launch = engine_launch(plan, PLUGINS[plan.device_type], model_dir, "tiny", tmp_path, 2)
        engine = LLMEngine(launch.engine_config())
        try:
            assert engine.runner.quant_spec is None or (
                engine.runner.quant_spec.scheme == quantization
            )
            params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
            engine.add_request([5, 6, 7, 8], params)
            finals = []
            while engine.has_unfinished():
                finals += [d.final for d in engine.step() if d.final is not None]
            assert [len(f.outputs[0].token_ids) for f in finals] == [4]
        finally:
            engine.close()


SHIPPED = sorted(p.name for p in MODELS.iterdir() if (p / "config.json").is_file())


@pytest.mark.parametrize("name", SHIPPED)
def test_every_mixed_node_plan_passes_the_engines_checks(name: str) -> None:
    info = inspect_model(MODELS / name)
    inventory = node("mixed")
    planned = refused = 0
    for quantization in SCHEMES:
        for tp in (None, 1, 2, 4):
            spec = WorkloadSpec(model=name, quantization=quantization, tensor_parallel_size=tp,
                                max_model_len=4096)  # fmt: skip
            try:
                placement = place(spec, inventory, info)
            except ConfigError:
                refused += 1
                continue
            for plan in placement.plans:
                launch = engine_launch(plan, PLUGINS[plan.device_type], MODELS / name, name,
                                       None, None)  # fmt: skip
                preflight(launch.engine_config())  # raises naming what the engine refuses
                planned += 1
    assert planned >= len(SCHEMES)  # every scheme is planned somewhere
    assert refused > 0  # and the planner does refuse some (quantized over ranks, at least)
