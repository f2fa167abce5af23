"""litellm, unchanged, against a real daemon with API keys: chat (plain, streamed through
``acompletion``, held to a pydantic model, tool calls under ``required`` and a named
function), ``text_completion`` on ``/v1/completions``, embeddings, and OpenAI-shaped errors
mapped to litellm's exceptions.

The file's daemon serves the tiny random Llama for chat as ``tiny`` and for embeddings as
``tiny-embed``: these tests check what litellm sends and how it reads the answers, so an
answer is checked against the daemon's own answer to the same request sent without litellm
(greedy: the same text), not for its quality. Held to a schema, the tiny model is asked for
compact JSON (left free, it pads with whitespace until ``max_tokens``). Tool calls alone use
the suite's demo-model daemon (``daemon``): the server's tool-call grammar lets whitespace in,
and only a real model closes its call. litellm is imported offline (``LITELLM_LOCAL_MODEL_COST_MAP``: otherwise its
import fetches a price list from GitHub) under an audit hook that records every connection and
name lookup beyond loopback: the module fails if litellm reaches for the network."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import jsonschema
import numpy as np
import pytest
from pydantic import BaseModel, ConfigDict, Field
from tests import loopback
from tests.daemons import TINY, Daemon, Profile, daemon_fixture, settled_request_log
from tests.serving.test_tool_calling import ASK, TOOLS, check_call

MODEL, EMBED = "tiny", "tiny-embed"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
LOOPBACK = {"127.0.0.1", "localhost", "::1"}


@dataclass
class Served:
    daemon: Daemon
    key: str
    """An inference-scope API key."""

    def args(self) -> dict[str, Any]:
        """What every litellm call gets: the daemon's ``/v1``, the key, no retries."""
        return {"api_base": self.daemon.url + "/v1", "api_key": self.key, "max_retries": 0}


