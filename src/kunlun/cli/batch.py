"""``kunlun-cli batch run``: a JSON-lines batch job against the platform (or any
OpenAI-compatible endpoint), resumable after any interruption.

The task comes from ``--config task.yaml`` and/or flags (a flag overrides the file). The
endpoint is ``--endpoint``, else the running daemon (``KUNLUN_ENDPOINT`` or the pid file);
``KUNLUN_API_KEY`` is sent when set. Exit status: 0 every line has a result; 1 some lines
failed or were bad (see ``failures.jsonl``; rerun to retry them); 2 a bad task; 3 the
endpoint is unreachable.
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from kunlun.address import DEFAULT_ENDPOINT
from kunlun.cli.client import DaemonClient, running_endpoint
from kunlun.cli.commands import summary
from kunlun.console import console, err_console, handle_errors, print_json
from kunlun.errors import ConfigError, Location

app = typer.Typer(help=summary("batch"), no_args_is_help=True)


@app.command()
@handle_errors
def run(
    config: Annotated[Path | None, typer.Option("--config", "-c", help="Task YAML.")] = None,
    task_name: Annotated[str | None, typer.Option(help="Job name used in request ids.")] = None,
    model_alias: Annotated[str | None, typer.Option(help="Served model name.")] = None,
    input_file: Annotated[Path | None, typer.Option(help="Input JSON lines.")] = None,
    output_dir: Annotated[Path | None, typer.Option(help="Where results go.")] = None,
    batch_size: Annotated[int | None, typer.Option(help="Requests in flight.")] = None,
    max_retries: Annotated[int | None, typer.Option(help="Retries per request.")] = None,
    timeout_seconds: Annotated[float | None, typer.Option(help="Per attempt.")] = None,
    endpoint: Annotated[
        str | None, typer.Option(help="Server root (default: KUNLUN_ENDPOINT or the daemon).")
    ] = None,
    json: Annotated[bool, typer.Option("--json", help="Print the summary as JSON.")] = False,
) -> None:
    """Run a batch task: one request per input line; a rerun resumes where the last stopped."""
    from kunlun.batch.runner import RESULTS, BatchRunner
    from kunlun.batch.task import load_task

    flags = {
        "task_name": task_name,
        "model_alias": model_alias,
        "input_file": input_file,
        "output_dir": output_dir,
        "batch_size": batch_size,
        "max_retries": max_retries,
        "timeout_seconds": timeout_seconds,
    }
    task = load_task(config, flags)
    url = _root(endpoint or running_endpoint() or DEFAULT_ENDPOINT)
    _check_model(url, task.model_alias)
    bar = _Bar()
    runner = BatchRunner(
        task,
        url,
        os.environ.get("KUNLUN_API_KEY") or None,
        on_start=bar.start,
        on_result=bar.advance,
    )
    try:
        with bar.progress:
            summary = asyncio.run(runner.run())
    except KeyboardInterrupt:
        err_console.print("interrupted; run the same command again to resume")
        raise SystemExit(130) from None
    if json:
        print_json(summary.to_dict())
    else:
        console.print(
            f"{task.task_name}: {summary.num_results}/{summary.num_requests} done "
            f"({summary.num_done_before} from an earlier run), {summary.num_failed} failed, "
            f"{summary.num_bad_lines} bad input line(s); {summary.completion_tokens} tokens in "
            f"{summary.duration_s:.1f}s ({summary.tokens_per_s:.1f} tokens/s)"
        )
        console.print(f"results: {task.output_dir / RESULTS}", markup=False)
        if not summary.complete:
            console.print(f"failures: {task.output_dir / 'failures.jsonl'}", markup=False)
    raise SystemExit(0 if summary.complete else 1)


def _root(endpoint: str) -> str:
    """The server root: ``http://host:port/v1/`` and ``http://host:port`` are the same."""
    return endpoint.rstrip("/").removesuffix("/v1")


def _check_model(url: str, model: str) -> None:
    """Fail at once, not once per line, when the endpoint is down or lacks the model."""
    listed = DaemonClient(url, timeout=30).get("/v1/models")
    served = [m.get("id") for m in listed.get("data", []) if isinstance(m, dict)]
    if model not in served:
        raise ConfigError(
            f"model {model!r} is not served at {url}; served models: "
            f"{', '.join(map(str, served)) or 'none'}",
            location=Location("model_alias"),
            hint="kunlun-cli workload list shows what runs",
        )


class _Bar:
    """The progress bar: done/total, ETA and completion tokens per second."""

    def __init__(self) -> None:
        self.progress = Progress(
            TextColumn("[bold]batch"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("ETA"),
            TimeRemainingColumn(),
            TextColumn("{task.fields[rate]} tokens/s, {task.fields[failed]} failed"),
            console=err_console,
        )
        self.task_id: Any = None
        self.tokens = 0
        self.started = time.monotonic()

    def start(self, num_pending: int, num_done: int) -> None:
        self.started = time.monotonic()
        self.task_id = self.progress.add_task(
            "batch", total=num_pending + num_done, completed=num_done, rate="0.0", failed=0
        )

    def advance(self, succeeded: bool, tokens: int) -> None:
        self.tokens += tokens
        rate = self.tokens / max(time.monotonic() - self.started, 1e-6)
        failed = self.progress.tasks[0].fields["failed"] + (0 if succeeded else 1)
        self.progress.update(self.task_id, advance=1, rate=f"{rate:.1f}", failed=failed)
