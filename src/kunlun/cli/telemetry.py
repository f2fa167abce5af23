"""``kunlun-cli telemetry metrics``: the daemon's ``/metrics`` as tables."""

from __future__ import annotations

import json as jsonlib
import sys
import time
from typing import Annotated, Any

import typer
from rich.console import Group, RenderableType
from rich.live import Live
from rich.table import Table
from rich.text import Text

from kunlun.cli.client import DaemonClient
from kunlun.cli.commands import summary
from kunlun.console import console, handle_errors, print_json
from kunlun.engine.outputs import DECODE_PARTS
from kunlun.errors import ConfigError, Location
from kunlun.telemetry.view import Snapshot, parse, parse_filters

app = typer.Typer(help=summary("telemetry"), no_args_is_help=True)


@app.command("metrics")
@handle_errors
def metrics(
    filters: Annotated[
        list[str] | None,
        typer.Option(
            "--filter",
            help="Show rows whose label LABEL has VALUE (LABEL=VALUE, e.g. "
            "device_type=cpu, model=smollm2); repeat to combine.",
        ),
    ] = None,
    watch: Annotated[bool, typer.Option("--watch", help="Refresh until Ctrl-C.")] = False,
    interval: Annotated[float, typer.Option(help="Seconds between refreshes with --watch.")] = 2.0,
    json: Annotated[
        bool, typer.Option("--json", help="Print JSON (one object per refresh).")
    ] = False,
) -> None:
    """Device utilization, memory, temperature and power; per replica: requests, queue,
    KV cache, TTFT / TPOT / end-to-end latency (p50, p99 estimated from the histograms)."""
    if interval <= 0:
        raise ConfigError(f"--interval {interval} must be > 0", location=Location("--interval"))
    wanted = parse_filters(filters or [])
    client = DaemonClient()

    def take() -> Snapshot:
        return parse(client.get_text("/metrics")).filtered(wanted)

    try:
        if json:
            _print_json(take(), compact=watch)
            while watch:
                time.sleep(interval)
                _print_json(take(), compact=True)
        elif not watch:
            console.print(render(take(), client.endpoint))
        else:
            with Live(render(take(), client.endpoint), console=console, auto_refresh=False) as live:
                while True:
                    time.sleep(interval)
                    live.update(render(take(), client.endpoint), refresh=True)
    except KeyboardInterrupt:
        return


def _print_json(snapshot: Snapshot, compact: bool) -> None:
    if compact:  # one line per refresh, for `--watch --json | jq`
        sys.stdout.write(jsonlib.dumps(snapshot.to_dict(), default=str) + "\n")
        sys.stdout.flush()
    else:
        print_json(snapshot.to_dict())


def render(snapshot: Snapshot, endpoint: str) -> RenderableType:
    """The device table, the replica table and the platform-wide line."""
    footer = f"daemon {endpoint} at {time.strftime('%H:%M:%S')}"
    rss = snapshot.platform.get("resident_memory_bytes")
    if rss is not None:
        footer += f"; platform memory (daemon and workers) {_bytes(rss)}"
    refused = snapshot.platform.get("refused")
    if refused:
        footer += "; refused by the gateway: " + _statuses(refused)
    tables = [device_table(snapshot.devices), replica_table(snapshot.replicas)]
    if any(r.get("decode_steps") for r in snapshot.replicas):
        tables.append(decode_table(snapshot.replicas))
    return Group(*tables, Text(footer))


def device_table(rows: list[dict[str, Any]]) -> Table:
    table = Table(title="Devices", title_justify="left")
    for column in (
        "DEVICE",
        "TYPE",
        "STATUS",
        "UTILIZATION",
        "MEMORY",
        "MEM BANDWIDTH",
        "TEMPERATURE",
        "POWER",
    ):
        table.add_column(column, no_wrap=True)
    for d in rows:
        table.add_row(
            d["device"],
            d.get("device_type", "-"),
            d.get("status", "-"),
            _num(d.get("utilization_pct"), "{:.0f}%"),
            _memory(d.get("memory_used_bytes"), d.get("memory_total_bytes")),
            _bandwidth(d),
            _num(d.get("temperature_c"), "{:.0f} C"),
            _num(d.get("power_w"), "{:.0f} W"),
        )
    return table


