"""The execution plan: how one replica of a workload runs on its concrete devices.

The planner's decisions for one device class are :func:`options` (which dtype and
tensor-parallel size could work, in preference order, and why the others cannot);
:func:`build_plan` turns the option placement picked, on the device group it picked, into an
:class:`ExecutionPlan`: engine, dtype, quantization, tensor-parallel size, KV-cache blocks
from the memory budget (device memory such as HBM; the host half of a vendor split is not
used), ``max_num_seqs``, operator implementations with their fallbacks, engine options from
vendor attributes, and the visibility environment.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from kunlun.engine.launch import EMBEDDED_ENGINE
from kunlun.engine.schemes import COMPUTE_DTYPES
from kunlun.engine.tp_layout import head_split_problem, quantized_split_problem
from kunlun.planner.batching import (
    BatchSizing,
    StepSizing,
    graph_capture,
    size_batch,
    size_step_tokens,
    without_graphs,
)
from kunlun.planner.capacity import DeviceCapacity
from kunlun.planner.engine_options import engine_options
from kunlun.planner.estimate import (
    BLOCK_SIZE,
    MIB,
    MemoryNeed,
    compute_tokens_per_s,
    memory_need,
    tokens_per_s,
)
from kunlun.planner.model_info import ModelInfo
from kunlun.planner.operators import choose_operators

#: Activation and KV dtypes the embedded engine runs, in the default preference order.
ENGINE_DTYPES: tuple[str, ...] = ("bf16", "fp16", "fp32")
#: KV-cache reservation weight of each priority class (the seed's 3:2:1).
PRIORITY_WEIGHTS: dict[str, int] = {"high": 3, "normal": 2, "low": 1}
#: Default KV budget on a device that computes in host RAM, unless the spec sets one (its
#: ``kv_cache_memory_mb``, or a ``memory_utilization``: see :func:`kv_budget_mb`).
HOST_KV_CAP_MB = 1024
TP_SIZES: tuple[int, ...] = (1, 2, 4, 8, 16)
_MAX_OPTIONS = 3


@dataclass(frozen=True, slots=True)
class Demand:
    """A workload spec as the planner sees it, resolved against its model."""

    model: ModelInfo
    dtype: str | None
    quantization: str
    """Effective weight quantization: the spec's, or the checkpoint's scheme."""
    max_model_len: int
    max_num_seqs: int | None
    """The spec's ``max_num_seqs``, or None: sized per plan
    (:mod:`kunlun.planner.batching`)."""
    step_tokens: int | None = None
    """The spec's ``max_num_batched_tokens``, or None: sized per plan
    (:mod:`kunlun.planner.batching`)."""
    priority: str = "normal"
    kv_cache_memory_mb: int | None = None
    device: str | None = None
    preferred_device_types: tuple[str, ...] = ()
    scorer: str = "performance"
    replicas: int = 1
    engine: str = EMBEDDED_ENGINE
    """The spec's engine (``auto`` or a name); plans carry the engine chosen
    (:func:`kunlun.engines.registry.choose_plan_engines`)."""
    tp: int | None = None
    """The spec's tensor-parallel size, or None: the smallest that fits."""
    memory_utilization: float | None = None
    """The spec's fraction of each device's memory this workload's plans may use, or None:
    :data:`~kunlun.planner.capacity.MEMORY_UTILIZATION` (the device capacities a placer
    judges are computed with it: :func:`~kunlun.planner.capacity.capacity_of`)."""

    @property
    def priority_weight(self) -> int:
        return PRIORITY_WEIGHTS[self.priority]


@dataclass(frozen=True, slots=True)
class Option:
    """One way a device class can run the demand: dtype, tensor-parallel size, its needs."""

    dtype: str
    tp: int
    need: MemoryNeed
    tokens_per_s: float | None
    """The decode estimate (roofline)."""
    compute_tokens_per_s: float | None
    """The declared compute throughput."""
    shared_device: bool = False
    """The ``tp`` ranks share one host CPU device (and its cores) instead of one device each."""

    @property
    def num_devices(self) -> int:
        """Devices the replica's ranks span."""
        return 1 if self.shared_device else self.tp


@dataclass(frozen=True, slots=True)
class Rejection:
    """An alternative that was considered and rejected, with the reason."""

    devices: str
    dtype: str | None
    tp: int | None
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return {"devices": self.devices, "dtype": self.dtype, "tp": self.tp, "reason": self.reason}


