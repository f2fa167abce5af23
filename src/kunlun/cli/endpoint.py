"""``kunlun-cli endpoint create | list | show | delete``: Request-as-a-Service endpoints
(:mod:`kunlun.serving.endpoints`), through the daemon's ``/api/v1/endpoints``.

``create`` reads the two schema files and the template and checks them here first, with the
daemon's own checker, so a bad file is named with its line (JSON syntax, template syntax) or
the field inside it (a schema its metaschema refuses); the daemon checks again (and the model
name, and the output schema against the guided-decoding engine) before storing it.
"""

from __future__ import annotations

import json as jsonlib
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from kunlun.cli.client import DaemonClient
from kunlun.cli.commands import summary
from kunlun.console import console, handle_errors, print_json
from kunlun.errors import ConfigError, Location, RequestError
from kunlun.serving.endpoints import check_definition

app = typer.Typer(help=summary("endpoint"), no_args_is_help=True)
JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON.")]
NameArg = Annotated[
    str, typer.Argument(help="Endpoint name (a letter, then letters, digits, _ -).")
]
FileOpt = Annotated[Path, typer.Option(exists=True, dir_okay=False, readable=True)]


@app.command()
@handle_errors
def create(
    name: NameArg,
    model: Annotated[str, typer.Option(help="The model that answers (a served model name).")],
    input_schema: Annotated[Path, typer.Option(help="JSON Schema of the request body (file).")],
    output_schema: Annotated[Path, typer.Option(help="JSON Schema of the output (file).")],
    prompt: Annotated[
        Path, typer.Option(help="jinja2 template of the prompt; `input` is the body.")
    ],
    description: Annotated[str, typer.Option(help="What the endpoint does.")] = "",
    replace: Annotated[bool, typer.Option(help="Replace an endpoint of the same name.")] = False,
    json: JsonOpt = False,
) -> None:
    """Make POST /v1/endpoints/NAME: input validated, prompt rendered, output held to a schema."""
    sources = {"input_schema": str(input_schema), "output_schema": str(output_schema),
               "prompt": str(prompt)}  # fmt: skip
    body: dict[str, Any] = {
        "name": name,
        "model": model,
        "input_schema": _read_json(input_schema, "input_schema"),
        "output_schema": _read_json(output_schema, "output_schema"),
        "prompt": _read_text(prompt, "prompt"),
        "description": description,
    }
    try:
        check_definition(body, sources)
    except RequestError as exc:  # a bad file or option: the CLI's bad-input exit status
        raise ConfigError(exc.message, location=exc.location, hint=exc.hint) from None
    params = {"replace": "true"} if replace else None
    made = DaemonClient().post("/api/v1/endpoints", json=body, params=params)
    if json:
        print_json(made)
        return
    verb = "replaced" if made.get("replaced") else "created"
    console.print(f"endpoint {made['name']} {verb}: POST /v1/endpoints/{made['name']} "
                  f"answers with {made['model']}", markup=False)  # fmt: skip


@app.command("list")
@handle_errors
def list_endpoints(json: JsonOpt = False) -> None:
    """Every endpoint, by name."""
    rows = DaemonClient().get("/api/v1/endpoints")
    if json:
        print_json(rows)
        return
    table = Table(title="Endpoints", title_justify="left")
    for col in ("NAME", "MODEL", "DESCRIPTION"):
        table.add_column(col)
    for r in rows:
        table.add_row(r["name"], r["model"], r["description"])
    console.print(table)


@app.command()
@handle_errors
def show(name: NameArg, json: JsonOpt = False) -> None:
    """An endpoint's model, schemas and prompt template."""
    found = DaemonClient().get(f"/api/v1/endpoints/{name}")
    if json:
        print_json(found)
        return
    console.print(f"endpoint {found['name']} -> {found['model']}: {found['description']}\n"
                  f"input schema:\n{jsonlib.dumps(found['input_schema'], indent=2)}\n"
                  f"output schema:\n{jsonlib.dumps(found['output_schema'], indent=2)}\n"
                  f"prompt:\n{found['prompt']}", markup=False)  # fmt: skip


@app.command()
@handle_errors
def delete(name: NameArg, json: JsonOpt = False) -> None:
    """Remove an endpoint (its URL answers 404 from then on)."""
    done = DaemonClient().delete(f"/api/v1/endpoints/{name}")
    if json:
        print_json(done)
        return
    console.print(f"endpoint {name} deleted", markup=False)


def _read_text(path: Path, field: str) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(
            f"cannot read it: {exc}", location=Location(str(path), None, field)
        ) from None


def _read_json(path: Path, field: str) -> Any:
    try:
        return jsonlib.loads(_read_text(path, field))
    except jsonlib.JSONDecodeError as exc:
        raise ConfigError(f"not valid JSON: {exc.msg} (column {exc.colno})",
                          location=Location(str(path), exc.lineno, field)) from None  # fmt: skip
