"""``kunlun-cli adapt``: one model on every pool and engine of a running platform, checked in
one command, ending in a pool-by-gate verdict matrix and an exit status a CI job can use.

In the order the product documents give for a new model:

1. **plan**: for each pool (device type with a Ready device; ``--pools all`` or a list) and
   engine, a dry run of the workload: the plan, or the planner's reason it cannot run there;
2. **start**: each planned one submitted as a workload of its own name
   (``adapt-<model>-<pool>-<engine>``) and waited for until RUNNING;
3. **smoke**: the shortest prompt, one request, alone;
4. **battery**: ``kunlun-cli validate``'s battery (or the rows of ``--only``) with one column
   per pool and engine, the first (or ``--reference``) the reference of the numerics and of
   the accuracy on the evaluation set (``--eval``, default the shipped one);
5. **bench**: a short streamed sweep (``--concurrency``) of each;
6. the gates of :mod:`kunlun.validate.gates`, printed as a matrix and written to
   ``OUT/adapt.json`` beside the battery's reports (``OUT/validation.*``), with each pool's
   verdict: adapted with the fastest engine that failed no gate, or not.

The workloads it started are stopped at the end (``--keep`` leaves them), so the daemon is
left as it was found. Exit 0 when every pool is adapted (with ``--every-engine``: when no
gate of any engine failed), 1 otherwise (2: bad input, 3: daemon unreachable).
"""

from __future__ import annotations

import asyncio
import json as json_lib
import re
import time
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from kunlun.cli.client import DaemonClient
from kunlun.console import console, err_console, handle_errors, print_json
from kunlun.errors import ConfigError, KunlunError, Location
from kunlun.validate import snapshots
from kunlun.validate.gates import (
    FAIL,
    GATES,
    PASS,
    Candidate,
    PoolVerdict,
    Verdict,
    judge,
    pool_verdicts,
    run_failed,
)

STYLE = {PASS: "green", FAIL: "bold red"}
REFERENCE_PREFIX = "reference:"
"""The column of ``--reference-model`` (a served model, not one adapt starts)."""


@handle_errors
def adapt(
    model: Annotated[
        str, typer.Option(help="Model alias, local HF directory, or GGUF file (imported).")
    ],
    pools: Annotated[str, typer.Option(help="all, or device types, comma-separated.")] = "all",
    engines: Annotated[str, typer.Option(help="Engines, comma-separated.")] = "kunlun",
    reference: Annotated[
        str | None, typer.Option(help="The reference column, POOL/ENGINE (default: the first).")
    ] = None,
    reference_model: Annotated[
        str | None,
        typer.Option(
            help="A model the platform serves (its name) as the reference instead: "
            "the known-good version new weights are held to."
        ),
    ] = None,
    quantization: Annotated[
        str | None, typer.Option("--quantization", "--quantize", help="Weight scheme to run.")
    ] = None,
    eval_file: Annotated[
        Path | None, typer.Option("--eval", help="Multiple-choice set (default: the shipped one).")
    ] = None,
    only: Annotated[
        list[str] | None, typer.Option(help="Battery rows or groups to run (default: all).")
    ] = None,
    accuracy_points: Annotated[float, typer.Option(min=0, max=100)] = 5.0,
    throughput_share: Annotated[
        float, typer.Option(min=0, max=1, help="Of the best engine's tokens/s on the pool.")
    ] = 0.8,
    concurrency: Annotated[list[int] | None, typer.Option(min=1, help="Bench clients.")] = None,
    requests: Annotated[int, typer.Option(min=1, help="Bench requests per run.")] = 8,
    output_len: Annotated[int, typer.Option(min=1, help="Bench output tokens.")] = 32,
    keep: Annotated[bool, typer.Option("--keep", help="Leave the workloads running.")] = False,
    snapshot_dir: Annotated[
        Path | None,
        typer.Option("--snapshots", help="Known-good snapshots (default: KUNLUN_HOME/snapshots)."),
    ] = None,
    out: Annotated[Path, typer.Option(help="Where adapt.json and the reports go.")] = Path(
        "kunlun-adapt"
    ),
    timeout: Annotated[
        float, typer.Option(min=1, help="Seconds a workload may take to start.")
    ] = 900,
    json: Annotated[bool, typer.Option("--json", help="Print adapt.json.")] = False,
    sign: Annotated[
        Path | None, typer.Option(help="Sign adapt.json with this Ed25519 private key (PEM).")
    ] = None,
    every_engine: Annotated[
        bool,
        typer.Option("--every-engine", help="Fail unless every engine passes (not one per pool)."),
    ] = False,
) -> None:
    # summary: kunlun.cli.commands
    client = DaemonClient(timeout=120)
    key, folder = client.api_key, snapshot_dir or snapshots.default_dir()
    if reference_model is not None:
        reference = served_reference(client, reference_model, reference)
    asked = pool_list(client, pools)
    model = imported(client, model)
    with Stages(len(asked) * len(names(engines))) as clock:
        candidates = plan_all(client, model, asked, names(engines), quantization)
        try:
            clock.mark("plan")
            ready = start_and_smoke(client, candidates, timeout, clock)
            battery(client.endpoint, key, ready, reference, reference_model, eval_file,
                    only or [], accuracy_points, out)  # fmt: skip
            clock.mark("battery")
            for c in ready:
                bench(client.endpoint, key, c, tuple(concurrency or (1, 4)), requests, output_len)
                clock.step("bench")
            clock.mark("bench")
            take_snapshots(client, model, ready, folder)
            clock.mark("snapshot")
        finally:
            for c in candidates if not keep else []:
                stop(client, c)
    verdicts = judge(candidates, accuracy_points, throughput_share)
    pools_found = pool_verdicts(candidates, verdicts)
    saved = keep_good(candidates, verdicts, folder)
    doc = {**report(model, candidates, verdicts, clock.seconds), "snapshots": saved,
           "pools": {p: v.to_dict() for p, v in pools_found.items()}}  # fmt: skip
    finish(doc, verdicts, pools_found, out, json, sign)
    raise SystemExit(1 if run_failed(verdicts, pools_found, every_engine) else 0)


