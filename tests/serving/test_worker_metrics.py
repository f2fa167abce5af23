"""Worker and gateway metrics against the real session worker and gateway (real SDK)."""

from __future__ import annotations

import time

import openai
from prometheus_client.parser import text_string_to_metric_families
from tests import loopback
from tests.serving.conftest import MODEL, GatewayServer, WorkerProcess

from kunlun.serving.faults import PROBE_HEADER


def scrape(worker: WorkerProcess) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    response = loopback.get(f"{worker.base_url}/metrics", timeout=10)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(response.text)
        for s in family.samples
    }


def test_worker_and_gateway_count_what_was_served(
    worker: WorkerProcess, gateway: GatewayServer
) -> None:
    from kunlun.telemetry.gateway_metrics import GatewayMetrics

    metrics: GatewayMetrics = gateway.state.metrics  # type: ignore[attr-defined]
    labels = {"model": MODEL, "replica": "r1", "priority": "normal"}

    def gateway_value(name: str, **extra: str) -> float:
        return metrics.registry.get_sample_value(name, {**labels, **extra}) or 0.0

    before = scrape(worker)
    gateway_before = (
        gateway_value("kunlun_requests_total", status="200"),
        gateway_value("kunlun_e2e_request_latency_seconds_count"),
    )
    client = openai.OpenAI(base_url=f"{gateway.base_url}/v1", api_key="x", max_retries=0)
    usage = []
    for _ in range(2):  # streamed, 6 tokens each
        stream = client.completions.create(
            model=MODEL,
            prompt="Count to ten:",
            max_tokens=6,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        usage += [c.usage for c in stream if c.usage]
    reply = client.completions.create(  # one call, two prompts: two engine requests
        model=MODEL, prompt=["Hello", "Goodbye"], max_tokens=3, extra_body={"ignore_eos": True}
    )
    usage.append(reply.usage)
    bad = loopback.post(
        f"{worker.base_url}/v1/completions",
        json={"model": MODEL, "prompt": "x", "max_tokens": 0},
        timeout=30,
    )
    assert bad.status_code == 400
    probe = loopback.post(  # a health check's probe is not traffic: counted apart
        f"{worker.base_url}/v1/completions",
        json={"model": MODEL, "prompt": "x", "max_tokens": 1},
        headers={PROBE_HEADER: "1"},
        timeout=30,
    )
    assert probe.status_code == 200
    after = scrape(worker)

    def delta(name: str, **label: str) -> float:
        key = (name, tuple(sorted(label.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert delta("kunlun_worker_requests_total", status="200") == 3
    assert delta("kunlun_worker_requests_total", status="400") == 1
    assert delta("kunlun_worker_health_probes_total", status="200") == 1
    assert delta("kunlun_time_to_first_token_seconds_count") == 3  # one per call
    assert delta("kunlun_time_per_output_token_seconds_count") == 4  # per engine request
    assert delta("kunlun_engine_queue_time_seconds_count") == 4
    assert delta("kunlun_generation_tokens_total") == sum(u.completion_tokens for u in usage)
    assert delta("kunlun_generation_tokens_total") == 2 * 6 + 2 * 3
    assert delta("kunlun_prompt_tokens_total") == sum(u.prompt_tokens for u in usage)
    assert delta("kunlun_engine_steps_total") >= 6
    assert 0 <= after[("kunlun_kv_cache_usage_ratio", ())] <= 1
    assert after[("kunlun_kv_cache_blocks", ())] > 0
    assert after[("kunlun_engine_waiting_sequences", ())] == 0
    ttft_sum = delta("kunlun_time_to_first_token_seconds_sum")
    tpot_sum = delta("kunlun_time_per_output_token_seconds_sum")
    assert 0 < ttft_sum < 60 and 0 < tpot_sum < 60
    # the gateway counted the three calls it relayed (the 400 went to the worker directly);
    # it counts an exchange once its last byte is sent, which may be just after the client
    # has read it, so wait for the count (it must then be exactly 3)
    deadline = time.monotonic() + 30
    while gateway_value("kunlun_requests_total", status="200") - gateway_before[0] < 3:
        assert time.monotonic() < deadline, "the gateway did not count its three calls"
        time.sleep(0.05)
    assert gateway_value("kunlun_requests_total", status="200") - gateway_before[0] == 3
    assert gateway_value("kunlun_e2e_request_latency_seconds_count") - gateway_before[1] == 3
    missing = loopback.post(
        f"{gateway.base_url}/v1/completions",
        json={"model": "no-such-model", "prompt": "x"},
        timeout=30,
    )
    assert missing.status_code == 404
    refused = metrics.registry.get_sample_value(
        "kunlun_scheduler_decisions_total",
        {"model": "-", "replica": "-", "priority": "-", "decision": "model_not_found"},
    )
    assert refused is not None and refused >= 1
