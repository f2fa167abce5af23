"""The demo GGUF served by llama.cpp's own server (``engine: llama.cpp``) behind the daemon.

The node agent starts the real ``llama-server`` (``make llama-server`` builds it) on the demo
model's original Q4_1 file, and the gateway relays to it with the same keys, admission and
metrics as for the embedded engine. The openai SDK tests of the gateway that do not depend on
the embedded engine's own routes or fields run here unchanged against it (imported from
test_api, with this module's ``daemon``); the rest of this file checks what differs: fields
llama.cpp lacks are a 400 naming them, its own metrics appear in the daemon's ``/metrics``,
and ``validate`` passes. The plan says ``fp32`` (``bf16`` on a CPU with native bf16) and
``quantization none``, so llama.cpp serves an unquantized copy of the file (:mod:`kunlun.engines.gguf_export`), made in the replica's
own process before the server starts.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Any

import openai
import psutil
import pytest
from tests import loopback
from tests.daemon.test_api import (  # noqa: F401 - collected here, against llama.cpp
    test_32_concurrent_streams,
    test_bad_parameters_of_platform_routes_answer_400_naming_the_field,
    test_chat_answers_paris,
    test_errors_in_openai_shape,
    test_model_cards_health_and_routing_errors_in_openai_shape,
    test_streaming_chat,
    test_structured_output_through_the_sandboxed_worker,
    test_worker_killed_mid_stream,
)
from tests.daemons import (
    PATIENT,
    SPEC,
    Daemon,
    Profile,
    assert_validate_passes,
    battery_parts,
    daemon_fixture,
    wait_running,
)

from kunlun.engines.adapter import find_binary
from kunlun.engines.builtin import LlamaCppEngine
from kunlun.serving.worker import default_nice

pytestmark = pytest.mark.skipif(
    find_binary("llama-server") is None, reason="llama-server is not built (make llama-server)"
)
HELLO = [{"role": "user", "content": "Say hello to the reader."}]


daemon = daemon_fixture(
    Profile("llama-cpp-home", (SPEC + "engine: llama.cpp\n",), files=(PATIENT,), demo=True)
)
"""A daemon whose only workload serves the demo model as ``smollm2`` on llama.cpp (the
daemon of the tests imported from test_api)."""


@pytest.fixture
def client(daemon: Daemon) -> openai.OpenAI:
    return openai.OpenAI(base_url=daemon.url + "/v1", api_key="unused", max_retries=0)


def test_the_workload_runs_llama_server_on_the_original_gguf(daemon: Daemon) -> None:
    described = daemon.describe(daemon.job)  # type: ignore[attr-defined]
    assert described["state"] == "RUNNING"
    assert described["placement"]["engine"]["chosen"] == "llama.cpp"
    # the version llama-server prints, recorded with the placement (and in snapshots)
    assert described["placement"]["engine"]["version"].startswith("version: ")
    logs = daemon.cli("workload", "logs", daemon.job)  # type: ignore[attr-defined]
    (line,) = [x for x in logs.stdout.splitlines() if x.startswith("engine: ")]
    argv = line.removeprefix("engine: ").split()
    assert "kunlun.engines.gguf_export" in argv and argv[argv.index("--source") + 1].endswith(
        ".Q4_1.gguf"
    )
    server = argv[argv.index("--") + 1 :]
    assert Path(server[0]).name == "llama-server"
    plan = described["placement"]["plan"]
    # unquantized in the plan's dtype: fp32, or bf16 where the CPU computes it natively
    assert server[server.index("--model") + 1].endswith(f"llama-cpp-{plan['dtype']}.gguf")
    assert "conversion: SmolLM2-135M-Instruct.Q4_1.gguf -> " in logs.stdout
    assert "--cont-batching" in argv
    assert_kv_is_the_plans(server, plan)
    reply = loopback.post(daemon.url + "/v1/completions", timeout=120,
                       json={"model": "smollm2", "prompt": "Hi", "max_tokens": 2})  # fmt: skip
    assert reply.status_code == 200, reply.text
    assert reply.headers["x-kunlun-device"] == "cpu:0"
    assert reply.headers["x-kunlun-replica"] == f"{daemon.job}-r0"  # type: ignore[attr-defined]


def assert_kv_is_the_plans(server: list[str], plan: dict[str, Any]) -> None:
    """llama-server's slots each hold a context of max_model_len, and together no more KV than
    the plan's (its blocks' tokens, in the plan's KV dtype): max_num_seqs of them, or as many
    as fit, at least one."""
    slots = int(server[server.index("--parallel") + 1])
    kv_tokens = plan["num_kv_blocks"] * plan["block_size"]
    assert slots == max(1, min(plan["max_num_seqs"], kv_tokens // plan["max_model_len"]))
    assert int(server[server.index("--ctx-size") + 1]) == slots * plan["max_model_len"]
    assert slots == 1 or slots * plan["max_model_len"] <= kv_tokens


README_SPEC = "model: smollm2\nname: smollm2-llama\nengine: llama.cpp\n"
"""The README's llama.cpp example, as it is written there: every other setting the plan's."""


def test_the_readme_example_runs_with_the_plans_defaults(daemon: Daemon) -> None:
    """Issue 34: with defaults the plan gives many slots of a long context (here max_model_len
    8192 and its max_num_seqs), and llama-server was started with a context of both
    multiplied (about 8 GB of KV on this CPU): stopped at its memory cap, FAILED."""
    readme = Path(__file__).parents[2].joinpath("README.md").read_text()
    assert "printf '" + README_SPEC.replace("\n", "\\n") + "' > llama.yaml" in readme
    job = daemon.submit(README_SPEC, name="readme-llama")
    try:
        wait_running(daemon, [job], timeout=600)
        plan = daemon.describe(job)["placement"]["plan"]
        assert plan["max_num_seqs"] > 1 and plan["max_model_len"] > 1024  # the defaults
        logs = daemon.cli("workload", "logs", job).stdout
        (line,) = [x for x in logs.splitlines() if x.startswith("engine: ")]
        argv = line.removeprefix("engine: ").split()
        assert_kv_is_the_plans(argv[argv.index("--") + 1 :], plan)
        reply = loopback.post(daemon.url + "/v1/completions", timeout=120,
                              json={"model": "smollm2-llama", "prompt": "Hi", "max_tokens": 2})  # fmt: skip
        assert reply.status_code == 200, reply.text
    finally:
        assert daemon.cli("workload", "stop", job).returncode == 0


def test_the_server_is_confined_like_a_worker(daemon: Daemon) -> None:
    """Started through kunlun.node.confine: the daemon's child, the workers' niceness, no core
    dumps, no_new_privs (and no seccomp filter: the allow-list is the worker's)."""
    (replica,) = daemon.describe(daemon.job)["replicas"]  # type: ignore[attr-defined]
    server = psutil.Process(int(replica["pid"]))
    assert server.name() == "llama-server"
    assert daemon.proc is not None and server.ppid() == daemon.proc.pid
    assert server.nice() == default_nice()
    assert server.rlimit(psutil.RLIMIT_CORE) == (0, 0)
    status = Path(f"/proc/{server.pid}/status").read_text()
    assert "NoNewPrivs:\t1" in status
    seccomp = [x for x in status.splitlines() if x.startswith("Seccomp")]
    assert seccomp == [  # no filter beyond what the daemon itself runs under
        x for x in Path(f"/proc/{daemon.proc.pid}/status").read_text().splitlines()
        if x.startswith("Seccomp")
    ]  # fmt: skip


def test_chat_stream_and_whole_answer_agree_with_usage(client: openai.OpenAI) -> None:
    full = client.chat.completions.create(model="smollm2", messages=HELLO, max_tokens=12,
                                          temperature=0)  # fmt: skip
    assert full.choices[0].message.content and full.usage is not None
    assert full.usage.completion_tokens == 12 and full.choices[0].finish_reason == "length"
    chunks = list(client.chat.completions.create(
        model="smollm2", messages=HELLO, max_tokens=12, temperature=0, stream=True,
        stream_options={"include_usage": True}))  # fmt: skip
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 12
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_seed_stop_and_logprobs(client: openai.OpenAI) -> None:
    def sample() -> str:
        resp = client.completions.create(model="smollm2", prompt="Once upon a time",
                                         max_tokens=12, temperature=1.0, seed=7)  # fmt: skip
        return resp.choices[0].text

    assert sample() == sample()  # the same seed, the same tokens
    stopped = client.completions.create(model="smollm2", prompt="Counting: 1, 2, 3,",
                                        max_tokens=20, temperature=0, stop=[" 6"])  # fmt: skip
    assert stopped.choices[0].finish_reason == "stop" and "6" not in stopped.choices[0].text
    chat = client.chat.completions.create(model="smollm2", messages=HELLO, max_tokens=4,
                                          temperature=0, logprobs=True, top_logprobs=2)  # fmt: skip
    content = chat.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == 4
    assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in content)


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"n": 2}, "n"),
        ({"echo": True}, "echo"),
        ({"guided_regex": "[0-9]+"}, "guided_regex"),
        ({"stream": True, "stream_options": {"include_usage": True,
                                             "continuous_usage_stats": True}},
         "stream_options.continuous_usage_stats"),
        ({"temperature": 9}, "temperature"),  # Kunlun's own range check, before the engine
        ({"promt": "x"}, "promt"),  # unknown fields are refused, not passed on
    ],
)  # fmt: skip
def test_what_llama_cpp_lacks_is_a_400_naming_the_field(
    daemon: Daemon, extra: dict[str, object], param: str
) -> None:
    body = {"model": "smollm2", "prompt": "Hi", "max_tokens": 2, **extra}
    resp = loopback.post(daemon.url + "/v1/completions", json=body, timeout=60)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    chat = loopback.post(daemon.url + "/v1/chat/completions", timeout=60,
                      json={"model": "smollm2", "messages": HELLO, "tools": tools})  # fmt: skip
    assert chat.status_code == 400 and chat.json()["error"]["param"] == "tools"
    assert "engine llama.cpp" in chat.json()["error"]["message"]
    sglang = loopback.post(daemon.url + "/generate", json={"model": "smollm2", "text": "Hi"})
    assert sglang.status_code == 400 and "engine llama.cpp" in sglang.text


