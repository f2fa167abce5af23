"""The rollouts' series in ``/metrics``, and the counts behind them.

:class:`Totals` counts the promotions (per model) and rollbacks (per model and cause) this
node carried out; :func:`rollout_families` turns the rollout records and those counts into
Prometheus families: each running rollout's canary weight and gate verdicts, every
rollout's state, and the two counters. Kept apart from
:class:`~kunlun.rollout.controller.RolloutController`, which keeps the totals and hands
:func:`rollout_families` its records when ``/metrics`` is scraped.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from kunlun.rollout.records import RUNNING_STATES, canary_weight
from kunlun.state.store import RolloutRecord


@dataclass
class Totals:
    promotions: dict[str, int] = field(default_factory=dict)
    rollbacks: dict[tuple[str, str], int] = field(default_factory=dict)


def rollout_families(records: list[RolloutRecord], totals: Totals) -> Iterator[Metric]:
    weight = GaugeMetricFamily("kunlun_rollout_canary_weight_percent",
                               "The canary's share of its model's requests.",
                               labels=["rollout", "model"])  # fmt: skip
    state = GaugeMetricFamily("kunlun_rollout_state", "1 for each rollout's state.",
                              labels=["rollout", "model", "state"])  # fmt: skip
    gate = GaugeMetricFamily("kunlun_rollout_gate_passing",
                             "1 pass, 0 inconclusive, -1 fail: each running gate's verdict.",
                             labels=["rollout", "model", "gate"])  # fmt: skip
    for record in records:
        if record.state in RUNNING_STATES:
            weight.add_metric([record.rollout_id, record.model], canary_weight(record))
            for g in record.gates:
                value = {"pass": 1.0, "fail": -1.0}.get(str(g["verdict"]), 0.0)
                gate.add_metric([record.rollout_id, record.model, str(g["gate"])], value)
        state.add_metric([record.rollout_id, record.model, record.state], 1.0)
    promotions = CounterMetricFamily("kunlun_rollout_promotions",
                                     "Rollouts promoted by this node.", labels=["model"])  # fmt: skip
    for model, count in totals.promotions.items():
        promotions.add_metric([model], float(count))
    rollbacks = CounterMetricFamily("kunlun_rollout_rollbacks",
                                    "Rollouts rolled back by this node, by cause "
                                    "(error_rate, p95_ttft, p95_e2e, start, aborted).",
                                    labels=["model", "reason"])  # fmt: skip
    for (model, reason), count in totals.rollbacks.items():
        rollbacks.add_metric([model, reason], float(count))
    yield from (weight, state, gate, promotions, rollbacks)
