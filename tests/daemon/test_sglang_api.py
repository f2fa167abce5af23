"""SGLang's native API (``/generate``, ``/get_model_info``, ``/get_server_info``,
``/flush_cache``) through the real daemon and its sandboxed worker, driven with httpx in the
request and response shapes SGLang documents (SGLang's own front-end imports torch, so it
does not run here: docs/sglang-api.md).

The suite's tiny-model daemon serves: these tests check the protocol; an answer is checked
against the daemon's answer to the same request by another route, never for its quality."""

from __future__ import annotations

import json
import math
import re
import time
from pathlib import Path
from typing import Any

import pytest
from tests import loopback
from tests.clients import run_sglang_program
from tests.daemons import Daemon

PROMPT = "The capital of France is"
MODEL = "tiny"


@pytest.fixture
def daemon(tiny_daemon: Daemon) -> Daemon:
    """The shared daemon of the tiny model: these tests check SGLang's shapes and that its
    routes answer as the OpenAI routes do, not the quality of an answer."""
    return tiny_daemon


def generate(daemon: Daemon, body: dict[str, Any], status: int = 200) -> Any:
    resp = loopback.post(daemon.url + "/generate", json=body, timeout=300)
    assert resp.status_code == status, resp.text
    return resp.json()


def completion(daemon: Daemon, **body: Any) -> dict[str, Any]:
    resp = loopback.post(daemon.url + "/v1/completions", json={"model": MODEL, **body},
                      timeout=300)  # fmt: skip
    assert resp.status_code == 200, resp.text
    return resp.json()  # type: ignore[no-any-return]


def greedy(max_new_tokens: int = 8, **extra: Any) -> dict[str, Any]:
    return {"temperature": 0, "max_new_tokens": max_new_tokens, **extra}


def test_generate_text_and_ids_equal_the_completions_route(daemon: Daemon) -> None:
    want = completion(daemon, prompt=PROMPT, max_tokens=8, temperature=0)
    out = generate(daemon, {"text": PROMPT, "sampling_params": greedy(), "rid": "r-1"})
    assert out["text"] == want["choices"][0]["text"]
    meta = out["meta_info"]
    assert meta["id"] == "r-1"
    assert meta["prompt_tokens"] == want["usage"]["prompt_tokens"]
    assert meta["completion_tokens"] == want["usage"]["completion_tokens"] == 8
    assert meta["finish_reason"] == {"type": "length", "length": 8}
    assert isinstance(meta["cached_tokens"], int) and meta["e2e_latency"] > 0
    ids = loopback.post(daemon.url + "/tokenize", json={"model": MODEL, "prompt": PROMPT}).json()
    by_ids = generate(daemon, {"input_ids": ids["tokens"], "sampling_params": greedy()})
    assert by_ids["text"] == out["text"]
    with_model = generate(daemon, {"model": MODEL, "text": PROMPT, "sampling_params": greedy()})
    assert with_model["text"] == out["text"]


def test_batches_and_n_answer_lists(daemon: Daemon) -> None:
    prompts = [PROMPT, "Once upon a time"]
    outs = generate(daemon, {"text": prompts, "sampling_params": greedy(4), "rid": ["a", "b"]})
    assert [o["meta_info"]["id"] for o in outs] == ["a", "b"]
    for prompt, out in zip(prompts, outs, strict=True):
        want = completion(daemon, prompt=prompt, max_tokens=4, temperature=0)
        assert out["text"] == want["choices"][0]["text"]
    ids = [loopback.post(daemon.url + "/tokenize", json={"model": MODEL, "prompt": p}).json()[
        "tokens"] for p in prompts]  # fmt: skip
    by_ids = generate(daemon, {"input_ids": ids, "sampling_params": greedy(4)})
    assert [o["text"] for o in by_ids] == [o["text"] for o in outs]
    two = generate(daemon, {"text": PROMPT, "sampling_params": {"n": 2, "max_new_tokens": 3,
                                                                "seed": 5}})  # fmt: skip
    assert isinstance(two, list) and len(two) == 2
    assert all(o["meta_info"]["completion_tokens"] == 3 for o in two)


