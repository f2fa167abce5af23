"""``kunlun-cli``: the operator's command line."""

from __future__ import annotations

import importlib
import signal
import sys
from pathlib import Path
from typing import Annotated

import typer

from kunlun import __version__
from kunlun.cli.output import console, handle_errors, print_json
from kunlun.paths import private_umask

COMMANDS: dict[str, tuple[str, str, bool]] = {
    "device": ("kunlun.cli.device", "app", True),
    "workload": ("kunlun.cli.workload", "app", True),
    "model": ("kunlun.cli.model", "app", True),
    "keys": ("kunlun.cli.keys", "app", True),
    "node": ("kunlun.cli.cluster", "nodes_app", True),
    "cluster": ("kunlun.cli.cluster", "cluster_app", True),
    "apikey": ("kunlun.cli.apikey", "app", True),
    "batch": ("kunlun.cli.batch", "app", True),
    "rollout": ("kunlun.cli.rollout", "app", True),
    "endpoint": ("kunlun.cli.endpoint", "app", True),
    "plan": ("kunlun.cli.plan", "plan", False),
    "telemetry": ("kunlun.cli.telemetry", "app", True),
    "bench": ("kunlun.cli.bench", "bench", False),
    "validate": ("kunlun.cli.validate", "validate", False),
    "doctor": ("kunlun.cli.main", "doctor", False),
    "version": ("kunlun.cli.main", "version", False),
}
"""The commands in their own modules, in the order ``--help`` lists them: name -> (module,
attribute, whether it is a group of subcommands). Each module imports what its commands
need (the planner, the HTTP client, the state store, ...), which takes about a second of
start-up in all; a run imports only the module of the command it runs."""

app = typer.Typer(
    help="Kunlun Platform: chip-agnostic LLM inference.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)


@app.callback()
def root() -> None:
    """Kunlun Platform: chip-agnostic LLM inference."""
    # a group even when :func:`register` adds one command: typer would otherwise run a
    # lone command as the program itself and refuse its name as an extra argument


def register(argv: list[str]) -> None:
    """Add to :data:`app` the command ``argv`` names (its first word that is not an
    option), or every command when it names none of them (``--help``, a typo: typer then
    lists them all or says which is unknown)."""
    first = next((word for word in argv if not word.startswith("-")), None)
    for name, (module, attribute, group) in COMMANDS.items():
        if first in COMMANDS and name != first:
            continue
        command = getattr(sys.modules[__name__] if module == __name__ else
                          importlib.import_module(module), attribute)  # fmt: skip
        if group:
            app.add_typer(command, name=name)
        else:
            app.command(name)(command)


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
    register(sys.argv[1:])
    app()
