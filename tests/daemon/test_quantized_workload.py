"""Quantized workloads on a real daemon: ``workload submit --model smollm2 --quantization
w8a8 --device cpu:0`` (and ``--quantize w4a16``) start, serve a chat completion through the
``openai`` SDK, and ``kunlun-cli validate`` passes on both (w8a8 with the activation
smoothing of :mod:`kunlun.engine.smooth`); ``model quantize`` writes a model the planner and
the engine both read."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from tests.daemons import (
    PATIENT,
    QUALITY_ROWS,
    Daemon,
    Daemons,
    Profile,
    assert_validate_passes,
    wait_running,
)

SPEC = """\
model: smollm2
max_num_seqs: 4
max_model_len: 1024
kv_cache_memory_mb: 64
"""
WORKLOADS = {"smollm2-w8a8": ("--quantization", "w8a8"), "smollm2-w4a16": ("--quantize", "w4a16")}


def serve_quantized(request: pytest.FixtureRequest, name: str) -> Iterator[Daemon]:
    """A daemon running the demo model as workload ``name`` on cpu:0."""
    with Daemons(request).serve(Profile(f"{name}-home", demo=True, files=(PATIENT,))) as daemon:
        spec = daemon.home / "spec.yaml"
        spec.write_text(SPEC)
        proc = daemon.cli("workload", "submit", "--file", str(spec), "--model", "smollm2",
                          *WORKLOADS[name], "--device", "cpu:0", "--name", name,
                          "--json")  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        wait_running(daemon, [json.loads(proc.stdout)["workload_id"]], timeout=600)
        yield daemon


@pytest.fixture(scope="module")
def w8a8(request: pytest.FixtureRequest) -> Iterator[Daemon]:
    yield from serve_quantized(request, "smollm2-w8a8")


@pytest.fixture(scope="module")
def w4a16(request: pytest.FixtureRequest) -> Iterator[Daemon]:
    yield from serve_quantized(request, "smollm2-w4a16")


@pytest.fixture
def quantized(request: pytest.FixtureRequest, name: str) -> Daemon:
    """The daemon serving workload ``name`` (one daemon per scheme: each starts in well
    under a minute; the two together took longer)."""
    return request.getfixturevalue(name.removeprefix("smollm2-"))  # type: ignore[no-any-return]


@pytest.mark.parametrize(("name", "scheme"), [("smollm2-w8a8", "w8a8"), ("smollm2-w4a16", "w4a16")])
def test_quantized_workload_serves_a_chat_completion(
    quantized: Daemon, name: str, scheme: str
) -> None:
    client = openai.OpenAI(base_url=quantized.url + "/v1", api_key="none", max_retries=0,
                           timeout=300)  # fmt: skip
    answer = client.chat.completions.create(
        model=name,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=12,
        temperature=0,
    )
    assert answer.choices[0].message.content
    assert answer.usage is not None and answer.usage.completion_tokens >= 1
    rows = json.loads(quantized.cli("workload", "list", "--json").stdout)
    job = next(w["workload_id"] for w in rows if w["name"] == name)
    plan = quantized.describe(job)["placement"]["plan"]
    assert plan["quantization"] == scheme and plan["devices"] == ["cpu:0"]
    logs = quantized.cli("workload", "logs", job).stdout
    assert f"quantized 210 layers to {scheme}" in logs, logs


@pytest.mark.parametrize(
    ("name", "part"),
    # what a scheme changes (QUALITY_ROWS); the serving path's rows run on fp32
    [(name, part) for name in WORKLOADS for part in QUALITY_ROWS],
)
def test_validate_passes_on_the_quantized_workload(
    quantized: Daemon, tmp_path: Path, name: str, part: str
) -> None:
    assert_validate_passes(quantized, name, tmp_path / "out", QUALITY_ROWS[part])


def test_model_quantize_registers_a_model_the_planner_reads(w8a8: Daemon) -> None:
    quantized = w8a8
    made = quantized.cli("model", "quantize", "--model", "smollm2", "--quantize", "w8a16",
                         "--name", "smollm2-int8")  # fmt: skip
    assert made.returncode == 0, made.stderr
    assert "model smollm2-int8 -> " in made.stdout and "(w8a16)" in made.stdout
    planned = quantized.cli("plan", "--model", "smollm2-int8", "--device", "cpu:0", "--json",
                            remote=False)  # fmt: skip
    assert planned.returncode == 0, planned.stderr
    assert json.loads(planned.stdout)["plan"]["quantization"] == "w8a16"
    again = quantized.cli("model", "quantize", "--model", "smollm2-int8", "--quantize", "w8a8")
    assert again.returncode == 2
    assert "is already quantized (w8a16)" in again.stderr
