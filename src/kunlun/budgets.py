"""Input budgets: the one place that says how much work a client's or a file's input may ask for.

Every input that is compiled, matched, parsed or unpacked on a user's behalf (a JSON schema, a
regular expression, a list of choices, a grammar, token ids to decode, nested JSON) gets a
budget here: a size or a count checked before any work, and a time to compile or match it,
spent off the event loop with a deadline (:func:`bounded`). Over a budget is an
:class:`~kunlun.errors.OverBudget`: HTTP 400 naming the input, the figure and the budget
(exit 3 for a file), and no other request waits on it.

Each budget has a default an operator can change with an environment variable
``KUNLUN_BUDGET_<NAME>`` (``KUNLUN_BUDGET_REGEX_BYTES=32768``), read by the daemon and its
workers alike; a bad value stops the daemon's start naming the variable (:func:`check`).
``docs/reliability.md`` lists them.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from kunlun.errors import ConfigError, Location, OverBudget

_T = TypeVar("_T")


@dataclass(frozen=True)
class Budget:
    name: str
    default: float
    unit: str
    what: str

    @property
    def variable(self) -> str:
        return f"KUNLUN_BUDGET_{self.name.upper()}"


BUDGETS = {b.name: b for b in (
    Budget("json_depth", 64, "levels", "nesting of arrays and objects in a JSON body, and in "
           "JSON carried inside a string field (a schema given as text)"),
    Budget("schema_bytes", 256 * 1024, "bytes", "a JSON schema (guided_json, response_format, "
           "a tool's parameters, an endpoint's input and output schemas) as JSON text"),
    Budget("regex_bytes", 16 * 1024, "bytes", "a regular expression a user writes "
           "(guided_regex, a schema's pattern)"),
    Budget("regex_program_bytes", 8 * 1024 * 1024, "bytes", "the compiled form of a user's "
           "regular expression (a{1000000} is refused here, not matched)"),
    Budget("choices", 1024, "strings", "guided_choice's strings (the grammar engine holds at "
           "most 2,000 alternatives in a row while generating)"),
    Budget("choice_bytes", 256 * 1024, "bytes", "guided_choice's strings together"),
    Budget("grammar_bytes", 256 * 1024, "bytes", "a grammar (guided_grammar, a structural "
           "tag) as text"),
    Budget("program_seconds", 5.0, "s", "time to compile a user's schema, regex, choices or "
           "grammar, or to check a value against a schema, off the event loop"),
    Budget("detokenize_ids", 65536, "token ids", "token ids one /detokenize call decodes"),
)}  # fmt: skip


@functools.cache
def limit(name: str) -> float:
    """The budget ``name``: its environment variable's value, else its default."""
    budget = BUDGETS[name]
    raw = os.environ.get(budget.variable)
    if raw is None:
        return budget.default
    kind = float if isinstance(budget.default, float) else int
    try:
        value = kind(raw)
    except ValueError:
        value = -1
    if not 0 < value < float("inf"):
        raise ConfigError(
            f"{budget.variable} must be a positive {'number' if kind is float else 'integer'} "
            f"({budget.unit}), got {raw!r}",
            location=Location(budget.variable),
        )
    return value


def check() -> None:
    """Read every budget once (at the daemon's start): a bad variable stops it by name."""
    for name in BUDGETS:
        limit(name)


def over(
    name: str, what: str, figure: float, field: str | None = None, where: Location | None = None
) -> OverBudget:
    """The error for ``what`` (``guided_choice``) at ``figure`` over the budget ``name``,
    located in the request's ``field`` (default ``what``) or at ``where`` (a file)."""
    budget = BUDGETS[name]
    shown = f"{figure:g}" if isinstance(figure, float) else f"{figure:,}"
    return OverBudget(
        f"{what} is {shown} {budget.unit}, over the budget of {limit(name):,g} {budget.unit} "
        f"({budget.what})",
        location=where or Location("request", field=field or what),
        hint=f"the operator can change it with {budget.variable}",
    )


def require(name: str, what: str, figure: float, field: str | None = None) -> None:
    """Refuse ``figure`` (a size or count of ``what``) when it is over the budget ``name``."""
    if figure > limit(name):
        raise over(name, what, figure, field)


_POOL = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="kunlun-budget")
"""The threads that compile and match user programs: two, so a flood of costly programs
waits here (each against its own deadline) and never takes the threads everything else uses
(``asyncio.to_thread``'s default pool)."""


WAIT_FACTOR = 4
"""A program gets ``program_seconds`` of its thread's CPU time, and at most this many times as
long by the clock (its wait for one of :data:`_POOL`'s threads included): on a machine busy
with other work a program that computes for a second can take five by the clock, and is not
over its budget for that."""


async def bounded(
    what: str, function: Callable[..., _T], *args: Any, field: str | None = None
) -> _T:
    """``function(*args)`` off the event loop, within ``program_seconds`` of CPU: its result,
    or an :class:`OverBudget` naming ``what`` when its thread has computed that long (or the
    clock has run :data:`WAIT_FACTOR` times as long). The work itself is written to end
    (linear-time matchers, bounded sizes); the budget is the backstop."""
    seconds = limit("program_seconds")
    threads: list[tuple[int, float]] = []  # (the thread running it, its CPU time then)

    def run() -> _T:
        threads.append((threading.get_ident(), time.thread_time()))
        return function(*args)

    loop = asyncio.get_running_loop()
    future = loop.run_in_executor(_POOL, run)
    started = loop.time()
    while True:
        try:
            return await asyncio.wait_for(asyncio.shield(future), seconds / 4)
        except TimeoutError:
            used = _thread_cpu(threads[0][0]) - threads[0][1] if threads else 0.0
            if used >= seconds or loop.time() - started >= seconds * WAIT_FACTOR:
                future.cancel()
                raise OverBudget(
                    f"{what} took longer than {seconds:g} s to compile or check",
                    location=Location("request", field=field or what),
                    hint=f"simplify it; the operator can change the budget with "
                    f"{BUDGETS['program_seconds'].variable}",
                ) from None


def _thread_cpu(ident: int) -> float:
    """CPU seconds the thread ``ident`` has used (0 where the platform cannot say, or the
    thread has just ended: its result is then on its way)."""
    try:
        return time.clock_gettime(time.pthread_getcpuclockid(ident))
    except (OSError, AttributeError):
        return 0.0
