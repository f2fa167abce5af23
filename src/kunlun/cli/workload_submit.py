"""``kunlun-cli workload submit``: its options are the workload spec's fields
(:mod:`kunlun.cli.spec_flags`), so this module alone of the workload commands imports the
spec; ``kunlun-cli workload list`` does not (:data:`kunlun.cli.commands.SUBCOMMANDS`)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from kunlun.cli.client import DaemonClient
from kunlun.cli.spec_flags import spec_command
from kunlun.cli.workload import JsonOpt, plan_summary
from kunlun.console import console, handle_errors, print_json
from kunlun.workload.spec import load_spec_file, parse_spec


@handle_errors
@spec_command()
def submit(
    file: Annotated[Path | None, typer.Option("--file", "-f", help="Workload spec YAML.")] = None,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Only show where it would run.")
    ] = False,
    json: JsonOpt = False,
    *,
    spec: dict[str, Any],
) -> None:
    """`--model M` with options, or `--file spec.yaml` (options override the file). Every
    field of the spec but the nested ones (telemetry, faults: in a file) is an option."""
    data: dict[str, Any] = load_spec_file(file).model_dump(exclude_unset=True) if file else {}
    data.update(spec)
    if "model" not in data:
        raise typer.BadParameter("give --model or --file with a 'model' field")
    parse_spec(data, str(file) if file else "command line")
    result = DaemonClient().post("/api/v1/workloads", json=data, params={"dry_run": dry_run})
    if json:
        print_json(result)
        return
    verb = "would run" if dry_run else "submitted"
    console.print(
        f"{result['workload_id']} {verb}: model {result['name']} -> "
        f"target_device {result['target_device'] or '(planning)'} [{result['state']}]"
    )
    placement = result.get("placement") or {}
    if placement.get("why"):
        console.print(f"  why: {placement['why']}", markup=False)
    if placement.get("plan"):
        console.print("  plan: " + plan_summary(placement["plan"]), markup=False)
    if dry_run:
        for device, why in (placement.get("rejected") or {}).items():
            console.print(f"  rejected {device}: {why}", markup=False)
