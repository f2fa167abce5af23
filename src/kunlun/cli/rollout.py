"""``kunlun-cli rollout create | status | list | promote | abort``: canary rollouts
(:mod:`kunlun.rollout`), through the daemon's ``/api/v1/rollouts``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from kunlun.cli.client import DaemonClient
from kunlun.cli.commands import summary
from kunlun.console import console, handle_errors, print_json
from kunlun.errors import ConfigError, Location
from kunlun.workload.spec import read_spec_fields

app = typer.Typer(help=summary("rollout"), no_args_is_help=True)
JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON.")]
RolloutArg = Annotated[str, typer.Argument(help="Rollout id (or its workload's id or name).")]


@app.command()
@handle_errors
def create(
    workload: Annotated[str, typer.Option(help="The workload to roll out (id or name).")],
    model: Annotated[str, typer.Option(help="The new version's model (alias or path).")],
    canary: Annotated[
        str | None, typer.Option(help="The first step's share of traffic, e.g. 10%.")
    ] = None,
    steps: Annotated[
        str | None, typer.Option(help="Canary shares in order, e.g. 10,25,50,100.")
    ] = None,
    interval: Annotated[
        str | None, typer.Option(help="How long each step runs before its gates decide (5m).")
    ] = None,
    max_error_rate: Annotated[
        str | None, typer.Option(help="Most errors beyond the baseline's rate (0.1%).")
    ] = None,
    max_p95_regression: Annotated[
        str | None, typer.Option(help="Most p95 TTFT / end-to-end regression (5%).")
    ] = None,
    min_requests: Annotated[
        int | None,
        typer.Option(min=1, help="Canary requests a step needs (default 3 / max-error-rate)."),
    ] = None,
    file: Annotated[
        Path | None,
        typer.Option("--file", "-f", help="YAML of workload spec fields the canary changes."),
    ] = None,
    json: JsonOpt = False,
) -> None:
    """Start the new version next to the old one and shift traffic step by step."""
    body: dict[str, Any] = {"workload": workload, "model": model}
    for key, value in (("canary", canary), ("steps", steps), ("interval_s", interval),
                       ("max_error_rate", max_error_rate),
                       ("max_p95_regression", max_p95_regression),
                       ("min_requests", min_requests)):  # fmt: skip
        if value is not None:
            body[key] = value
    if file is not None:
        body["overrides"] = read_spec_fields(file)
    status = DaemonClient().post("/api/v1/rollouts", json=body)
    if json:
        print_json(status)
        return
    console.print(f"rollout {status['rollout_id']}: canary {status['canary_workload_id']} "
                  f"({status['canary_model']}) starting next to {status['workload_id']}; "
                  f"steps {_steps(status['steps'])} %", markup=False)  # fmt: skip


@app.command()
@handle_errors
def status(rollout: Annotated[str | None, typer.Argument(help="Rollout id; default the newest.")] = None,
           json: JsonOpt = False) -> None:  # fmt: skip
    """Step, weights, each gate against its limit, requests counted, time to next step."""
    client = DaemonClient()
    if rollout is None:
        rows = client.get("/api/v1/rollouts")
        if not rows:
            raise ConfigError("no rollout yet", location=Location("ROLLOUT"),
                              hint="kunlun-cli rollout create --workload W --model M")  # fmt: skip
        found = rows[-1]
    else:
        found = client.get(f"/api/v1/rollouts/{rollout}")
    if json:
        print_json(found)
        return
    _show(found)


@app.command("list")
@handle_errors
def list_rollouts(json: JsonOpt = False) -> None:
    """Every rollout, oldest first."""
    rows = DaemonClient().get("/api/v1/rollouts")
    if json:
        print_json(rows)
        return
    table = Table(title="Rollouts", title_justify="left")
    for col in ("ROLLOUT", "MODEL", "STATE", "STEP", "CANARY %", "BASELINE", "CANARY", "REASON"):
        table.add_column(col)
    for r in rows:
        table.add_row(r["rollout_id"], r["model"], r["state"], _step(r),
                      f"{r['weights']['canary']:g}", r["workload_id"], r["canary_workload_id"],
                      r.get("reason") or "")  # fmt: skip
    console.print(table)


@app.command()
@handle_errors
def promote(rollout: RolloutArg, json: JsonOpt = False) -> None:
    """Give the canary all traffic now and stop the baseline, whatever the gates say."""
    _act(rollout, "promote", json)


@app.command()
@handle_errors
def abort(rollout: RolloutArg, json: JsonOpt = False) -> None:
    """Send all traffic back to the baseline and stop the canary."""
    _act(rollout, "abort", json)


def _act(rollout: str, action: str, json: bool) -> None:
    found = DaemonClient(timeout=120.0).post(f"/api/v1/rollouts/{rollout}/{action}")
    if json:
        print_json(found)
        return
    _show(found)


def _show(r: dict[str, Any]) -> None:
    lines = [
        f"rollout {r['rollout_id']}  {r['state']}"
        + (f": {r['reason']}" if r.get("reason") else ""),
        f"  model {r['model']}: baseline {r['workload_id']} ({r['baseline_model']}), canary "
        f"{r['canary_workload_id']} ({r['canary_model']})",
        f"  step {_step(r)} of steps {_steps(r['steps'])} %; weights baseline "
        f"{r['weights']['baseline']:g} % / canary {r['weights']['canary']:g} %",
    ]
    if r.get("next_step_in_s") is not None:
        lines.append(f"  step interval {r['interval_s']:g} s; next step in {r['next_step_in_s']:g} s "
                     "(when every gate passes)")  # fmt: skip
    console.print("\n".join(lines), markup=False)
    if r.get("gates"):
        table = Table(title_justify="left", title="Gates (canary vs baseline, this step)")
        for col in ("GATE", "VERDICT", "CANARY", "BASELINE", "LIMIT", "SAMPLES", "DETAIL"):
            table.add_column(col)
        for g in r["gates"]:
            rate = g["gate"] == "error_rate"
            table.add_row(g["gate"], g["verdict"].upper(), _value(g["canary"], rate),
                          _value(g["baseline"], rate), _value(g["limit"], rate),
                          f"{g['samples']}/{g['needed']}", g["detail"])  # fmt: skip
        console.print(table)


def _value(value: float | None, rate: bool) -> str:
    if value is None:
        return "-"
    return f"{value:.2%}" if rate else f"{value:.1f} ms"


def _step(r: dict[str, Any]) -> str:
    return "-" if r["step"] < 0 else f"{r['step'] + 1}/{len(r['steps']) - 1}"


def _steps(steps: list[float]) -> str:
    return ",".join(f"{s:g}" for s in steps)
