"""``kunlun-cli snapshot save | list | show | diff | restore``: known-good snapshots
(:mod:`kunlun.validate.snapshots`), taken of a running workload through the daemon.

``save WORKLOAD`` records what the workload runs (spec, plan, device profiles, versions) and
its greedy answers; ``kunlun-cli adapt`` saves one per passing pool and engine with its
figures. ``restore ID`` submits the snapshot's spec again and waits until it serves;
``--check`` then asks the greedy prompts again and exits 1 when an answer differs.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from kunlun.cli.client import DaemonClient
from kunlun.cli.commands import summary
from kunlun.console import console, err_console, handle_errors, print_json
from kunlun.engine.launch import EMBEDDED_ENGINE
from kunlun.errors import KunlunError
from kunlun.validate import snapshots

app = typer.Typer(help=summary("snapshot"), no_args_is_help=True)
DirOpt = Annotated[
    Path | None, typer.Option("--dir", help="Snapshot folder (default: KUNLUN_HOME/snapshots).")
]


def folder(given: Path | None) -> Path:
    return given or snapshots.default_dir()


def greedy_answers(client: DaemonClient, name: str) -> list[dict[str, str]]:
    """The model ``name``'s greedy answers to the fingerprint prompts."""
    out = []
    for prompt in snapshots.PROMPTS:
        answer = client.post("/v1/completions", json={
            "model": name, "prompt": prompt, "max_tokens": snapshots.FINGERPRINT_TOKENS,
            "temperature": 0})  # fmt: skip
        out.append({"prompt": prompt, "text": answer["choices"][0]["text"]})
    return out


def capture(
    client: DaemonClient, workload_id: str, model: str | None = None,
    figures: dict[str, Any] | None = None,
) -> dict[str, Any]:  # fmt: skip
    """A snapshot of the running workload ``workload_id`` (``model``: as the operator named
    it; default the spec's)."""
    from kunlun.planner.cache import model_fingerprint

    described = client.get(f"/api/v1/workloads/{workload_id}")
    spec, plan = described["spec"], (described.get("placement") or {}).get("plan") or {}
    devices = [d for d in client.get("/api/v1/devices") if d["id"] in (plan.get("devices") or [])]
    version = client.get("/healthz").get("version")
    engine = plan.get("engine") or spec.get("engine")
    path = Path(plan.get("model_path") or "")
    now = time.time()
    model = model or str(spec["model"])
    return {
        "id": snapshots.new_id(model, devices[0]["type"] if devices else "?", str(engine), now),
        "created": now,
        "model": model,
        "model_path": str(path) if plan.get("model_path") else None,
        "model_fingerprint": model_fingerprint(path) if path.is_dir() else None,
        "pool": devices[0]["type"] if devices else None,
        "engine": engine,
        "engine_version": ((described.get("placement") or {}).get("engine") or {}).get("version")
        or (version if engine == EMBEDDED_ENGINE else None),
        "spec": spec,
        "plan": plan,
        "devices": devices,
        "kunlun_version": version,
        "endpoint": client.endpoint,
        "figures": figures or {},
        "greedy": greedy_answers(client, described["name"]),
    }


@app.command()
@handle_errors
def save(
    workload: str, dir: DirOpt = None, json: Annotated[bool, typer.Option("--json")] = False
) -> None:
    """Snapshot a RUNNING workload: spec, plan, devices, versions, greedy answers."""
    client = DaemonClient(timeout=120)
    path = snapshots.save(folder(dir), capture(client, workload))
    data = snapshots.load(path.parent, path.stem)
    if json:
        print_json(data)
    else:
        console.print(f"saved {data['id']}: {path}", markup=False)


@app.command("list")
@handle_errors
def list_snapshots(
    dir: DirOpt = None,
    model: Annotated[str | None, typer.Option(help="Only this model's.")] = None,
    json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """The snapshots, oldest first."""
    unread: list[str] = []
    found = [s for s in snapshots.listed(folder(dir), unread)
             if model is None or s.get("model") == model]  # fmt: skip
    for problem in unread:
        err_console.print(f"not a snapshot, skipped: {problem}", markup=False)
    if json:
        print_json(found)
        return
    table = Table(title=f"Snapshots in {folder(dir)}", title_justify="left")
    for col in ("ID", "MODEL", "POOL", "ENGINE", "DTYPE", "ACCURACY", "TOK/S", "SAVED"):
        table.add_column(col)
    for s in found:
        figures = s.get("figures") or {}
        accuracy, rate = figures.get("accuracy"), figures.get("tokens_per_s")
        table.add_row(s["id"], str(s.get("model")), str(s.get("pool")), str(s.get("engine")),
                      str((s.get("plan") or {}).get("dtype")),
                      "-" if accuracy is None else f"{accuracy:.1%}",
                      "-" if rate is None else f"{rate:.1f}",
                      time.strftime("%Y-%m-%d %H:%M", time.gmtime(s.get("created", 0))))  # fmt: skip
    console.print(table)


@app.command()
@handle_errors
def show(snapshot_id: str, dir: DirOpt = None) -> None:
    """The whole snapshot as JSON."""
    print_json(snapshots.load(folder(dir), snapshot_id))


@app.command()
@handle_errors
def diff(first: str, second: str, dir: DirOpt = None) -> None:
    """What differs between two snapshots, field by field (ids and times left out)."""
    a, b = snapshots.load(folder(dir), first), snapshots.load(folder(dir), second)
    changes = snapshots.diff(a, b)
    for field, left, right in changes:
        console.print(f"{field}: {left!r} -> {right!r}", markup=False)
    console.print(f"{len(changes)} field(s) differ", markup=False)


@app.command()
@handle_errors
def restore(
    snapshot_id: str,
    dir: DirOpt = None,
    check: Annotated[bool, typer.Option("--check", help="Ask the greedy prompts again.")] = False,
    timeout: Annotated[float, typer.Option(min=1)] = 900,
) -> None:
    """Submit the snapshot's workload spec again, wait until it serves; with --check, exit 1
    unless its greedy answers are the snapshot's."""
    saved = snapshots.load(folder(dir), snapshot_id)
    client = DaemonClient(timeout=120)
    job, row, why = client.run_workload(saved["spec"], timeout)
    if why is not None:
        raise KunlunError(f"{job} did not come up: {why}")
    console.print(f"restored {saved['id']} as {job} ({row['name']})", markup=False)
    if not check:
        return
    differ = [(was, now) for was, now in zip(saved["greedy"], greedy_answers(client, row["name"]),
                                             strict=True) if was["text"] != now["text"]]  # fmt: skip
    for was, now in differ:
        console.print(f"differs: {was['prompt']!r}: {was['text']!r} -> {now['text']!r}",
                      markup=False)  # fmt: skip
    console.print(f"greedy answers: {len(saved['greedy']) - len(differ)} of "
                  f"{len(saved['greedy'])} the same", markup=False)  # fmt: skip
    raise SystemExit(1 if differ else 0)
