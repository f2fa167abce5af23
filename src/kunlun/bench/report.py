"""The benchmark's outputs: a rich table, notes on memory and start-up, and a PNG chart.

The chart has two panels against concurrency (log scale; or, with Poisson runs only,
against the arrival rate): throughput (output tokens/s, with goodput when SLOs were given;
requests/s on the right-hand axis when every request returned exactly ``output_len``
tokens, so that the two are proportional) and latency (TTFT p50 and p99, TPOT p50, end-to-end p50, in ms). It is
drawn with matplotlib's Agg backend, so no display is needed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.table import Table


def run_label(run: dict[str, Any]) -> str:
    if run["mode"] == "concurrency":
        return f"concurrency {run['concurrency']}"
    return f"Poisson {run['rate']:g}/s"


def table(doc: dict[str, Any]) -> Table:
    """One row per run."""
    title = (
        f"bench {doc['model']} at {doc['endpoint']}: {doc['input_len']} prompt + "
        f"{doc['output_len']} output tokens per request"
    )
    t = Table(title=title, title_justify="left")
    columns = ("RUN", "OK/ALL", "REQ/S", "OUT TOK/S", "GOODPUT REQ/S", "TTFT ms p50/p90/p99",
               "TPOT ms p50/p90/p99", "ITL ms p50/p99", "E2E ms p50/p90/p99", "PEAK MEMORY")  # fmt: skip
    for column in columns:
        t.add_column(column, no_wrap=True)
    for run in doc["runs"]:
        t.add_row(
            run_label(run),
            f"{run['num_ok']}/{run['num_requests']}",
            _num(run["requests_per_s"], "{:.2f}"),
            _num(run["output_tokens_per_s"], "{:.1f}"),
            _num(run["goodput_requests_per_s"], "{:.2f}"),
            _dist(run["ttft_ms"], ("p50", "p90", "p99")),
            _dist(run["tpot_ms"], ("p50", "p90", "p99")),
            _dist(run["itl_ms"], ("p50", "p99")),
            _dist(run["e2e_ms"], ("p50", "p90", "p99")),
            _mib(run["peak_memory_bytes"]),
        )
    return t


def notes(doc: dict[str, Any]) -> list[str]:
    """Memory, start-up and error lines printed under the table."""
    memory = doc["memory"]
    lines = []
    if memory["idle_bytes"] is not None:
        lines.append(
            f"platform memory (daemon and workers, resident): idle {_mib(memory['idle_bytes'])}, "
            f"one request {_mib(memory['one_request_bytes'])}, "
            f"full concurrency {_mib(memory['full_concurrency_bytes'])}"
        )
    else:
        lines.append("platform memory: unknown (the endpoint has no Kunlun /metrics)")
    for replica in doc["startup"]:
        lines.append(
            f"start-up of {replica['replica']} on {replica['device']}: compile "
            f"{_num(replica['compile_s'], '{:.2f}')} s, load {_num(replica['load_s'], '{:.2f}')} s, "
            f"warm-up first token {_num(replica['warmup_ttft_s'], '{:.3f}')} s, "
            f"process start to ready {_num(replica['total_s'], '{:.2f}')} s"
        )
    for run in doc["runs"]:
        for error in run["errors"]:
            lines.append(f"{run_label(run)}: error: {error}")
    client = doc.get("client") or {}
    if client:
        lines.append(f"this benchmark's own CPU: {client['cpu_s']:.1f} s in {client['wall_s']:.1f} s "
                     f"({client['cpu_share']:.1%})")  # fmt: skip
    lines += [f"warning: {w}" for w in doc.get("warnings") or []]
    return lines


def write_chart(doc: dict[str, Any], path: Path) -> Path:
    """Draw the chart (see the module docstring) to ``path`` as PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [r for r in doc["runs"] if r["mode"] == "concurrency"]
    axis, xlabel = "concurrency", "concurrent requests (closed loop)"
    if not runs:
        runs = [r for r in doc["runs"] if r["mode"] == "poisson"]
        axis, xlabel = "rate", "arrival rate, requests/s (Poisson)"
    runs = sorted(runs, key=lambda r: r[axis])
    xs = [r[axis] for r in runs]
    figure, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    figure.suptitle(
        f"{doc['model']}: {doc['input_len']} prompt + {doc['output_len']} output tokens per request"
    )
    left.plot(xs, [r["output_tokens_per_s"] or 0 for r in runs], "o-", label="output tokens/s")
    if any(r["goodput_requests_per_s"] is not None for r in runs):
        goodput = [(r["goodput_requests_per_s"] or 0) * doc["output_len"] for r in runs]
        left.plot(xs, goodput, "s--", label="goodput: output tokens/s of requests within SLO")
    left.set_xlabel(xlabel)
    left.set_ylabel("output tokens/s")
    left.set_title("throughput")
    left.set_ylim(bottom=0)
    length = doc["output_len"]
    if all(r["total_output_tokens"] == r["num_ok"] * length for r in runs):
        # every request returned exactly output_len tokens: requests/s is tokens/s / output_len
        scale = (lambda t: t / length, lambda q: q * length)
        left.secondary_yaxis("right", functions=scale).set_ylabel("requests/s")
    left.legend(loc="best", fontsize="small")
    for key, quantile, style in (
        ("ttft_ms", "p50", "o-"),
        ("ttft_ms", "p99", "o--"),
        ("tpot_ms", "p50", "s-"),
        ("e2e_ms", "p50", "^-"),
    ):
        values = [r[key][quantile] for r in runs]
        if any(v is not None for v in values):
            name = f"{key.removesuffix('_ms').upper()} {quantile}"
            right.plot(
                xs, [v if v is not None else float("nan") for v in values], style, label=name
            )
    right.set_yscale("log")
    right.set_xlabel(xlabel)
    right.set_ylabel("ms (log scale)")
    right.set_title("latency")
    right.legend(fontsize="small")
    for ax in (left, right):
        if axis == "concurrency":
            ax.set_xscale("log", base=2)
        ax.set_xticks(xs, [f"{x:g}" for x in xs])
        ax.minorticks_off()
        ax.grid(alpha=0.3)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, format="png", dpi=100)
    plt.close(figure)
    return path


def _num(value: float | None, form: str) -> str:
    return "-" if value is None else form.format(value)


def _dist(dist: dict[str, float | None], keys: tuple[str, ...]) -> str:
    """Milliseconds, whole above 100 (the JSON keeps every digit)."""
    return "/".join(_num(dist[k], "{:.0f}" if (dist[k] or 0) >= 100 else "{:.1f}") for k in keys)


def _mib(value: float | None) -> str:
    return "-" if value is None else f"{value / (1 << 20):.0f} MiB"
