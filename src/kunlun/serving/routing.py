"""Replica choice: the ``round-robin`` and ``load-aware`` policies, and the device samples
they read.

:class:`Router` picks, among the ready replicas of a model, one with a free slot (fewer
requests in flight than its ``slots``) and, when the request names a pool, whose device is of
that type:

* ``round-robin`` takes the replicas in turn, skipping those without a free slot;
* ``load-aware`` takes the one with the least outstanding tokens (the prompt estimate plus
  ``max_tokens`` of each request in flight, the new one included), divided by the device's
  weight. A device whose utilization is above ``min_gpu_utilization_threshold`` gets no new
  request while another candidate's device is at or below it. A device hotter than the
  thermal limit for ``duration_s`` in a row has its weight multiplied by ``weight_factor``
  (one half by default) until a sample shows it cooled.

Device utilization and temperature come from :class:`DeviceSamples`, a mapping from device id
(``cuda:0``, ``ascend:3``) to :class:`DeviceSample` that anything may write (the telemetry
collector does); samples older than ``sample_max_age_s`` are ignored. Without a fresh
utilization figure a replica's own occupancy (in flight / ``max_num_seqs``) stands in for it.

The decision is one pass over the candidates with no allocation: it runs for every request.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator, MutableMapping, Sequence
from dataclasses import dataclass

from kunlun.errors import Location, RequestError
from kunlun.serving.replica import Replica
from kunlun.serving.scheduler_config import SchedulerConfig, SchedulerConfigSource

PRIORITIES = ("high", "normal", "low")
"""The priority classes, most urgent first (ties in fair queuing go to the earlier one)."""
PRIORITY_HEADER = "X-Kunlun-Priority"
POOL_HEADER = "X-Kunlun-Pool"
KEY_PRIORITY_SCOPE = "kunlun.key_priority"
"""ASGI scope key where the API-key check leaves the key's priority, when it has one."""


class PoolNotFound(RequestError):
    """``X-Kunlun-Pool`` names a device type with no replica of the requested model."""

    code = "pool_not_found"
    http_status = 404


def resolve_priority(header: str | None, key_priority: str | None, workload_priority: str) -> str:
    """A request's class: the ``X-Kunlun-Priority`` header, else its API key's priority,
    else its workload's. An invalid header value is a 400 naming the header and the value."""
    if header is not None:
        value = header.strip().lower()
        if value not in PRIORITIES:
            raise RequestError(
                f"header {PRIORITY_HEADER} must be one of {', '.join(PRIORITIES)}, got {header!r}",
                location=Location("request", field=PRIORITY_HEADER),
            )
        return value
    return key_priority or workload_priority


@dataclass(frozen=True, slots=True)
class DeviceSample:
    """One reading of a device: utilization in percent, temperature in Celsius (either may
    be unknown) and when it was taken (``time.time()`` seconds)."""

    utilization_pct: float | None
    temperature_c: float | None
    ts: float


class DeviceSamples(MutableMapping[str, DeviceSample]):
    """Latest sample per device id, remembering since when each device has been above the
    thermal limit (every sample written is checked, so brief cool spells reset it)."""

    def __init__(self, thermal_limit_c: float = 85.0) -> None:
        self.thermal_limit_c = thermal_limit_c
        self._samples: dict[str, DeviceSample] = {}
        self._hot_since: dict[str, float] = {}

    def __setitem__(self, device_id: str, sample: DeviceSample) -> None:
        self._samples[device_id] = sample
        if sample.temperature_c is not None and sample.temperature_c > self.thermal_limit_c:
            self._hot_since.setdefault(device_id, sample.ts)
        else:
            self._hot_since.pop(device_id, None)

    def __getitem__(self, device_id: str) -> DeviceSample:
        return self._samples[device_id]

    def __delitem__(self, device_id: str) -> None:
        del self._samples[device_id]
        self._hot_since.pop(device_id, None)

    def __iter__(self) -> Iterator[str]:
        return iter(self._samples)

    def __len__(self) -> int:
        return len(self._samples)

    def get(self, device_id: str, default: DeviceSample | None = None) -> DeviceSample | None:  # type: ignore[override]
        return self._samples.get(device_id, default)

    def hot_for_s(self, device_id: str) -> float:
        """How long the device has been above the limit, up to its latest sample (0 if not)."""
        since = self._hot_since.get(device_id)
        return 0.0 if since is None else self._samples[device_id].ts - since


class Router:
    """Chooses the replica for each request under the config in force (see module doc)."""

    def __init__(self, source: SchedulerConfigSource, samples: DeviceSamples) -> None:
        self.source = source
        self.samples = samples
        self._turn = 0
        source.on_change(self._configure)

    def _configure(self, config: SchedulerConfig) -> None:
        self.samples.thermal_limit_c = config.thermal.limit_c

    def choose(self, replicas: Sequence[Replica], pool: str | None, tokens: int) -> Replica | None:
        """The replica to send a request of about ``tokens`` tokens to, among ``replicas``
        (ready, one model); None when none matching ``pool`` has a free slot."""
        config = self.source.config
        if config.policy == "round-robin":
            return self._round_robin(replicas, pool)
        return self._load_aware(replicas, pool, tokens, config)

    def _round_robin(self, replicas: Sequence[Replica], pool: str | None) -> Replica | None:
        n = len(replicas)
        start = self._turn
        for i in range(n):
            replica = replicas[(start + i) % n]
            if replica.in_flight < replica.slots and (pool is None or replica.device_type == pool):
                self._turn = start + i + 1
                return replica
        return None

    def _load_aware(
        self, replicas: Sequence[Replica], pool: str | None, tokens: int, config: SchedulerConfig
    ) -> Replica | None:
        threshold_pct = config.min_gpu_utilization_threshold * 100.0
        oldest = time.time() - config.sample_max_age_s
        thermal = config.thermal
        samples = self.samples
        best_cool: Replica | None = None
        best_any: Replica | None = None
        score_cool = score_any = math.inf
        n = len(replicas)
        start = self._turn  # equal scores take turns
        self._turn += 1
        for i in range(n):
            replica = replicas[(start + i) % n]
            if replica.in_flight >= replica.slots or (
                pool is not None and replica.device_type != pool
            ):
                continue
            utilization = None
            weight = replica.weight
            sample = samples.get(replica.device)
            if sample is not None and sample.ts >= oldest:
                utilization = sample.utilization_pct
                if samples.hot_for_s(replica.device) >= thermal.duration_s:
                    weight *= thermal.weight_factor
            if utilization is None:
                utilization = 100.0 * replica.in_flight / replica.max_num_seqs
            score = (replica.outstanding_tokens + tokens) / weight
            if score < score_any:
                best_any, score_any = replica, score
            if utilization <= threshold_pct and score < score_cool:
                best_cool, score_cool = replica, score
        return best_cool if best_cool is not None else best_any
