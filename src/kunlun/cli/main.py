"""``kunlun-cli``: the operator's command line."""

from __future__ import annotations

import importlib
import inspect
import signal
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from kunlun import __version__
from kunlun.cli.commands import COMMANDS, SUBCOMMANDS, Command
from kunlun.console import console, handle_errors, print_json
from kunlun.paths import private_umask

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
    option), importing its module; when it names none (``--help``, no arguments, a typo),
    a placeholder of each command with its summary, importing nothing: typer then lists
    them all or says which is unknown."""
    first = next((word for word in argv if not word.startswith("-")), None)
    if first not in COMMANDS:
        for name, entry in COMMANDS.items():
            if entry.group:
                app.add_typer(typer.Typer(help=entry.summary), name=name)
            else:
                app.command(name, help=entry.summary)(_placeholder)
        return
    entry = COMMANDS[first]
    command = _loaded(entry)
    if entry.group:
        rest = argv[argv.index(first) + 1 :]
        second = next((word for word in rest if not word.startswith("-")), None)
        for name, sub in SUBCOMMANDS.get(first, {}).items():
            if name == second:
                _add(command, name, sub)
            else:  # listed by the group's --help with its summary, its module not imported
                command.command(name, help=sub.summary)(_placeholder)
            command.registered_commands.insert(0, command.registered_commands.pop())  # first
        app.add_typer(command, name=first)
    else:
        _add(app, first, entry)


def _loaded(entry: Command) -> Any:
    module = (
        sys.modules[__name__] if entry.module == __name__ else importlib.import_module(entry.module)
    )
    return getattr(module, entry.attribute)


def _add(group: typer.Typer, name: str, entry: Command) -> None:
    """Register the single command ``entry`` as ``name``: its summary, then its docstring."""
    command = _loaded(entry)
    more = inspect.getdoc(command)
    group.command(name, help=entry.summary + (f"\n\n{more}" if more else ""))(command)


def _placeholder() -> None:
    """Listed by ``--help``; never run (a command named on the line is registered itself)."""


@handle_errors
def doctor(
    replay: Annotated[
        Path | None, typer.Option("--replay", help="Check a recorded node instead of this one.")
    ] = None,
    json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    # summary: kunlun.cli.commands
    from kunlun.device.doctor import render, run_doctor

    report = run_doctor(replay=replay)
    if json:
        print_json(report.to_dict())
    else:
        render(report, console)
    raise SystemExit(report.exit_code())


def version() -> None:  # summary: kunlun.cli.commands
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
