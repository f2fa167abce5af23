"""``kunlun-cli``: the operator's command line."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Annotated

import typer

from kunlun import __version__
from kunlun.cli import (
    apikey,
    batch,
    bench,
    cluster,
    device,
    endpoint,
    keys,
    model,
    rollout,
    telemetry,
    validate,
    workload,
)
from kunlun.cli.output import console, handle_errors, print_json
from kunlun.cli.plan import plan
from kunlun.paths import private_umask

app = typer.Typer(
    help="Kunlun Platform: chip-agnostic LLM inference.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
app.add_typer(device.app, name="device")
app.add_typer(workload.app, name="workload")
app.add_typer(model.app, name="model")
app.add_typer(keys.app, name="keys")
app.add_typer(cluster.nodes_app, name="node")
app.add_typer(cluster.cluster_app, name="cluster")
app.add_typer(apikey.app, name="apikey")
app.add_typer(batch.app, name="batch")
app.add_typer(rollout.app, name="rollout")
app.add_typer(endpoint.app, name="endpoint")
app.command("plan")(plan)
app.add_typer(telemetry.app, name="telemetry")
app.command("bench")(bench.bench)
app.command("validate")(validate.validate)


@app.command()
@handle_errors
def doctor(
    replay: Annotated[
        Path | None, typer.Option("--replay", help="Check a recorded node instead of this one.")
    ] = None,
    json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """Check this machine's environment: kernel, vendor tools, drivers, container, ports."""
    from kunlun.device.doctor import render, run_doctor

    report = run_doctor(replay=replay)
    if json:
        print_json(report.to_dict())
    else:
        render(report, console)
    raise SystemExit(report.exit_code())


@app.command()
def version() -> None:
    """Print the Kunlun version."""
    console.print(__version__)


def main() -> None:
    # Ctrl-C and ``kill -INT`` stop every command (``--watch``, ``logs -f`` included), even
    # when the shell that started it set SIGINT to "ignore", as non-interactive shells do
    # for background jobs: Python keeps an inherited SIG_IGN instead of raising
    # KeyboardInterrupt.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    private_umask()  # what the CLI writes under KUNLUN_HOME is the user's alone
    app()
