"""``kunlun-cli validate``: the standard battery on every target, printed as a matrix."""

from __future__ import annotations

import os
import secrets
from pathlib import Path
from typing import Annotated

import typer

from kunlun.address import DEFAULT_ENDPOINT
from kunlun.cli.client import running_endpoint
from kunlun.console import console, err_console, handle_errors
from kunlun.errors import ConfigError, Location
from kunlun.validate.matrix import Cell, Column, Row

EndpointOpt = Annotated[
    list[str] | None,
    typer.Option(help="OpenAI-compatible server root (repeatable); default: the daemon."),
]
ModelOpt = Annotated[
    list[str] | None,
    typer.Option(help="Served model name (repeatable: one column per endpoint x model)."),
]
TargetOpt = Annotated[
    list[str] | None,
    typer.Option(help="A named column NAME=URL[,model=M][,pool=P] (repeatable)."),
]
ReferenceOpt = Annotated[
    str | None,
    typer.Option(help="Column name or endpoint URL to compare numerics with (default: first)."),
]
AllPoolsOpt = Annotated[
    bool,
    typer.Option("--all-pools", help="One column per device pool serving the model."),
]
OnlyOpt = Annotated[
    list[str] | None,
    typer.Option(help="Run only these checks or groups, e.g. functional, api.sse."),
]
SeedOpt = Annotated[
    int | None,
    typer.Option(help="Seed of the numbers, questions and ids drawn (default: random)."),
]


@handle_errors
def validate(
    endpoint: EndpointOpt = None,
    model: ModelOpt = None,
    target: TargetOpt = None,
    reference: ReferenceOpt = None,
    baseline: Annotated[
        Path | None, typer.Option(help="A saved validation.json: fail on regressions against it.")
    ] = None,
    out: Annotated[
        Path, typer.Option(help="Where the matrix is written (Markdown, HTML, JSON, JUnit XML).")
    ] = Path("kunlun-validation"),
    all_pools: AllPoolsOpt = False,
    api_key: Annotated[
        str | None, typer.Option(help="API key (default: $KUNLUN_API_KEY).", show_default=False)
    ] = None,
    only: OnlyOpt = None,
    max_tokens: Annotated[int, typer.Option(min=4, max=4096, help="Answer budget.")] = 24,
    seed: SeedOpt = None,
    eval_file: Annotated[
        Path | None,
        typer.Option(
            "--eval",
            help="A multiple-choice set (JSON lines of question, choices, "
            "answer) for the accuracy row (default: the shipped one).",
        ),
    ] = None,
    accuracy_points: Annotated[
        float,
        typer.Option(
            min=0, max=100, help="Points of accuracy a column may score below the reference's."
        ),
    ] = 5.0,
) -> None:
    # summary: kunlun.cli.commands
    from kunlun.validate import battery, report
    from kunlun.validate.check import Settings
    from kunlun.validate.matrix import Status, load_matrix

    key = api_key or os.environ.get("KUNLUN_API_KEY") or None
    columns = _columns(endpoint, list(model or []), target, reference, all_pools, key)
    saved = load_matrix(baseline) if baseline is not None else None
    settings = Settings(
        work_dir=out / "work",
        api_key=key,
        max_tokens=max_tokens,
        seed=secrets.randbelow(1 << 31) if seed is None else seed,
        eval_file=eval_file,
        accuracy_points=accuracy_points,
    )
    if eval_file is not None:  # a bad file is refused before anything is sent
        from kunlun.validate.accuracy import load_eval

        load_eval(eval_file)
    err_console.print(
        f"validating {len(columns)} target(s): "
        + ", ".join(
            f"{c.name} ({c.endpoint} {c.model}{' pool ' + c.pool if c.pool else ''})"
            for c in columns
        )  # fmt: skip
        + f"; reference {columns[0].name}; seed {settings.seed}",
        markup=False,
    )
    matrix = battery.run_battery(columns, settings, only or (), saved, _progress)
    paths = report.write_all(matrix, out)
    console.print(report.rich_table(matrix))
    for line in report.notes_lines(matrix):
        console.print(line, markup=False)
    console.print("written: " + ", ".join(str(p) for p in paths.values()), markup=False)
    raise SystemExit(1 if any(c.status is Status.FAIL for _, _, c in matrix.failures()) else 0)


def _columns(
    endpoint: list[str] | None,
    models: list[str],
    target: list[str] | None,
    reference: str | None,
    all_pools: bool,
    key: str | None,
) -> list[Column]:
    """The matrix's columns, the reference first: each ``--target``, then, given
    ``--endpoint`` or no ``--target``, one per endpoint (default: the running daemon's) and
    model, or per pool serving the model with ``--all-pools``."""
    from kunlun.validate.target import (
        cross_columns,
        discover_pools,
        normalize_endpoint,
        parse_target,
        with_reference,
    )

    columns = [parse_target(spec, models[0] if models else None) for spec in target or []]
    if endpoint or not target:
        if not models:
            raise ConfigError("which model? give --model M", location=Location("--model"))
        urls = [normalize_endpoint(u) for u in endpoint or [running_endpoint() or DEFAULT_ENDPOINT]]
        pools = None
        if all_pools:
            headers = {"Authorization": f"Bearer {key}"} if key else {}
            pools = {(u, m): discover_pools(u, m, headers) for u in urls for m in models}
            empty = [f"{m} at {u}" for (u, m), found in pools.items() if not found]
            if empty:
                raise ConfigError(
                    f"no RUNNING workload serves {', '.join(empty)}",
                    location=Location("--all-pools"),
                    hint="check `kunlun-cli workload list`",
                )
        columns += cross_columns(urls, models, pools)
    return with_reference(columns, reference, models[0] if models else None)


def _progress(column: Column, row: Row, cell: Cell) -> None:
    """One line on stderr per cell as the battery fills it."""
    line = f"  {column.name:<16} {row.id:<28} {cell.status.value} {cell.figure}"
    err_console.print(line, markup=False)
