"""An engine worker's own metrics: what only the engine knows exactly.

The worker app calls :meth:`WorkerTelemetry.observe` once per finished API call (the same
moment it logs the call) and serves :meth:`WorkerTelemetry.metrics` as ``GET /metrics``.
The daemon's ``/metrics`` scrapes every ready worker and adds the labels that say which
model, replica, priority and device the series belong to (:mod:`kunlun.daemon.exposition`);
the worker's series carry none of those.

Definitions (all times from the worker's clock):

- TTFT: from the worker receiving the call to the engine handing back the call's first
  generated token; one observation per call that produced a token;
- TPOT: per engine request, (finish - first token) / (output tokens - 1), for requests with at
  least two output tokens (with ``n`` > 1, the longest completion counts);
- engine queue time: per engine request, from its arrival in the engine to its first
  admission into a batch (waiting for a free sequence slot or KV blocks).

A health check's probe (:mod:`kunlun.node.health`) is not traffic: it counts only in
``kunlun_worker_health_probes_total{status}``, never in the request, token or latency series.

Engine state (KV-cache blocks, running and waiting sequences, preemptions, prefix-cache hits)
is read from :meth:`AsyncLLMEngine.stats` when scraped, so it costs nothing per request.

The series a vLLM Grafana dashboard reads are also exposed under vLLM's names
(:data:`VLLM_ALIASES`), from the same collectors at the same scrape, each with vLLM's
``model_name`` label: a dashboard written for vLLM works unchanged.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

from fastapi.responses import Response
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kunlun.engine.async_engine import AsyncLLMEngine
from kunlun.engine.outputs import DECODE_PARTS, DecodeTime, RequestOutput

TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1, 1.5,
                2, 3, 5, 10, 20, 60)  # fmt: skip
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15,
                0.2, 0.3, 0.5, 1, 2.5)  # fmt: skip
QUEUE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5,
                 10, 30, 60)  # fmt: skip


VLLM_ALIASES = {
    "kunlun_engine_running_sequences": "vllm:num_requests_running",
    "kunlun_engine_waiting_sequences": "vllm:num_requests_waiting",
    "kunlun_kv_cache_usage_ratio": "vllm:kv_cache_usage_perc",
    "kunlun_prompt_tokens": "vllm:prompt_tokens",
    "kunlun_generation_tokens": "vllm:generation_tokens",
    "kunlun_engine_preemptions": "vllm:num_preemptions",
    "kunlun_prefix_cache_hit_tokens": "vllm:prefix_cache_hits",
    "kunlun_prefix_cache_query_tokens": "vllm:prefix_cache_queries",
    "kunlun_time_to_first_token_seconds": "vllm:time_to_first_token_seconds",
    "kunlun_time_per_output_token_seconds": "vllm:time_per_output_token_seconds",
    "kunlun_engine_queue_time_seconds": "vllm:request_queue_time_seconds",
}
"""The worker's series that vLLM has, and vLLM's name for each (counters without
``_total``, as a family is named): the same values, exposed twice."""


class CallRecord(Protocol):
    """What the worker app knows about one finished API call."""

    status: int
    started: float
    """``time.perf_counter()`` when the worker received the call."""
    first_token: float | None
    """``time.perf_counter()`` when its first generated token came back, if any."""
    num_completion: int
    num_prompt: dict[int, int]
    """Prompt tokens per prompt of the call."""
    finals: list[RequestOutput]
    """The complete output of every engine request of the call that finished."""
    probe: bool
    """Whether the call was a health check's probe."""