def replica_table(rows: list[dict[str, Any]]) -> Table:
    """REQUESTS: count per HTTP status; QUEUE: requests at the replica / its limit; WAIT: sequences the engine has not admitted
    yet; KV: share of the KV cache in use; times in ms (p50, p99 from the histograms)."""
    table = Table(title="Replicas", title_justify="left")
    columns = ("MODEL", "REPLICA", "DEVICE", "PRIO", "READY", "REQUESTS", "QUEUE", "WAIT", "KV",
               "TTFT ms p50/p99", "TPOT ms", "E2E ms", "TOKENS IN/OUT", "MEMORY", "RESTARTS")  # fmt: skip
    for column in columns:  # statuses wrap onto more lines rather than squeeze the others
        table.add_column(column, no_wrap=column != "REQUESTS")
    for r in rows:
        table.add_row(
            r.get("model", "-"),
            r["replica"],
            r.get("device", "-"),
            r.get("priority", "-"),
            {1.0: "yes", 0.0: "no"}.get(r.get("ready", -1), "-"),
            _statuses(r.get("requests") or {}),
            f"{_num(r.get('queue_depth'), '{:.0f}')}/{_num(r.get('queue_limit'), '{:.0f}')}",
            _num(r.get("waiting"), "{:.0f}"),
            _num(_times(r.get("kv_cache_usage"), 100), "{:.0f}%"),
            f"{_ms(r.get('ttft_p50_s'))}/{_ms(r.get('ttft_p99_s'))}",
            _ms(r.get("tpot_p50_s")),
            _ms(r.get("e2e_p50_s")),
            f"{_num(r.get('prompt_tokens'), '{:.0f}')}/{_num(r.get('generation_tokens'), '{:.0f}')}",
            _bytes(r.get("resident_memory_bytes")),
            _num(r.get("restarts"), "{:.0f}"),
        )
    return table


def decode_table(rows: list[dict[str, Any]]) -> Table:
    """The step profiler's figure per replica: its decode path, decode steps so far, their
    mean wall time and its parts (compiled step, reference forward, engine), and on the
    compiled path the Python share (the engine part)."""
    table = Table(title="Decode steps", title_justify="left")
    for column in ("REPLICA", "PATH", "STEPS", "STEP ms", *map(str.upper, DECODE_PARTS),
                   "PYTHON"):  # fmt: skip
        table.add_column(column)
    for r in rows:
        steps = r.get("decode_steps")
        if not steps or "decode_path" not in r:
            continue
        parts = {part: r.get(f"decode_{part}_s", 0.0) for part in DECODE_PARTS}
        wall = max(sum(parts.values()), 1e-9)
        shares = {part: f"{100 * value / wall:.0f}%" for part, value in parts.items()}
        # the compiled step and graph replays run no Python: the engine's part is all of it
        python = shares["engine"] if r["decode_path"] in ("compiled", "graphs") else "-"
        table.add_row(r["replica"], r["decode_path"], f"{steps:.0f}",
                      f"{wall / steps * 1000:.1f}", *shares.values(), python)  # fmt: skip
    return table


def _num(value: float | None, form: str) -> str:
    return "-" if value is None else form.format(value)


def _times(value: float | None, factor: float) -> float | None:
    return None if value is None else value * factor


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.0f}"


def _bytes(value: float | None) -> str:
    if value is None:
        return "-"
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20)):
        if value >= size:
            return f"{value / size:.1f} {unit}"
    return f"{value:.0f} B"


def _memory(used: float | None, total: float | None) -> str:
    if total is None:
        return "-"
    return f"{_bytes(used) if used is not None else '?'} / {_bytes(total)}"


def _bandwidth(d: dict[str, Any]) -> str:
    parts = []
    if d.get("memory_bandwidth_util_pct") is not None:
        parts.append(f"{d['memory_bandwidth_util_pct']:.0f}% busy")
    if d.get("memory_bandwidth_bytes_per_s") is not None:
        parts.append(f"peak {d['memory_bandwidth_bytes_per_s'] / 1e9:.0f} GB/s")
    return ", ".join(parts) or "-"


def _statuses(counts: dict[str, float]) -> str:
    return " ".join(f"{status}:{count:.0f}" for status, count in sorted(counts.items())) or "-"
