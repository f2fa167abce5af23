"""``kunlun-cli device list``: the inventory as a table or JSON."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from kunlun.cli.client import DaemonClient, running_endpoint
from kunlun.cli.commands import summary
from kunlun.console import console, handle_errors, print_json
from kunlun.device.inventory import Inventory, build_inventory
from kunlun.device.profile import Status

app = typer.Typer(help=summary("device"), no_args_is_help=True)

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
    endpoint = running_endpoint() if replay is None and config is None else None
    if endpoint is not None:  # a daemon runs: show its inventory
        rows = DaemonClient(endpoint).get("/api/v1/devices")
        source = f"daemon {endpoint}"
        inventory = None
    else:
        inventory = build_inventory(config=config, replay=replay)
        rows, source = (
            inventory.to_list(),
            "replay " + str(inventory.replay_dir) if inventory.replay_dir else "local discovery",
        )
    if json:
        print_json(rows)
        return
    console.print(device_table(rows, source))
    print_reasons(rows)
    if inventory is not None:
        print_plugin_errors(inventory)


def device_table(rows: list[dict[str, Any]], source: str = "") -> Table:
    """The device table from ``DeviceProfile.to_dict()`` rows."""
    table = Table(title=f"Devices ({source})" if source else "Devices", title_justify="left")
    for column in ("ID", "TYPE", "NAME", "STATUS", "MEMORY", "UTILIZATION", "TOPOLOGY"):
        table.add_column(column, no_wrap=column != "NAME")
    for d in rows:
        style = _STATUS_STYLE[Status(d["status"])]
        table.add_row(
            d["id"],
            d["type"],
            d["name"],
            f"[{style}]{d['status']}[/]",
            memory_text(d),
            _pct(d.get("utilization_pct")),
            " ".join(str(x) for x in d.get("topology") or []) or "-",
        )
    return table


def memory_text(d: dict[str, Any]) -> str:
    total, used = d.get("memory_total_mb"), d.get("memory_used_mb")
    if total is None:
        return "-"
    return f"{used if used is not None else '?'}/{total} MiB"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}%"


def print_reasons(rows: list[dict[str, Any]]) -> None:
    for d in rows:
        style = _STATUS_STYLE[Status(d["status"])]
        for reason in d["reasons"]:
            console.print(f"[{style}]{d['id']}[/] ", end="")
            console.print(reason, markup=False)


def print_plugin_errors(inventory: Inventory) -> None:
    for r in inventory.reports:
        if r.error:
            console.print(f"[yellow]plugin {r.device_type}[/]: ", end="")
            console.print(r.error, markup=False)