def dtype_order(model: ModelInfo, cap: DeviceCapacity) -> list[str]:
    """Engine dtypes in preference order: the checkpoint's 16-bit dtype, bf16, fp16, then fp32;
    dtypes the device only emulates (a CPU without native bf16) come after fp32."""
    order = list(ENGINE_DTYPES)
    if model.checkpoint_dtype in ("bf16", "fp16"):
        order.remove(model.checkpoint_dtype)
        order.insert(0, model.checkpoint_dtype)
    native = [d for d in order if d not in cap.emulated]
    return native + [d for d in order if d in cap.emulated]


def quantization_problem(cap: DeviceCapacity, quantization: str, label: str) -> str | None:
    """Why ``cap`` cannot run weights quantized as ``quantization``, or None."""
    needed = COMPUTE_DTYPES.get(quantization)
    if needed is not None and needed not in cap.dtypes:
        return (
            f"quantization={quantization} needs {needed} but {label} has supported_dtypes "
            f"{sorted(cap.dtypes)}"
        )
    return None


def options(
    demand: Demand, cap: DeviceCapacity, num_devices: int, label: str
) -> tuple[list[Option], list[Rejection]]:
    """The ways an empty device group of this class can run the demand, best first: the
    first dtype in preference order that fits, at the smallest tensor-parallel size that fits
    and the next two larger ones (placement falls back to those when devices are partly
    used); and every alternative rejected, with its reason.

    ``num_devices`` is how many devices of the class may form a tensor-parallel group."""
    rejected: list[Rejection] = []
    if (why := quantization_problem(cap, demand.quantization, label)) is not None:
        return [], [Rejection(label, None, None, why)]
    wanted = [demand.dtype] if demand.dtype else dtype_order(demand.model, cap)
    found: list[Option] = []
    for dtype in wanted:
        if dtype not in cap.dtypes:
            rejected.append(
                Rejection(
                    label,
                    dtype,
                    None,
                    f"dtype {dtype} not in supported_dtypes {sorted(cap.dtypes)}",
                )
            )
            continue
        for tp in (demand.tp,) if demand.tp else TP_SIZES:
            shared = shares_host_device(demand, cap, tp, num_devices)
            split = 1 if shared else tp  # memory and rates per device
            why = _tp_problem(demand, cap, tp, num_devices, shared)
            if why is None:
                need = memory_need(demand.model, dtype, demand.quantization, split,
                                   demand.max_model_len, demand.max_num_seqs,
                                   demand.kv_cache_memory_mb)  # fmt: skip
                if need.weights_mb + need.min_kv_mb <= cap.usable_mb:
                    empty_kv = kv_budget_mb(demand, cap, need, cap.usable_mb - need.weights_mb)
                    batch = plan_batch(demand, cap, dtype, split, empty_kv * split).max_num_seqs
                    rate = tokens_per_s(demand.model, cap, dtype, demand.quantization, split,
                                        batch, demand.max_model_len)  # fmt: skip
                    compute = compute_tokens_per_s(demand.model, cap, dtype,
                                                   demand.quantization, split)  # fmt: skip
                    found.append(Option(dtype, tp, need, rate, compute, shared))
                    if tp >= num_devices or len(found) == _MAX_OPTIONS:
                        break
                    continue
                why = (
                    f"needs {need.weights_mb + need.min_kv_mb:.0f} MiB per device (weights "
                    f"{need.weights_mb:.0f} + KV for max_model_len={demand.max_model_len} "
                    f"{need.min_kv_mb:.0f}); {cap.usable_mb:.0f} MiB usable"
                    + ("" if demand.memory_utilization is None
                       else f" (memory_utilization {demand.memory_utilization:g})")
                )  # fmt: skip
            rejected.append(Rejection(label, dtype, tp, why))
            if tp >= num_devices:
                break
        if found:
            later = wanted[wanted.index(dtype) + 1 :]
            rejected += [
                Rejection(
                    label,
                    d,
                    None,
                    f"{d} has no native units here ({d}_native: no); {dtype} is preferred",
                )  # fmt: skip
                for d in later
                if d in cap.emulated
            ]
            break
    return found, rejected


def shares_host_device(demand: Demand, cap: DeviceCapacity, tp: int, num_devices: int) -> bool:
    """Whether ``tp`` ranks run together on one host CPU device, splitting its cores: only
    when the spec asks for that tensor-parallel size and the class has fewer devices."""
    return demand.tp == tp > num_devices and cap.torch_device_type == "cpu"