def test_vllm_spellings_are_worded_for_llama_cpp(client: openai.OpenAI) -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}  # fmt: skip
    resp = client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "Give a number as JSON."}],
        max_completion_tokens=24, temperature=0,
        extra_body={"guided_json": schema, "repetition_penalty": 1.1},
    )  # fmt: skip
    assert resp.choices[0].finish_reason == "stop", resp
    assert isinstance(json.loads(resp.choices[0].message.content or "")["n"], int)


def test_llama_cpp_metrics_are_in_the_daemon_metrics(client: openai.OpenAI, daemon: Daemon) -> None:
    client.completions.create(model="smollm2", prompt="Hi", max_tokens=3)
    text = daemon.get("/metrics").text
    replica = f'replica="{daemon.job}-r0"'  # type: ignore[attr-defined]
    predicted = [x for x in text.splitlines()
                 if x.startswith("llamacpp:tokens_predicted_total{") and replica in x]  # fmt: skip
    assert predicted and float(predicted[0].rsplit(" ", 1)[1]) >= 3
    info = [x for x in text.splitlines() if x.startswith("kunlun_replica_info{") and replica in x]
    assert info and 'engine="llama.cpp"' in info[0]
    # the health checker reads the server's progress from its own metrics, as from /stats
    (described,) = daemon.describe(daemon.job)["replicas"]  # type: ignore[attr-defined]
    server = described["base_url"]
    # it answers the daemon only: its start's key is in its environment (its user's to read)
    # and nowhere else, and nothing is answered without it
    environ = Path(f"/proc/{described['pid']}/environ").read_bytes().split(b"\0")
    (key,) = [v.split(b"=", 1)[1].decode() for v in environ if v.startswith(b"LLAMA_API_KEY=")]
    assert len(key) >= 40 and key not in json.dumps(described) and key not in daemon.log()
    assert key not in " ".join(Path(f"/proc/{described['pid']}/cmdline").read_text().split("\0"))
    assert loopback.get(server + "/metrics", timeout=30).status_code == 401
    refused = loopback.post(server + "/v1/completions", json={"prompt": "Hi", "max_tokens": 1},
                            headers={"Authorization": "Bearer " + "k" * 43}, timeout=30)  # fmt: skip
    assert refused.status_code == 401, refused.text
    own = loopback.get(server + "/metrics", headers={"Authorization": f"Bearer {key}"},
                       timeout=30).text  # fmt: skip
    progress = LlamaCppEngine().progress(own)
    assert progress["num_steps"] >= 3 and progress["num_unfinished_requests"] == 0


