"""The gates of a rollout step: the canary against the baseline over the same window.

- ``error_rate``: the canary's share of requests answered 5xx or ended by an engine error
  (client 4xx do not count) may exceed the baseline's by at most ``max_error_rate``. It
  fails early, before ``min_requests``, once so many errors were seen that the limit is
  out of reach even if the rest of ``min_requests`` succeed.
- ``p95_ttft`` and ``p95_e2e``: the canary's p95 time to first token (and end-to-end) may
  be at most ``1 + max_p95_regression`` times the baseline's. A gate fails only when the
  regression is clear at 90 % confidence: the lower bound of the canary's p95 is above the
  upper bound of the baseline's times the limit (each bound from the order statistics of
  its histogram), so sampling noise between two equal versions is not a regression.

A gate with fewer than ``min_requests`` canary samples (for latency, fewer in either
version) is ``inconclusive``: the rollout waits for more traffic instead of passing.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from kunlun.serving.canary_window import BASELINE, CANARY, LatencyHistogram, VersionWindow

PASS, FAIL, INCONCLUSIVE = "pass", "fail", "inconclusive"
QUANTILE = 0.95


@dataclass(frozen=True)
class GateResult:
    gate: str
    verdict: str
    canary: float | None
    """The canary's measured value (a rate, or milliseconds)."""
    baseline: float | None
    limit: float | None
    """The most the canary's value may be (a rate, or milliseconds)."""
    samples: int
    needed: int
    detail: str

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def evaluate(
    windows: dict[str, VersionWindow],
    max_error_rate: float,
    max_p95_regression: float,
    min_requests: int,
) -> list[GateResult]:
    """Every gate's verdict over one step's ``windows`` (``baseline`` and ``canary``)."""
    canary, baseline = windows[CANARY], windows[BASELINE]
    return [
        _error_rate(canary, baseline, max_error_rate, min_requests),
        _p95("p95_ttft", "TTFT", canary.ttft, baseline.ttft, max_p95_regression, min_requests),
        _p95("p95_e2e", "end-to-end", canary.e2e, baseline.e2e, max_p95_regression, min_requests),
    ]


def _error_rate(
    canary: VersionWindow, baseline: VersionWindow, max_rate: float, needed: int
) -> GateResult:
    base_rate = baseline.errors / baseline.requests if baseline.requests else 0.0
    limit = base_rate + max_rate
    rate = canary.errors / canary.requests if canary.requests else None
    seen = f"{canary.errors} error(s) in {canary.requests} canary request(s)"
    allowed = limit * max(canary.requests, needed)
    if canary.errors > allowed:
        return GateResult("error_rate", FAIL, rate, base_rate, limit, canary.requests, needed,
                          f"{seen}: more than the {allowed:.2f} that {max(canary.requests, needed)} "
                          f"requests may have at {_pct(limit)} (baseline {_pct(base_rate)} + "
                          f"{_pct(max_rate)})")  # fmt: skip
    if canary.requests < needed:
        return GateResult("error_rate", INCONCLUSIVE, rate, base_rate, limit, canary.requests,
                          needed, f"{seen}; waiting for {needed - canary.requests} more")  # fmt: skip
    verdict = PASS if rate is not None and rate <= limit else FAIL
    return GateResult("error_rate", verdict, rate, base_rate, limit, canary.requests, needed,
                      f"{seen}: {_pct(rate or 0.0)} against at most {_pct(limit)}")  # fmt: skip


def _p95(
    gate: str,
    what: str,
    canary: LatencyHistogram,
    baseline: LatencyHistogram,
    max_regression: float,
    needed: int,
) -> GateResult:
    samples = min(canary.total, baseline.total)
    mine = canary.quantile(QUANTILE) if canary.total else None
    theirs = baseline.quantile(QUANTILE) if baseline.total else None
    limit = None if theirs is None else theirs * (1 + max_regression)
    if samples < needed or mine is None or theirs is None:
        return GateResult(gate, INCONCLUSIVE, mine, theirs, limit, samples, needed,
                          f"{canary.total} canary and {baseline.total} baseline sample(s); "
                          f"waiting for {needed} of each")  # fmt: skip
    canary_low, _ = canary.bounds(QUANTILE)
    _, baseline_high = baseline.bounds(QUANTILE)
    change = mine / theirs - 1 if theirs > 0 else math.inf
    shown = f"p95 {what} {mine:.1f} ms against the baseline's {theirs:.1f} ms ({change:+.1%})"
    if canary_low > baseline_high * (1 + max_regression):
        return GateResult(gate, FAIL, mine, theirs, limit, samples, needed,
                          f"{shown}: over the {max_regression:.0%} allowed even at the "
                          f"90% confidence bounds ({canary_low:.1f} ms > "
                          f"{baseline_high:.1f} ms x {1 + max_regression:g})")  # fmt: skip
    return GateResult(gate, PASS, mine, theirs, limit, samples, needed,
                      f"{shown}: within {max_regression:.0%} (at 90% confidence)")  # fmt: skip


def _pct(rate: float) -> str:
    return f"{rate:.2%}" if rate < 0.01 else f"{rate:.1%}"