def _tp_problem(
    demand: Demand, cap: DeviceCapacity, tp: int, num_devices: int, shared: bool = False
) -> str | None:
    model = demand.model
    if tp > num_devices and not shared:
        return f"tp={tp} needs {tp} devices; {num_devices} in this class"
    why = head_split_problem(model.num_attention_heads, model.num_kv_heads, tp)
    if why is not None:
        return f"tp={tp}: {why}"
    if tp > 1 and not shared and not cap.p2p:
        return f"tp={tp} needs peer-to-peer between devices; p2p_enabled is false"
    return quantized_split_problem(demand.quantization, tp)


@dataclass
class ExecutionPlan:
    """How one replica runs: everything the engine worker is started with, and why."""

    model: str
    model_path: str | None
    architecture: str
    engine: str
    devices: list[str]
    device_type: str
    torch_device: str
    dtype: str
    quantization: str
    tensor_parallel_size: int
    max_model_len: int
    max_num_seqs: int
    block_size: int
    num_kv_blocks: int
    kv_cache_memory_mb: int
    weight_memory_mb: int
    memory: dict[str, Any]
    operators: dict[str, dict[str, Any]]
    engine_options: dict[str, Any]
    env: dict[str, str]
    estimated_tokens_per_s: float | None
    """Decode estimate (roofline of compute and memory bandwidth)."""
    notes: list[str] = field(default_factory=list)
    compute_tokens_per_s: float | None = None
    """Declared compute throughput for the plan's compute dtype."""
    max_num_batched_tokens: int | None = None
    """Tokens one engine step computes (the chunked-prefill budget); None in plans cached
    before it was planned: the engine's default."""
    memory_utilization: float | None = None
    """The spec's ``memory_utilization`` (part of the plan cache key), or None: the default
    fraction (``memory["utilization"]`` holds the fraction the plan was made with)."""
    graph_batch_sizes: list[int] = field(default_factory=list)
    """Decode batch sizes the embedded engine captures as device graphs (on devices whose
    plugin declares graph capture, one rank; :mod:`kunlun.engine.graphs`); empty: none."""

    def set_engine(self, engine: str) -> None:
        """Run on ``engine``; where that is not the embedded engine, the decode graphs it
        would capture are dropped, saying so."""
        self.engine = engine
        if engine != EMBEDDED_ENGINE and self.graph_batch_sizes:
            self.graph_batch_sizes, self.notes = [], without_graphs(self.notes, engine)

    @property
    def fallback_ops(self) -> list[str]:
        return [op for op, choice in self.operators.items() if choice["fallback"]]

    def summary(self) -> str:
        """One line: what the replica runs with (the workload log and the CLI print it)."""
        rate = self.estimated_tokens_per_s
        fraction = self.memory_utilization
        return (
            f"{self.model} on {','.join(self.devices)}: engine {self.engine}, dtype {self.dtype}, "
            f"quantization {self.quantization}, tp {self.tensor_parallel_size}, "
            f"max_model_len {self.max_model_len}, max_num_seqs {self.max_num_seqs}, "
            f"max_num_batched_tokens {self.max_num_batched_tokens or 'default'}, "
            f"KV {self.num_kv_blocks} blocks ({self.kv_cache_memory_mb} MiB), "
            f"{'' if fraction is None else f'memory_utilization {fraction:g}, '}"
            f"decode estimate {'-' if rate is None else f'{rate:.0f}'} tokens/s, "
            f"fallback ops {', '.join(self.fallback_ops) or 'none'}"
        )

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["fallback_ops"] = self.fallback_ops
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ExecutionPlan:
        known = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}  # not fallback_ops
        return cls(**known)


def plan_batch(
    demand: Demand, cap: DeviceCapacity, dtype: str, num_devices: int, kv_mb: float
) -> BatchSizing:
    """``max_num_seqs`` of a replica of ``demand`` on ``num_devices`` devices like ``cap``
    with ``kv_mb`` MiB of KV in all: the spec's, else sized
    (:func:`~kunlun.planner.batching.size_batch`)."""
    if demand.max_num_seqs is not None:
        return BatchSizing(demand.max_num_seqs, f"max_num_seqs {demand.max_num_seqs}: the spec's")
    return size_batch(demand.model, cap, dtype, demand.quantization, num_devices,
                      demand.max_model_len, kv_mb)  # fmt: skip


def plan_step_tokens(
    demand: Demand, cap: DeviceCapacity, dtype: str, num_devices: int, max_num_seqs: int
) -> StepSizing:
    """``max_num_batched_tokens`` of a replica of ``demand`` on ``num_devices`` devices like
    ``cap`` running ``max_num_seqs`` sequences: the spec's, else sized
    (:func:`~kunlun.planner.batching.size_step_tokens`)."""
    if demand.step_tokens is not None:
        return StepSizing(demand.step_tokens,
                          f"max_num_batched_tokens {demand.step_tokens}: the spec's")  # fmt: skip
    return size_step_tokens(demand.model, cap, dtype, demand.quantization, num_devices,
                            demand.max_model_len, max_num_seqs)  # fmt: skip