def llama_cpp_parts() -> dict[str, tuple[str, ...]]:
    """The battery's parts, the accuracy row run with the numerics part: on llama.cpp, which
    has no ``echo``, it is SKIP, and a part must pass something too."""
    parts = battery_parts()
    accuracy = parts.pop("accuracy")
    return {**parts, "numerics": parts["numerics"] + accuracy}


@pytest.mark.parametrize("part", llama_cpp_parts())
def test_validate_passes_on_llama_cpp(daemon: Daemon, tmp_path: Path, part: str) -> None:
    out = tmp_path / "validate"
    assert_validate_passes(daemon, "smollm2", out, llama_cpp_parts()[part])
    if part == "numerics":
        cell = json.loads((out / "validation.json").read_text())["cells"]["smollm2"][
            "accuracy.multiple_choice"]  # fmt: skip
        assert cell["status"] == "SKIP" and "lacks echo" in cell["detail"], cell


def test_sigterm_drains_a_llama_cpp_stream_then_stops_its_server(daemon: Daemon) -> None:
    """Last in this file: it stops the module's daemon."""
    (replica,) = daemon.describe(daemon.job)["replicas"]  # type: ignore[attr-defined]
    body = {"model": "smollm2", "prompt": "Count slowly:", "max_tokens": 48, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    lines: list[str] = []
    with loopback.stream("POST", daemon.url + "/v1/completions", json=body, timeout=300) as resp:
        for line in filter(None, resp.iter_lines()):
            lines.append(line)
            if len(lines) == 2:
                daemon.signal(signal.SIGTERM)  # in flight: it must finish
    assert lines[-1] == "data: [DONE]"
    usage = json.loads(lines[-2].removeprefix("data: "))["usage"]
    assert usage["completion_tokens"] == 48
    assert daemon.proc is not None and daemon.proc.wait(120) == 0
    assert not psutil.pid_exists(int(replica["pid"])) or (
        psutil.Process(int(replica["pid"])).status() == psutil.STATUS_ZOMBIE
    )
