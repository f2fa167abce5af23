"""The OpenAI API of a real daemon, through the real ``openai`` SDK, plus the workload CLI."""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import openai
import pytest
from tests import loopback
from tests.daemons import BIN, Daemon, wait_ready

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture
def client(daemon: Daemon) -> openai.OpenAI:
    return openai.OpenAI(base_url=daemon.url + "/v1", api_key="unused", max_retries=0)


def test_chat_answers_paris(client: openai.OpenAI) -> None:
    resp = client.chat.completions.create(
        model="smollm2", messages=QUESTION, max_tokens=32, temperature=0
    )
    assert "Paris" in (resp.choices[0].message.content or "")
    assert (
        resp.usage is not None
        and resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens
    )
    assert [m.id for m in client.models.list().data] == ["smollm2"]


def test_responses_are_kept_in_the_daemons_state_store(
    daemon: Daemon, client: openai.OpenAI
) -> None:
    """``previous_response_id`` through the daemon: the gateway keeps each answer's
    conversation in ``KUNLUN_HOME/state.db`` (the cluster's etcd on a cluster)."""
    import sqlite3

    first = client.responses.create(model="smollm2", input="Hello, I am Ada.", temperature=0,
                                    max_output_tokens=6)  # fmt: skip
    second = client.responses.create(model="smollm2", input="Who am I?", temperature=0,
                                     max_output_tokens=6, previous_response_id=first.id)  # fmt: skip
    assert second.previous_response_id == first.id
    with sqlite3.connect(daemon.home / "state.db") as db:
        (row,) = db.execute("SELECT data FROM responses WHERE response_id = ?",
                            (second.id,)).fetchall()  # fmt: skip
    items = json.loads(row[0])["items"]
    assert items[0] == {"type": "message", "role": "user", "content": "Hello, I am Ada."}
    assert items[1]["type"] == "message" and items[1]["role"] == "assistant"
    assert items[1]["content"][0]["text"] == first.output_text
    assert items[2] == {"type": "message", "role": "user", "content": "Who am I?"}
    assert items[3]["content"][0]["text"] == second.output_text and len(items) == 4


def test_model_cards_health_and_routing_errors_in_openai_shape(
    daemon: Daemon, client: openai.OpenAI
) -> None:
    (card,) = client.models.list().data
    assert (card.id, card.object, card.owned_by) == ("smollm2", "model", "kunlun")
    assert card.created > 1_700_000_000 and card.model_extra["max_model_len"] == 1024  # type: ignore[index]
    assert client.models.retrieve("smollm2").model_dump() == card.model_dump()
    with pytest.raises(openai.NotFoundError) as caught:
        client.models.retrieve("no-such-model")
    body = caught.value.body
    assert isinstance(body, dict) and body["code"] == "model_not_found" and body["param"] == "model"
    assert loopback.get(daemon.url + "/health", timeout=30).json() == {"status": "ok"}
    for method, path, status, code in (("GET", "/v1/nothing-here", 404, "not_found"),
                                       ("DELETE", "/v1/models", 405, "method_not_allowed")):  # fmt: skip
        resp = loopback.request(method, daemon.url + path, timeout=30)
        assert resp.status_code == status, resp.text
        error = resp.json()["error"]
        assert error["code"] == code and path in error["message"]
        assert set(error) == {"message", "type", "param", "code"}
    assert "GET" in loopback.delete(daemon.url + "/v1/models", timeout=30).headers["allow"]