def kv_budget_mb(demand: Demand, cap: DeviceCapacity, need: MemoryNeed, share_mb: float) -> float:
    """Per-device KV memory of one replica on ``cap``: its priority share of the memory left
    after weights, no more than it can use (``batch`` full-length sequences, or the spec's
    ``kv_cache_memory_mb``), capped at :data:`HOST_KV_CAP_MB` on host RAM unless the spec set
    the KV size or a ``memory_utilization`` (then the share of that fraction of RAM is the
    bound); never below one full-length sequence."""
    budget = min(share_mb, need.wanted_kv_mb)
    if demand.kv_cache_memory_mb is not None:
        return budget
    if cap.host_memory and demand.memory_utilization is None:
        budget = min(budget, HOST_KV_CAP_MB)
    return max(budget, need.min_kv_mb)


def build_plan(
    demand: Demand, group: list[DeviceCapacity], option: Option, kv_mb: float, share_note: str
) -> ExecutionPlan:
    """The plan for one replica of ``demand`` on ``group`` with ``option``."""
    first, model = group[0], demand.model
    kv_token = model.kv_bytes_per_token(option.dtype)
    # whole MiB, rounded up, as the launch hands them to the engine (truncating would give a
    # small model's sub-MiB budget as an invalid 0); the blocks are what the engine makes
    kv_total_mb = math.ceil(kv_mb * option.num_devices)
    blocks = kv_total_mb * MIB // (BLOCK_SIZE * kv_token)
    sizing = plan_batch(demand, first, option.dtype, option.num_devices, kv_total_mb)
    batch = sizing.max_num_seqs
    step = plan_step_tokens(demand, first, option.dtype, option.num_devices, batch)
    if blocks * BLOCK_SIZE < demand.max_model_len:
        notes_kv = [f"KV ({blocks} blocks) is shorter than max_model_len={demand.max_model_len}"]
    else:
        notes_kv = []
    ops = choose_operators(first.torch_device_type, demand.quantization, option.dtype)
    opts, env, notes = engine_options(first.custom_attributes)
    graphs, graph_note = graph_capture(first, option.tp, demand.engine, batch)
    if graph_note:
        notes.append(graph_note)
    if first.visibility_env:
        env[first.visibility_env] = ",".join(str(c.index) for c in group)
    local = 0 if first.visibility_env else first.index
    notes[:0] = [share_note, *notes_kv, sizing.reason, step.reason]
    if demand.memory_utilization is not None:
        notes.insert(1, f"memory_utilization {demand.memory_utilization:g}: "
                        f"{first.usable_mb:.0f} MiB per device usable (the spec's)")  # fmt: skip
    if blocks * BLOCK_SIZE < batch * demand.max_model_len:
        notes.append(
            f"KV holds {blocks * BLOCK_SIZE} tokens: {batch} sequences run together "
            f"when they average at most {blocks * BLOCK_SIZE // batch} tokens"
        )
    return ExecutionPlan(
        model=model.name,
        model_path=model.path,
        architecture=model.architecture,
        engine=demand.engine,
        devices=[c.device_id for c in group],
        device_type=first.device_type,
        torch_device="cpu"
        if first.torch_device_type == "cpu"
        else f"{first.torch_device_type}:{local}",
        dtype=option.dtype,
        quantization=demand.quantization,
        tensor_parallel_size=option.tp,
        max_model_len=demand.max_model_len,
        max_num_seqs=batch,
        block_size=BLOCK_SIZE,
        num_kv_blocks=blocks,
        kv_cache_memory_mb=kv_total_mb,
        weight_memory_mb=int(round(option.need.weights_mb)),
        memory={
            "device_memory_mb": first.memory_total_mb,
            "source": first.memory_source,
            "usable_mb": round(first.usable_mb),
            "host_memory_mb": first.host_memory_mb,
            "host_memory_used": False,
            "utilization": first.utilization,
        },
        operators={op: c.to_dict() for op, c in ops.items()},
        engine_options=opts,
        env=env,
        estimated_tokens_per_s=_round(option.tokens_per_s),
        notes=notes,
        compute_tokens_per_s=_round(option.compute_tokens_per_s),
        max_num_batched_tokens=step.tokens,
        memory_utilization=demand.memory_utilization,
        graph_batch_sizes=graphs,
    )


def _round(rate: float | None) -> float | None:
    return None if rate is None else round(rate, 1)
