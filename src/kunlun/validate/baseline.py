"""The regression gate: this run against a saved one (``--baseline validation.json``).

Columns are matched by name and rows by id. A regression is:

- a cell that was PASS and is now FAIL;
- a metric that moved the wrong way beyond its tolerance (:data:`RULES`): logprob deltas
  that grew, throughput that dropped, time to first token that rose, greedy outputs that
  now diverge earlier.

Each column gets one ``regression.baseline`` cell listing what regressed.
"""

from __future__ import annotations

from dataclasses import dataclass

from kunlun.validate.matrix import Cell, Matrix, Row, Status, failed, passed, skipped

ROW = Row("regression.baseline", "regression vs baseline")


@dataclass(frozen=True)
class Rule:
    """When a metric has regressed: ``now`` worse than ``base`` by more than
    ``relative`` times ``base`` plus ``absolute``."""

    higher_is_better: bool
    relative: float
    absolute: float

    def regressed(self, base: float, now: float) -> bool:
        allowed = abs(base) * self.relative + self.absolute
        return now < base - allowed if self.higher_is_better else now > base + allowed


RULES = {
    "mean_abs_delta": Rule(higher_is_better=False, relative=0.5, absolute=0.01),
    "max_abs_delta": Rule(higher_is_better=False, relative=0.5, absolute=0.1),
    "output_tok_s": Rule(higher_is_better=True, relative=0.2, absolute=0.0),
    "ttft_ms": Rule(higher_is_better=False, relative=0.5, absolute=50.0),
    "first_divergence": Rule(higher_is_better=True, relative=0.0, absolute=4.0),
}
"""Throughput may drop 20 %, TTFT rise 50 % + 50 ms, mean |delta logprob| grow 50 % +
0.01, max 50 % + 0.1, the first greedy divergence come 4 tokens earlier."""


def compare(run: Matrix, base: Matrix) -> None:
    """Add the ``regression.baseline`` row to ``run``."""
    run.add_row(ROW)
    for column in run.columns:
        if column.name not in base.cells:
            known = ", ".join(base.cells) or "none"
            run.set(
                column.name, ROW.id, skipped(f"no column {column.name!r} in the baseline ({known})")
            )
            continue
        run.set(column.name, ROW.id, _compare_column(run, base, column.name))


def _compare_column(run: Matrix, base: Matrix, column: str) -> Cell:
    regressions: list[str] = []
    compared = 0
    for row in run.rows:
        now, before = run.get(column, row.id), base.get(column, row.id)
        if now is None or before is None or row.id == ROW.id:
            continue
        compared += 1
        if before.status is Status.PASS and now.status is Status.FAIL:
            regressions.append(f"{row.id} PASS -> FAIL ({now.figure})")
        for key, rule in RULES.items():
            if key in now.metrics and key in before.metrics:
                b, n = before.metrics[key], now.metrics[key]
                if rule.regressed(b, n):
                    regressions.append(f"{row.id} {key} {b:g} -> {n:g}")
    if regressions:
        return failed(f"{len(regressions)} regression(s)", "; ".join(regressions))
    return passed(f"{compared} cells, no regression")