def wait_workloads_ready(daemon: Daemon, admin: str, count: int, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while True:
        rows = daemon.get("/api/v1/workloads", headers={"Authorization": f"Bearer {admin}"}).json()
        if len(rows) == count and all(r["ready_replicas"] >= 1 for r in rows):
            return
        if time.monotonic() > deadline or any(r["state"] == "FAILED" for r in rows):
            pytest.fail(f"workloads not ready: {rows}\n{daemon.log()}")
        time.sleep(0.3)


litellm_daemon = daemon_fixture(Profile(
    "litellm-home", (TINY,),
    args=("--model", "{tiny}", "--served-model-name", EMBED, "--task", "embed", "--dtype",
          "float32", "--max-model-len", "64"),
    keys=(("ops", "admin"), ("app", "inference")),
))  # fmt: skip
"""The tiny model twice: ``tiny`` for chat, ``tiny-embed`` for embeddings (``--model``)."""


@pytest.fixture(scope="module")
def served(litellm_daemon: Daemon) -> Served:
    wait_workloads_ready(litellm_daemon, litellm_daemon.keys["ops"], 2)
    return Served(litellm_daemon, litellm_daemon.keys["app"])


class NetworkWatch:
    """Records each connection and name lookup this process makes beyond loopback while
    armed (``sys.addaudithook``: the hook stays for the process; disarmed, it does nothing)."""

    def __init__(self) -> None:
        self.armed = False
        self.seen: list[str] = []
        sys.addaudithook(self._hook)

    def _hook(self, event: str, args: tuple[Any, ...]) -> None:
        if not self.armed:
            return
        if event == "socket.getaddrinfo" and str(args[0]) not in LOOPBACK:
            self.seen.append(f"lookup {args[0]}")
        elif (
            event == "socket.connect"
            and isinstance(args[1], tuple)  # an IP address, not a Unix socket's path
            and str(args[1][0]) not in LOOPBACK
        ):
            self.seen.append(f"connect {args[1]}")


@pytest.fixture(scope="module")
def litellm(served: Served) -> Iterator[ModuleType]:
    """litellm imported offline, with no callbacks, the network watched until the module
    ends."""
    watch = NetworkWatch()
    watch.armed = True
    with pytest.MonkeyPatch.context() as env:
        env.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # the price list bundled, not fetched
        env.setenv("LITELLM_OFFLINE_MODE", "true")  # nor any other catalog litellm fetches
        import litellm

    litellm.suppress_debug_info = True
    for name in ("callbacks", "success_callback", "failure_callback", "input_callback"):
        assert getattr(litellm, name) == [], name  # nothing is sent to a logging service
    yield litellm
    watch.armed = False
    assert watch.seen == [], watch.seen


def last_logged(served: Served, count: int) -> list[tuple[str, str, int]]:
    """``(path, model, status)`` of the daemon's last ``count`` logged requests."""
    entries = settled_request_log(served.daemon.home)[-count:]
    return [(e["path"], e["model"], e["status"]) for e in entries]


def direct_chat(served: Served, **body: Any) -> dict[str, Any]:
    """The daemon's answer to a chat request sent with httpx, not litellm."""
    answer = loopback.post(served.daemon.url + "/v1/chat/completions", timeout=120,
                        headers={"Authorization": f"Bearer {served.key}"},
                        json={"model": MODEL, "messages": QUESTION, "temperature": 0, **body})  # fmt: skip
    assert answer.status_code == 200, answer.text
    return answer.json()  # type: ignore[no-any-return]


def test_chat_completion(litellm: ModuleType, served: Served) -> None:
    reply = litellm.completion(model=f"openai/{MODEL}", messages=QUESTION, max_tokens=32,
                               temperature=0, **served.args())  # fmt: skip
    want = direct_chat(served, max_tokens=32)["choices"][0]
    # the question reached the model as sent, and the answer came back whole
    assert reply.choices[0].message.content == want["message"]["content"] != ""
    assert reply.choices[0].finish_reason == want["finish_reason"]
    assert reply.choices[0].finish_reason in ("stop", "length")
    usage = reply.usage
    assert usage.prompt_tokens > 0 and usage.completion_tokens > 0
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert last_logged(served, 2) == [("/v1/chat/completions", MODEL, 200)] * 2


def test_a_stream_through_acompletion_joins_to_the_whole_answer(
    litellm: ModuleType, served: Served
) -> None:
    fields = {"model": f"openai/{MODEL}", "messages": QUESTION, "max_tokens": 24,
              "temperature": 0, **served.args()}  # fmt: skip

    async def streamed() -> list[Any]:
        stream = await litellm.acompletion(
            stream=True, stream_options={"include_usage": True}, **fields
        )
        return [chunk async for chunk in stream]

    chunks = asyncio.run(streamed())
    whole = litellm.completion(**fields)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content != ""
    assert text == direct_chat(served, max_tokens=24)["choices"][0]["message"]["content"]
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == whole.choices[0].finish_reason in ("stop", "length")
    usage = [c.usage for c in chunks if getattr(c, "usage", None)]
    assert usage and usage[-1].completion_tokens == whole.usage.completion_tokens


def test_response_format_from_a_pydantic_model(litellm: ModuleType, served: Served) -> None:
    class Place(BaseModel):
        # llguidance's option (JSON Schema ignores it): no whitespace between JSON tokens
        model_config = ConfigDict(json_schema_extra={"x-guidance": {"whitespace_flexible": False}})
        city: str = Field(max_length=20)
        country: str = Field(max_length=20)

    reply = litellm.completion(model=f"openai/{MODEL}", messages=QUESTION, max_tokens=64,
                               temperature=0, response_format=Place, **served.args())  # fmt: skip
    assert reply.choices[0].finish_reason == "stop"
    content = reply.choices[0].message.content
    jsonschema.validate(json.loads(content), Place.model_json_schema())
    assert Place.model_validate_json(content).city


@pytest.mark.parametrize(
    ("choice", "names"),
    [("required", {"get_weather", "get_time"}),
     ({"type": "function", "function": {"name": "get_time"}}, {"get_time"})],
)  # fmt: skip
def test_tool_calls_valid_against_the_schema(
    litellm: ModuleType, daemon: Daemon, choice: Any, names: set[str]
) -> None:
    """On the demo model: the call's grammar allows whitespace anywhere, which the tiny model
    writes until ``max_tokens``; a real model closes its call."""
    reply = litellm.completion(model="openai/smollm2", messages=ASK, tools=TOOLS,
                               tool_choice=choice, parallel_tool_calls=False, max_tokens=120,
                               temperature=0, api_base=daemon.url + "/v1", api_key="none",
                               max_retries=0)  # fmt: skip
    answer = reply.choices[0]
    assert answer.finish_reason == "tool_calls", answer
    assert len(answer.message.tool_calls) == 1
    check_call(answer.message.tool_calls[0], names)


def test_text_completion_goes_to_v1_completions(litellm: ModuleType, served: Served) -> None:
    prompt = "The capital of France is"
    reply = litellm.text_completion(model=f"openai/{MODEL}", prompt=prompt,
                                    max_tokens=6, temperature=0, **served.args())  # fmt: skip
    assert reply.object == "text_completion"
    assert reply.choices[0].text.strip() and reply.choices[0].finish_reason in ("stop", "length")
    direct = loopback.post(served.daemon.url + "/v1/completions", timeout=120,
                        headers={"Authorization": f"Bearer {served.key}"},
                        json={"model": MODEL, "prompt": prompt, "max_tokens": 6,
                              "temperature": 0}).json()  # fmt: skip
    assert reply.choices[0].text == direct["choices"][0]["text"]
    assert reply.usage.completion_tokens > 0
    assert last_logged(served, 2) == [("/v1/completions", MODEL, 200)] * 2


def test_embeddings_equal_the_api_vectors(litellm: ModuleType, served: Served) -> None:
    texts = ["The cat sat on the mat.", "hi"]
    reply = litellm.embedding(model=f"openai/{EMBED}", input=texts, **served.args())
    direct = loopback.post(served.daemon.url + "/v1/embeddings", timeout=60,
                        headers={"Authorization": f"Bearer {served.key}"},
                        json={"model": EMBED, "input": texts, "encoding_format": "float"})  # fmt: skip
    assert direct.status_code == 200, direct.text
    expected = np.array([d["embedding"] for d in direct.json()["data"]])
    got = np.array([d["embedding"] for d in sorted(reply.data, key=lambda d: d["index"])])
    assert got.shape == expected.shape == (2, 64)
    assert np.allclose(got, expected, rtol=0, atol=1e-6)  # base64 float32 vs JSON floats
    assert reply.usage.prompt_tokens == direct.json()["usage"]["prompt_tokens"]


def test_errors_map_to_litellm_exceptions(litellm: ModuleType, served: Served) -> None:
    fields = {"model": f"openai/{MODEL}", "messages": QUESTION, "max_tokens": 4}
    with pytest.raises(litellm.BadRequestError) as refused:
        litellm.completion(extra_body={"temprature": 0.5}, **fields, **served.args())
    assert "temprature" in str(refused.value)
    with pytest.raises(litellm.AuthenticationError):
        litellm.completion(**fields, **{**served.args(), "api_key": "sk-wrong"})
    with pytest.raises(litellm.NotFoundError):
        litellm.completion(**{**fields, "model": "openai/no-such-model"}, **served.args())
