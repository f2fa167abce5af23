"""Ollama's API on a real daemon, through Ollama's own client library (the ``ollama``
package): chat (whole and streamed as NDJSON), generate, the model list, show, embeddings,
tool calls and ``format``; refusals name their field; calls are logged and counted like any.
The daemon serves the tiny model twice: for generation (``tiny``) and for embeddings
(``tiny-embed``), which is also how SGLang's front-end is tried with two models served (a
call without a model name goes to the only generation model)."""

from __future__ import annotations

import json
import signal
import time
from typing import Any

import httpx
import ollama
import pytest
from tests import loopback
from tests.clients import run_sglang_program
from tests.daemons import TINY, Daemon, Profile, daemon_fixture, settled_request_log

EMBED = "model: {tiny}\nname: tiny-embed\ntask: embed\n"
daemon = daemon_fixture(Profile("ollama-home", (TINY, EMBED)))


@pytest.fixture(scope="module")
def client(daemon: Daemon) -> ollama.Client:
    return ollama.Client(host=daemon.url, timeout=120)


OPTIONS = {"temperature": 0, "num_predict": 8, "seed": 1}
ASK = [{"role": "user", "content": "Say something."}]


def test_chat_whole_and_streamed(client: ollama.Client) -> None:
    whole = client.chat(model="tiny", messages=ASK, options=OPTIONS)
    assert whole.done and whole.done_reason in ("stop", "length")
    assert whole.message.role == "assistant" and whole.message.content
    assert whole.eval_count and whole.eval_count <= 8 and whole.prompt_eval_count
    parts = list(client.chat(model="tiny", messages=ASK, options=OPTIONS, stream=True))
    assert [p.done for p in parts][-1] is True and not any(p.done for p in parts[:-1])
    assert "".join(p.message.content or "" for p in parts) == whole.message.content  # greedy
    assert parts[-1].eval_count == whole.eval_count


def test_generate_raw_and_templated(client: ollama.Client) -> None:
    templated = client.generate(model="tiny", prompt="Once upon a time", options=OPTIONS)
    raw = client.generate(model="tiny", prompt="Once upon a time", raw=True, options=OPTIONS)
    assert templated.done and raw.done and templated.response and raw.response
    assert raw.prompt_eval_count < templated.prompt_eval_count  # no chat template around it
    streamed = list(client.generate(model="tiny", prompt="Once upon a time", raw=True,
                                    options=OPTIONS, stream=True))  # fmt: skip
    assert "".join(p.response for p in streamed) == raw.response
    loaded = client.generate(model="tiny")  # an empty prompt asks that the model be loaded
    assert loaded.done and loaded.done_reason == "load"


def test_list_show_and_running_models(client: ollama.Client) -> None:
    names = {m.model for m in client.list().models}
    assert names == {"tiny", "tiny-embed"}
    assert {m.model for m in client.ps().models} == names
    shown = client.show("tiny")
    assert shown.capabilities == ["completion", "tools"] and shown.template
    assert client.show("tiny-embed").capabilities == ["embedding"]


def test_embed(client: ollama.Client) -> None:
    answer = client.embed(model="tiny-embed", input=["first text", "second text"])
    assert len(answer.embeddings) == 2 and len(answer.embeddings[0]) > 0
    assert answer.embeddings[0] != answer.embeddings[1]
    single = client.embeddings(model="tiny-embed", prompt="first text")
    assert single.embedding == pytest.approx(answer.embeddings[0], abs=1e-5)
    with pytest.raises(ollama.ResponseError) as caught:
        client.embed(model="tiny", input="x")  # served for generation
    assert caught.value.status_code == 400


def test_tools_and_format(client: ollama.Client) -> None:
    tool = {"type": "function", "function": {
        "name": "get_weather", "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string",
                                                                 "maxLength": 12}},
                       "required": ["city"]}}}  # fmt: skip
    # the tiny model writes nonsense: a schema holds its answer to JSON all the same
    schema = {"type": "object", "properties": {"n": {"type": "integer", "maximum": 99}},
              "required": ["n"]}  # fmt: skip
    answer = client.chat(model="tiny", messages=ASK, format=schema,
                         options={**OPTIONS, "num_predict": 40})  # fmt: skip
    assert answer.done_reason == "stop", answer  # a closed object of one bounded integer
    assert set(json.loads(answer.message.content)) == {"n"}
    # tools reach the prompt (the template's tool list), and calls come back as Ollama
    # writes them (arguments an object); the tiny model may call the tool or not: where it
    # does, the call is whole and its arguments parse
    called = client.chat(model="tiny", messages=ASK, tools=[tool], options=OPTIONS)
    plain = client.chat(model="tiny", messages=ASK, options=OPTIONS)
    assert called.prompt_eval_count > plain.prompt_eval_count + 20
    for call in called.message.tool_calls or []:
        assert call.function.name == "get_weather" and isinstance(call.function.arguments, dict)


