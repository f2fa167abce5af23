"""The launch contract: an EngineLaunch round-trips through its file, a bad file is refused
naming the field and value, and the device facts in it (torch device type, extension module)
have one owner, the device plugin, which the engine, placement and the planner all ask."""

from __future__ import annotations

import dataclasses
import json
import subprocess
from pathlib import Path

import pytest
import torch
from tests.planner.conftest import model, node

from kunlun.device.registry import load_plugins, plugin_for_torch_device, torch_extension
from kunlun.engine.device import extension_module, resolve_device
from kunlun.engine.launch import (
    EngineLaunch,
    Rank,
    ReadyInfo,
    device_fields,
    read_launch,
    worker_command,
)
from kunlun.errors import ConfigError, EngineError
from kunlun.planner.capacity import capacity_of
from kunlun.planner.launch import engine_launch
from kunlun.planner.operators import choose_operators
from kunlun.serving.worker import write_launch
from kunlun.workload.placement import place
from kunlun.workload.placement.filters import runnable
from kunlun.workload.spec import WorkloadSpec

PLUGINS = load_plugins().plugins


def full_launch(tmp_path: Path) -> EngineLaunch:
    """A launch with every field away from its default."""
    return EngineLaunch(
        model_dir=tmp_path / "model", served_name="m", device="npu:1", device_type="ascend",
        torch_module="torch_npu", distributed_backend="hccl", dtype="bf16",
        quantization="w4a16", group_size=32, tensor_parallel_size=2, max_num_seqs=4,
        max_num_batched_tokens=256, max_model_len=512, num_blocks=40, block_size=8,
        enable_prefix_caching=False, num_threads=3, seed=7, host="::1", port=4321,
        ready_file=tmp_path / "ready.json", plan_dir=tmp_path / "plan", nice=0,
        sandbox={"parent_pid": 1, "enabled": False}, trace_prefix=str(tmp_path / "t"),
        profiling_interval_ms=0,
    )  # fmt: skip


def test_a_launch_round_trips_through_its_file(tmp_path: Path) -> None:
    launch = full_launch(tmp_path)
    path = launch.write(tmp_path / "run" / "launch.json")
    assert read_launch(path) == launch
    assert set(json.loads(path.read_text())) == set(EngineLaunch.model_fields)
    with pytest.raises(ValueError):
        launch.model_copy().__setattr__("port", 1)  # frozen: a launch is not edited in place


def test_engine_config_carries_every_engine_setting(tmp_path: Path) -> None:
    config = full_launch(tmp_path).engine_config(tmp_path / "cast")
    assert config.model_dir == tmp_path / "cast" and config.device == "npu:1"
    assert config.dtype is torch.bfloat16
    assert (config.quantization, config.group_size) == ("w4a16", 32)
    assert (config.tensor_parallel_size, config.distributed_backend) == (2, "hccl")
    assert (config.max_num_seqs, config.max_num_batched_tokens, config.max_model_len) == (
        4,
        256,
        512,
    )
    assert (config.num_blocks, config.block_size, config.enable_prefix_caching) == (40, 8, False)
    assert (config.num_threads, config.seed) == (3, 7)
    # settings left None keep the engine's own defaults (EngineConfig owns them)
    bare = EngineLaunch(model_dir=Path("m"), served_name="m", device="cpu:0").engine_config()
    defaults = type(bare)(Path("m"))
    assert bare == defaults and bare.device == "cpu"


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"max_num_seqs": 0}, "max_num_seqs=0"),
        ({"dtype": "fp64"}, "dtype='fp64'"),
        ({"port": 70000}, "port=70000"),
        ({"nice": 20}, "nice=20"),
        ({"device": "cuda:x"}, "device='cuda:x'"),
        ({"num_blocks": 4, "kv_cache_memory_bytes": 4096}, "num_blocks=4 are exclusive"),
        ({"sandbox": {"parent_pid": 1, "jail": True}}, "sandbox="),
        ({"kv_cache_memory_mb": 64}, "kv_cache_memory_mb: unknown field"),
        ({"served_name": ""}, "served_name=''"),
    ],
)
def test_a_bad_launch_is_refused_naming_the_field_and_value(
    tmp_path: Path, change: dict[str, object], named: str
) -> None:
    path = tmp_path / "launch.json"
    path.write_text(json.dumps({"model_dir": "m", "served_name": "x", **change}))
    with pytest.raises(ConfigError) as caught:
        read_launch(path)
    assert named in str(caught.value) and str(path) in str(caught.value)
    assert caught.value.exit_code == 2


def test_an_unreadable_or_malformed_launch_file_is_refused_naming_the_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read the launch file"):
        read_launch(tmp_path / "absent.json")
    (tmp_path / "list.json").write_text("[1]")
    with pytest.raises(ConfigError, match="holds a JSON object, got list"):
        read_launch(tmp_path / "list.json")
    (tmp_path / "cut.json").write_text('{\n"model_dir": "m",\n')
    with pytest.raises(ConfigError, match=r"cut.json:3: the launch file is not JSON"):
        read_launch(tmp_path / "cut.json")


# ---- one owner of the device facts: the plugin ----
@pytest.mark.parametrize("name", sorted(PLUGINS))
def test_every_plugins_device_type_resolves_to_its_extension_in_the_engine(name: str) -> None:
    """The engine's resolver, placement and the launch ask the plugin: a plugin whose device
    type the engine would resolve without its extension fails here."""
    plugin = PLUGINS[name]
    kind, module = plugin.torch_device_type, plugin.torch_module
    assert extension_module(kind) == torch_extension(kind) == module
    fields = device_fields(plugin, f"{kind}:0")
    assert (fields["device_type"], fields["torch_module"]) == (name, module)
    if module is None:
        assert resolve_device(f"{kind}:0").type == kind
    elif not plugin.torch_extension_available():
        with pytest.raises(EngineError, match=f"needs the PyTorch extension '{module}'"):
            resolve_device(f"{kind}:0")


