"""Reading the daemon's exposition back: device rows, replica rows, quantiles.

:func:`parse` turns ``/metrics`` text into a :class:`Snapshot`: one row per device and one
per replica, each a flat dict of labels and figures, plus the platform-wide ones
(:func:`snapshot` does it for the families already read, so a reader that needs them twice
parses the text once).
:func:`histogram_quantile` estimates a quantile from cumulative buckets the way
Prometheus's ``histogram_quantile`` does (linear within the bucket). ``kunlun-cli telemetry
metrics`` shows a snapshot; ``kunlun-cli bench`` reads memory and start-up times from one.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families

from kunlun.errors import ConfigError, Location

Labels = tuple[tuple[str, str], ...]

PLATFORM_MEMORY = "kunlun_platform_resident_memory_bytes"
"""The gauge of the resident memory of the daemon's whole process tree (written by
:mod:`kunlun.daemon.exposition`, read here and by ``kunlun-cli bench``)."""
_DEVICE_FIGURES = {
    "kunlun_device_utilization_percent": "utilization_pct",
    "kunlun_device_memory_used_bytes": "memory_used_bytes",
    "kunlun_device_memory_total_bytes": "memory_total_bytes",
    "kunlun_device_temperature_celsius": "temperature_c",
    "kunlun_device_power_watts": "power_w",
    "kunlun_device_memory_bandwidth_utilization_percent": "memory_bandwidth_util_pct",
    "kunlun_device_memory_bandwidth_bytes_per_second": "memory_bandwidth_bytes_per_s",
    "kunlun_device_sample_timestamp_seconds": "sampled_at",
}
_REPLICA_FIGURES = {
    "kunlun_replica_ready": "ready",
    "kunlun_replica_queue_depth": "queue_depth",
    "kunlun_replica_queue_limit": "queue_limit",
    "kunlun_replica_restarts_total": "restarts",
    "kunlun_kv_cache_usage_ratio": "kv_cache_usage",
    "kunlun_engine_running_sequences": "running",
    "kunlun_engine_waiting_sequences": "waiting",
    "kunlun_prompt_tokens_total": "prompt_tokens",
    "kunlun_generation_tokens_total": "generation_tokens",
    "kunlun_engine_preemptions_total": "preemptions",
    "kunlun_engine_decode_steps_total": "decode_steps",
}
_REPLICA_HISTOGRAMS = {
    "kunlun_time_to_first_token_seconds": "ttft",
    "kunlun_time_per_output_token_seconds": "tpot",
    "kunlun_e2e_request_latency_seconds": "e2e",
    "kunlun_engine_queue_time_seconds": "engine_queue",
    "kunlun_gateway_queue_time_seconds": "gateway_queue",
}


@dataclass
class Snapshot:
    """One scrape, as rows."""

    devices: list[dict[str, Any]] = field(default_factory=list)
    replicas: list[dict[str, Any]] = field(default_factory=list)
    platform: dict[str, Any] = field(default_factory=dict)
    """Platform-wide figures: ``resident_memory_bytes``, ``refused`` (status -> count)."""

    def filtered(self, filters: dict[str, str]) -> Snapshot:
        """The rows whose labels match every ``key=value`` filter (rows lacking a key drop)."""

        def keep(row: dict[str, Any]) -> bool:
            return all(str(row.get(k)) == v for k, v in filters.items())

        return Snapshot(
            [r for r in self.devices if keep(r)],
            [r for r in self.replicas if keep(r)],
            self.platform,
        )

    def to_dict(self) -> dict[str, Any]:
        return {"devices": self.devices, "replicas": self.replicas, "platform": self.platform}


def parse_filters(items: list[str]) -> dict[str, str]:
    """``["device_type=cpu", ...]`` -> ``{"device_type": "cpu"}``; a malformed one is a
    :class:`ConfigError` naming it."""
    filters = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip() or not value.strip():
            raise ConfigError(
                f"filter {item!r} is not LABEL=VALUE (e.g. device_type=cpu)",
                location=Location("--filter"),
            )
        filters[key.strip()] = value.strip()
    return filters


def histogram_quantile(q: float, buckets: list[tuple[float, float]]) -> float | None:
    """The ``q`` quantile of a histogram given as (upper bound, cumulative count) pairs,
    interpolated linearly inside its bucket; None when the histogram is empty. A quantile
    in the ``+Inf`` bucket is the highest finite bound."""
    buckets = sorted(buckets)
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    lower_bound, lower_count = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if math.isinf(bound):
                return lower_bound
            if count == lower_count:
                return bound
            return lower_bound + (bound - lower_bound) * (rank - lower_count) / (
                count - lower_count
            )
        lower_bound, lower_count = bound, count
    return lower_bound


def parse(text: str) -> Snapshot:
    """The :class:`Snapshot` of one exposition of the daemon's ``/metrics``."""
    return snapshot(metric_families(text))


