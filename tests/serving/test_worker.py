"""The engine worker process on its own: startup contract, endpoints, aborts, shutdown."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import openai
import pytest
from tests import loopback

from kunlun.engine.launch import worker_command

if TYPE_CHECKING:
    from .conftest import WorkerProcess

MODEL = "smollm2"


def wait_until(predicate: Callable[[], bool], timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


def idle(worker: WorkerProcess) -> bool:
    stats = worker.stats()
    return stats["num_unfinished_requests"] == 0 and (
        stats["num_blocks_free"] == stats["num_blocks_total"]
    )


def test_ready_file_and_startup_log(worker: WorkerProcess) -> None:
    ready = worker.ready
    assert set(ready) == {"pid", "port", "load_time_s", "warmup_ttft_ms", "compile_time_s",
                          "ranks", "handoff"}  # fmt: skip
    assert ready["pid"] == worker.process.pid
    assert ready["handoff"].startswith(f"kunlun-worker-{worker.process.pid}-")
    assert [(r["rank"], r["pid"]) for r in ready["ranks"]] == [(0, worker.process.pid)]
    assert ready["warmup_ttft_ms"] > 0 and ready["compile_time_s"] == 0
    log = worker.log()
    for line in ("Compilation Time: 0.00 s", "Load Time: ", "First Token Latency: "):
        assert line in log


def test_every_worker_thread_runs_at_the_worker_niceness(worker: WorkerProcess) -> None:
    import os
    from pathlib import Path

    from kunlun.serving.worker import WORKER_NICE

    base = os.nice(0)  # the worker adds its niceness to the one it inherits (ours)
    tasks = list(Path(f"/proc/{worker.process.pid}/task").iterdir())
    assert len(tasks) > 2  # the event loop, the engine and torch threads
    for task in tasks:
        fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        assert int(fields[16]) == min(19, base + WORKER_NICE), task.name  # field 19: nice


def test_bad_niceness_is_refused_naming_the_setting(tmp_path: Path) -> None:
    from kunlun.serving.worker import write_launch

    launch = write_launch(tmp_path / "launch.json", tmp_path, "x")
    env = {**os.environ, "KUNLUN_WORKER_NICE": "fast"}
    done = subprocess.run(worker_command(launch), env=env, capture_output=True, text=True)
    assert done.returncode == 2
    assert "KUNLUN_WORKER_NICE" in done.stderr and "'fast'" in done.stderr


def test_a_bad_launch_file_is_refused_naming_the_field_and_value(tmp_path: Path) -> None:
    """The worker takes nothing but its launch file, and refuses a bad one before loading
    anything: exit 2, the file, the field and the value on stderr."""
    from kunlun.serving.worker import write_launch

    good = json.loads(write_launch(tmp_path / "good.json", tmp_path, "x").read_text())
    cases = {
        "max_num_seqs": ({**good, "max_num_seqs": 0}, "max_num_seqs=0"),
        "dtype": ({**good, "dtype": "fp64"}, "dtype='fp64'"),
        "max_num_seq": ({**good, "max_num_seq": 8}, "max_num_seq: unknown field"),
        "device": ({**good, "device": "npu:one"}, "device='npu:one'"),
    }
    for name, (data, expected) in cases.items():
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(data))
        done = subprocess.run(worker_command(path), capture_output=True, text=True, timeout=120)
        assert done.returncode == 2, (name, done.stderr)
        assert str(path) in done.stderr and expected in done.stderr, (name, done.stderr)
    not_json = tmp_path / "broken.json"
    not_json.write_text('{"model_dir": "m",\n "served_name": }')
    done = subprocess.run(worker_command(not_json), capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and f"{not_json}:2" in done.stderr and "not JSON" in done.stderr
    # flags of the old command line are not a second way in
    done = subprocess.run([*worker_command(tmp_path / "good.json"), "--dtype", "bf16"],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 2 and "--dtype" in done.stderr


def test_an_engine_setting_the_engine_cannot_run_is_refused_naming_it(
    demo_model_dir: Path, tmp_path: Path
) -> None:
    """A launch the contract accepts but the engine cannot run on this model (int4 groups of
    128 on the demo, whose layers are 576 wide) fails at start with the setting named, exit
    2, instead of running something else; a scheme the contract does not know is refused
    before that, naming the field."""
    from kunlun.serving.worker import write_launch

    launch = write_launch(tmp_path / "launch.json", demo_model_dir, "x", quantization="w4a16",
                          group_size=128, ready_file=tmp_path / "ready.json")  # fmt: skip
    done = subprocess.run(worker_command(launch), capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr
    assert "group_size=128" in done.stderr and "576" in done.stderr
    assert not (tmp_path / "ready.json").exists()
    with pytest.raises(ValueError, match="quantization must be one of .* got 'int3'"):
        write_launch(tmp_path / "bad.json", demo_model_dir, "x", quantization="int3")


def test_health_models_and_stats(worker: WorkerProcess) -> None:
    assert loopback.get(f"{worker.base_url}/health").status_code == 200
    models = loopback.get(f"{worker.base_url}/v1/models").json()
    assert [m["id"] for m in models["data"]] == [MODEL]
    stats = worker.stats()
    for key in ("num_blocks_free", "num_blocks_used", "num_running", "num_waiting"):
        assert isinstance(stats[key], int)


def test_batch_of_prompts_token_ids_and_request_log(worker: WorkerProcess) -> None:
    client = openai.OpenAI(base_url=f"{worker.base_url}/v1", api_key="x", max_retries=0)
    completion = client.completions.create(
        model=MODEL, prompt=[[504, 3575, 282, 4649, 314], [504, 3575]], max_tokens=2,
        n=2, temperature=0, extra_headers={"X-Request-Id": "batch-1"},
    )  # fmt: skip
    assert sorted(c.index for c in completion.choices) == [0, 1, 2, 3]
    assert completion.choices[0].text == completion.choices[1].text == " Paris."  # greedy
    assert completion.usage.prompt_tokens == 7 and completion.usage.completion_tokens == 8
    line = next(x for x in worker.log().splitlines() if x.startswith("Request batch-1:"))
    assert "status=200" in line and "completion_tokens=8" in line and "ttft_ms=" in line


def test_chat_logprobs_shape(worker: WorkerProcess) -> None:
    client = openai.OpenAI(base_url=f"{worker.base_url}/v1", api_key="x", max_retries=0)
    completion = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
        logprobs=True, top_logprobs=3,
    )  # fmt: skip
    content = completion.choices[0].logprobs.content
    assert len(content) == 2
    for entry in content:
        # a token may be part of a character: its text shows the bytes with U+FFFD
        assert bytes(entry.bytes).decode(errors="replace") == entry.token
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[-1].logprob


def test_errors_keep_the_worker_serving(worker: WorkerProcess) -> None:
    url = f"{worker.base_url}/v1/completions"
    too_long = loopback.post(url, json={"model": MODEL, "prompt": "hi " * 600, "max_tokens": 1})
    assert too_long.status_code == 400
    assert too_long.json()["error"]["code"] == "context_length_exceeded"
    bad = loopback.post(url, json={"model": MODEL, "prompt": "hi", "logprobs": 9})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "logprobs"
    mixed = loopback.post(url, json={"model": MODEL, "prompt": ["hi", [1, 2]]})
    assert mixed.status_code == 400 and "expected a string, a list" in mixed.text
    assert loopback.post(url, json={"model": MODEL, "prompt": "hi", "max_tokens": 1}).is_success


def test_disconnected_stream_is_aborted(worker: WorkerProcess) -> None:
    body = {"model": MODEL, "prompt": "Count:", "max_tokens": 300, "ignore_eos": True,
            "stream": True}  # fmt: skip
    with loopback.stream("POST", f"{worker.base_url}/v1/completions", json=body) as response:
        lines = response.iter_lines()  # keep a reference: a dropped generator closes the stream
        next(lines)
        assert worker.stats()["num_unfinished_requests"] == 1
    assert wait_until(lambda: idle(worker), 3.0), worker.stats()


def test_disconnected_non_stream_request_is_aborted(worker: WorkerProcess) -> None:
    body = json.dumps({"model": MODEL, "prompt": "Count:", "max_tokens": 300,
                       "ignore_eos": True}).encode()  # fmt: skip
    port = worker.ready["port"]
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        assert wait_until(lambda: worker.stats()["num_unfinished_requests"] == 1)
    assert wait_until(lambda: idle(worker), 3.0), worker.stats()


def test_sigterm_finishes_streams_then_exits_0(
    start_worker: Callable[[str], WorkerProcess],
) -> None:
    spare = start_worker("spare")
    body = {"model": "spare", "prompt": "Count:", "max_tokens": 8, "ignore_eos": True,
            "stream": True}  # fmt: skip
    with loopback.stream("POST", f"{spare.base_url}/v1/completions", json=body) as response:
        lines = response.iter_lines()
        next(lines)
        spare.process.send_signal(signal.SIGTERM)
        rest = [line for line in lines if line]
    assert rest[-1] == "data: [DONE]"
    assert spare.process.wait(30) == 0


def test_stream_interval_sends_fewer_larger_events_and_loses_nothing(
    demo_model_dir: Path, tmp_path: Path
) -> None:
    from tests.serving.conftest import launch_worker

    coalescing = launch_worker(tmp_path / "interval", demo_model_dir, stream_interval=4)
    try:
        client = openai.OpenAI(base_url=coalescing.base_url + "/v1", api_key="none", max_retries=0)
        args = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 17,
                "temperature": 0, "extra_body": {"ignore_eos": True}}  # fmt: skip
        whole = client.completions.create(**args)
        chunks = list(client.completions.create(**args, stream=True,
                                                stream_options={"include_usage": True}))  # fmt: skip
    finally:
        coalescing.stop()
    texts = [c.choices[0].text for c in chunks if c.choices and c.choices[0].text]
    assert "".join(texts) == whole.choices[0].text
    # the first token alone, then at least 4 tokens per event: at most 1 + 16 / 4 events
    assert 2 <= len(texts) <= 5, texts
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 17
