"""What vLLM's users send and read, unchanged, against a real daemon serving the tiny model:
a script written for vLLM (the openai SDK with vLLM's request fields in ``extra_body``),
vLLM's small routes (``/version``, ``/ping``, ``/load``, ``/tokenizer_info``, ``/tokenize``
with no model), the ``vllm:`` metric names a vLLM Grafana dashboard reads, and lm-eval's
``local-completions`` model with its remote tokenizer, in a process where transformers
cannot be imported."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from tests import loopback
from tests.clients import PINNED
from tests.daemons import Daemon

import kunlun

MODEL = "tiny"
PROMPT = "The quick brown fox jumps over the lazy dog and runs into the forest"


@pytest.fixture(scope="module")
def client(tiny_daemon: Daemon) -> openai.OpenAI:
    return openai.OpenAI(base_url=tiny_daemon.url + "/v1", api_key="none", max_retries=0)


def complete(client: openai.OpenAI, **extra: Any) -> Any:
    """A greedy completion of :data:`PROMPT`, vLLM's fields in ``extra_body``; the output's
    token ids are read from its logprobs (``return_tokens_as_token_ids``)."""
    fields = {"return_tokens_as_token_ids": True, **extra}
    return client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0,
                                     logprobs=0, extra_body=fields)  # fmt: skip


def ids(reply: Any) -> list[int]:
    return [int(t.removeprefix("token_id:")) for t in reply.choices[0].logprobs.tokens]


def test_a_script_written_for_vllm_runs_unchanged(client: openai.OpenAI) -> None:
    plain = complete(client, ignore_eos=True)
    tokens = ids(plain)
    assert len(tokens) == 8 and plain.choices[0].finish_reason == "length"
    # stop_token_ids: the second token ends the answer
    stopped = complete(client, ignore_eos=True, stop_token_ids=[tokens[1]])
    assert ids(stopped) == tokens[:2] and stopped.choices[0].finish_reason == "stop"
    # min_tokens: that token is masked until four are out, so the answer goes on past it
    held = complete(client, ignore_eos=True, stop_token_ids=[tokens[1]], min_tokens=4)
    assert len(ids(held)) >= 4 and tokens[1] not in ids(held)[:4], ids(held)
    # include_stop_str_in_output: the stop string stays at the end of the text
    text = plain.choices[0].text
    stop = text[2:4] if len(text) >= 4 else text
    cut = text.find(stop)
    without = complete(client, ignore_eos=True, stop=[stop]).choices[0].text
    within = complete(client, ignore_eos=True, stop=[stop], include_stop_str_in_output=True)
    assert without == text[:cut] and within.choices[0].text == text[: cut + len(stop)]
    # truncate_prompt_tokens: only the prompt's last three tokens are read
    short = complete(client, truncate_prompt_tokens=3)
    assert short.usage.prompt_tokens == 3 and plain.usage.prompt_tokens > 3
    # fields that change nothing here are accepted: priority (the engine's order),
    # skip_special_tokens
    same = complete(client, ignore_eos=True, priority=-1, skip_special_tokens=False)
    assert ids(same) == tokens


def test_prompt_logprobs_come_back_in_vllms_shape(client: openai.OpenAI) -> None:
    reply = complete(client, prompt_logprobs=2).model_dump()
    prompt = reply["choices"][0]["prompt_logprobs"]
    assert len(prompt) == reply["usage"]["prompt_tokens"] and prompt[0] is None
    for entry in prompt[1:]:
        assert 2 <= len(entry) <= 3  # the prompt's token, and the two most likely
        ranks = sorted(v["rank"] for v in entry.values() if v["rank"] is not None)
        assert ranks[:2] == [1, 2] and all(v["logprob"] <= 0 for v in entry.values())
        assert all(isinstance(v["decoded_token"], str) for v in entry.values())
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
        extra_body={"prompt_logprobs": 0})  # fmt: skip
    assert len(chat.model_dump()["prompt_logprobs"]) == chat.usage.prompt_tokens
    with pytest.raises(openai.BadRequestError) as caught:
        complete(client, prompt_logprobs=1, stream=True)
    assert caught.value.body["param"] == "prompt_logprobs"  # type: ignore[index]


def test_structured_outputs_hold_the_answer(client: openai.OpenAI) -> None:
    def answer(**outputs: Any) -> str:
        reply = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12,
                                          extra_body={"structured_outputs": outputs})  # fmt: skip
        return str(reply.choices[0].text)

    assert answer(choice=["alpha", "beta"]) in ("alpha", "beta")
    digits = answer(regex="[0-9]{3}")
    assert len(digits) == 3 and digits.isdigit(), digits
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    text = answer(json=schema)
    if text.endswith("}"):  # (one that ran to max_tokens need not parse: the tiny model)
        assert set(json.loads(text)) == {"n"}  # closed: no other key
    for fields, param in (
        ({"choice": ["a"], "regex": "b"}, "structured_outputs.choice"),
        ({"structural_tag": "{}"}, "structured_outputs.structural_tag"),
    ):
        with pytest.raises(openai.BadRequestError) as caught:
            answer(**fields)
        assert caught.value.body["param"] == param, caught.value.body  # type: ignore[index]


def test_vllms_routes(tiny_daemon: Daemon) -> None:
    get = lambda path: loopback.get(tiny_daemon.url + path, timeout=30)  # noqa: E731
    assert get("/version").json() == {"version": kunlun.__version__}
    assert get("/ping").status_code == 200
    assert loopback.post(tiny_daemon.url + "/ping", timeout=30).status_code == 200
    assert get("/load").json()["server_load"] >= 0
    info = get("/tokenizer_info").json()
    assert info["model"] == MODEL and "eos_token" in info and info["chat_template"]
    tokens = loopback.post(tiny_daemon.url + "/tokenize", timeout=30,
                           json={"prompt": "hello world", "add_special_tokens": False})  # fmt: skip
    assert tokens.status_code == 200, tokens.text
    back = loopback.post(tiny_daemon.url + "/detokenize", timeout=30,
                         json={"tokens": tokens.json()["tokens"]})  # fmt: skip
    assert back.json()["prompt"] == "hello world"


def test_vllms_metric_names_alias_the_platforms(client: openai.OpenAI, tiny_daemon: Daemon) -> None:
    complete(client)
    text = loopback.get(tiny_daemon.url + "/metrics", timeout=30).text
    samples = {(s.name, s.labels.get("replica")): s for f in text_string_to_metric_families(text)
               for s in f.samples}  # fmt: skip
    pairs = [("kunlun_prompt_tokens_total", "vllm:prompt_tokens_total"),
             ("kunlun_engine_running_sequences", "vllm:num_requests_running"),
             ("kunlun_kv_cache_usage_ratio", "vllm:kv_cache_usage_perc"),
             ("kunlun_time_to_first_token_seconds_count",
              "vllm:time_to_first_token_seconds_count")]  # fmt: skip
    for ours, theirs in pairs:
        found = [(r, s) for (name, r), s in samples.items() if name == theirs]
        assert found, f"{theirs} is not exposed"
        for replica, sample in found:
            assert sample.labels["model_name"] == MODEL and sample.labels["model"] == MODEL
            if ours.endswith(("_total", "_count")):  # (gauges may move between the two)
                assert sample.value == samples[(ours, replica)].value


LM_EVAL = """
import json, sys
class NoTransformers:  # lm-eval must not need it on this path
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "transformers":
            raise ImportError("transformers is not installed here")
