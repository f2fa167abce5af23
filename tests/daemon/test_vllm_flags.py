"""vLLM's ``--chat-template`` and ``--gpu-memory-utilization`` on ``kunlun-platform --model``,
and as the workload spec's ``chat_template`` and ``memory_utilization``: a real daemon serves
the tiny model with a template of its own (chat, ``/tokenize`` and tool calls render with it)
and plans it with the fraction given; a bad template is refused at submit, naming the field
and the line. (Flags refused before the daemon serves: ``test_serve_model_flag.py``.)"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import openai
from tests import loopback
from tests.daemons import Daemon, Profile, daemon_fixture

from kunlun.engine.tokenizer import Tokenizer

MARKER = "[[house-template]]"
TEMPLATE = (
    "{% for m in messages %}<|im_start|>" + MARKER + " {{ m.role }}: {{ m.content }}<|im_end|>\n"
    "{% endfor %}{% if tools %}<|im_start|>tools:{% for t in tools %} {{ t.function.name }}"
    "{% endfor %}<|im_end|>\n{% endif %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% endif %}"
)
"""A template that marks every message, and renders the request's tools itself."""
FRACTION = 0.7
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}  # fmt: skip
HI = [{"role": "user", "content": "Hi there"}]


served = daemon_fixture(Profile(
    "vllm-flags-home",
    args=("--model", "{tiny}", "--served-model-name", "tiny", "--chat-template",
          "{home}/house.jinja", "--gpu-memory-utilization", str(FRACTION), "--max-model-len",
          "256", "--max-num-seqs", "2"),
    files=(("house.jinja", TEMPLATE),), ready=True,
))  # fmt: skip
"""The tiny model served by ``--model`` with vLLM's flags (a chat template of the house)."""


def tokens_of(model_dir: Path, template: str | None, **variables: Any) -> list[int]:
    """The prompt tokens of :data:`HI` through ``template`` (None: the model's own)."""
    local = Tokenizer(model_dir)
    if template is not None:
        local.chat_template = template
    text = local.apply_chat_template(HI, add_generation_prompt=True, **variables)
    return local.encode(text, add_special_tokens=False)


def post(daemon: Daemon, path: str, body: dict[str, Any], **params: Any) -> httpx.Response:
    return loopback.post(daemon.url + path, json=body, params=params, timeout=120)


def test_chat_and_tokenize_render_with_the_template_given(served: Daemon, tiny_model: Path) -> None:
    ours, models = tokens_of(tiny_model, TEMPLATE), tokens_of(tiny_model, None)
    assert ours != models
    made = post(served, "/tokenize", {"model": "tiny", "messages": HI})
    assert made.status_code == 200, made.text
    assert made.json()["tokens"] == ours
    back = post(served, "/detokenize", {"model": "tiny", "tokens": ours}).json()["prompt"]
    assert f"{MARKER} user: Hi there" in back
    client = openai.OpenAI(base_url=served.url + "/v1", api_key="x", max_retries=0)
    reply = client.chat.completions.create(model="tiny", messages=HI, max_tokens=2)  # type: ignore[arg-type]
    assert reply.usage is not None and reply.usage.prompt_tokens == len(ours)


def test_tool_calls_see_the_template_given(served: Daemon, tiny_model: Path) -> None:
    """The template reads ``tools``: the worker passes the request's tools to it (rather than
    writing them into a system message for a template that does not)."""
    client = openai.OpenAI(base_url=served.url + "/v1", api_key="x", max_retries=0)
    reply = client.chat.completions.create(
        model="tiny",
        messages=HI,
        tools=[WEATHER],
        max_tokens=2,  # type: ignore[arg-type,list-item]
    )
    expected = tokens_of(tiny_model, TEMPLATE, tools=[WEATHER])
    assert reply.usage is not None and reply.usage.prompt_tokens == len(expected)
    assert len(expected) > len(tokens_of(tiny_model, TEMPLATE))


def test_the_workload_shows_the_template_and_plans_with_the_fraction(served: Daemon) -> None:
    (row,) = served.get("/api/v1/workloads").json()  # as `workload list --json` prints it
    described = served.get(f"/api/v1/workloads/{row['workload_id']}").json()
    assert described["spec"]["chat_template"] == TEMPLATE
    assert described["spec"]["memory_utilization"] == FRACTION
    plan = described["placement"]["plan"]
    assert plan["memory_utilization"] == FRACTION and plan["memory"]["utilization"] == FRACTION
    assert plan["memory"]["usable_mb"] <= plan["memory"]["device_memory_mb"] * FRACTION
    text = served.cli("workload", "describe", row["workload_id"])
    assert text.returncode == 0 and f"memory_utilization {FRACTION:g}" in text.stdout, text.stdout


def test_a_spec_file_sets_both_and_a_bad_template_is_refused_with_its_line(
    served: Daemon, tiny_model: Path
) -> None:
    spec = served.home / "spec.yaml"
    spec.write_text(
        f"model: {tiny_model}\nname: other\nmax_model_len: 256\ngpu_memory_utilization: 0.5\n"
        "chat_template: |\n  {% for m in messages %}{{ m.content }}{% endfor %}\n"
    )
    dry = served.cli("workload", "submit", "--file", str(spec), "--dry-run", "--json")
    assert dry.returncode == 0, dry.stderr
    plan = json.loads(dry.stdout)["placement"]["plan"]
    assert plan["memory_utilization"] == 0.5 and plan["memory"]["utilization"] == 0.5
    bad = "{% for m in messages %}\n{{ m.content }\n{% endfor %}"
    refused = post(served, "/api/v1/workloads", {"model": str(tiny_model), "chat_template": bad},
                   dry_run=True)  # fmt: skip
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert error["param"] == "chat_template"
    assert "chat_template: line 2" in error["message"], error
    too_much = post(served, "/api/v1/workloads",
                    {"model": str(tiny_model), "memory_utilization": 1.5}, dry_run=True)  # fmt: skip
    assert too_much.status_code == 400 and too_much.json()["error"]["param"] == "memory_utilization"
