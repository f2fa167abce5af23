"""``kunlun-cli apikey create | list | revoke``.

Works on ``KUNLUN_HOME`` directly, or through the daemon when ``KUNLUN_ENDPOINT`` is set (then
``KUNLUN_API_KEY`` must hold a valid key once any key exists). Keys are stored only as hashes;
a new key is shown once.
"""

from __future__ import annotations

import os
from datetime import datetime
from typing import Annotated, Any
from urllib.parse import quote

import typer
from rich.table import Table

from kunlun.cli.client import DaemonClient
from kunlun.cli.output import console, handle_errors, print_json
from kunlun.paths import kunlun_home
from kunlun.state.api_keys import create_key, revoke_key, shown_key
from kunlun.state.sqlite import SQLiteStore

app = typer.Typer(help="API keys: create, list, revoke.", no_args_is_help=True)


def _store() -> SQLiteStore:
    return SQLiteStore(kunlun_home() / "state.db")


def _remote() -> DaemonClient | None:
    return DaemonClient() if os.environ.get("KUNLUN_ENDPOINT") else None


@app.command()
@handle_errors
def create(
    name: str,
    priority: Annotated[
        str | None,
        typer.Option(
            help="Priority class of the key's requests: high, normal or low (default: the "
            "workload's; the X-Kunlun-Priority header still overrides it)."
        ),
    ] = None,
    json: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """Create a key; it is printed once and never stored in clear."""
    remote = _remote()
    if remote:
        out = remote.post("/api/v1/apikeys", json={"name": name, "priority": priority})
    else:
        record, secret = create_key(_store(), name, priority)
        out = {"key_id": record.key_id, "name": record.name, "key": secret,
               "priority": record.priority}  # fmt: skip
    if json:
        print_json(out)
        return
    klass = f", priority {out['priority']}" if out.get("priority") else ""
    console.print(
        f"created key {out['key_id']} ({out['name']}{klass}); store it now, it is not shown again:"
    )
    console.print(out["key"], markup=False)


@app.command("list")
@handle_errors
def list_keys(json: Annotated[bool, typer.Option("--json")] = False) -> None:
    """Keys with their state (the secrets themselves are never shown)."""
    remote = _remote()
    rows: list[dict[str, Any]] = (
        remote.get("/api/v1/apikeys")
        if remote
        else [
            {
                "key_id": k.key_id,
                "name": k.name,
                "created": k.created,
                "revoked": k.revoked,
                "priority": k.priority,
            }
            for k in _store().list_api_keys()
        ]
    )
    if json:
        print_json(rows)
        return
    table = Table(title="API keys", title_justify="left")
    for col in ("KEY ID", "NAME", "PRIORITY", "CREATED", "STATE"):
        table.add_column(col)
    for k in rows:
        state = (
            f"revoked {datetime.fromtimestamp(k['revoked']):%Y-%m-%d %H:%M}"
            if k["revoked"]
            else "active"
        )
        table.add_row(
            k["key_id"],
            k["name"],
            k.get("priority") or "-",
            f"{datetime.fromtimestamp(k['created']):%Y-%m-%d %H:%M}",
            state,
        )
    console.print(table)


@app.command()
@handle_errors
def revoke(key: Annotated[str, typer.Argument(help="Key id, name or the key itself.")]) -> None:
    """Revoke a key by id, name or the key itself (a key is never echoed back)."""
    remote = _remote()
    if remote:
        path = "/api/v1/apikeys/"
        out = remote.request("DELETE", path + quote(key, safe=""), shown=path + shown_key(key))
        key_id, name = out["key_id"], out["name"]
    else:
        record = revoke_key(_store(), key)
        key_id, name = record.key_id, record.name
    console.print(f"revoked {key_id} ({name})")