def test_plugins_that_share_a_torch_device_type_agree_on_its_extension() -> None:
    by_type: dict[str, set[str | None]] = {}
    for plugin in PLUGINS.values():
        by_type.setdefault(plugin.torch_device_type, set()).add(plugin.torch_module)
    assert {kind: len(modules) for kind, modules in by_type.items()} == dict.fromkeys(by_type, 1)
    assert type(plugin_for_torch_device("cpu")) is type(PLUGINS["cpu"])
    assert plugin_for_torch_device("no-such-type") is None


def test_an_enflame_gcu_device_needs_torch_gcu_everywhere() -> None:
    """The case that was wrong: placement knew gcu needs torch_gcu, the engine did not."""
    enflame = PLUGINS["enflame"]
    assert (enflame.torch_device_type, enflame.torch_module) == ("gcu", "torch_gcu")
    with pytest.raises(EngineError, match="'gcu:0' needs the PyTorch extension 'torch_gcu'"):
        resolve_device("gcu:0")
    cpu = capacity_of(node("mixed").profiles[0])
    gcu = dataclasses.replace(cpu, device_type="enflame", torch_device_type="gcu")
    assert runnable(gcu) == "the torch backend for gcu (torch_gcu) is not installed here"


def test_an_enflame_launch_is_refused_by_the_worker_naming_torch_gcu(tmp_path: Path) -> None:
    launch = write_launch(tmp_path / "launch.json", tmp_path / "model", "x", device="gcu:0")
    assert read_launch(launch).torch_module == "torch_gcu"
    done = subprocess.run(worker_command(launch), capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stderr
    assert "'gcu:0' needs the PyTorch extension 'torch_gcu'" in done.stderr


def test_the_vendor_kernels_a_plan_lacks_are_the_plugins_own() -> None:
    for name, kind in (("ascend", "npu"), ("cambricon", "mlu")):
        offered = PLUGINS[name].vendor_kernels["matmul"]
        assert offered in choose_operators(kind, "w8a8")["matmul"].why


def test_the_plan_gives_the_launch_its_settings_and_the_plugin_its_device_facts(
    tmp_path: Path,
) -> None:
    spec = WorkloadSpec(model="Llama-3-8B", device="ascend:0", dtype="bf16")
    plan = place(spec, node("mixed"), model("Llama-3-8B")).plans[0]
    launch = engine_launch(plan, PLUGINS[plan.device_type], "/models/llama", "llama",
                           tmp_path, 4, trace_prefix="t")  # fmt: skip
    assert (launch.device, launch.device_type, launch.torch_module) == (
        plan.torch_device,
        "ascend",
        "torch_npu",
    )
    assert launch.dtype == plan.dtype == "bf16"
    assert (launch.quantization, launch.tensor_parallel_size) == (
        plan.quantization,
        plan.tensor_parallel_size,
    )
    assert launch.kv_cache_memory_bytes == plan.kv_cache_memory_mb << 20
    assert (launch.max_num_seqs, launch.max_model_len, launch.block_size) == (
        plan.max_num_seqs,
        plan.max_model_len,
        plan.block_size,
    )
    assert (launch.num_threads, launch.plan_dir, launch.trace_prefix) == (4, tmp_path, "t")
    assert read_launch(launch.write(tmp_path / "launch.json")) == launch


SOURCE = Path(__file__).resolve().parents[2] / "src" / "kunlun"


def spelled_in(text: str) -> list[str]:
    """The source files of the package that contain ``text``, relative to it."""
    return sorted(
        str(path.relative_to(SOURCE))
        for path in SOURCE.rglob("*.py")
        if text in path.read_text(encoding="utf-8")
    )


def test_the_worker_command_line_is_spelled_in_one_place() -> None:
    assert spelled_in('"kunlun.serving.worker"') == ["engine/launch.py"]
    assert worker_command("L")[1:] == ["-m", "kunlun.serving.worker", "--launch", "L"]


@pytest.mark.parametrize(
    "module", sorted({p.torch_module for p in PLUGINS.values() if p.torch_module})
)
def test_a_torch_extension_is_named_only_by_its_plugin(module: str) -> None:
    """No second table of vendor extensions: only the plugin module names its extension."""
    named = spelled_in(f'"{module}"')
    assert len(named) == 1 and named[0].startswith("device/plugins/"), named


def test_a_ready_record_round_trips_and_a_bad_one_names_its_file_and_field(
    tmp_path: Path,
) -> None:
    path = tmp_path / "r.ready.json"
    assert ReadyInfo.read(path) is None  # not written yet
    made = ReadyInfo(pid=12, port=41234, load_time_s=1.5, compile_time_s=0.0,
                     warmup_ttft_ms=45.6, ranks=(Rank(rank=0, pid=12, device="cpu:0"),))  # fmt: skip
    assert ReadyInfo.read(made.write(path)) == made
    assert json.loads(path.read_text())["ranks"] == [{"rank": 0, "pid": 12, "device": "cpu:0"}]
    path.write_text('{"port": 0, "load_time_s": 1}')
    with pytest.raises(ConfigError) as err:
        ReadyInfo.read(path)
    assert err.value.location is not None
    assert (err.value.location.path, err.value.location.field) == (str(path), "port")
    path.write_text('{"port": 80, "load_time_s": 1, "colour": "red"}')
    with pytest.raises(ConfigError, match="not a ready record") as err:
        ReadyInfo.read(path)
    assert err.value.location is not None and err.value.location.field == "colour"
