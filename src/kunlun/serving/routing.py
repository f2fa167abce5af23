"""Replica choice: the ``round-robin`` and ``load-aware`` policies, and the device samples
they read.

:class:`Router` picks, among the ready replicas of a model, one with a free slot (fewer
requests in flight than its ``slots``) and, when the request names a pool, whose device is of
that type:

* ``round-robin`` takes the replicas in turn, skipping those without a free slot;
* ``load-aware`` takes the one with the least outstanding tokens (the prompt estimate plus
  ``max_tokens`` of each request in flight, the new one included). A device whose
  utilization is above ``min_gpu_utilization_threshold`` gets no new request while another
  candidate's device is at or below it. A device hotter than the thermal limit for
  ``duration_s`` in a row has its weight multiplied by ``weight_factor`` (one half by
  default: its outstanding tokens count double) until a sample shows it cooled.

Device utilization and temperature come from :class:`DeviceSamples`, a mapping from device id
(``cuda:0``, ``ascend:3``) to :class:`DeviceLoad` that anything may write (the telemetry
collector does); samples older than ``sample_max_age_s`` are ignored. Without a fresh
utilization figure a replica's own occupancy (in flight / ``max_num_seqs``) stands in for it.

The decision is one pass over the candidates that allocates nothing per replica (device
figures are worked out when a sample is written, not when a request comes): it runs for
every request.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Iterator, MutableMapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from kunlun import headers as http_headers
from kunlun.errors import Location, RequestError
from kunlun.limits import PRIORITIES
from kunlun.serving.pools import parse_pool, pool_name
from kunlun.serving.replica import Replica
from kunlun.serving.scheduler_config import SchedulerConfig, SchedulerConfigSource, ThermalConfig

PRIORITY_HEADER = http_headers.PRIORITY
POOL_HEADER = http_headers.POOL
KEY_PRIORITY_SCOPE = "kunlun.key_priority"
"""ASGI scope key where the API-key check leaves the key's priority, when it has one."""


REMOTE_TIE_BREAK = 0.5
"""Added to another cluster node's replica's score (estimated tokens in flight): less than one
token, so it only decides between equally loaded replicas, for this node's own (no hop)."""


class PoolNotFound(RequestError):
    """``X-Kunlun-Pool`` names a pool (device type, or device type/engine) with no replica of
    the requested model."""

    code = "pool_not_found"
    http_status = 404
    openai_type = "invalid_request_error"


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


def pool_header(header: str) -> str:
    """The pool an ``X-Kunlun-Pool`` value names, spelled canonically (``cpu``,
    ``cpu/llama.cpp``; :mod:`kunlun.serving.pools`); a malformed one is a 400 naming the header
    and the value. An empty value names no pool: it is refused as one that serves nothing."""
    if not header.strip():
        return ""
    try:
        return pool_name(*parse_pool(header))
    except ValueError as exc:
        raise RequestError(
            f"header {POOL_HEADER}: {exc}", location=Location("request", field=POOL_HEADER)
        ) from None


@dataclass(frozen=True, slots=True)
class DeviceLoad:
    """What routing reads of a device: utilization in percent, temperature in Celsius (either
    may be unknown) and when it was read (``time.time()`` seconds), from the telemetry
    collector's :class:`~kunlun.telemetry.collector.DeviceSample` or a cluster peer's
    replica status."""

    utilization_pct: float | None
    temperature_c: float | None
    ts: float


class DeviceView(NamedTuple):
    """What routing reads of a device, worked out when its sample is written."""

    utilization_pct: float | None
    weight_factor: float
    """``thermal.weight_factor`` once the device has been hot long enough, else 1."""
    fresh_until: float
    """``ts + sample_max_age_s``: after this the sample is ignored."""