def finish(doc: dict[str, Any], verdicts: dict[str, dict[str, Verdict]],
           pools_found: dict[str, PoolVerdict], out: Path, as_json: bool,
           sign: Path | None) -> None:  # fmt: skip
    """Write ``adapt.json`` (and, with ``sign``, its detached signature ``adapt.json.sig``,
    which ``kunlun-cli keys verify`` checks), print the matrix (or the JSON)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "adapt.json").write_text(json_lib.dumps(doc, indent=2) + "\n")
    if sign is not None:
        from kunlun.offline.signing import load_private_key, sign_file

        sign_file(load_private_key(sign), out / "adapt.json")
    if as_json:
        print_json(doc)
    else:
        render(verdicts)
        for pool, v in pools_found.items():
            said = f"adapted with {v.engine}" if v.status == PASS else "not adapted"
            console.print(f"pool {pool}: {said}: {v.why}", markup=False)
        console.print(f"written: {out / 'adapt.json'}", markup=False)


class Stages:
    """Seconds each stage of the run took (``adapt.json``'s ``seconds``) and, on a terminal,
    a progress bar per stage (the lines of :func:`say` print above them)."""

    NAMES = ("plan", "start", "smoke", "battery", "bench", "snapshot")

    def __init__(self, items: int) -> None:
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
        )

        self.began = self.last = time.monotonic()
        self.seconds: dict[str, float] = {}
        self.bars = Progress(TextColumn("{task.description:<9}"), BarColumn(),
                             MofNCompleteColumn(), TimeElapsedColumn(), console=err_console,
                             disable=not err_console.is_terminal)  # fmt: skip
        self.tasks = {stage: self.bars.add_task(stage, total=1 if stage == "battery" else items)
                      for stage in self.NAMES}  # fmt: skip

    def __enter__(self) -> Stages:
        self.bars.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.bars.stop()

    def step(self, stage: str) -> None:
        self.bars.advance(self.tasks[stage])

    def mark(self, stage: str) -> None:
        """``stage`` is over (what it skipped counts as done)."""
        now = time.monotonic()
        task = self.tasks[stage]
        self.bars.update(task, completed=self.bars.tasks[task].total)
        self.seconds[stage] = round(now - self.last, 1)
        self.seconds["total"] = round(now - self.began, 1)
        self.last = now


def imported(client: DaemonClient, model: str) -> str:
    """The name the platform knows ``model`` by: a GGUF file is imported first (a path on the
    daemon's machine, under its model roots), under its file name's stem; an alias or a
    Hugging Face directory is taken as it is."""
    if not model.endswith(".gguf"):
        return model
    say(f"import {model}")
    record = client.post("/api/v1/models/import-gguf",
                         json={"path": str(Path(model).expanduser().resolve())}, timeout=600)  # fmt: skip
    say(f"imported {model} as {record['alias']}")
    return str(record["alias"])


def start_and_smoke(
    client: DaemonClient, candidates: list[Candidate], timeout: float, clock: Stages
) -> list[Candidate]:
    """Start every planned candidate, then send each the smoke request; those answered."""
    for c in candidates:
        start(client, c, timeout)
        clock.step("start")
    clock.mark("start")
    for c in candidates:
        c.smoke = smoke(client, c) if c.started else None
        clock.step("smoke")
    clock.mark("smoke")
    return [c for c in candidates if c.smoke is not None and c.smoke.status == PASS]


def names(text: str) -> list[str]:
    found = [n.strip() for n in text.split(",") if n.strip()]
    if not found:
        raise ConfigError(f"no name in {text!r}", location=Location("--engines"))
    return list(dict.fromkeys(found))


def workload_name(purpose: str, model: str, *parts: str) -> str:
    """The name of a workload this command starts for ``model``: ``adapt-smollm2-cpu-kunlun``."""
    slug = re.sub(r"[^A-Za-z0-9]+", "-", Path(model).name).strip("-").lower() or "model"
    return "-".join((purpose, slug, *parts))


def pool_list(client: DaemonClient, pools: str) -> list[str]:
    """The device types asked for, each with a Ready device on the platform."""
    ready = sorted({d["type"] for d in client.get("/api/v1/devices") if d["status"] == "Ready"})
    if pools.strip() == "all":
        if not ready:
            raise ConfigError("no Ready device on the platform", location=Location("--pools"))
        return ready
    asked = names(pools)
    unknown = [p for p in asked if p not in ready]
    if unknown:
        raise ConfigError(f"no Ready {', '.join(unknown)} device; pools here: "
                          f"{', '.join(ready) or 'none'}", location=Location("--pools"))  # fmt: skip
    return asked


def plan_all(
    client: DaemonClient, model: str, pools: list[str], engines: list[str], scheme: str | None
) -> list[Candidate]:
    """A candidate per pool and engine, with the planner's plan or its reason."""
    candidates = []
    for pool in pools:
        for engine in engines:
            c = Candidate(pool, engine, workload_name("adapt", model, pool, engine))
            spec = {"model": model, "name": c.name, "engine": engine,
                    "preferred_device_types": [pool]}  # fmt: skip
            if scheme is not None:
                spec["quantization"] = scheme
            say(f"plan {c.column}")
            try:
                made = client.post("/api/v1/workloads", json=spec, params={"dry_run": True})
            except KunlunError as exc:
                if exc.exit_code == 3:  # the daemon is gone: nothing else can be said
                    raise
                c.refused = str(exc).split(": ", 1)[-1]
            else:
                plan = (made.get("placement") or {}).get("plan") or {}
                device_types = {d.split(":")[0] for d in plan.get("devices") or []}
                if device_types != {pool}:
                    c.refused = (f"the planner places it on {', '.join(plan.get('devices') or [])}"
                                 f", not on {pool}: {made['placement'].get('why')}")  # fmt: skip
                else:
                    c.plan, c.spec = plan, spec
            candidates.append(c)
    return candidates


def start(client: DaemonClient, c: Candidate, timeout: float) -> None:
    """Submit ``c``'s workload and wait until it is RUNNING with a ready replica."""
    if c.plan is None or c.spec is None:
        return
    say(f"start {c.column} as {c.name}")
    try:
        c.workload_id, _, c.start_error = client.run_workload(c.spec, timeout)
    except KunlunError as exc:
        c.start_error = str(exc)


def smoke(client: DaemonClient, c: Candidate) -> Verdict:
    """The shortest request, alone: one token of a one-word prompt."""
    say(f"smoke {c.column}")
    began = time.perf_counter()
    try:
        answer = client.post("/v1/completions", json={"model": c.name, "prompt": "Hi",
                                                      "max_tokens": 1, "temperature": 0})  # fmt: skip
    except KunlunError as exc:
        return Verdict(FAIL, "no answer", str(exc))
    took = time.perf_counter() - began
    if not answer.get("choices"):
        return Verdict(FAIL, "no choice", json_lib.dumps(answer)[:200])
    return Verdict(PASS, f"{took * 1000:.0f} ms", "one token of a one-word prompt")


def served_reference(client: DaemonClient, name: str, reference: str | None) -> str:
    """The column name of ``--reference-model NAME``, once the platform is seen to serve it."""
    if reference is not None:
        raise ConfigError("give --reference or --reference-model, not both",
                          location=Location("--reference-model"))  # fmt: skip
    served = [card["id"] for card in client.get("/v1/models")["data"]]
    if name not in served:
        raise ConfigError(f"{name!r} is not served here; served: {', '.join(served) or 'none'}",
                          location=Location("--reference-model"))  # fmt: skip
    return REFERENCE_PREFIX + name


def battery(
    endpoint: str, key: str | None, ready: list[Candidate], reference: str | None,
    reference_model: str | None, eval_file: Path | None, only: list[str], points: float,
    out: Path,
) -> None:  # fmt: skip
    """The validation battery, one column per ready candidate; its cells kept on each."""
    if not ready:
        return
    from kunlun.validate import battery as run
    from kunlun.validate import report
    from kunlun.validate.check import Settings
    from kunlun.validate.matrix import Column
    from kunlun.validate.target import with_reference

    columns = [Column(c.column, endpoint, c.name) for c in ready]
    if reference_model is not None:
        columns.insert(0, Column(REFERENCE_PREFIX + reference_model, endpoint, reference_model))
    columns = with_reference(columns, reference, None)
    say(f"battery on {len(columns)} column(s), reference {columns[0].name}")
    settings = Settings(work_dir=out / "work", api_key=key, seed=7, eval_file=eval_file,
                        accuracy_points=points)  # fmt: skip
    matrix = run.run_battery(columns, settings, only)
    report.write_all(matrix, out)
    for c in ready:
        c.cells = matrix.cells.get(c.column, {})


def bench(
    endpoint: str, key: str | None, c: Candidate, concurrency: tuple[int, ...], requests: int,
    output_len: int,
) -> None:  # fmt: skip
    from kunlun.bench.load import Target
    from kunlun.bench.suite import BenchOptions, run

    say(f"bench {c.column}: concurrency {', '.join(map(str, concurrency))}")
    options = BenchOptions(Target(endpoint, c.name, key), concurrencies=concurrency,
                           num_prompts=requests, input_len=32, output_len=output_len)  # fmt: skip
    try:
        c.bench = asyncio.run(run(options))
    except KunlunError as exc:
        c.bench_error = str(exc)


def take_snapshots(client: DaemonClient, model: str, ready: list[Candidate], folder: Path) -> None:
    """Each ready candidate's snapshot while it runs, and its last known-good one."""
    from kunlun.cli.snapshot import capture

    unread: list[str] = []
    for c in ready:
        c.known_good = snapshots.last_known_good(folder, model, c.pool, c.engine, unread)
    for problem in dict.fromkeys(unread):  # a damaged snapshot is said, not silently passed over
        err_console.print(f"not a snapshot, skipped: {problem}", markup=False)
    for c in ready:
        if c.workload_id is None:
            continue
        say(f"snapshot {c.column}")
        figures = {"accuracy": c.accuracy(), "tokens_per_s": c.tokens_per_s(),
                   "battery": {row: cell.status.value for row, cell in c.cells.items()}}  # fmt: skip
        try:
            c.snapshot = capture(client, c.workload_id, model, figures)
        except KunlunError as exc:  # said; the run's verdicts stand without it
            err_console.print(f"no snapshot of {c.column}: {exc}", markup=False)


def keep_good(
    candidates: list[Candidate], verdicts: dict[str, dict[str, Verdict]], folder: Path
) -> list[str]:
    """Save the snapshot of every candidate no gate failed: the new known-good."""
    saved = []
    for c in candidates:
        if c.snapshot is not None and all(v.status != FAIL for v in verdicts[c.column].values()):
            saved.append(str(snapshots.save(folder, c.snapshot)))
    return saved


def stop(client: DaemonClient, c: Candidate) -> None:
    if c.workload_id is None:
        return
    try:
        client.post(f"/api/v1/workloads/{c.workload_id}/stop")
    except KunlunError as exc:  # said, and the others are still stopped
        err_console.print(f"could not stop {c.workload_id} ({c.name}): {exc}", markup=False)


def report(
    model: str,
    candidates: list[Candidate],
    verdicts: dict[str, dict[str, Verdict]],
    seconds: dict[str, float],
) -> dict[str, Any]:
    return {
        "model": model,
        "seconds": seconds,
        "gates": list(GATES),
        "columns": [{
            "column": c.column, "pool": c.pool, "engine": c.engine, "name": c.name,
            "workload_id": c.workload_id, "plan": c.plan,
            "tokens_per_s": c.tokens_per_s(),
            "verdicts": {g: v.to_dict() for g, v in verdicts[c.column].items()},
        } for c in candidates],
    }  # fmt: skip


def render(verdicts: dict[str, dict[str, Verdict]]) -> None:
    table = Table(title="Adaptation", title_justify="left")
    table.add_column("POOL / ENGINE")
    for gate in GATES:
        table.add_column(gate.upper())
    for column, gates in verdicts.items():
        cells = [f"[{STYLE.get(v.status, 'dim')}]{v.status}[/]\n{v.figure}".rstrip()
                 for v in gates.values()]  # fmt: skip
        table.add_row(column, *cells)
    console.print(table)
    for column, gates in verdicts.items():
        for gate, v in gates.items():
            if v.status != PASS and v.why:
                console.print(f"{v.status} {gate} on {column}: {v.why}", markup=False)


def say(line: str) -> None:
    err_console.print(line, markup=False)