def test_stream_accumulates_to_the_final_text(daemon: Daemon) -> None:
    final = generate(daemon, {"text": PROMPT, "sampling_params": greedy(12)})
    events = []
    body = {"text": PROMPT, "sampling_params": greedy(12), "stream": True}
    with loopback.stream("POST", daemon.url + "/generate", json=body, timeout=300) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        events = [line for line in resp.iter_lines() if line]
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(line.removeprefix("data: ")) for line in events[:-1]]
    texts = [c["text"] for c in chunks]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:], strict=False))  # cumulative
    assert texts[-1] == final["text"]
    assert [c["meta_info"]["finish_reason"] for c in chunks[:-1]] == [None] * (len(chunks) - 1)
    assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 12}
    assert chunks[-1]["meta_info"]["completion_tokens"] == 12


def test_finish_reasons_name_what_matched(daemon: Daemon) -> None:
    free = generate(daemon, {"text": PROMPT, "sampling_params": greedy(12)})
    words = free["text"].split()
    stop = words[1] if len(words) > 1 else words[0]
    out = generate(daemon, {"text": PROMPT, "sampling_params": greedy(12, stop=[stop])})
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert stop not in out["text"]
    lp = generate(daemon, {"text": PROMPT, "sampling_params": greedy(12),
                           "return_logprob": True})  # fmt: skip
    third = lp["meta_info"]["output_token_logprobs"][2][1]
    by_id = generate(
        daemon, {"text": PROMPT, "sampling_params": greedy(12, stop_token_ids=[third])}
    )
    assert by_id["meta_info"]["finish_reason"] == {"type": "stop", "matched": third}
    assert by_id["meta_info"]["completion_tokens"] <= 3
    eos = generate(daemon, {"text": "Say hi.", "sampling_params": greedy(300)})
    reason = eos["meta_info"]["finish_reason"]
    assert reason["type"] in {"stop", "length"}
    if reason["type"] == "stop":
        assert isinstance(reason["matched"], int)  # the end-of-sequence token's id


def test_logprobs_shapes_and_values_match_the_completions_route(daemon: Daemon) -> None:
    want = completion(daemon, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=2)
    out = generate(daemon, {"text": PROMPT, "sampling_params": greedy(5), "return_logprob": True,
                            "top_logprobs_num": 2, "logprob_start_len": 0})  # fmt: skip
    meta = out["meta_info"]
    output = meta["output_token_logprobs"]
    assert len(output) == 5 and all(t[2] is None for t in output)  # no text unless asked
    for (logprob, _, _), expected in zip(output, want["choices"][0]["logprobs"]["token_logprobs"],
                                         strict=True):  # fmt: skip
        assert math.isclose(logprob, expected, abs_tol=1e-4)
    tops = meta["output_top_logprobs"]
    assert len(tops) == 5 and all(len(t) == 2 and t[0][0] >= t[1][0] for t in tops)
    assert [t[0][1] for t in tops] == [t[1] for t in output]  # greedy: the top token
    inputs = meta["input_token_logprobs"]
    assert len(inputs) == meta["prompt_tokens"] and inputs[0][0] is None
    assert all(isinstance(t[0], float) and t[0] <= 0 for t in inputs[1:])
    assert meta["input_top_logprobs"][0] is None and len(meta["input_top_logprobs"][1]) == 2
    last = generate(daemon, {"text": PROMPT, "sampling_params": greedy(2), "return_logprob": True,
                             "return_text_in_logprobs": True})  # fmt: skip
    assert len(last["meta_info"]["input_token_logprobs"]) == 1  # default: the last prompt token
    assert "input_top_logprobs" not in last["meta_info"]
    texts = [t[2] for t in last["meta_info"]["output_token_logprobs"]]
    assert "".join(texts) == last["text"]


