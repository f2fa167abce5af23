"""The stages of ``kunlun-cli adapt`` (:mod:`kunlun.cli.adapt`), one function each: import a
GGUF file, list the pools, plan every pool and engine, start and smoke each, run the battery
(against the first column, a served model, or transformers), bench, take and keep
snapshots, stop what was started.
"""

from __future__ import annotations

import asyncio
import contextlib
import json as json_lib
import re
import time
from pathlib import Path

from kunlun.cli.client import DaemonClient
from kunlun.console import err_console
from kunlun.errors import ConfigError, KunlunError, Location
from kunlun.validate import snapshots
from kunlun.validate.gates import FAIL, PASS, Candidate, Verdict

HF_REFERENCE = "transformers"
"""``--reference transformers``: the reference column run by Hugging Face transformers."""
REFERENCE_PREFIX = "reference:"
"""The column of ``--reference-model`` (a served model, not one adapt starts)."""


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
            why = f"refused: {c.refused}" if c.refused is not None else made["placement"].get("why")
            say(f"plan {c.column}: {why}")
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


def references(
    client: DaemonClient, model: str, reference: str | None, reference_model: str | None
) -> tuple[str | None, Path | None]:
    """The reference column's name (``--reference``, or that of ``--reference-model``) and,
    for ``--reference transformers``, the model directory transformers loads."""
    if reference_model is not None:
        return served_reference(client, reference_model, reference), None
    if reference == HF_REFERENCE:
        return reference, hf_reference_dir(client, model)
    return reference, None


def hf_reference_dir(client: DaemonClient, model: str) -> Path:
    """The Hugging Face directory of ``model`` for ``--reference transformers``: the path
    given, or the catalog's path of an alias (files on this machine)."""
    if Path(model).is_dir():
        return Path(model)
    found = {m["alias"]: m for m in client.get("/api/v1/models")}.get(model)
    if found is None or not Path(found["path"]).is_dir():
        raise ConfigError(f"--reference transformers reads the model's files on this machine: "
                          f"{model!r} is no directory here"
                          + (f" (the catalog's {found['path']})" if found else ""),
                          location=Location("--reference"))  # fmt: skip
    return Path(found["path"])


def battery(
    endpoint: str, key: str | None, ready: list[Candidate], reference: str | None,
    reference_model: str | None, eval_file: Path | None, only: list[str], points: float,
    out: Path, hf_dir: Path | None = None,
) -> None:  # fmt: skip
    """The validation battery, one column per ready candidate; its cells kept on each; with
    ``hf_dir``, the reference column is that model run by transformers."""
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
    settings = Settings(work_dir=out / "work", api_key=key, seed=7, eval_file=eval_file,
                        accuracy_points=points)  # fmt: skip
    with contextlib.ExitStack() as stack:
        if hf_dir is not None:
            from kunlun.validate.hf_reference import COLUMN, NAME, TransformersReference

            say(f"loading {hf_dir} with transformers (float32) as the reference")
            served = stack.enter_context(TransformersReference(hf_dir))
            columns.insert(0, Column(COLUMN, served.url, NAME))
            reference = COLUMN
        columns = with_reference(columns, reference, None)
        say(f"battery on {len(columns)} column(s), reference {columns[0].name}")
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


def say(line: str) -> None:
    err_console.print(line, markup=False)


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
