"""The gates of ``kunlun-cli adapt``: what one pool and engine must show before a model is
called adapted there, judged from what the run measured.

One :class:`Candidate` per pool and engine: its plan (or the planner's refusal), its start,
the smoke request, its column of the validation battery and its benchmark. :func:`judge`
gives each the verdict of every gate in :data:`GATES`:

- ``plan``: the planner placed it on that pool (a refusal is FAIL with the planner's reason);
- ``start``: its workload came up RUNNING with a ready replica;
- ``smoke``: the shortest request, alone, was answered;
- ``battery``: every row of its validation column is PASS or SKIP (a SKIP is said with its
  reason, never counted as a pass of something it did not run);
- ``numerics``: the battery's numerics rows against the reference column;
- ``accuracy``: the multiple-choice accuracy within ``accuracy_points`` of the reference
  (:mod:`kunlun.validate.accuracy`);
- ``throughput``: output tokens/s of its busiest benchmark run at least ``throughput_share``
  of the best engine measured on the same pool type;
- ``failures``: no request of the smoke run or the benchmark failed;
- ``regression``: against the last known-good snapshot of the same model, pool and engine
  (:mod:`kunlun.validate.snapshots`), accuracy at most ``accuracy_points`` lower and tokens/s
  at least ``throughput_share`` of its figure (NOT RUN when there is none yet).

A gate whose evidence was not gathered (a step after a failed one, a row the run left out)
is NOT RUN with the reason, never a pass. A pool is adapted (:func:`pool_verdicts`) when at
least one of its engines failed no gate; the fastest of those is the one chosen, and the
others are said with the gate each failed (an engine slower than the best fails
``throughput``: that makes it the wrong choice for the pool, not the pool unfit).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kunlun.validate.matrix import Cell, Status

GATES = (
    "plan",
    "start",
    "smoke",
    "battery",
    "numerics",
    "accuracy",
    "throughput",
    "failures",
    "regression",
)
PASS, FAIL, NOT_RUN = "PASS", "FAIL", "NOT RUN"


@dataclass
class Verdict:
    status: str
    figure: str = ""
    why: str = ""

    def to_dict(self) -> dict[str, str]:
        return {"status": self.status, "figure": self.figure, "why": self.why}


@dataclass
class Candidate:
    """One pool and engine, and what the run found there."""

    pool: str
    engine: str
    name: str
    """The model name its workload serves (unique to the run)."""
    spec: dict[str, Any] | None = None
    """The workload spec submitted for it."""
    plan: dict[str, Any] | None = None
    refused: str | None = None
    """The planner's reason, when it cannot run there."""
    workload_id: str | None = None
    start_error: str | None = None
    smoke: Verdict | None = None
    cells: dict[str, Cell] = field(default_factory=dict)
    """Its column of the validation matrix."""
    bench: dict[str, Any] | None = None
    bench_error: str | None = None
    known_good: dict[str, Any] | None = None
    """The last known-good snapshot of the same model, pool and engine, if any."""
    snapshot: dict[str, Any] | None = None
    """What this run would save as known-good (taken while its workload ran)."""

    @property
    def column(self) -> str:
        return f"{self.pool}/{self.engine}"

    @property
    def started(self) -> bool:
        return self.workload_id is not None and self.start_error is None

    def tokens_per_s(self) -> float | None:
        """Output tokens/s of the benchmark's busiest run."""
        runs = (self.bench or {}).get("runs") or []
        if not runs:
            return None
        busiest = max(runs, key=lambda r: r.get("concurrency") or 0)
        rate = busiest.get("output_tokens_per_s")
        return float(rate) if rate is not None else None

    def accuracy(self) -> float | None:
        cell = self.cells.get("accuracy.multiple_choice")
        value = (cell.metrics or {}).get("accuracy") if cell is not None else None
        return float(value) if value is not None else None

    def failed_requests(self) -> int:
        return sum(int(r.get("num_errors") or 0) for r in (self.bench or {}).get("runs") or [])


def judge(
    candidates: list[Candidate], accuracy_points: float, throughput_share: float
) -> dict[str, dict[str, Verdict]]:
    """``verdicts[column][gate]`` for every candidate."""
    best: dict[str, float] = {}
    for c in candidates:
        rate = c.tokens_per_s()
        if rate is not None:
            best[c.pool] = max(best.get(c.pool, 0.0), rate)
    return {c.column: _gates(c, best.get(c.pool), accuracy_points, throughput_share)
            for c in candidates}  # fmt: skip


def _gates(c: Candidate, best: float | None, points: float, share: float) -> dict[str, Verdict]:
    out = {gate: Verdict(NOT_RUN, why="an earlier gate failed") for gate in GATES}
    if c.refused is not None or c.plan is None:
        out["plan"] = Verdict(FAIL, "refused", c.refused or "no plan")
        return out
    out["plan"] = Verdict(PASS, f"{c.plan.get('dtype')}, {c.plan.get('quantization')}, "
                                f"tp {c.plan.get('tensor_parallel_size')}",
                          ", ".join(c.plan.get("devices") or []))  # fmt: skip
    if not c.started:
        out["start"] = Verdict(FAIL, "not running", c.start_error or "not submitted")
        return out
    out["start"] = Verdict(PASS, "running", c.workload_id or "")
    out["smoke"] = c.smoke or Verdict(NOT_RUN, why="not sent")
    if c.smoke is None or c.smoke.status != PASS:
        return out
    out["battery"] = _battery(c.cells)
    out["numerics"] = _rows(c.cells, "numerics.")
    out["accuracy"] = _rows(c.cells, "accuracy.")
    out["throughput"], out["failures"] = _bench(c, best, share)
    out["regression"] = _regression(c, points, share)
    return out