def test_regex_and_json_schema_are_honoured(daemon: Daemon) -> None:
    out = generate(daemon, {"text": "A number:", "sampling_params": greedy(12, regex=r"[0-9]{3}")})
    assert re.fullmatch(r"[0-9]{3}", out["text"]), out["text"]
    # bounded, and compact (llguidance's x-guidance, ignored by JSON Schema): left free, the
    # tiny random model writes digits and whitespace until max_new_tokens
    schema = {"type": "object", "properties": {"age": {"type": "integer", "minimum": 0,
                                                       "maximum": 150}},
              "required": ["age"], "additionalProperties": False,
              "x-guidance": {"whitespace_flexible": False}}  # fmt: skip
    out = generate(daemon, {"text": "JSON:", "sampling_params": greedy(
        40, json_schema=json.dumps(schema))})  # fmt: skip
    assert isinstance(json.loads(out["text"])["age"], int)
    assert out["meta_info"]["finish_reason"]["type"] == "stop"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"text": PROMPT, "lora_path": "x"}, "lora_path"),
        ({"text": PROMPT, "image_data": "x.png"}, "image_data"),
        ({"text": PROMPT, "return_hidden_states": True}, "return_hidden_states"),
        ({"text": PROMPT, "session_params": {"id": "s"}}, "session_params"),
        ({"text": PROMPT, "colour": 1}, "colour"),
        ({"text": PROMPT, "input_ids": [1, 2]}, "text"),
        ({}, "text"),
        (
            {"text": PROMPT, "sampling_params": {"min_new_tokens": 2}},
            "sampling_params.min_new_tokens",
        ),
        ({"text": PROMPT, "sampling_params": {"stop_regex": "x+"}}, "sampling_params.stop_regex"),
        ({"text": PROMPT, "sampling_params": {"top_k": 0}}, "sampling_params.top_k"),
        ({"text": PROMPT, "sampling_params": {"temperature": -1}}, "sampling_params.temperature"),
        ({"text": PROMPT, "sampling_params": {"tempreature": 1}}, "sampling_params.tempreature"),
        ({"text": PROMPT, "sampling_params": {"regex": "a", "ebnf": "b"}}, "sampling_params.ebnf"),
        ({"text": PROMPT, "sampling_params": {"json_schema": "{"}}, "sampling_params.json_schema"),
        ({"text": PROMPT, "sampling_params": {"regex": "("}}, "sampling_params.regex"),
        ({"text": PROMPT, "return_logprob": True, "logprob_start_len": 999}, "logprob_start_len"),
        ({"text": PROMPT, "top_logprobs_num": 21}, "top_logprobs_num"),
        ({"text": [PROMPT], "rid": "one"}, "rid"),
        ({"text": PROMPT, "model": 3}, "model"),
    ],
)
def test_every_refusal_is_a_400_naming_the_field(
    daemon: Daemon, body: dict[str, Any], param: str
) -> None:
    error = generate(daemon, body, status=400)["error"]
    assert error["param"] == param, error
    assert error["type"] == "invalid_request_error"


def test_unknown_model_is_a_404(daemon: Daemon) -> None:
    error = generate(daemon, {"text": PROMPT, "model": "nope"}, status=404)["error"]
    assert MODEL in error["message"]


