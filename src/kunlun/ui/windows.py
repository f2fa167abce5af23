"""Windowed figures for the Metrics page: quantiles between two samples, not a replica's life.

A Prometheus histogram is cumulative since its process started, so quantiles read from one
scrape describe the whole life of a replica and barely move once it has served a while. The
daemon samples its ``/metrics`` every few seconds (:mod:`kunlun.ui.history`); :func:`scrape`
keeps one sample's cumulative buckets and counters (per replica, per device and per priority
class) and :func:`window` subtracts the sample before from the current one: p50/p99 of the requests that finished
between the two samples (:func:`~kunlun.telemetry.view.histogram_quantile` on the bucket
deltas, None when none finished), and counter deltas for rates.

Per device, the buckets of the replicas on it are summed; per priority class, the gateway's
queue-wait histogram and request counter carry the request's class (``X-Kunlun-Priority``
or the key's), and ``kunlun_gateway_queue_depth`` the requests waiting in each class's queue.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.core import Metric

from kunlun.serving.queue_metrics import NAME as QUEUE_DEPTH
from kunlun.telemetry.gateway_metrics import NONE
from kunlun.telemetry.view import histogram_quantile

HISTOGRAMS = {
    "kunlun_time_to_first_token_seconds": "ttft",
    "kunlun_time_per_output_token_seconds": "tpot",
    "kunlun_gateway_queue_time_seconds": "wait",
}
"""The histograms windowed, and their short names."""

Key = tuple[str, str, str]
"""(group: replica, device or priority; its name; the figure)."""


@dataclass
class Scrape:
    """One scrape's cumulative figures: histogram buckets and counters by :data:`Key`."""

    ts: float
    buckets: dict[Key, dict[float, float]] = field(default_factory=dict)
    counters: dict[Key, float] = field(default_factory=dict)
    gauges: dict[Key, float] = field(default_factory=dict)


def scrape(families: list[Metric], ts: float | None = None) -> Scrape:
    """The :class:`Scrape` of one ``/metrics`` exposition, read into its families
    (:func:`~kunlun.telemetry.view.metric_families`)."""
    buckets: dict[Key, dict[float, float]] = defaultdict(lambda: defaultdict(float))
    counters: dict[Key, float] = defaultdict(float)
    gauges: dict[Key, float] = defaultdict(float)
    device_of: dict[str, str] = {}
    for family in families:
        for s in family.samples:
            labels, replica = s.labels, s.labels.get("replica", NONE)
            if s.name == "kunlun_replica_info":
                device_of[replica] = labels["device"]
            elif s.name.endswith("_bucket") and s.name[:-7] in HISTOGRAMS:
                short, le = HISTOGRAMS[s.name[:-7]], float(labels["le"])
                if short == "wait":
                    buckets[("priority", labels.get("priority", NONE), short)][le] += s.value
                elif replica != NONE:
                    buckets[("replica", replica, short)][le] += s.value
            elif s.name == "kunlun_generation_tokens_total" and replica != NONE:
                counters[("replica", replica, "tokens")] += s.value
            elif s.name == "kunlun_requests_total" and labels.get("priority", NONE) != NONE:
                counters[("priority", labels["priority"], "requests")] += s.value
            elif s.name == QUEUE_DEPTH:
                gauges[("priority", labels["priority"], "queued")] += s.value
    for (group, name, short), by_le in list(buckets.items()):
        if group == "replica" and name in device_of:
            summed = buckets[("device", device_of[name], short)]
            for le, value in by_le.items():
                summed[le] += value
    for (group, name, short), value in list(counters.items()):
        if group == "replica" and name in device_of:
            counters[("device", device_of[name], short)] += value
    return Scrape(ts if ts is not None else time.time(),
                  {k: dict(v) for k, v in buckets.items()}, dict(counters), dict(gauges))  # fmt: skip


def window(now: Scrape, before: Scrape | None) -> dict[str, dict[str, dict[str, Any]]]:
    """Per group and name, the figures between ``before`` and ``now``: ``<hist>_p50_s`` and
    ``<hist>_p99_s`` of the requests finished in between, ``<counter>_per_s`` and the gauges.
    Without ``before`` (the first sample) there is no window: quantiles and rates are None.
    A series that went down (its worker restarted) counts from zero."""
    out: dict[str, dict[str, dict[str, Any]]] = defaultdict(lambda: defaultdict(dict))
    for (group, name, short), by_le in now.buckets.items():
        row = out[group][name]
        delta = None
        if before is not None:
            old = before.buckets.get((group, name, short), {})
            delta = [(le, count - old.get(le, 0.0)) for le, count in by_le.items()]
            if any(count < 0 for _, count in delta):
                delta = list(by_le.items())
        for q in (50, 99):
            row[f"{short}_p{q}_s"] = histogram_quantile(q / 100, delta) if delta else None
    span = now.ts - before.ts if before is not None else 0.0
    for (group, name, short), value in now.counters.items():
        rate = None
        if before is not None and span > 0:
            old_value = before.counters.get((group, name, short), 0.0)
            rate = (value - (old_value if value >= old_value else 0.0)) / span
        out[group][name][f"{short}_per_s"] = rate
    for (group, name, short), value in now.gauges.items():
        out[group][name][short] = value
    return {group: dict(rows) for group, rows in out.items()}
