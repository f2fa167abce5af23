"""A tensor-parallel replica through the real daemon: two ranks sharing cpu:0 over gloo.

``--tp-size 2`` on the one-CPU node runs both ranks on cpu:0, splitting its cores. The replica
is ready when both ranks are; ``workload describe`` lists its ranks; its greedy tokens and
their logprobs are transformers' on the same weights. A rank SIGKILLed in the middle of a
stream ends that stream with an SSE error event; the group restarts together and the next
request gets the same answer. A size the heads cannot take is refused with the numbers.

The tiny model serves (4 query heads, 2 KV heads): these tests check the mechanics of the
ranks, and the reference check holds their numerics to transformers' exactly.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import openai
import pytest
import torch
from tests import loopback
from tests.daemons import TINY_SPEC, Daemon, Profile, daemon_fixture, wait_ready, wait_running

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
PROMPT = "The capital of France is"
NEAR_TIE = 1e-4
"""A greedy token may differ from transformers' best only where their two best logprobs are
this close (the ranks' all-reduce sums in another order: the last bits differ)."""


empty_daemon = daemon_fixture(Profile("tp-home"))


@pytest.fixture(scope="module")
def tp_daemon(tiny_model: Path, empty_daemon: Daemon) -> Daemon:
    """The tiny model on two ranks (``workload submit --tp-size 2``), in float32: its answers
    are held to transformers' float32 logprobs (a CPU with native bf16 plans bf16)."""
    d = empty_daemon
    spec = d.home / "spec.yaml"
    spec.write_text(TINY_SPEC.format(path=tiny_model, name="tiny") + "dtype: fp32\n")
    made = d.cli("workload", "submit", "--file", str(spec), "--tp-size", "2", "--json")
    assert made.returncode == 0, made.stderr
    d.job = json.loads(made.stdout)["workload_id"]
    wait_running(d, [d.job])
    return d


def workload(daemon: Daemon) -> dict[str, Any]:
    """``workload describe --json`` of the tp workload, from the API (no CLI start-up)."""
    answer = daemon.get(f"/api/v1/workloads/{daemon.job}")
    assert answer.status_code == 200, answer.text
    return answer.json()  # type: ignore[no-any-return]


def ranks_of(daemon: Daemon) -> list[dict[str, Any]]:
    return workload(daemon)["replicas"][0]["ranks"]  # type: ignore[no-any-return]


def greedy_tokens(daemon: Daemon, prompt_ids: list[int]) -> list[tuple[float, int]]:
    """``(logprob, token id)`` of 16 greedy tokens after ``prompt_ids`` (SGLang's
    ``/generate``, which returns the ids)."""
    body = {"input_ids": prompt_ids, "return_logprob": True,
            "sampling_params": {"temperature": 0, "max_new_tokens": 16, "ignore_eos": True}}  # fmt: skip
    answer = loopback.post(daemon.url + "/generate", json=body, timeout=120)
    assert answer.status_code == 200, answer.text
    return [(t[0], t[1]) for t in answer.json()["meta_info"]["output_token_logprobs"]]


def assert_transformers_agrees(
    model_dir: Path, prompt_ids: list[int], tokens: list[tuple[float, int]]
) -> None:
    """Each greedy token is transformers' best next token (or within :data:`NEAR_TIE` of it)
    and its logprob is transformers', with the same prefix fed in."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ids = prompt_ids + [t for _, t in tokens]
    with torch.no_grad():
        logits = model.eval()(torch.tensor([ids])).logits[0]
    reference = logits[len(prompt_ids) - 1 : len(ids) - 1].float().log_softmax(-1)
    assert len(tokens) == 16
    for step, (logprob, token) in enumerate(tokens):
        assert float(reference[step].max() - reference[step, token]) < NEAR_TIE, step
        assert abs(float(reference[step, token]) - logprob) < 1e-3, (step, logprob)


def prompt_ids(daemon: Daemon) -> list[int]:
    made = loopback.post(daemon.url + "/tokenize", json={"model": "tiny", "prompt": PROMPT})
    assert made.status_code == 200, made.text
    return list(made.json()["tokens"])


def test_tp2_replica_serves_and_lists_its_ranks(tp_daemon: Daemon, tiny_model: Path) -> None:
    described = workload(tp_daemon)
    assert described["placement"]["plan"]["tensor_parallel_size"] == 2
    ranks = ranks_of(tp_daemon)
    assert [r["rank"] for r in ranks] == [0, 1]
    assert all(r["device"] == "cpu" for r in ranks) and ranks[0]["pid"] != ranks[1]["pid"]
    text = tp_daemon.cli("workload", "describe", tp_daemon.job)  # type: ignore[arg-type]
    assert "rank 1: pid" in text.stdout and "tp 2" in text.stdout
    client = openai.OpenAI(base_url=tp_daemon.url + "/v1", api_key="none")
    resp = client.chat.completions.create(
        model="tiny", messages=QUESTION, max_tokens=16, temperature=0
    )
    assert resp.choices[0].message.content and resp.usage and resp.usage.completion_tokens >= 1
    ids = prompt_ids(tp_daemon)
    assert_transformers_agrees(tiny_model, ids, greedy_tokens(tp_daemon, ids))


def test_a_rank_killed_mid_stream_restarts_the_group(tp_daemon: Daemon) -> None:
    ids = prompt_ids(tp_daemon)
    answer = greedy_tokens(tp_daemon, ids)
    before = workload(tp_daemon)["replicas"][0]
    follower = before["ranks"][1]["pid"]
    # the workload's whole context: the stream is far from its end when the rank dies
    body = {"model": "tiny", "prompt": "Write a long essay.", "max_tokens": 1000,
            "stream": True, "ignore_eos": True}  # fmt: skip
    lines: list[str] = []
    with loopback.stream("POST", tp_daemon.url + "/v1/completions", json=body, timeout=120) as resp:
        for line in resp.iter_lines():
            lines.append(line)
            if len(lines) == 6:
                os.kill(follower, signal.SIGKILL)
    payloads = [json.loads(x[6:]) for x in lines if x.startswith("data: {")]
    assert "error" in payloads[-1], lines[-3:]
    assert "data: [DONE]" not in lines
    deadline = time.monotonic() + 240
    while not ((after := workload(tp_daemon))["replicas"][0]["pid"] != before["pid"]
               and after["replicas"][0]["ready"]):  # fmt: skip
        assert time.monotonic() < deadline, after
        time.sleep(0.2)
    wait_ready(tp_daemon, timeout=240)
    assert after["replicas"][0]["restarts"] == 1
    assert any("rank 1 of 2" in e["message"] for e in after["events"]) or "rank 1 of 2" in (
        tp_daemon.cli("workload", "logs", tp_daemon.job).stdout  # type: ignore[arg-type]
    )
    assert [r["rank"] for r in after["replicas"][0]["ranks"]] == [0, 1]
    assert follower not in {r["pid"] for r in after["replicas"][0]["ranks"]}
    client = openai.OpenAI(base_url=tp_daemon.url + "/v1", api_key="none")
    resp = client.chat.completions.create(
        model="tiny", messages=QUESTION, max_tokens=16, temperature=0
    )
    assert resp.choices[0].message.content
    again = greedy_tokens(tp_daemon, ids)  # the restarted group computes as before
    assert [t for _, t in again] == [t for _, t in answer]
    assert all(abs(a - b) < 1e-4 for (a, _), (b, _) in zip(again, answer, strict=True))


def test_a_tp_size_the_heads_cannot_take_is_refused(tp_daemon: Daemon, tiny_model: Path) -> None:
    # the tiny Llama: 4 query heads, 2 KV heads; 3 ranks cannot replicate 2 KV heads evenly
    planned = tp_daemon.cli("plan", "--model", str(tiny_model), "--tp-size", "3", remote=False)
    assert planned.returncode == 2, planned.stdout
    assert "tp=3" in planned.stderr and "num_key_value_heads=2" in planned.stderr
    refused = tp_daemon.cli("workload", "submit", "--model", str(tiny_model), "--name", "tp3",
                            "--tp-size", "3", "--dry-run")  # fmt: skip
    assert refused.returncode == 2 and "num_key_value_heads=2" in refused.stderr
