"""The pure parts of rollouts: parsing what users type, the histograms, the gates' verdicts
and the split (weights and sticky sessions)."""

from __future__ import annotations

import random

import pytest

from kunlun.errors import ConfigError
from kunlun.rollout.gates import FAIL, INCONCLUSIVE, PASS, evaluate
from kunlun.rollout.spec import parse_rollout
from kunlun.serving.canary_split import Split
from kunlun.serving.canary_window import (
    BASELINE,
    CANARY,
    LatencyHistogram,
    RolloutStats,
    VersionWindow,
)


def test_spec_parses_what_users_type() -> None:
    spec = parse_rollout({"workload": "chat", "model": "m2", "canary": "10%", "interval_s": "5m",
                          "max_error_rate": "0.1%", "max_p95_regression": "5%"})  # fmt: skip
    assert spec.steps == [10, 25, 50, 100] and spec.interval_s == 300
    assert spec.max_error_rate == pytest.approx(0.001) and spec.max_p95_regression == 0.05
    assert spec.needed_requests() == 3000
    assert parse_rollout({"workload": "w", "model": "m", "canary": 5, "steps": [20, 60]}).steps == [
        5, 20, 60, 100]  # fmt: skip
    assert parse_rollout({"workload": "w", "model": "m", "interval_s": "500ms"}).interval_s == 0.5


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ({"steps": "50,20"}, "steps must grow"),
        ({"canary": "150%"}, "at most 100"),
        ({"interval_s": "soon"}, "like 90s, 5m or 1h"),
        ({"interval_s": 3.6e24}, "at most 604800 s"),  # issue 32: once accepted
        ({"interval_s": float("nan")}, "above 0 and at most"),
        ({"interval_s": "169h"}, "at most 604800 s"),
        ({"max_error_rate": "-1%"}, "between 0% and 100%"),
        ({"min_requests": 0}, "min_requests"),
        ({"bogus": 1}, "bogus: unknown field"),
    ],
)
def test_bad_rollouts_are_refused_naming_the_field(body: dict[str, object], expected: str) -> None:
    with pytest.raises(ConfigError, match=expected):
        parse_rollout({"workload": "w", "model": "m", **body})


def test_histogram_quantiles_are_within_one_percent_and_merge_exactly() -> None:
    rng = random.Random(3)
    values = [rng.lognormvariate(4, 0.5) for _ in range(5000)]
    whole, first, second = LatencyHistogram(), LatencyHistogram(), LatencyHistogram()
    for i, v in enumerate(values):
        whole.add(v)
        (first if i % 2 else second).add(v)
    first.merge(second)
    assert first == whole
    true = sorted(values)[int(0.95 * len(values)) - 1]
    assert whole.quantile(0.95) == pytest.approx(true, rel=0.011)
    low, high = whole.bounds(0.95)
    assert low <= whole.quantile(0.95) <= high
    assert LatencyHistogram.from_dict(whole.to_dict()) == whole


def _window(n: int, errors: int, ms: float, rng: random.Random) -> VersionWindow:
    window = VersionWindow()
    for i in range(n):
        latency = rng.gauss(ms, ms * 0.15)
        window.record(i < errors, latency / 2, latency)
    return window


def test_equal_versions_pass_and_a_clear_regression_fails() -> None:
    rng = random.Random(5)
    for _ in range(50):  # noise between two equal versions is no regression
        windows = {BASELINE: _window(400, 0, 100, rng), CANARY: _window(100, 0, 100, rng)}
        assert {g.verdict for g in evaluate(windows, 0.01, 0.05, 50)} == {PASS}
    slow = {BASELINE: _window(400, 0, 100, rng), CANARY: _window(100, 0, 140, rng)}
    verdicts = {g.gate: g.verdict for g in evaluate(slow, 0.01, 0.05, 50)}
    assert verdicts == {"error_rate": PASS, "p95_ttft": FAIL, "p95_e2e": FAIL}


def test_too_few_samples_are_inconclusive_but_many_errors_fail_early() -> None:
    rng = random.Random(7)
    few = {BASELINE: _window(40, 0, 100, rng), CANARY: _window(9, 0, 100, rng)}
    assert {g.verdict for g in evaluate(few, 0.001, 0.05, 3000)} == {INCONCLUSIVE}
    failing = {BASELINE: _window(40, 0, 100, rng), CANARY: _window(9, 4, 100, rng)}
    error_rate = evaluate(failing, 0.001, 0.05, 3000)[0]
    assert error_rate.verdict == FAIL and "4 error(s) in 9" in error_rate.detail
    # the baseline's own errors are allowed to the canary too
    both = {BASELINE: _window(1000, 100, 100, rng), CANARY: _window(100, 10, 100, rng)}
    assert evaluate(both, 0.01, 0.05, 50)[0].verdict == PASS


def test_split_weights_and_sticky_sessions() -> None:
    split = Split("ro-1", 0, 25.0, "wl-base", "wl-new")
    drawn = [split.choose(None).role for _ in range(4000)]
    assert 0.21 < drawn.count(CANARY) / len(drawn) < 0.29
    for session in (b"alice", b"bob", b"carol"):
        assert len({split.choose(session) for _ in range(20)}) == 1
    # a session in the canary's share stays there as the share grows
    grown = Split("ro-1", 1, 50.0, "wl-base", "wl-new")
    for n in range(200):
        session = f"s{n}".encode()
        if split.choose(session).role == CANARY:
            assert grown.choose(session).role == CANARY
    version = split.choose(b"alice")
    assert version.header in (b"canary:wl-new", b"baseline:wl-base")
    assert Split("ro-1", 0, 0.0, "a", "b").choose(b"x").role == BASELINE


def test_stats_keep_each_step_apart() -> None:
    stats = RolloutStats()
    stats.record("ro-1", 0, CANARY, False, 10.0, 20.0)
    stats.record("ro-1", 1, CANARY, True, None, 5.0)
    assert stats.window("ro-1", 0)[CANARY].requests == 1
    assert stats.window("ro-1", 1)[CANARY].errors == 1
    assert stats.window("ro-1", 1)[BASELINE].requests == 0
    stats.forget([("ro-1", 1)])
    assert stats.window("ro-1", 0)[CANARY].requests == 0
    assert set(stats.snapshot()) == {"ro-1/1"}