def test_tokenize_and_detokenize_through_the_gateway(daemon: Daemon) -> None:
    from kunlun.engine.tokenizer import Tokenizer

    local = Tokenizer(daemon.home / "models" / "smollm2")
    post = lambda path, body: loopback.post(daemon.url + path, json=body, timeout=60)  # noqa: E731
    text = "Hello world, how are you?"
    made = post("/tokenize", {"model": "smollm2", "prompt": text})
    assert made.status_code == 200, made.text
    assert made.json() == {"count": len(local.encode(text)), "max_model_len": 1024,
                           "tokens": local.encode(text)}  # fmt: skip
    chat = post("/tokenize", {"model": "smollm2", "messages": [{"role": "user", "content": text}]})
    rendered = local.apply_chat_template([{"role": "user", "content": text}],
                                         add_generation_prompt=True)  # fmt: skip
    assert chat.json()["tokens"] == local.encode(rendered, add_special_tokens=False)
    back = post("/detokenize", {"model": "smollm2", "tokens": made.json()["tokens"]})
    assert back.status_code == 200 and back.json() == {"prompt": text}
    for path, body, status, param in (
        ("/tokenize", {"model": "nope", "prompt": "x"}, 404, "model"),
        ("/tokenize", {"model": "smollm2"}, 400, "prompt"),
        ("/tokenize", {"model": "smollm2", "prompt": "x", "promt": 1}, 400, "promt"),
        ("/detokenize", {"model": "smollm2", "tokens": [1, 10**9]}, 400, "tokens.1"),
    ):  # fmt: skip
        refused = post(path, body)
        assert refused.status_code == status, refused.text
        assert refused.json()["error"]["param"] == param, refused.text


def test_structured_output_through_the_sandboxed_worker(client: openai.OpenAI) -> None:
    schema = {"type": "object", "additionalProperties": False, "required": ["city", "country"],
              "properties": {"city": {"type": "string", "maxLength": 20},
                             "country": {"type": "string", "maxLength": 20}}}  # fmt: skip
    resp = client.chat.completions.create(
        model="smollm2", messages=QUESTION, max_tokens=64, temperature=0,
        response_format={"type": "json_schema",
                         "json_schema": {"name": "place", "schema": schema}},  # type: ignore[typeddict-item]
    )  # fmt: skip
    assert resp.choices[0].finish_reason == "stop"
    answer = json.loads(resp.choices[0].message.content or "")
    assert set(answer) == {"city", "country"} and all(isinstance(v, str) for v in answer.values())


@pytest.mark.parametrize("include_usage", [False, True])
def test_streaming_chat(client: openai.OpenAI, include_usage: bool) -> None:
    stream = client.chat.completions.create(
        model="smollm2",
        messages=QUESTION,
        max_tokens=16,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True} if include_usage else None,
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert "Paris" in text
    full = client.chat.completions.create(
        model="smollm2", messages=QUESTION, max_tokens=16, temperature=0
    )
    assert text == full.choices[0].message.content
    if include_usage:
        assert chunks[-1].choices == [] and chunks[-1].usage is not None
        assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens  # type: ignore[union-attr]
    else:
        assert all(c.usage is None for c in chunks)


def test_completions_echo_logprobs_n_and_seed(client: openai.OpenAI) -> None:
    resp = client.completions.create(
        model="smollm2",
        prompt="The capital of France is",
        max_tokens=4,
        temperature=0,
        echo=True,
        logprobs=2,
    )
    choice = resp.choices[0]
    assert choice.text.startswith("The capital of France is")
    lp = choice.logprobs
    assert lp is not None and lp.token_logprobs is not None and lp.tokens is not None
    assert lp.token_logprobs[0] is None  # the first prompt token has no logprob
    assert len(lp.tokens) == resp.usage.prompt_tokens + resp.usage.completion_tokens  # type: ignore[union-attr]
    two = client.completions.create(
        model="smollm2", prompt="Once upon a time", max_tokens=12, temperature=1.0, n=2, seed=7
    )
    assert sorted(c.index for c in two.choices) == [0, 1]
    again = client.completions.create(
        model="smollm2", prompt="Once upon a time", max_tokens=12, temperature=1.0, n=2, seed=7
    )
    assert [c.text for c in two.choices] == [c.text for c in again.choices]


