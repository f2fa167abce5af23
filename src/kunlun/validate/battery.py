"""Running the battery: every check on every column, into one :class:`Matrix`.

The reference column runs first (the numerics of the others are compared with it), then
the others in order; checks run one after the other so the performance figures of one
column are not disturbed by another. After a column's checks, two summary rows judge
everything it answered: the garbage detector over every answer text, and the
``X-Kunlun-Device`` header of every completion (for a pool column, each must come from that
pool; the detail lists the ``X-Kunlun-Replica`` of each too).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime

import httpx

from kunlun import __version__
from kunlun import headers as http_headers
from kunlun.errors import ConfigError, Location
from kunlun.serving.pools import parse_pool
from kunlun.validate import (
    accuracy,
    conformance,
    cross_engine,
    functional,
    native_api,
    numerics,
    performance,
    tool_calling,
)
from kunlun.validate import baseline as baseline_gate
from kunlun.validate.check import Check, Context, Settings
from kunlun.validate.client import LACKED, CheckFailed, TargetClient
from kunlun.validate.matrix import Cell, Column, Matrix, Row, Status, failed, passed, skipped

GARBAGE = Row("quality.garbage", "garbage detector (every answer)")
ROUTING = Row("quality.routing", http_headers.DEVICE)
OnCell = Callable[[Column, Row, Cell], None]
PREFLIGHT_TIMEOUT_S = 30.0
"""How long the first request to a target may take before the target counts as down."""


def all_checks(settings: Settings) -> list[Check]:
    return [
        *functional.CHECKS,
        *conformance.CHECKS,
        *tool_calling.CHECKS,
        *native_api.CHECKS,
        *performance.checks(settings.perf_requests),
        *numerics.CHECKS,
        *cross_engine.CHECKS,
        *accuracy.CHECKS,
    ]


def select(checks: list[Check], only: Sequence[str]) -> list[Check]:
    """The checks named by ``only`` (row ids or groups such as ``functional``); all if empty."""
    if not only:
        return checks
    known = {c.row.id for c in checks} | {c.row.group for c in checks}
    unknown = [name for name in only if name not in known]
    if unknown:
        raise ConfigError(
            f"unknown check(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}",
            location=Location("--only"),
        )
    return [c for c in checks if c.row.id in only or c.row.group in only]


def run_battery(
    columns: list[Column],
    settings: Settings,
    only: Sequence[str] = (),
    baseline: Matrix | None = None,
    on_cell: OnCell | None = None,
) -> Matrix:
    """Every selected check on every column (the first column is the reference)."""
    checks = select(all_checks(settings), only)
    rows = [c.row for c in checks] + [GARBAGE, ROUTING]
    matrix = Matrix(rows, list(columns))
    started = time.monotonic()
    matrix.meta = {
        "started": datetime.now(UTC).isoformat(timespec="seconds"),
        "kunlun_version": __version__,
        "seed": settings.seed,
        "max_tokens": settings.max_tokens,
        "only": list(only),
        "thresholds": {
            "mean_abs_delta": numerics.MEAN_ABS_MAX,
            "max_abs_delta": numerics.MAX_ABS_MAX,
            "near_tie_nats": numerics.NEAR_TIE,
        },
    }
    reference: dict[str, object] | None = None
    for column in columns:
        ctx = _run_column(column, checks, settings, reference, matrix, on_cell)
        if column.reference:
            reference = ctx.scratch
    matrix.meta["duration_s"] = round(time.monotonic() - started, 1)
    if baseline is not None:
        baseline_gate.compare(matrix, baseline)
        if on_cell is not None:
            for column in columns:
                cell = matrix.get(column.name, baseline_gate.ROW.id)
                if cell is not None:
                    on_cell(column, baseline_gate.ROW, cell)
    return matrix


def _run_column(
    column: Column,
    checks: list[Check],
    settings: Settings,
    reference: dict[str, object] | None,
    matrix: Matrix,
    on_cell: OnCell | None,
) -> Context:
    client = TargetClient(column, settings.api_key, settings.timeout_s)
    rng = random.Random(f"{settings.seed}:{column.name}")
    ctx = Context(column, client, settings, rng, None if column.reference else reference)

    def put(row: Row, cell: Cell) -> None:
        matrix.set(column.name, row.id, cell)
        if on_cell is not None:
            on_cell(column, row, cell)

    try:
        down = unreachable(client)
        for check in checks:
            put(check.row, failed("unreachable", down) if down else run_check(check, ctx))
        put(GARBAGE, failed("unreachable", down) if down else garbage_cell(client))
        put(ROUTING, failed("unreachable", down) if down else routing_cell(client))
    finally:
        client.close()
    return ctx


def unreachable(client: TargetClient) -> str | None:
    """Why the target cannot be reached at all (then every check of it fails at once,
    rather than each waiting for its own timeout), or None."""
    try:
        client.http.get("/v1/models", timeout=PREFLIGHT_TIMEOUT_S)
    except httpx.HTTPError as exc:
        return f"GET {client.column.endpoint}/v1/models: {type(exc).__name__}: {exc}"
    return None


def run_check(check: Check, ctx: Context) -> Cell:
    """One cell; a check that cannot go on is a FAIL naming why."""
    started = time.monotonic()
    lacked: list[str] = []
    token = LACKED.set(lacked)
    try:
        cell = check.run(ctx)
    except CheckFailed as exc:
        cell = failed(exc.figure, exc.detail)
    except Exception as exc:  # a bug of the validator or an answer it could not read
        cell = failed("check error", f"{type(exc).__name__}: {exc}")
    finally:
        LACKED.reset(token)
    if cell.status is Status.FAIL and lacked:  # not this engine's feature: said, not failed
        cell = skipped(f"the engine serving it lacks {', '.join(dict.fromkeys(lacked))}")
    cell.metrics.setdefault("seconds", round(time.monotonic() - started, 2))
    return cell


def garbage_cell(client: TargetClient) -> Cell:
    flagged = client.garbage()
    total = len(client.answers)
    if not total:
        return skipped("no answers to judge")
    figure = f"{len(flagged)}/{total} flagged"
    if flagged:
        shown = [
            f"{check}: {', '.join(reasons)} in {text[:60]!r}" for check, text, reasons in flagged
        ]
        return failed(figure, "; ".join(shown[:4]), flagged=float(len(flagged)))
    return passed(figure, flagged=0.0)


def routing_cell(client: TargetClient) -> Cell:
    """Where the completions were answered from; a pool column's must all be that pool's."""
    seen = client.devices
    total = sum(seen.values())
    if not total:
        return skipped("no completion answered")
    shown = ", ".join(f"{d or 'none'} x{n}" for d, n in seen.most_common())
    if set(client.replicas) != {""}:
        shown += "; replicas " + ", ".join(f"{r or 'none'} x{n}"
                                           for r, n in client.replicas.most_common())  # fmt: skip
    pool = client.column.pool
    if pool is None:
        if set(seen) == {""}:
            return skipped("no X-Kunlun-Device header (not a Kunlun gateway)")
        if "" in seen:
            return failed(f"{seen['']} without header", shown)
        return passed(", ".join(sorted(seen)), shown)
    device_type = parse_pool(pool).device_type  # an engine's pool: its requests' device type
    outside = {d: n for d, n in seen.items() if d.partition(":")[0] != device_type}
    if outside:
        stray = ", ".join(f"{d or 'no header'} x{n}" for d, n in outside.items())
        return failed(f"{sum(outside.values())}/{total} outside pool {pool}", stray)
    return passed(", ".join(sorted(seen)), shown)