class WorkerTelemetry:
    """The metrics of one worker, in their own registry (see the module docstring)."""

    def __init__(self, engine: AsyncLLMEngine, served_name: str) -> None:
        disable_created_metrics()  # no *_created series: the daemon relays every sample
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.calls = Counter(
            "kunlun_worker_requests",
            "API calls answered by the engine worker, by HTTP status.",
            ["status"],
            registry=r,
        )
        self.probes = Counter(
            "kunlun_worker_health_probes",
            "Health-check probes answered by the engine worker, by HTTP status.",
            ["status"],
            registry=r,
        )
        self.ttft = Histogram(
            "kunlun_time_to_first_token_seconds",
            "Time from the worker receiving a call to its first generated token.",
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            "kunlun_time_per_output_token_seconds",
            "Per engine request: (finish - first token) / (output tokens - 1).",
            buckets=TPOT_BUCKETS,
            registry=r,
        )
        self.queue = Histogram(
            "kunlun_engine_queue_time_seconds",
            "Per engine request: time "
            "from arrival in the engine to its first admission into a batch.",
            buckets=QUEUE_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter(
            "kunlun_prompt_tokens", "Prompt tokens of finished calls (tokens in).", registry=r
        )
        self.generation_tokens = Counter(
            "kunlun_generation_tokens",
            "Generated tokens of finished calls (tokens out).",
            registry=r,
        )
        r.register(_EngineState(engine))
        self.aliases = CollectorRegistry(auto_describe=True)
        self.aliases.register(_VllmAliases(r, served_name))

    def observe(self, call: CallRecord) -> None:
        """Count one finished call (see the module docstring for the definitions)."""
        if call.probe:
            self.probes.labels(str(call.status)).inc()
            return
        self.calls.labels(str(call.status)).inc()
        if call.first_token is not None:
            self.ttft.observe(call.first_token - call.started)
        self.prompt_tokens.inc(sum(call.num_prompt.values()))
        self.generation_tokens.inc(call.num_completion)
        for final in call.finals:
            if final.first_scheduled_time is not None:
                self.queue.observe(max(0.0, final.first_scheduled_time - final.arrival_time))
            num_tokens = max((len(o.token_ids) for o in final.outputs), default=0)
            if num_tokens >= 2 and final.first_token_time and final.finish_time:
                self.tpot.observe((final.finish_time - final.first_token_time) / (num_tokens - 1))

    def render(self) -> bytes:
        """The exposition text of every metric of this worker."""
        return generate_latest(self.registry) + generate_latest(self.aliases)

    async def metrics(self) -> Response:
        """``GET /metrics`` of the worker."""
        return Response(self.render(), media_type=CONTENT_TYPE_LATEST)


class _VllmAliases(Collector):
    """The families of :data:`VLLM_ALIASES` under vLLM's names, labelled ``model_name``."""

    def __init__(self, source: CollectorRegistry, model_name: str) -> None:
        self.source = source
        self.model_name = model_name

    def collect(self) -> Iterator[Metric]:
        for family in self.source.collect():
            alias = VLLM_ALIASES.get(family.name)
            if alias is None:
                continue
            copy = Metric(alias, family.documentation, family.type, family.unit)
            for sample in family.samples:
                name = alias + sample.name[len(family.name) :]  # (_total, _bucket, _sum...)
                labels = {**sample.labels, "model_name": self.model_name}
                copy.add_sample(name, labels, sample.value, sample.timestamp, sample.exemplar)
            yield copy


def _decode_families(decode: DecodeTime) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
    """The step profiler's figure: where decode steps' time goes (:class:`DecodeTime`)."""
    yield CounterMetricFamily(
        "kunlun_engine_decode_steps",
        "Engine steps in which every sequence computed one token.",
        decode.steps,
    )
    parts = CounterMetricFamily(
        "kunlun_engine_decode_seconds",
        "Wall time of those steps by part: compiled (the compiled decode step: kernels, no "
        "Python), model (the reference path's forward: its modules in Python), engine "
        "(scheduling, batch tensors, sampling, detokenizing: Python).",
        labels=["part"],
    )
    for part in DECODE_PARTS:
        parts.add_metric([part], getattr(decode, f"{part}_s"))
    yield parts
    path = GaugeMetricFamily(
        "kunlun_engine_decode_path", "The decode path that runs (1 on its label).", labels=["path"]
    )
    path.add_metric([decode.path], 1)
    yield path


class _EngineState(Collector):
    """The engine's statistics, read when scraped."""

    def __init__(self, engine: AsyncLLMEngine) -> None:
        self.engine = engine

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        s = self.engine.stats()
        usage = s.num_blocks_used / s.num_blocks_total if s.num_blocks_total else 0.0
        yield GaugeMetricFamily(
            "kunlun_kv_cache_usage_ratio",
            "Share of KV-cache blocks held by sequences (0 to 1).",
            usage,
        )
        yield GaugeMetricFamily(
            "kunlun_kv_cache_blocks", "KV-cache blocks of the engine.", s.num_blocks_total
        )
        yield GaugeMetricFamily(
            "kunlun_kv_cache_used_blocks", "KV-cache blocks held by sequences.", s.num_blocks_used
        )
        yield GaugeMetricFamily(
            "kunlun_engine_running_sequences", "Sequences in the running batch.", s.num_running
        )
        yield GaugeMetricFamily(
            "kunlun_engine_waiting_sequences",
            "Sequences waiting for admission (the engine's queue depth).",
            s.num_waiting,
        )
        yield CounterMetricFamily(
            "kunlun_engine_preemptions",
            "Sequences preempted (KV blocks ran out) and queued again.",
            s.num_preemptions,
        )
        yield CounterMetricFamily("kunlun_engine_steps", "Engine steps run.", s.num_steps)
        yield from _decode_families(s.decode)
        yield CounterMetricFamily(
            "kunlun_engine_failed_steps",
            "Engine steps in which the model failed some request.",
            s.num_failed_steps,
        )
        yield CounterMetricFamily(
            "kunlun_prefix_cache_hit_tokens",
            "Prompt tokens served from the prefix cache.",
            s.prefix_cache_hit_tokens,
        )
        yield CounterMetricFamily(
            "kunlun_prefix_cache_query_tokens",
            "Prompt tokens looked up in the prefix cache.",
            s.prefix_cache_query_tokens,
        )