class DeviceSamples(MutableMapping[str, DeviceLoad]):
    """Latest sample per device id, remembering since when each device has been above the
    thermal limit (every sample written is checked, so a cool reading resets it).

    Writing a sample also works out its :class:`DeviceView` under the thermal settings and
    sample age in force (:meth:`configure`), so the per-request decision only looks it up."""

    def __init__(self, thermal: ThermalConfig | None = None, max_age_s: float = 10.0) -> None:
        self.thermal = thermal or ThermalConfig()
        self.max_age_s = max_age_s
        self.views: dict[str, DeviceView] = {}
        """Device id -> what routing reads (kept in step with the samples)."""
        self._samples: dict[str, DeviceLoad] = {}
        self._hot_since: dict[str, float] = {}

    def configure(self, thermal: ThermalConfig, max_age_s: float) -> None:
        """New thermal settings and sample age: every device's view is worked out again."""
        self.thermal, self.max_age_s = thermal, max_age_s
        for device_id, sample in list(self._samples.items()):
            self._hot_since.pop(device_id, None)
            self[device_id] = sample

    def __setitem__(self, device_id: str, sample: DeviceLoad) -> None:
        self._samples[device_id] = sample
        factor = 1.0
        if sample.temperature_c is not None and sample.temperature_c > self.thermal.limit_c:
            since = self._hot_since.setdefault(device_id, sample.ts)
            if sample.ts - since >= self.thermal.duration_s:
                factor = self.thermal.weight_factor
        else:
            self._hot_since.pop(device_id, None)
        self.views[device_id] = DeviceView(
            sample.utilization_pct, factor, sample.ts + self.max_age_s
        )

    def __getitem__(self, device_id: str) -> DeviceLoad:
        return self._samples[device_id]

    def __delitem__(self, device_id: str) -> None:
        del self._samples[device_id]
        self._hot_since.pop(device_id, None)
        self.views.pop(device_id, None)

    def __iter__(self) -> Iterator[str]:
        return iter(self._samples)

    def __len__(self) -> int:
        return len(self._samples)


class Router:
    """Chooses the replica for each request under the config in force (see module doc)."""

    def __init__(self, source: SchedulerConfigSource, samples: DeviceSamples) -> None:
        self.source = source
        self.samples = samples
        self._turn = 0
        source.on_change(self._configure)

    def _configure(self, config: SchedulerConfig) -> None:
        self.samples.configure(config.thermal, config.sample_max_age_s)

    def choose(
        self,
        replicas: Sequence[Replica],
        pool: str | None,
        tokens: int,
        workload: str | None = None,
        avoid: tuple[str, ...] = (),
    ) -> Replica | None:
        """The replica to send a request of about ``tokens`` tokens to, among the routable
        ones of ``replicas`` (one model's); None when none matching ``pool`` has a free slot.
        ``workload``: only that workload's replicas (one version of a model during a
        rollout); ``avoid``: replica ids not to take (those a request already failed on)."""
        config = self.source.config
        if workload is not None or avoid:
            replicas = [r for r in replicas
                        if (workload is None or r.workload_id == workload)
                        and r.replica_id not in avoid]  # fmt: skip
        if config.policy == "round-robin":
            return self._round_robin(replicas, pool)
        return self._load_aware(replicas, pool, tokens, config.min_gpu_utilization_threshold)

    def _round_robin(self, replicas: Sequence[Replica], pool: str | None) -> Replica | None:
        n = len(replicas)
        start = self._turn
        for i in range(n):
            replica = replicas[(start + i) % n]
            if (
                replica.routable
                and replica.in_flight < replica.slots
                and (pool is None or pool in replica.pools)
            ):
                self._turn = start + i + 1
                return replica
        return None

    def _load_aware(
        self, replicas: Sequence[Replica], pool: str | None, tokens: int, threshold: float
    ) -> Replica | None:
        threshold_pct = threshold * 100.0
        now = time.time()
        view_of = self.samples.views.get
        best_cool: Replica | None = None
        best_any: Replica | None = None
        score_cool = score_any = math.inf
        # start at a different replica each time, so that equal scores take turns
        self._turn = start = (self._turn + 1) % (len(replicas) or 1)
        for replica in itertools.chain(replicas[start:], replicas[:start]):
            in_flight = replica.in_flight
            if (
                not replica.routable
                or in_flight >= replica.max_num_seqs
                or in_flight >= replica.max_queue
                or (pool is not None and pool not in replica.pools)
            ):
                continue
            score: float = replica.outstanding_tokens + tokens
            if replica.node is not None:  # another node's: at equal load, this node's own wins
                score += REMOTE_TIE_BREAK
            view = view_of(replica.device)
            if view is not None and view.fresh_until >= now:
                utilization = view.utilization_pct
                score /= view.weight_factor
            else:
                utilization = None
            if score < score_any:
                best_any, score_any = replica, score
            if score < score_cool:
                if utilization is None:
                    utilization = 100.0 * in_flight / replica.max_num_seqs
                if utilization <= threshold_pct:
                    best_cool, score_cool = replica, score
        return best_cool if best_cool is not None else best_any
