"""``kunlun-device-probe``: walk through device discovery step by step.

Shows how each config entry parsed (file:line), each vendor command run and its result, each
device object built, and the verdict per device. Exit status: 0 when every declared device is
Ready, 1 when some are Degraded, Unhealthy or Excluded, 2 on a config error.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from kunlun.cli.device import device_table, memory_text
from kunlun.console import console, handle_errors, print_json
from kunlun.device.inventory import Inventory, build_inventory, read_config, resolve_replay_dir

app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)


@app.command()
@handle_errors
def probe(
    config: Annotated[
        Path | None, typer.Option("--config", help="device-plugin-config.yaml to check.")
    ] = None,
    replay: Annotated[
        Path | None, typer.Option("--replay", help="Read recorded tool output from DIR.")
    ] = None,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Show every step.")] = False,
    json: Annotated[bool, typer.Option("--json", help="Print the whole probe as JSON.")] = False,
) -> None:
    """Discover devices, check them against the declaration, and explain every verdict."""
    replay_dir = resolve_replay_dir(replay)
    declarations = read_config(config) if config else []
    inventory = build_inventory(config=config, replay=replay_dir, declarations=declarations)
    if json:
        print_json(probe_dict(inventory))
    else:
        _render(inventory, verbose)
    raise SystemExit(inventory.exit_code())


def _render(inv: Inventory, verbose: bool) -> None:
    source = f"replay {inv.replay_dir}" if inv.replay_dir else "live tools"
    console.print(f"[bold]Step 1[/] config: {inv.config_path or '(none)'}; discovery from {source}")
    for d in inv.declarations:
        fields = ", ".join(f"{k}={v}" for k, v in d.decl.model_dump(exclude_unset=True).items())
        console.print(f"  {d.path}:{d.line} {d.id}: ", end="")
        console.print(fields if verbose else f"{len(d.declared_fields())} fields", markup=False)
    console.print("[bold]Step 2[/] vendor plugins and commands")
    for r in inv.reports:
        state = "error" if r.error else ("found" if r.tool_found else "no tool")
        console.print(
            f"  plugin {r.device_type}: {state}, {len(r.devices)} device(s), {r.duration_ms:.0f} ms"
        )
        if verbose:
            for c in r.commands:
                mark = "ok " if c.ok else "FAIL"
                console.print(f"    [{mark}] ", end="")
                console.print(
                    f"{c.command} ({c.source}, {c.duration_ms:.0f} ms): {c.detail}", markup=False
                )
            for note in r.notes:
                console.print(f"    note: {note}", markup=False)
        if r.error:
            console.print("    [red]error:[/] ", end="")
            console.print(r.error, markup=False)
    console.print("[bold]Step 3[/] device objects built")
    for r in inv.reports:
        for dev in r.devices:
            line = f"  {dev.id} {dev.name} bus={dev.bus_id or '-'} memory={dev.memory_total_mb} MB health={dev.health_detail or dev.health.value}"
            console.print(line, markup=False)
            for problem in dev.problems if verbose else []:
                console.print(f"    problem: {problem}", markup=False)
    console.print("[bold]Step 4[/] verdicts")
    console.print(device_table(inv.to_list()))
    for p in inv.profiles:
        console.print(f"  {p.id}: {p.status.value} ({memory_text(p.to_dict())})", markup=False)
        for reason in p.reasons:
            console.print(f"    - {reason}", markup=False)
        if verbose:
            prov = ", ".join(f"{k}:{f.provenance.value}" for k, f in p.fields.items())
            console.print(f"    provenance: {prov}", markup=False)


def probe_dict(inv: Inventory) -> dict[str, Any]:
    """The whole probe as JSON: declarations, plugin reports with commands, verdicts."""
    return {
        "config": inv.config_path,
        "replay": inv.replay_dir,
        "declarations": [
            {"id": d.id, "line": d.line, "fields": d.decl.model_dump(exclude_unset=True)}
            for d in inv.declarations
        ],
        "plugins": [
            {
                "device_type": r.device_type,
                "tool_found": r.tool_found,
                "error": r.error,
                "notes": r.notes,
                "devices": [dev.id for dev in r.devices],
                "commands": [
                    {"command": c.command, "source": c.source, "ok": c.ok, "detail": c.detail}
                    for c in r.commands
                ],
            }
            for r in inv.reports
        ],
        "devices": inv.to_list(),
        "exit_code": inv.exit_code(),
    }


def main() -> None:
    app()