def test_errors_in_openai_shape(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model="smollm2", messages=QUESTION, temperature=-1)
    assert "temperature" in str(bad.value)
    with pytest.raises(openai.BadRequestError) as long:
        client.completions.create(model="smollm2", prompt="word " * 3000, max_tokens=4)
    assert "1024" in str(long.value)
    with pytest.raises(openai.NotFoundError) as missing:
        client.chat.completions.create(model="gpt-4", messages=QUESTION)
    assert "smollm2" in str(missing.value)


def test_bad_parameters_of_platform_routes_answer_400_naming_the_field(daemon: Daemon) -> None:
    job = daemon.job  # type: ignore[attr-defined]
    resp = loopback.get(f"{daemon.url}/api/v1/workloads/{job}/logs", params={"offset": -5})
    assert resp.status_code == 400
    error = resp.json()["error"]
    assert error["param"] == "query.offset" and error["type"] == "invalid_request_error"
    assert "-5" in error["message"] and "offset" in error["message"]
    resp = loopback.post(f"{daemon.url}/v1/batches", json={"endpoint": "/v1/completions"})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "input_file_id"
    # an offset past the end of the log (found by the fuzzer: 2**46 gave a 500) resumes
    # from the end
    resp = loopback.get(f"{daemon.url}/api/v1/workloads/{job}/logs", params={"offset": 2**46})
    assert resp.status_code == 200, resp.text
    end = resp.json()["offset"]
    assert resp.json()["text"] == "" and 0 < end < 2**46
    again = loopback.get(f"{daemon.url}/api/v1/workloads/{job}/logs", params={"offset": end})
    assert again.status_code == 200 and again.json()["offset"] >= end


def test_32_concurrent_streams(client: openai.OpenAI) -> None:
    def one(i: int) -> str:
        stream = client.chat.completions.create(
            model="smollm2",
            messages=[{"role": "user", "content": f"Count to {i % 5 + 3}."}],
            max_tokens=8,
            stream=True,
            temperature=0,
        )
        return "".join(c.choices[0].delta.content or "" for c in stream if c.choices)

    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        texts = list(pool.map(one, range(32)))
    assert len(texts) == 32 and all(texts)


def test_disconnect_aborts_and_frees_blocks(daemon: Daemon) -> None:
    replica = daemon.describe(daemon.job)["replicas"][0]  # type: ignore[attr-defined]
    body = {
        "model": "smollm2",
        "prompt": "Tell a long story.",
        "max_tokens": 400,
        "stream": True,
        "ignore_eos": True,
    }
    with loopback.stream("POST", daemon.url + "/v1/completions", json=body, timeout=60) as resp:
        lines = resp.iter_lines()  # keep a reference: a dropped generator closes the stream
        for _ in range(6):
            next(lines)
        key = daemon.worker_key(replica["replica_id"])
        running = loopback.get(replica["base_url"] + "/stats", headers=key).json()
        assert running["num_running"] == 1 and running["num_blocks_used"] > 0
    # leaving the block closes the connection: the client is gone
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        stats = loopback.get(replica["base_url"] + "/stats", headers=key).json()
        if stats["num_running"] == 0 and stats["num_blocks_used"] == 0:
            break
        time.sleep(0.05)
    assert stats["num_running"] == 0 and stats["num_unfinished_requests"] == 0
    assert stats["num_blocks_used"] == 0  # prefix-cached blocks are free (evictable), not used


