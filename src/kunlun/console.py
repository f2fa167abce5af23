"""Terminal output of both entry points (`kunlun-cli`, `kunlun-platform`), and the one place
that maps Kunlun errors to exit codes and messages."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from functools import wraps
from typing import Any, TypeVar

from rich.console import Console
from rich.markup import escape

from kunlun.errors import KunlunError

# Wide when piped (rich would assume 80 columns and squeeze the tables).
_WIDTH = None if sys.stdout.isatty() else 160
console = Console(highlight=False, soft_wrap=True, width=_WIDTH)
err_console = Console(stderr=True, highlight=False, soft_wrap=True, width=_WIDTH)

F = TypeVar("F", bound=Callable[..., Any])


def handle_errors(fn: F) -> F:
    """Run a command; a :class:`KunlunError` becomes a message on stderr and its exit code."""

    @wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except KunlunError as exc:
            err_console.print(f"[bold red]error[/] {escape(f'[{exc.code}]')} ", end="")
            err_console.print(str(exc), markup=False)
            raise SystemExit(exc.exit_code) from None

    return wrapper  # type: ignore[return-value]


def print_json(data: Any) -> None:
    """Machine-readable output: plain JSON on stdout, no styling."""
    sys.stdout.write(json.dumps(data, indent=2, default=str) + "\n")