def _regression(c: Candidate, points: float, share: float) -> Verdict:
    good = c.known_good
    if good is None:
        return Verdict(NOT_RUN, why=f"no known-good snapshot of {c.column} yet")
    figures, found = good.get("figures") or {}, []
    accuracy, was = c.accuracy(), figures.get("accuracy")
    if accuracy is not None and was is not None and (was - accuracy) * 100 > points:
        found.append(f"accuracy {accuracy:.1%} against {was:.1%}")
    rate, had = c.tokens_per_s(), figures.get("tokens_per_s")
    if rate is not None and had and rate < share * had:
        found.append(f"{rate:.1f} tok/s against {had:.1f}")
    if found:
        return Verdict(FAIL, "regressed", f"against {good['id']}: " + "; ".join(found))
    return Verdict(PASS, f"vs {good['id']}", "accuracy and tokens/s within the gates")


def _battery(cells: dict[str, Cell]) -> Verdict:
    if not cells:
        return Verdict(NOT_RUN, why="the battery did not run")
    failed = [row for row, cell in cells.items() if cell.status is Status.FAIL]
    skipped = [f"{row}: {cell.detail}" for row, cell in cells.items()
               if cell.status is Status.SKIP]  # fmt: skip
    figure = f"{len(cells) - len(failed) - len(skipped)} PASS, {len(failed)} FAIL, " \
             f"{len(skipped)} SKIP"  # fmt: skip
    if failed:
        return Verdict(FAIL, figure, "failed: " + ", ".join(failed))
    return Verdict(PASS, figure, "; ".join(skipped))


def _rows(cells: dict[str, Cell], prefix: str) -> Verdict:
    """The verdict of the battery's rows starting with ``prefix``."""
    mine = {row: cell for row, cell in cells.items() if row.startswith(prefix)}
    if not mine:
        return Verdict(NOT_RUN, why=f"no {prefix.rstrip('.')} row was run (--only)")
    failed = {row: cell for row, cell in mine.items() if cell.status is Status.FAIL}
    ran = {row: cell for row, cell in mine.items() if cell.status is Status.PASS}
    if failed:
        row, cell = next(iter(failed.items()))
        return Verdict(FAIL, cell.figure, f"{row}: {cell.detail}")
    if not ran:
        return Verdict(NOT_RUN, why="; ".join(f"{r}: {c.detail}" for r, c in mine.items()))
    return Verdict(PASS, "; ".join(c.figure for c in ran.values()), ", ".join(ran))


def _bench(c: Candidate, best: float | None, share: float) -> tuple[Verdict, Verdict]:
    if c.bench is None:
        why = c.bench_error or "the benchmark did not run"
        return Verdict(FAIL if c.bench_error else NOT_RUN, why=why), Verdict(NOT_RUN, why=why)
    rate, failed = c.tokens_per_s(), c.failed_requests()
    failures = Verdict(FAIL if failed else PASS, f"{failed} failed",
                       "benchmark and smoke requests")  # fmt: skip
    if rate is None or best is None:
        return Verdict(FAIL, "no rate", "no benchmark run finished a request"), failures
    figure = f"{rate:.1f} tok/s ({rate / best:.0%} of the best on {c.pool})"
    if rate < share * best:
        return Verdict(FAIL, figure, f"under {share:.0%} of {best:.1f} tok/s"), failures
    return Verdict(PASS, figure, f"at least {share:.0%} of {best:.1f} tok/s"), failures


@dataclass
class PoolVerdict:
    """A pool's verdict: adapted (PASS) when at least one engine passed every gate; the
    engine chosen is the fastest of those."""

    status: str
    engine: str | None
    why: str

    def to_dict(self) -> dict[str, str | None]:
        return {"status": self.status, "engine": self.engine, "why": self.why}


def pool_verdicts(
    candidates: list[Candidate], verdicts: dict[str, dict[str, Verdict]]
) -> dict[str, PoolVerdict]:
    """``out[pool]``: adapted with the fastest engine that failed no gate, or FAIL naming
    each engine's first failed gate."""
    out: dict[str, PoolVerdict] = {}
    for pool in dict.fromkeys(c.pool for c in candidates):
        mine = [c for c in candidates if c.pool == pool]
        failed = {c.engine: next(((g, v) for g, v in verdicts[c.column].items()
                                  if v.status == FAIL), None) for c in mine}  # fmt: skip
        passing = [c for c in mine if failed[c.engine] is None]
        others = "; ".join(f"{e}: {g} {v.figure or 'FAIL'}" + (f" ({v.why})" if v.why else "")
                           for e, found in failed.items() if found for g, v in [found])  # fmt: skip
        if not passing:
            out[pool] = PoolVerdict(FAIL, None, others)
            continue
        best = max(passing, key=lambda c: c.tokens_per_s() or 0.0)
        rate = best.tokens_per_s()
        why = f"{best.engine} passed every gate" + (f" at {rate:.1f} tok/s" if rate else "")
        out[pool] = PoolVerdict(
            PASS, best.engine, why + (f"; not chosen: {others}" if others else "")
        )
    return out


def run_failed(
    verdicts: dict[str, dict[str, Verdict]], pools: dict[str, PoolVerdict], every_engine: bool
) -> bool:
    """Whether the run fails: a pool not adapted, or (``every_engine``) any gate failed."""
    if every_engine:
        return any(v.status == FAIL for gates in verdicts.values() for v in gates.values())
    return any(v.status != PASS for v in pools.values())