def test_model_and_server_info(daemon: Daemon) -> None:
    info = loopback.get(daemon.url + "/get_model_info").json()
    assert info["model_path"] == info["tokenizer_path"] == MODEL
    assert info["is_generation"] is True and info["architectures"] == ["LlamaForCausalLM"]
    assert info["chat_template"] == "chatml"  # the tiny model's template writes ChatML turns
    server = loopback.get(daemon.url + "/get_server_info").json()
    assert server["served_models"] == [MODEL] and server["num_replicas"] == 1
    made = loopback.post(daemon.url + "/tokenize", json={"model": MODEL, "prompt": "x"}).json()
    assert server["context_length"] == made["max_model_len"]
    assert server["max_running_requests"] >= 1
    assert server["max_total_num_tokens"] % server["page_size"] == 0
    assert server["engine"] == "kunlun" and server["version"]
    same = loopback.get(daemon.url + "/get_server_info", params={"model": MODEL}).json()
    assert same["context_length"] == server["context_length"]
    assert loopback.get(daemon.url + "/get_model_info", params={"model": "x"}).status_code == 404


def flush_when_idle(daemon: Daemon) -> str:
    """POST /flush_cache until it succeeds (a request of an earlier test may still be ending:
    then it is refused); the answer's text."""
    deadline = time.monotonic() + 60
    while (flushed := loopback.post(daemon.url + "/flush_cache", timeout=60)).status_code != 200:
        assert flushed.status_code == 400 and time.monotonic() < deadline, flushed.text
        time.sleep(0.2)
    return flushed.text


def test_flush_cache_forgets_the_prefix_cache(daemon: Daemon) -> None:
    text = "Kunlun flush test. " * 12  # several KV blocks of prompt
    body = {"text": text, "sampling_params": greedy(1)}
    generate(daemon, body)
    assert generate(daemon, body)["meta_info"]["cached_tokens"] > 0
    assert flush_when_idle(daemon).startswith("Cache flushed")
    assert generate(daemon, body)["meta_info"]["cached_tokens"] == 0
    assert generate(daemon, body)["meta_info"]["cached_tokens"] > 0


def test_max_new_tokens_zero_runs_the_prompt_only(daemon: Daemon) -> None:
    out = generate(daemon, {"text": PROMPT, "sampling_params": {"max_new_tokens": 0}})
    assert out["text"] == ""
    assert out["meta_info"]["completion_tokens"] == 0
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    # RuntimeEndpoint's select(): prompt logprobs of several continuations, no output
    outs = generate(daemon, {"text": [PROMPT + " Paris", PROMPT + " Rome"],
                             "sampling_params": {"max_new_tokens": 0, "temperature": 0},
                             "return_logprob": True, "return_text_in_logprobs": True,
                             "logprob_start_len": 3})  # fmt: skip
    for o in outs:
        assert o["meta_info"]["output_token_logprobs"] == []
        assert len(o["meta_info"]["input_token_logprobs"]) == o["meta_info"]["prompt_tokens"] - 3