def test_workload_cli(daemon: Daemon) -> None:
    listed = daemon.cli("workload", "list")
    assert listed.returncode == 0 and daemon.job in listed.stdout and "RUNNING" in listed.stdout  # type: ignore[attr-defined]
    desc = daemon.cli("workload", "describe", daemon.job)  # type: ignore[attr-defined]
    assert "target_device: cpu:0" in desc.stdout and "why:" in desc.stdout
    logs = daemon.cli("workload", "logs", daemon.job)  # type: ignore[attr-defined]
    for key in ("Compilation Time", "Load Time", "First Token Latency"):
        assert key in logs.stdout
    dry = daemon.cli(
        "workload", "submit", "--model", "smollm2", "--name", "other", "--dry-run", "--json"
    )
    assert dry.returncode == 0, dry.stderr
    assert json.loads(dry.stdout)["target_device"] == "cpu:0"
    unknown = daemon.cli("workload", "submit", "--model", "no-such-model")
    assert (
        unknown.returncode == 2
        and "no-such-model" in unknown.stderr
        and "smollm2" in unknown.stderr
    )
    taken = daemon.cli("workload", "submit", "--model", "smollm2")
    assert taken.returncode == 2 and "already serves 'smollm2'" in taken.stderr
    bad = daemon.cli(
        "workload", "submit", "--model", "smollm2", "--name", "x", "--device", "ascend:7"
    )
    assert bad.returncode == 2 and "ascend:7" in bad.stderr and "cpu:0" in bad.stderr
    devices = daemon.cli("device", "list")
    assert devices.returncode == 0 and "daemon" in devices.stdout and "cpu:0" in devices.stdout


def test_cli_without_daemon_says_so(daemon: Daemon) -> None:
    proc = subprocess.run(
        [str(BIN / "kunlun-cli"), "workload", "list"],
        capture_output=True,
        text=True,
        env=dict(os.environ, KUNLUN_ENDPOINT="http://127.0.0.1:1"),
        timeout=60,
    )
    assert proc.returncode == 3
    assert "cannot reach the Kunlun daemon at http://127.0.0.1:1" in proc.stderr


def test_worker_killed_mid_stream(daemon: Daemon, client: openai.OpenAI) -> None:
    job = daemon.job  # type: ignore[attr-defined]
    before = daemon.describe(job)["replicas"][0]
    body = {
        "model": "smollm2",
        "prompt": "Write a long essay.",
        "max_tokens": 500,
        "stream": True,
        "ignore_eos": True,
    }
    lines: list[str] = []
    with loopback.stream("POST", daemon.url + "/v1/completions", json=body, timeout=60) as resp:
        for line in resp.iter_lines():
            lines.append(line)
            if len(lines) == 6:
                os.kill(before["pid"], signal.SIGKILL)
    payloads = [json.loads(x[6:]) for x in lines if x.startswith("data: {")]
    assert "error" in payloads[-1] and payloads[-1]["error"]["code"] == "worker_died"
    assert "data: [DONE]" not in lines
    assert daemon.get("/healthz").status_code == 200
    # the gateway saw the death first; the agent notices within its 0.1 s tick, then
    # restarts the worker after its back-off: wait for the new process to be ready
    deadline = time.monotonic() + 120
    while not ((after := daemon.describe(job))["replicas"][0]["pid"] != before["pid"]
               and after["replicas"][0]["ready"]):  # fmt: skip
        assert time.monotonic() < deadline, after
        time.sleep(0.2)
    wait_ready(daemon, timeout=120)
    assert after["replicas"][0]["restarts"] == 1
    assert any(e["kind"] == "crashed" and "signal 9" in e["message"] for e in after["events"])
    resp = client.chat.completions.create(
        model="smollm2", messages=QUESTION, max_tokens=16, temperature=0
    )
    assert "Paris" in (resp.choices[0].message.content or "")


def test_model_that_cannot_load_fails_the_workload_with_the_reason(
    daemon: Daemon, client: openai.OpenAI, tmp_path: Path
) -> None:
    model_dir = tmp_path / "gpt2-like"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    made = daemon.cli("workload", "submit", "--model", str(model_dir), "--name", "broken", "--json")
    assert made.returncode == 0, made.stderr
    job = json.loads(made.stdout)["workload_id"]
    deadline = time.monotonic() + 120
    while (described := daemon.describe(job))["state"] != "FAILED":
        assert time.monotonic() < deadline, described
        time.sleep(0.5)
    assert "GPT2LMHeadModel" in described["reason"] and "LlamaForCausalLM" in described["reason"]
    assert described["replicas"] == []  # not restarted in a loop
    resp = client.chat.completions.create(
        model="smollm2", messages=QUESTION, max_tokens=8, temperature=0
    )
    assert resp.choices[0].message.content
