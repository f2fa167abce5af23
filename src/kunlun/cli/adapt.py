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

import json as json_lib
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from kunlun.cli.adapt_stages import (
    Stages,
    battery,
    bench,
    imported,
    keep_good,
    names,
    plan_all,
    pool_list,
    references,
    start_and_smoke,
    stop,
    take_snapshots,
)
from kunlun.cli.client import DaemonClient
from kunlun.console import console, handle_errors, print_json
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
ReferenceOption = Annotated[
    str | None,
    typer.Option(
        help="The reference column: POOL/ENGINE (default: the first), or "
        "transformers (the model run by Hugging Face transformers, float32)."
    ),
]
ReferenceModelOption = Annotated[
    str | None,
    typer.Option(
        help="A model the platform serves (its name) as the reference instead: "
        "the known-good version new weights are held to."
    ),
]


@handle_errors
def adapt(
    model: Annotated[
        str, typer.Option(help="Model alias, local HF directory, or GGUF file (imported).")
    ],
    pools: Annotated[str, typer.Option(help="all, or device types, comma-separated.")] = "all",
    engines: Annotated[str, typer.Option(help="Engines, comma-separated.")] = "kunlun",
    reference: ReferenceOption = None,
    reference_model: ReferenceModelOption = None,
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
    asked = pool_list(client, pools)
    model = imported(client, model)
    reference, hf_dir = references(client, model, reference, reference_model)
    engine_names = names(engines)
    with Stages(len(asked) * len(engine_names)) as clock:
        candidates = plan_all(client, model, asked, engine_names, quantization)
        try:
            clock.mark("plan")
            ready = start_and_smoke(client, candidates, timeout, clock)
            battery(client.endpoint, key, ready, reference, reference_model, eval_file,
                    only or [], accuracy_points, out, hf_dir)  # fmt: skip
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