def test_validate_generate_row_passes(daemon: Daemon, tmp_path: Path) -> None:
    proc = daemon.cli("validate", "--endpoint", daemon.url, "--model", MODEL, "--only",
                      "api.generate", "--out", str(tmp_path), timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    cells = json.loads((tmp_path / "validation.json").read_text())["cells"][MODEL]
    assert cells["api.generate"]["status"] == "PASS", cells["api.generate"]
    assert cells["api.generate"]["figure"].startswith("8 tokens")


def test_the_body_runtime_endpoint_sends_is_accepted(daemon: Daemon) -> None:
    """SGLang's RuntimeEndpoint.generate sends every sampling field at its default."""
    params = {"skip_special_tokens": True, "spaces_between_special_tokens": True,
              "max_new_tokens": 6, "min_new_tokens": 0, "n": 1, "stop": [],
              "stop_token_ids": [], "stop_regex": [], "temperature": 0, "top_p": 1.0,
              "top_k": -1, "min_p": 0.0, "frequency_penalty": 0.0, "presence_penalty": 0.0,
              "ignore_eos": False, "regex": None, "json_schema": None}  # fmt: skip
    out = generate(daemon, {"text": PROMPT, "sampling_params": params})
    want = completion(daemon, prompt=PROMPT, max_tokens=6, temperature=0)
    assert out["text"] == want["choices"][0]["text"]


def stream_events(daemon: Daemon, body: dict[str, Any]) -> list[dict[str, Any]]:
    with loopback.stream("POST", daemon.url + "/generate", json={**body, "stream": True},
                      timeout=300) as resp:  # fmt: skip
        assert resp.status_code == 200
        lines = [line for line in resp.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]


def test_a_streamed_batch_tags_events_with_their_index(daemon: Daemon) -> None:
    body = {"text": [PROMPT, "Once upon a time"], "sampling_params": greedy(6),
            "return_logprob": True}  # fmt: skip
    whole = generate(daemon, body)
    events = stream_events(daemon, body)
    for index, answer in enumerate(whole):
        mine = [e for e in events if e["index"] == index]
        assert mine[-1]["text"] == answer["text"]
        assert mine[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 6}
        last_logprobs = mine[-1]["meta_info"]["output_token_logprobs"]
        assert [t[1] for t in last_logprobs] == [
            t[1] for t in answer["meta_info"]["output_token_logprobs"]
        ]


def test_flush_is_refused_while_a_request_runs(daemon: Daemon) -> None:
    # the workload's whole context: the tiny model is still writing when the flush comes
    body = {"text": "Tell me a long story.", "stream": True,
            "sampling_params": {"max_new_tokens": 1000, "ignore_eos": True}}  # fmt: skip
    with loopback.stream("POST", daemon.url + "/generate", json=body, timeout=300) as resp:
        lines = resp.iter_lines()
        assert next(line for line in lines if line).startswith("data: ")
        refused = loopback.post(daemon.url + "/flush_cache", timeout=60)
        assert refused.status_code == 400
        assert "running or waiting" in refused.json()["error"]["message"]
    flush_when_idle(daemon)  # the client left: its request is aborted soon


def test_sglang_front_end_programs_run_unchanged(daemon: Daemon) -> None:
    """SGLang's ``RuntimeEndpoint`` and ``@sgl.function`` programs (gen, streamed gen,
    run_batch, select, two gens in one state) against the daemon, in their own process."""
    out = run_sglang_program(daemon.url)
    assert out["model_path"] == MODEL
    want = generate(daemon, {"text": PROMPT, "sampling_params": greedy(6)})
    assert out["gen"] == want["text"] == out["streamed"] == out["batch"][0]
    italy = generate(daemon, {"text": "The capital of Italy is", "sampling_params": greedy(6)})
    assert out["batch"][1] == italy["text"] != out["gen"]  # Italy's answer, not France's
    meta = out["gen_meta"]
    assert meta["finish_reason"] == {"type": "length", "length": 6}
    assert (
        meta["completion_tokens"] == 6
        and meta["prompt_tokens"] == want["meta_info"]["prompt_tokens"]
    )
    # select: SGLang scores each choice with the prompt logprobs the daemon returns
    scores = out["select_meta"]["normalized_prompt_logprobs"]
    assert len(scores) == 3 and all(isinstance(x, float) and x < 0 for x in scores)
    assert out["select"] == [" Paris", " Rome", " Berlin"][scores.index(max(scores))]
    a, b = out["steps"]
    assert out["steps_text"] == f"Q: What is 2+2?\nA:{a}\nQ: What is 3+3?\nA:{b}"
    # a chat program, with the template /get_model_info names: the model's own turns (ChatML)
    assert out["chat_template"] == "chatml"
    question = "What is the capital of France?"
    assert out["chat_text"].startswith(f"<|im_start|>user\n{question}<|im_end|>\n"
                                       "<|im_start|>assistant\n")  # fmt: skip
    same = loopback.post(daemon.url + "/v1/chat/completions", timeout=120, json={
        "model": MODEL, "messages": [{"role": "user", "content": question}], "max_tokens": 8,
        "temperature": 0}).json()  # fmt: skip
    assert out["chat_answer"] == same["choices"][0]["message"]["content"]  # the same prompt
