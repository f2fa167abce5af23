"""``kunlun-cli apikey create | list | revoke``.

Works on ``KUNLUN_HOME`` directly, or through the daemon when ``KUNLUN_ENDPOINT`` is set (then
``KUNLUN_API_KEY`` must hold a valid key once any key exists). Keys are stored only as hashes;
a new key is shown once. ``create --scope admin|inference`` (default inference) says what
the key may do; ``--rpm``, ``--tpm`` and ``--allow-ip`` set its own limits.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any
from urllib.parse import quote

import typer
from rich.table import Table

from kunlun.cli.client import state_client
from kunlun.cli.commands import summary
from kunlun.console import console, err_console, handle_errors, print_json
from kunlun.paths import kunlun_home
from kunlun.state.api_keys import (
    DEFAULT_SCOPE,
    create_key,
    describe_key,
    no_admin_warning,
    revoke_key,
    shown_key,
)
from kunlun.state.sqlite import SQLiteStore

app = typer.Typer(help=summary("apikey"), no_args_is_help=True)


def _store() -> SQLiteStore:
    return SQLiteStore(kunlun_home() / "state.db")


@app.command()
@handle_errors
def create(
    name: str,
    scope: Annotated[
        str,
        typer.Option(
            help="admin (every route, the admin API included) or inference (the OpenAI "
            "API under /v1 and /metrics only)."
        ),
    ] = DEFAULT_SCOPE,
    priority: Annotated[
        str | None,
        typer.Option(
            help="Priority class of the key's requests: high, normal or low (default: the "
            "workload's; the X-Kunlun-Priority header still overrides it)."
        ),
    ] = None,
    rpm: Annotated[
        int | None,
        typer.Option(help="Requests per minute (default: the daemon's api_keys.rpm; 0: none)."),
    ] = None,
    tpm: Annotated[
        int | None,
        typer.Option(
            help="Tokens (prompt + completion) per minute (default: the daemon's "
            "api_keys.tpm; 0: none)."
        ),
    ] = None,
    allow_ip: Annotated[
        str | None,
        typer.Option(
            "--allow-ip",
            help="Client networks that may use the key, CIDR[,CIDR] (default: the daemon's "
            "api_keys.allow_ips; without one, any).",
        ),
    ] = None,
    json: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """Create a key; it is printed once and never stored in clear."""
    remote = state_client()
    if remote:
        body = {"name": name, "priority": priority, "scope": scope, "rpm": rpm, "tpm": tpm,
                "allow_ips": allow_ip}  # fmt: skip
        out = remote.post("/api/v1/apikeys", json=body)
    else:
        store = _store()
        record, secret = create_key(store, name, priority, scope, rpm, tpm, allow_ip)
        out = {**describe_key(record), "key": secret, "warning": no_admin_warning(store)}
    if out.get("warning"):  # on stderr, so that --json output stays one document
        err_console.print(f"warning: {out['warning']}", markup=False)
    if json:
        print_json(out)
        return
    extras = [f"scope {out['scope']}"]
    extras += [f"priority {out['priority']}"] if out.get("priority") else []
    extras += [f"{field} {out[field]}" for field in ("rpm", "tpm") if out.get(field) is not None]
    extras += [f"from {','.join(out['allow_ips'])}"] if out.get("allow_ips") else []
    console.print(
        f"created key {out['key_id']} ({out['name']}, {', '.join(extras)}); "
        "store it now, it is not shown again:"
    )
    console.print(out["key"], markup=False)


@app.command("list")
@handle_errors
def list_keys(json: Annotated[bool, typer.Option("--json")] = False) -> None:
    """Keys with their scope, limits and state (the secrets themselves are never shown)."""
    remote = state_client()
    rows: list[dict[str, Any]] = (
        remote.get("/api/v1/apikeys")
        if remote
        else [describe_key(k) for k in _store().list_api_keys()]
    )
    if json:
        print_json(rows)
        return
    table = Table(title="API keys", title_justify="left")
    for col in ("KEY ID", "NAME", "SCOPE", "PRIORITY", "RPM", "TPM", "ALLOW IPS", "CREATED",
                "STATE"):  # fmt: skip
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
            k.get("scope") or "-",
            k.get("priority") or "-",
            _limit(k.get("rpm")),
            _limit(k.get("tpm")),
            ",".join(k.get("allow_ips") or []) or "default",
            f"{datetime.fromtimestamp(k['created']):%Y-%m-%d %H:%M}",
            state,
        )
    console.print(table)


def _limit(value: int | None) -> str:
    """A key's own rpm/tpm as the table shows it."""
    return "default" if value is None else "none" if value == 0 else str(value)


@app.command()
@handle_errors
def revoke(key: Annotated[str, typer.Argument(help="Key id, name or the key itself.")]) -> None:
    """Revoke a key by id, name or the key itself (a key is never echoed back)."""
    remote = state_client()
    if remote:
        path = "/api/v1/apikeys/"
        out = remote.request("DELETE", path + quote(key, safe=""), shown=path + shown_key(key))
        key_id, name = out["key_id"], out["name"]
    else:
        record = revoke_key(_store(), key)
        key_id, name = record.key_id, record.name
    console.print(f"revoked {key_id} ({name})")