sys.meta_path.insert(0, NoTransformers())
from lm_eval.api.instance import Instance
from lm_eval.models.openai_completions import LocalCompletionsAPI
lm = LocalCompletionsAPI(base_url=sys.argv[1] + "/v1/completions", model="tiny")
assert lm.tokenizer_backend == "remote", lm.tokenizer_backend
pairs = [("The quick brown fox", " jumps"), ("Hello", " world")]
requests = [Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)]
print(json.dumps({"scores": lm.loglikelihood(requests), "pair": lm._encode_pair(*pairs[0])}))
"""


def test_lm_eval_local_completions_needs_no_tokenizer_files(
    client: openai.OpenAI, tiny_daemon: Daemon
) -> None:
    assert (PINNED / "lm_eval").is_dir(), f"lm-eval is not in {PINNED}: make test"
    env = {**os.environ, "PYTHONPATH": str(PINNED)}
    proc = subprocess.run([sys.executable, "-c", LM_EVAL, tiny_daemon.url], env=env,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    (logprob, greedy), _ = out["scores"]
    # the same score from the completions API: the continuation's tokens, teacher-forced
    context, continuation = out["pair"]  # as lm-eval tokenized them, through /tokenize
    reply = client.completions.create(model=MODEL, prompt=context + continuation, echo=True,
                                      logprobs=1, max_tokens=1, temperature=0)  # fmt: skip
    scores = reply.choices[0].logprobs.token_logprobs
    expected = sum(scores[len(context) : len(context) + len(continuation)])
    assert logprob == pytest.approx(expected, abs=1e-3) and isinstance(greedy, bool)
