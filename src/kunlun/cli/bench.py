"""``kunlun-cli bench``: TTFT, TPOT, ITL, latency, throughput and goodput of an endpoint."""

from __future__ import annotations

import json as jsonlib
import os
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from kunlun.address import DEFAULT_ENDPOINT
from kunlun.console import console, err_console, handle_errors, print_json
from kunlun.errors import ConfigError, Location

if TYPE_CHECKING:
    from kunlun.bench import load

DEFAULT_OUT = Path("kunlun-bench")

ConcurrencyOpt = Annotated[
    str | None,
    typer.Option(
        help="Closed-loop sweep: concurrent clients per run (default 1,4,16; none "
        "when only --rate is given)."
    ),
]
RateOpt = Annotated[
    str | None, typer.Option(help="Poisson run(s): mean requests per second, e.g. 2 or 1,2,4.")
]
NumPromptsOpt = Annotated[
    int | None,
    typer.Option(
        min=1, help="Requests per run (default: 4 per client, at least 8; 32 per Poisson run)."
    ),
]
ApiKeyOpt = Annotated[
    str | None, typer.Option(help="Bearer token (default: $KUNLUN_API_KEY, $OPENAI_API_KEY).")
]
RecordOpt = Annotated[
    bool,
    typer.Option(
        "--record",
        help="Keep the sweep's output tokens/s in the Kunlun daemon at --endpoint, as the "
        "measured speed of the workload named by --model (engine: auto picks by it).",
    ),
]


def _positive_ints(text: str, option: str) -> tuple[int, ...]:
    try:
        values = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        values = ()
    if not values or min(values) < 1:
        raise ConfigError(
            f"{text!r} is not a comma-separated list of integers >= 1 (e.g. 1,4,16)",
            location=Location(option),
        )
    return values


def _positive_floats(text: str, option: str) -> tuple[float, ...]:
    try:
        values = tuple(float(part) for part in text.split(",") if part.strip())
    except ValueError:
        values = ()
    if not values or not min(values) > 0:
        raise ConfigError(
            f"{text!r} is not a comma-separated list of numbers > 0 (e.g. 2 or 1,2,4)",
            location=Location(option),
        )
    return values


@handle_errors
def bench(
    endpoint: Annotated[
        str, typer.Option(help=f"Server root or its /v1 URL, e.g. {DEFAULT_ENDPOINT}.")
    ],
    model: Annotated[str, typer.Option(help="Model name to send.")],
    concurrency: ConcurrencyOpt = None,
    rate: RateOpt = None,
    num_prompts: NumPromptsOpt = None,
    input_len: Annotated[int, typer.Option(min=1, help="Prompt tokens per request.")] = 128,
    output_len: Annotated[
        int, typer.Option(min=1, help="Output tokens per request (sent with ignore_eos).")
    ] = 128,
    slo_ttft_ms: Annotated[
        float | None, typer.Option(min=0, help="Goodput SLO on time to first token.")
    ] = None,
    slo_tpot_ms: Annotated[
        float | None, typer.Option(min=0, help="Goodput SLO on time per output token.")
    ] = None,
    out: Annotated[Path, typer.Option(help="Folder for bench.json and bench.png.")] = DEFAULT_OUT,
    api_key: ApiKeyOpt = None,
    seed: Annotated[int, typer.Option(help="Seed of the random prompts and arrivals.")] = 0,
    timeout: Annotated[float, typer.Option(min=1, help="Seconds one request may take.")] = 600.0,
    json: Annotated[
        bool, typer.Option("--json", help="Print the JSON document, not the table.")
    ] = False,
    record: RecordOpt = False,
) -> None:
    """Runs a warm-up request, a closed-loop concurrency sweep and Poisson runs, then prints a
    table, writes OUT/bench.json and OUT/bench.png (throughput and latency against
    concurrency), and reads the platform's memory and start-up times from /metrics when the
    endpoint is a Kunlun daemon. Exit status 1 when any request failed.
    """
    from kunlun.bench import load, suite
    from kunlun.event_loop import run_event_loop

    key = api_key or os.environ.get("KUNLUN_API_KEY") or os.environ.get("OPENAI_API_KEY")
    target = load.Target.parse(endpoint, model, key, timeout)
    rates = _positive_floats(rate, "--rate") if rate is not None else ()
    if concurrency is not None:
        levels = _positive_ints(concurrency, "--concurrency")
    else:
        levels = () if rates else (1, 4, 16)
    options = suite.BenchOptions(
        target, levels, rates, num_prompts, input_len, output_len, slo_ttft_ms, slo_tpot_ms, seed
    )
    # uvloop: the benchmark's own CPU per streamed token is what it takes from what it measures
    doc = run_event_loop(
        suite.run(options, lambda message: err_console.print(message, markup=False))
    )
    _report(doc, out, json)
    if any(run["num_errors"] for run in doc["runs"]):
        raise SystemExit(1)
    if record:
        _record(target, doc)


def _report(doc: dict[str, Any], out: Path, json: bool) -> None:
    """Write OUT/bench.png and OUT/bench.json (naming the chart), then print the document
    (``--json``) or the table, its notes and what was written."""
    from kunlun.bench import report

    out.mkdir(parents=True, exist_ok=True)
    chart = report.write_chart(doc, out / "bench.png")
    doc["chart"] = str(chart)
    (out / "bench.json").write_text(jsonlib.dumps(doc, indent=2) + "\n")
    if json:
        print_json(doc)
    else:
        console.print(report.table(doc))
        for line in report.notes(doc):
            console.print(line, markup=False)
        console.print(f"wrote {out / 'bench.json'} and {chart}")


def _record(target: load.Target, doc: dict[str, Any]) -> None:
    """Send the closed-loop runs' output tokens/s to the daemon (see ``--record``)."""
    from kunlun.cli.client import DaemonClient

    runs = [{"concurrency": run["concurrency"], "output_tokens_per_s": run["output_tokens_per_s"]}
            for run in doc["runs"] if run.get("mode") == "concurrency"]  # fmt: skip
    if not runs:
        raise ConfigError("--record keeps the --concurrency sweep; this run had none",
                          location=Location("--record"))  # fmt: skip
    client = DaemonClient(target.base_url, api_key=target.api_key)
    answer = client.post(f"/api/v1/workloads/{target.model}/measurements", json={"runs": runs})
    kept = answer["measurement"]
    console.print(f"recorded for model {answer['model']}: {kept['engine']} on "
                  f"{kept['device_type']} at quantization {kept['quantization']}", markup=False)  # fmt: skip
