"""``kunlun-cli workload list | describe | logs | stop | scale`` (through the daemon); ``submit``
is :mod:`kunlun.cli.workload_submit`."""

from __future__ import annotations

import re
import time
from datetime import datetime
from typing import Annotated, Any

import typer
from rich.table import Table

from kunlun.cli.client import DaemonClient
from kunlun.cli.commands import summary
from kunlun.console import console, handle_errors, print_json


def plan_summary(plan: dict[str, Any]) -> str:
    """One line for a placement's plan (the planner is imported only to print one)."""
    from kunlun.planner.plan import ExecutionPlan

    return ExecutionPlan.from_dict(plan).summary()


app = typer.Typer(help=summary("workload"), no_args_is_help=True)
JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON.")]
_KEY_LINES = re.compile(r"(Compilation Time|Load Time|First Token Latency)")


@app.command("list")
@handle_errors
def list_workloads(json: JsonOpt = False) -> None:
    """List workloads with STATE, MODEL, TARGET DEVICE and ready replicas."""
    rows = DaemonClient().get("/api/v1/workloads")
    if json:
        print_json(rows)
        return
    table = Table(title="Workloads", title_justify="left")
    for col in ("JOB", "NAME", "STATE", "MODEL", "TARGET DEVICE", "REPLICAS", "PRIORITY", "AGE"):
        table.add_column(col)
    for w in rows:
        table.add_row(
            w["workload_id"],
            w["name"],
            w["state"],
            str(w["model"]),
            w["target_device"] or "-",
            f"{w['ready_replicas']}/{w['replicas']}",
            str(w["priority"]),
            _age(w["created"]),
        )
    console.print(table)


@app.command()
@handle_errors
def describe(job: str, json: JsonOpt = False) -> None:
    """State, target device and why, replicas (with restarts) and events of a workload."""
    d = DaemonClient().get(f"/api/v1/workloads/{job}")
    if json:
        print_json(d)
        return
    console.print(f"[bold]{d['workload_id']}[/] ({d['name']})  state: {d['state']}")
    if d.get("reason"):
        console.print(f"reason: {d['reason']}", markup=False)
    placement = d.get("placement") or {}
    console.print(
        f"target_device: {d.get('target_device') or '-'}  dtype: {placement.get('dtype', '-')}"
    )
    if placement.get("why"):
        console.print(f"why: {placement['why']}", markup=False)
    if placement.get("plan"):
        console.print("plan: " + plan_summary(placement["plan"]), markup=False)
    for device, why in (placement.get("rejected") or {}).items():
        console.print(f"  rejected {device}: {why}", markup=False)
    for r in d["replicas"]:
        console.print(
            f"replica {r['replica_id']} on {r['device']}: {'ready' if r['ready'] else 'not ready'}, "
            f"pid {r['pid']}, restarts {r['restarts']}, in flight {r['in_flight']}"
        )
        for rank in r.get("ranks") or []:
            console.print(f"  rank {rank['rank']}: pid {rank['pid']} on {rank['device']}")
    console.print("events:")
    for e in d["events"]:
        console.print(f"  {datetime.fromtimestamp(e['ts']):%H:%M:%S} {e['kind']:<9} ", end="")
        console.print(e["message"], markup=False)


@app.command()
@handle_errors
def logs(
    job: str,
    follow: Annotated[
        bool, typer.Option("--follow", "-f", help="Keep printing new lines.")
    ] = False,
) -> None:
    """The workload's engine logs (Compilation Time, Load Time, First Token Latency, requests)."""
    client = DaemonClient()
    offset = 0
    while True:
        chunk = client.get(f"/api/v1/workloads/{job}/logs", params={"offset": offset})
        for line in chunk["text"].splitlines():
            style = "bold" if _KEY_LINES.search(line) else ""
            console.print(f"[{style}]{_escape(line)}[/]" if style else line, markup=bool(style))
        offset = chunk["offset"]
        if not follow or chunk["state"] in ("STOPPED", "FAILED"):
            return
        time.sleep(0.5)


@app.command()
@handle_errors
def stop(job: str) -> None:
    """Stop a workload's replicas."""
    result = DaemonClient().post(f"/api/v1/workloads/{job}/stop")
    console.print(f"{result['workload_id']}: {result['state']}")


@app.command()
@handle_errors
def scale(job: str, replicas: int) -> None:
    """Run REPLICAS replicas of a running workload (the others keep serving)."""
    result = DaemonClient().post(f"/api/v1/workloads/{job}/scale", json={"replicas": replicas})
    console.print(f"{result['workload_id']}: {result['replicas']} replicas ({result['state']})")


def _age(created: float) -> str:
    seconds = int(time.time() - created)
    return (
        f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
        if seconds >= 3600
        else f"{seconds // 60}m{seconds % 60:02d}s"
    )


def _escape(text: str) -> str:
    return text.replace("[", "\\[")
