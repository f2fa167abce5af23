"""The launch of one replica of a plan: the plan's engine settings with the device facts of
its plugin (:class:`~kunlun.engine.launch.EngineLaunch`, what a worker starts from)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from kunlun.engine.launch import EngineLaunch, device_fields
from kunlun.planner.estimate import MIB
from kunlun.planner.plan import ExecutionPlan

if TYPE_CHECKING:
    from kunlun.device.plugin import DevicePlugin


def engine_launch(
    plan: ExecutionPlan,
    plugin: DevicePlugin | None,
    model_dir: str | Path,
    served_name: str,
    plan_dir: Path | None,
    num_threads: int | None,
    **worker: Any,
) -> EngineLaunch:
    """The launch of one replica of ``plan``: the plan's engine settings, the device facts of
    ``plugin`` (the plan's device type's plugin: device type, torch extension module,
    distributed backend), and ``worker`` settings (profiling). The node agent adds the ready
    file and the sandbox."""
    if plugin is not None:
        facts = device_fields(plugin, plan.torch_device)
    else:
        facts = {"device": plan.torch_device, "device_type": plan.device_type}
    return EngineLaunch(
        model_dir=Path(model_dir),
        served_name=served_name,
        **facts,
        dtype=plan.dtype,  # type: ignore[arg-type]
        quantization=plan.quantization,
        tensor_parallel_size=plan.tensor_parallel_size,
        max_num_seqs=plan.max_num_seqs,
        max_num_batched_tokens=plan.max_num_batched_tokens,
        graph_batch_sizes=list(plan.graph_batch_sizes),
        max_model_len=plan.max_model_len,
        kv_cache_memory_bytes=plan.kv_cache_memory_mb * MIB,
        block_size=plan.block_size,
        num_threads=num_threads,
        plan_dir=plan_dir,
        **worker,
    )
