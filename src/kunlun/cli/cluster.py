"""``kunlun-cli node list | drain | undrain`` and ``kunlun-cli cluster certs | status``.

``node`` and ``cluster status`` ask any node of a running cluster (``KUNLUN_ENDPOINT``, or the
local daemon); ``cluster certs`` makes the cluster's CA and member certificates offline.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from kunlun.cli.client import DaemonClient
from kunlun.cli.commands import summary
from kunlun.console import console, handle_errors, print_json

nodes_app = typer.Typer(help=summary("node"), no_args_is_help=True)
cluster_app = typer.Typer(help=summary("cluster"), no_args_is_help=True)
JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON.")]


@nodes_app.command("list")
@handle_errors
def list_nodes(json: JsonOpt = False) -> None:
    """Every node with a live lease: state, leader, devices and replicas."""
    rows = DaemonClient().get("/api/v1/nodes")
    if json:
        print_json(rows)
        return
    table = Table(title="Nodes", title_justify="left")
    for col in ("NODE", "STATE", "LEADER", "DEVICES", "REPLICAS", "API"):
        table.add_column(col)
    for n in rows:
        devices = ", ".join(f"{d['id']} {d['status']}" for d in n.get("devices") or []) or "-"
        replicas = ", ".join(
            f"{r['replica_id']}{'' if r.get('ready') else ' (loading)'}"
            + (f" (failed: {r['failed']})" if r.get("failed") else "")
            for r in n.get("replicas") or []
        )
        table.add_row(n["name"], n["state"], "*" if n.get("leader") else "", devices,
                      replicas or "-", n.get("api_url") or "-")  # fmt: skip
    console.print(table)


@nodes_app.command()
@handle_errors
def drain(node: Annotated[str, typer.Argument(help="The node's name.")]) -> None:
    """Move every replica off NODE (each keeps serving until its successor is ready)."""
    DaemonClient().post(f"/api/v1/nodes/{node}/drain")
    console.print(f"node {node} draining: its replicas move to other nodes", markup=False)


@nodes_app.command()
@handle_errors
def undrain(node: Annotated[str, typer.Argument(help="The node's name.")]) -> None:
    """Let NODE take replicas again."""
    DaemonClient().post(f"/api/v1/nodes/{node}/undrain")
    console.print(f"node {node} takes replicas again", markup=False)


@cluster_app.command()
@handle_errors
def certs(
    out: Annotated[Path, typer.Option("--out", help="Directory for the CA and certificates.")],
    name: Annotated[
        list[str],
        typer.Option("--name", help="A member (node name or etcd member name); repeatable."),
    ],
    host: Annotated[
        list[str] | None,
        typer.Option("--host", help="An address or DNS name members are reached at; repeatable."),
    ] = None,
    days: Annotated[int, typer.Option(min=1, help="Validity in days.")] = 825,
) -> None:
    """A CA (made once in DIR, reused after) and a certificate for each --name."""
    from kunlun.state.certs import make_certs

    for path in make_certs(out, name, host or [], days):
        console.print(f"wrote {path}", markup=False)


@cluster_app.command()
@handle_errors
def status(json: JsonOpt = False) -> None:
    """This node's view: the leader, its term, fenced writes, lease losses, etcd."""
    data = DaemonClient().get("/api/v1/cluster")
    if json:
        print_json(data)
        return
    for key, value in data.items():
        console.print(f"{key}: {value}", markup=False)
