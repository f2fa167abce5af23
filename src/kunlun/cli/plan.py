"""``kunlun-cli plan``: the execution plan of a model on this node's (or a recorded node's)
devices, and with ``--explain`` every alternative rejected and why.

Planning needs no weights and starts nothing: a model may be a catalog alias, a local
directory or a configuration shipped in ``examples/models``; devices may be replayed. Memory
used by running workloads is not counted (ask a daemon with ``workload submit --dry-run``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from kunlun.cli.spec_flags import spec_command
from kunlun.console import console, handle_errors, print_json
from kunlun.device.inventory import build_inventory
from kunlun.engines import measured
from kunlun.errors import ConfigError, Location
from kunlun.paths import kunlun_home
from kunlun.planner.capacity import MEMORY_UTILIZATION
from kunlun.planner.model_info import inspect_model, locate_model
from kunlun.planner.plan import ExecutionPlan
from kunlun.state.sqlite import SQLiteStore
from kunlun.workload.placement import Placement, place
from kunlun.workload.spec import parse_spec

PLANNED = ("device", "dtype", "quantization", "tensor_parallel_size", "engine", "scorer",
           "max_num_seqs", "max_num_batched_tokens", "priority", "preferred_device_types",
           "max_model_len", "kv_cache_memory_mb", "memory_utilization", "replicas")  # fmt: skip
"""The workload spec's fields that planning reads, each an option of ``plan``
(:mod:`kunlun.cli.spec_flags`)."""


@handle_errors
@spec_command(PLANNED)
def plan(
    model: Annotated[str, typer.Option(help="Alias, local HF directory, or examples/models name.")],
    pool: Annotated[str | None, typer.Option(help="Only devices of this type.")] = None,
    replay: Annotated[Path | None, typer.Option(help="Recorded vendor-tool output.")] = None,
    config: Annotated[Path | None, typer.Option(help="device-plugin-config.yaml.")] = None,
    explain: Annotated[bool, typer.Option("--explain", help="Every rejected alternative.")] = False,
    json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
    *,
    spec: dict[str, Any],
) -> None:
    # summary: kunlun.cli.commands
    placed = parse_spec({"model": model, **spec}, "command line")
    state = kunlun_home() / "state.db"
    store = SQLiteStore(state) if state.exists() else None
    name, path = locate_model(store, model)
    info = inspect_model(path, name)
    inventory = build_inventory(config=config, replay=replay)
    if pool is not None:
        types = sorted({p.device_type for p in inventory.profiles})
        inventory.profiles = [p for p in inventory.profiles if p.device_type == pool]
        if not inventory.profiles:
            raise ConfigError(
                f"no {pool!r} devices; device types here: {', '.join(types) or 'none'}",
                location=Location("--pool"),
            )
    placement = place(placed, inventory, info, measured=measured.for_model(store, name))
    if json:
        out: dict[str, Any] = {"model": info.to_dict(), **placement.to_dict()}
        out["alternatives"] = [r.to_dict() for r in placement.alternatives]
        print_json(out)
        return
    render(placement, explain)


def render(placement: Placement, explain: bool) -> None:
    """The plan as text and tables; with ``explain``, the rejected alternatives too."""
    p = placement.plans[0]
    console.print(f"[bold]plan[/] {p.model} -> target_device {placement.target_device}")
    console.print(f"why: {placement.why}", markup=False)
    console.print(plan_lines(p), markup=False)
    ops = Table(title="Operators", title_justify="left")
    for col in ("OPERATOR", "IMPLEMENTATION", "FALLBACK", "WHY"):
        ops.add_column(col)
    for op, choice in p.operators.items():
        ops.add_row(
            op, choice["implementation"], "yes" if choice["fallback"] else "no", choice["why"]
        )
    console.print(ops)
    for note in p.notes:
        console.print(f"note: {note}", markup=False)
    if placement.engine is not None:
        console.print(f"engine: {placement.engine.chosen} ({placement.engine.why})", markup=False)
    if explain and placement.engine is not None:
        engines = Table(title="Engines not chosen", title_justify="left")
        for col in ("ENGINE", "REASON"):
            engines.add_column(col)
        for name, reason in placement.engine.rejected:
            engines.add_row(name, reason)
        console.print(engines)
    if explain:
        table = Table(title="Rejected alternatives", title_justify="left")
        for col in ("DEVICES", "DTYPE", "TP", "REASON"):
            table.add_column(col)
        for r in placement.alternatives:
            table.add_row(r.devices, r.dtype or "-", str(r.tp or "-"), r.reason)
        console.print(table)


def plan_lines(p: ExecutionPlan) -> str:
    """The plan's settings, a few per line."""

    def tokens(rate: float | None) -> str:
        return "-" if rate is None else f"{rate:.0f}"

    memory = p.memory
    return "\n".join([
        f"engine: {p.engine}  dtype: {p.dtype}  quantization: {p.quantization}  "
        f"tensor_parallel_size: {p.tensor_parallel_size}  devices: {','.join(p.devices)} "
        f"(torch device {p.torch_device})",
        f"max_model_len: {p.max_model_len}  max_num_seqs: {p.max_num_seqs}  "
        f"max_num_batched_tokens: {p.max_num_batched_tokens or 'engine default'}  "
        f"kv_cache: {p.num_kv_blocks} blocks of {p.block_size} ({p.kv_cache_memory_mb} MiB)  "
        f"weights: {p.weight_memory_mb} MiB per device",
        f"tokens/s: decode estimate {tokens(p.estimated_tokens_per_s)}, declared compute "
        f"{tokens(p.compute_tokens_per_s)}",
        f"memory: {memory['device_memory_mb']:.0f} MiB from {memory['source']}, "
        f"{memory['usable_mb']} usable (utilization {memory.get('utilization', MEMORY_UTILIZATION):g}); "
        f"host memory {memory['host_memory_mb'] or '-'} MiB "
        "(not used for KV)",
        f"engine options: {p.engine_options or '-'}  env: {p.env or '-'}  "
        f"fallback ops: {', '.join(p.fallback_ops) or 'none'}",
    ])  # fmt: skip
