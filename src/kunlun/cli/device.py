"""``kunlun-cli device list``: the inventory as a table or JSON."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from kunlun.cli.output import console, handle_errors, print_json
from kunlun.device.inventory import Inventory, build_inventory
from kunlun.device.profile import DeviceProfile, Status

app = typer.Typer(help="Devices: discovery, status and declarations.", no_args_is_help=True)

ReplayOpt = Annotated[
    Path | None,
    typer.Option(
        "--replay", help="Read recorded vendor-tool output from DIR (or KUNLUN_REPLAY_DIR)."
    ),
]
ConfigOpt = Annotated[
    Path | None, typer.Option("--config", help="device-plugin-config.yaml with declarations.")
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")]

_STATUS_STYLE = {
    Status.READY: "green",
    Status.DEGRADED: "yellow",
    Status.UNHEALTHY: "red",
    Status.EXCLUDED: "red",
}


@app.command("list")
@handle_errors
def list_devices(replay: ReplayOpt = None, config: ConfigOpt = None, json: JsonOpt = False) -> None:
    """List every device with STATUS, MEMORY, UTILIZATION, TOPOLOGY and reasons."""
    inventory = build_inventory(config=config, replay=replay)
    if json:
        print_json(inventory.to_list())
        return
    console.print(device_table(inventory))
    print_reasons(inventory)
    print_plugin_errors(inventory)


def device_table(inventory: Inventory) -> Table:
    table = Table(title="Devices", title_justify="left")
    for column in ("ID", "TYPE", "NAME", "STATUS", "MEMORY", "UTILIZATION", "TOPOLOGY"):
        table.add_column(column, no_wrap=column != "NAME")
    for p in inventory.profiles:
        style = _STATUS_STYLE[p.status]
        table.add_row(
            p.id,
            p.device_type,
            p.name,
            f"[{style}]{p.status.value}[/]",
            memory_text(p),
            _pct(p.get("utilization_pct")),
            " ".join(str(d) for d in p.get("topology_distance") or []) or "-",
        )
    return table


def memory_text(p: DeviceProfile) -> str:
    total, used = p.get("memory_total_mb"), p.get("memory_used_mb")
    if total is None:
        return "-"
    return f"{used if used is not None else '?'}/{total} MiB"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}%"


def print_reasons(inventory: Inventory) -> None:
    for p in inventory.profiles:
        if p.reasons:
            style = _STATUS_STYLE[p.status]
            for reason in p.reasons:
                console.print(f"[{style}]{p.id}[/] ", end="")
                console.print(reason, markup=False)


def print_plugin_errors(inventory: Inventory) -> None:
    for r in inventory.reports:
        if r.error:
            console.print(f"[yellow]plugin {r.device_type}[/]: ", end="")
            console.print(r.error, markup=False)