def metric_families(text: str) -> list[Metric]:
    """The metric families of one exposition; a :class:`ConfigError` for anything else."""
    try:
        return list(text_string_to_metric_families(text))
    except ValueError as exc:
        raise ConfigError(
            f"not a Prometheus exposition: {exc}", location=Location("/metrics")
        ) from None


def snapshot(families: list[Metric]) -> Snapshot:
    """The :class:`Snapshot` of the daemon's exposition, already read into its families."""
    devices: dict[str, dict[str, Any]] = defaultdict(dict)
    replicas: dict[str, dict[str, Any]] = defaultdict(dict)
    buckets: dict[tuple[str, str], dict[float, float]] = defaultdict(lambda: defaultdict(float))
    requests: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    result = Snapshot()
    for family in families:
        for sample in family.samples:
            name, labels, value = sample.name, sample.labels, sample.value
            replica = labels.get("replica")
            if name in _DEVICE_FIGURES:
                devices[labels["device"]][_DEVICE_FIGURES[name]] = value
            elif name == "kunlun_device_status":
                devices[labels["device"]].update(
                    device=labels["device"],
                    device_type=labels["device_type"],
                    status=labels["status"],
                )
            elif name == "kunlun_replica_info":
                replicas[labels["replica"]].update(labels)
            elif name == "kunlun_requests_total":
                requests[replica or "-"][labels["status"]] += value
                if replica and replica != "-":
                    replicas[replica].setdefault("model", labels["model"])
                    replicas[replica].setdefault("priority", labels["priority"])
            elif name == PLATFORM_MEMORY:
                result.platform["resident_memory_bytes"] = value
            elif name == "kunlun_process_resident_memory_bytes" and replica and replica != "-":
                replicas[replica]["resident_memory_bytes"] = value
            elif name == "kunlun_engine_decode_seconds_total" and replica:
                replicas[replica][f"decode_{labels['part']}_s"] = value
            elif name == "kunlun_engine_decode_path" and replica:
                replicas[replica]["decode_path"] = labels["path"]
            elif name == "kunlun_replica_startup_seconds" and replica:
                replicas[replica][f"startup_{labels['phase']}_s"] = value
            elif replica and replica != "-" and name in _REPLICA_FIGURES:
                replicas[replica][_REPLICA_FIGURES[name]] = value
            elif replica and replica != "-" and name.endswith("_bucket"):
                base = name.removesuffix("_bucket")
                if base in _REPLICA_HISTOGRAMS:
                    buckets[(replica, _REPLICA_HISTOGRAMS[base])][float(labels["le"])] += value
            elif replica and replica != "-" and name.endswith("_count"):
                base = name.removesuffix("_count")
                if base in _REPLICA_HISTOGRAMS:
                    replicas[replica][f"{_REPLICA_HISTOGRAMS[base]}_count"] = value
    for (replica, short), by_bound in buckets.items():
        pairs = list(by_bound.items())
        replicas[replica][f"{short}_p50_s"] = histogram_quantile(0.5, pairs)
        replicas[replica][f"{short}_p99_s"] = histogram_quantile(0.99, pairs)
    for replica, by_status in requests.items():
        if replica == "-":
            result.platform["refused"] = dict(by_status)
        else:
            replicas[replica]["requests"] = dict(by_status)
    result.devices = [{"device": d, **row} for d, row in sorted(devices.items())]
    result.replicas = [{"replica": r, **row} for r, row in sorted(replicas.items())]
    return result