@pytest.mark.parametrize(
    ("body", "field"),
    [({"options": {"mirostat": 2}}, "options.mirostat"),
     ({"options": {"typo_option": 1}}, "options.typo_option"),
     ({"think": True}, "think"),
     ({"images": ["aGk="]}, "images")],
)  # fmt: skip
def test_refusals_name_the_field(daemon: Daemon, body: dict[str, Any], field: str) -> None:
    answer = loopback.post(daemon.url + "/api/generate", timeout=60,
                           json={"model": "tiny", "prompt": "hi", "stream": False, **body})  # fmt: skip
    assert answer.status_code == 400, answer.text
    assert field in answer.text


def test_runtime_options_are_the_workloads_and_accepted(client: ollama.Client) -> None:
    runtime = {"num_ctx": 64, "num_thread": 1, "num_gpu": 0, "use_mmap": True}
    answer = client.generate(model="tiny", prompt="Once upon a time", raw=True,
                             options={**OPTIONS, **runtime}, keep_alive="5m")  # fmt: skip
    assert answer.done and answer.response


def test_calls_are_logged_and_counted(daemon: Daemon, client: ollama.Client) -> None:
    answer = client.chat(model="tiny", messages=ASK, options=OPTIONS)
    logged = [e for e in settled_request_log(daemon.home) if e["path"] == "/api/chat"]
    assert logged and logged[-1]["model"] == "tiny" and logged[-1]["status"] == 200
    assert answer.eval_count
    metrics = loopback.get(daemon.url + "/metrics", timeout=30).text
    assert "kunlun_requests_total{" in metrics and 'model="tiny"' in metrics
    stream = httpx.post(daemon.url + "/api/chat", timeout=60,
                        json={"model": "tiny", "messages": ASK, "options": OPTIONS})  # fmt: skip
    assert stream.headers["content-type"].startswith("application/x-ndjson")
    lines = [json.loads(line) for line in stream.text.splitlines()]
    assert lines[-1]["done"] is True and all(not line["done"] for line in lines[:-1])


def test_sglang_front_end_with_an_embedding_model_beside(daemon: Daemon) -> None:
    """Issue 34: with a second model served, SGLang's ``RuntimeEndpoint`` got a 400 asking
    for a model it cannot send; the only generation model is now the default (an embedding
    model does not count), ``/get_model_info`` says which, and ``/health_generate`` answers."""
    out = run_sglang_program(daemon.url)
    assert out["model_path"] == "tiny" and out["gen_meta"]["completion_tokens"] >= 1
    assert loopback.get(daemon.url + "/health_generate", timeout=60).status_code == 200
    embed = loopback.get(daemon.url + "/get_model_info?model=tiny-embed", timeout=60)
    assert embed.status_code == 200 and embed.json()["model_path"] == "tiny-embed"


def test_a_configured_default_model_is_the_one_a_request_without_model_means(
    daemon: Daemon,
) -> None:
    """``default_model`` in ``scheduler_config.yaml`` (reloaded live) names the model of an
    SGLang request that names none, over the only generation model; a default that is not
    served is a 404 naming it."""
    config = daemon.home / "scheduler_config.yaml"

    def info_after(text: str | None) -> httpx.Response:
        if text is None:
            config.unlink()
        else:
            config.write_text(text)
        daemon.signal(signal.SIGHUP)  # reload now (the daemon also looks every second)
        deadline = time.monotonic() + 30
        while True:
            reply = loopback.get(daemon.url + "/get_model_info", timeout=60)
            said = reply.json().get("model_path") or reply.json()["error"]["message"]
            if (text is None and said == "tiny") or (text is not None and text.split()[-1] in said):
                return reply
            assert time.monotonic() < deadline, said
            time.sleep(0.2)

    try:
        missing = info_after("default_model: nope\n")
        assert missing.status_code == 404 and "'nope' is not served" in missing.text
        generated = loopback.post(daemon.url + "/generate", timeout=60, json={"text": "Hi"})
        assert generated.status_code == 404 and "'nope'" in generated.text
        chosen = info_after("default_model: tiny-embed\n")
        assert chosen.status_code == 200 and chosen.json()["model_path"] == "tiny-embed"
    finally:
        info_after(None)
