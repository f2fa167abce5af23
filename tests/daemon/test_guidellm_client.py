"""guidellm, the real CLI with its backend's default settings, benchmarks a real daemon.

``guidellm run`` with the ``openai_http`` backend as it comes: a ``/health`` check,
``/v1/models`` for the model's name, then streamed ``/v1/chat/completions`` with
``stream_options`` ``include_usage`` and vLLM's ``continuous_usage_stats``, ``ignore_eos`` and
``max_completion_tokens``. Synthetic prompts are counted with the served model's own
tokenizer (the tiny model's: the benchmark checks the protocol, not the answers), offline (``HF_HUB_OFFLINE``: a download attempt fails the run). The
JSON report must show every request answered, with exactly the tokens asked for and a first
token time. ``continuous_usage_stats`` is then checked on the wire: every chunk carries the
usage so far."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from tests import loopback
from tests.daemons import Daemon, Profile, daemon_fixture, settled_request_log

MODEL = "tiny"
NUM_REQUESTS, PROMPT_TOKENS, OUTPUT_TOKENS = 3, 24, 8
GUIDELLM = Path(sys.executable).parent / "guidellm"


guidellm_daemon = daemon_fixture(Profile(
    "guidellm-home", args=("--model", "{tiny}", "--served-model-name", MODEL, "--max-model-len",
                           "512", "--max-num-seqs", "2"),
    keys=(("bench", "inference"),), ready=True))  # fmt: skip
"""A daemon with API keys serving the tiny model (``kunlun-platform --model``)."""


@pytest.fixture(scope="module")
def served(guidellm_daemon: Daemon) -> tuple[Daemon, str]:
    """The daemon and its inference key."""
    return guidellm_daemon, guidellm_daemon.keys["bench"]


def offline_env() -> dict[str, str]:
    """This process's environment with Hugging Face libraries held offline, and no guidellm
    settings from outside the test."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GUIDELLM__")}
    return {**env, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


def test_guidellm_benchmark_with_default_backend_settings(
    served: tuple[Daemon, str], tiny_model: Path, tmp_path: Path
) -> None:
    daemon, key = served
    report_path = tmp_path / "report.json"
    command = [
        str(GUIDELLM), "run",
        "--backend", f"kind=openai_http,target={daemon.url},api_key={key}",
        "--profile", "kind=synchronous",
        "--constraint", f"kind=max_requests,count={NUM_REQUESTS}",
        "--data", f"kind=synthetic_text,prompt_tokens={PROMPT_TOKENS},output_tokens={OUTPUT_TOKENS}",
        "--tokenizer", f"kind=huggingface_auto,model={tiny_model}",
        "--output", f"kind=json,path={report_path}",
        "--disable-console-interactive",
    ]  # fmt: skip
    proc = subprocess.run(command, capture_output=True, text=True, env=offline_env(),
                          cwd=tmp_path, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    report = json.loads(report_path.read_text())
    (benchmark,) = report["benchmarks"]
    totals = benchmark["metrics"]["request_totals"]
    assert (totals["successful"], totals["errored"], totals["incomplete"]) == (NUM_REQUESTS, 0, 0)
    requests = benchmark["requests"]["successful"]
    assert len(requests) == NUM_REQUESTS and not benchmark["requests"]["errored"]
    for request in requests:
        assert request["prompt_tokens"] > 0
        assert request["output_tokens"] == OUTPUT_TOKENS  # ignore_eos, max_completion_tokens
        assert request["time_to_first_token_ms"] > 0
    metrics = benchmark["metrics"]
    for name in ("time_to_first_token_ms", "prompt_token_count", "output_token_count"):
        assert metrics[name]["successful"]["mean"] > 0, name
    logged = [(e["path"], e["model"], e["status"]) for e in settled_request_log(daemon.home)]
    assert logged[-NUM_REQUESTS:] == [("/v1/chat/completions", MODEL, 200)] * NUM_REQUESTS
    assert ("/v1/models", None, 200) in logged


def sse_chunks(daemon: Daemon, key: str, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    headers = {"Authorization": f"Bearer {key}"}
    with loopback.stream(
        "POST", daemon.url + path, json=body, headers=headers, timeout=120
    ) as resp:
        assert resp.status_code == 200, resp.read()
        lines = [line.removeprefix("data: ") for line in resp.iter_lines() if line]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


@pytest.mark.parametrize(("path", "prompt"), [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Count to ten."}]}),
    ("/v1/completions", {"prompt": "One, two,"}),
])  # fmt: skip
def test_continuous_usage_stats_puts_the_usage_so_far_in_every_chunk(
    served: tuple[Daemon, str], path: str, prompt: dict[str, Any]
) -> None:
    daemon, key = served
    body = {"model": MODEL, **prompt, "max_tokens": 5, "ignore_eos": True, "stream": True}
    options = {"include_usage": True, "continuous_usage_stats": True}
    chunks = sse_chunks(daemon, key, path, {**body, "stream_options": options})
    *running, last = chunks
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 5
    assert running and all(c["choices"] and c["usage"] for c in running)
    counts = [c["usage"]["completion_tokens"] for c in running]
    assert counts == sorted(counts) and counts[-1] == 5
    for chunk in chunks:
        usage = chunk["usage"]
        assert usage["prompt_tokens"] == last["usage"]["prompt_tokens"] > 0
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    plain = sse_chunks(daemon, key, path, {**body, "stream_options": {"include_usage": True}})
    assert all(c["usage"] is None for c in plain[:-1])
    tokens = ("prompt_tokens", "completion_tokens")  # cached_tokens differs: the prefix is reused
    assert [plain[-1]["usage"][t] for t in tokens] == [last["usage"][t] for t in tokens]
    alone = {**body, "stream_options": {"continuous_usage_stats": True}}
    assert all("usage" not in c for c in sse_chunks(daemon, key, path, alone))  # as vLLM
