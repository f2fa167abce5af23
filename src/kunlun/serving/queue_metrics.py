"""The gateway's fair queue as a gauge: requests waiting per model and priority class.

``kunlun_replica_queue_depth`` counts what a replica has admitted; a request the gateway holds
back (every replica of its model full) waits in its class's queue of the model's backlog
(:mod:`kunlun.serving.admission`) and is counted nowhere else. ``kunlun_gateway_queue_depth``
reports, at each scrape, every class of every served model (0 when none waits), so a
dashboard can chart each class from the first scrape on.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from kunlun.limits import PRIORITIES

if TYPE_CHECKING:
    from prometheus_client import Metric

    from kunlun.serving.admission import Admission

NAME = "kunlun_gateway_queue_depth"


class QueueDepth(Collector):
    """Reads ``admission``'s backlogs at each scrape (a few dict lookups)."""

    def __init__(self, admission: Admission) -> None:
        self.admission = admission

    def collect(self) -> Iterator[Metric]:
        gauge = GaugeMetricFamily(
            NAME,
            "Requests waiting in the gateway's queue for a replica, by model and priority class.",
            labels=["model", "priority"],
        )
        backlogs = self.admission.backlogs
        for model in sorted(set(self.admission.replicas.models()) | set(backlogs)):
            backlog = backlogs.get(model)
            for priority in PRIORITIES:
                waiting = len(backlog.queues[priority]) if backlog is not None else 0
                gauge.add_metric([model, priority], waiting)
        yield gauge
