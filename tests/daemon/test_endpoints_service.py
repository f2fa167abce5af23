"""Request-as-a-Service endpoints against a real daemon serving the tiny model: made with the
real ``kunlun-cli endpoint create`` from files, called over loopback with httpx, answers
validated with ``jsonschema``; bad bodies, bad files, unknown models and names refused with
errors naming what is wrong; listed and described (OpenAPI 3.1); deleted; kept across a
restart of the daemon."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest
from tests import loopback
from tests.daemons import TINY, Daemon, Profile, daemon_fixture, settled_request_log

INPUT = {
    "type": "object", "additionalProperties": False, "required": ["review", "items"],
    "properties": {
        "review": {"type": "string", "maxLength": 200},
        "items": {"type": "array", "maxItems": 5, "items": {
            "type": "object", "required": ["name", "price"],
            "properties": {"name": {"type": "string"},
                           "price": {"type": "number", "minimum": 0}}}}},
}  # fmt: skip
OUTPUT = {
    "type": "object", "additionalProperties": False, "required": ["sentiment", "stars"],
    "properties": {"sentiment": {"enum": ["positive", "negative"]},
                   "stars": {"type": "integer", "minimum": 1, "maximum": 5}},
    "x-guidance": {"whitespace_flexible": False},
}  # fmt: skip
"""The answer's schema. Its ``x-guidance`` option (read by llguidance, ignored by JSON Schema)
allows no whitespace between JSON tokens: the tiny random model, free to, pads its answer
with whitespace until ``max_tokens``; held to compact JSON it finishes in a few tokens."""
PROMPT = """Review of an order:
{{ input.review }}
{% for item in input.items %}
- {{ item.name }} at {{ item.price }}
{% endfor %}
Answer with JSON: the sentiment and 1 to 5 stars.
"""
BODY = {"review": "Great coffee, fast delivery.", "items": [{"name": "beans", "price": 12.5}]}


endpoints_daemon = daemon_fixture(Profile("endpoints-home", (TINY,)))
"""A daemon of its own (it is restarted) serving the tiny model."""


@pytest.fixture(scope="module")
def served(
    endpoints_daemon: Daemon, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Daemon, Path]:
    """The daemon, and the endpoint files."""
    files = tmp_path_factory.mktemp("endpoint-files")
    (files / "in.json").write_text(json.dumps(INPUT, indent=2))
    (files / "out.json").write_text(json.dumps(OUTPUT, indent=2))
    (files / "review.jinja").write_text(PROMPT)
    return endpoints_daemon, files


def create(d: Daemon, files: Path, name: str, *extra: str, **paths: str) -> Any:
    names = {"input_schema": "in.json", "output_schema": "out.json", "prompt": "review.jinja"}
    names.update(paths)
    return d.cli("endpoint", "create", name, "--model", "tiny",
                 "--input-schema", str(files / names["input_schema"]),
                 "--output-schema", str(files / names["output_schema"]),
                 "--prompt", str(files / names["prompt"]), *extra)  # fmt: skip


def call(d: Daemon, name: str, body: Any, **params: Any) -> httpx.Response:
    return loopback.post(f"{d.url}/v1/endpoints/{name}", json=body, params=params, timeout=300)


def assert_answers(d: Daemon, name: str) -> dict[str, Any]:
    resp = call(d, name, BODY, max_tokens=48)
    assert resp.status_code == 200, resp.text
    reply = resp.json()
    jsonschema.validate(reply["output"], OUTPUT)
    assert reply["endpoint"] == name and reply["model"] == "tiny"
    assert reply["finish_reason"] == "stop"
    usage = reply["usage"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"] > 0
    assert resp.headers["x-request-id"] and resp.headers["x-kunlun-device"]
    return dict(reply)


def test_an_endpoint_made_from_files_answers_valid_json(served: tuple[Daemon, Path]) -> None:
    d, files = served
    made = create(d, files, "review", "--description", "Rates a review", "--json")
    assert made.returncode == 0, made.stderr
    record = json.loads(made.stdout)
    assert record["input_schema"] == INPUT and record["output_schema"] == OUTPUT
    assert record["prompt"] == PROMPT and record["output_schema_compiled"] is True
    assert_answers(d, "review")
    # the same request through the gateway's chat route, as a client would send it
    log = [e for e in settled_request_log(d.home) if e["path"] == "/v1/endpoints/review"]
    assert log and log[-1]["status"] == 200 and log[-1]["model"] == "tiny"
    # the template saw every item (keys before dict methods: input.items is the field)
    shown = d.cli("endpoint", "show", "review")
    assert shown.returncode == 0 and "{% for item in input.items %}" in shown.stdout


def test_a_body_that_fails_the_input_schema_is_a_400_naming_its_path(
    served: tuple[Daemon, Path],
) -> None:
    d, files = served
    assert create(d, files, "review-bad", "--replace").returncode == 0
    items = [{"name": "a", "price": 1}, {"name": "b", "price": 2}, {"name": "c", "price": -3}]
    for body, param, words in (
        ({**BODY, "items": items}, "input.items.2.price", "minimum of 0"),
        ({**BODY, "items": [{"name": "a", "price": "free"}]}, "input.items.0.price", "number"),
        ({"items": []}, "input", '"review" is a required property'),
        ({**BODY, "extra": 1}, "input", "'extra' was unexpected"),
        ([1, 2], "input", 'not of type "object"'),
    ):
        resp = call(d, "review-bad", body)
        assert resp.status_code == 400, resp.text
        error = resp.json()["error"]
        assert error["param"] == param and words in error["message"], error
        assert error["type"] == "invalid_request_error"
    resp = loopback.post(f"{d.url}/v1/endpoints/review-bad", content=b"{not json",
                      headers={"content-type": "application/json"}, timeout=30)  # fmt: skip
    assert resp.status_code == 400 and "JSON" in resp.json()["error"]["message"]
    # a template that refuses a body it accepted: a 400 about the input, the reason given
    (files / "raise.jinja").write_text(
        '{% if input.review == "boom" %}{{ raise_exception("no booms here") }}{% endif %}x'
    )
    assert create(d, files, "review-raise", "--replace", prompt="raise.jinja").returncode == 0
    resp = call(d, "review-raise", {**BODY, "review": "boom"})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "input"
    assert "no booms here" in resp.json()["error"]["message"]
    resp = call(d, "review-bad", BODY, top_k=3)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "top_k"
    resp = call(d, "review-bad", BODY, max_tokens="many")
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "max_tokens"


def test_an_answer_cut_by_max_tokens_is_an_error_not_an_output(
    served: tuple[Daemon, Path],
) -> None:
    d, files = served
    assert create(d, files, "review-cut", "--replace").returncode == 0
    resp = call(d, "review-cut", BODY, max_tokens=2)
    assert resp.status_code == 502, resp.text
    error = resp.json()["error"]
    assert error["code"] == "endpoint_output_truncated" and "max_tokens" in error["message"]


def test_bad_files_names_and_models_are_refused_clearly(served: tuple[Daemon, Path]) -> None:
    d, files = served
    (files / "broken.json").write_text('{\n  "type": "object",\n  "properties": {,}\n}\n')
    (files / "nonsense.json").write_text(json.dumps({"type": "object", "properties": {
        "price": {"type": "money"}}}))  # fmt: skip
    (files / "outside.json").write_text(json.dumps({"$ref": "https://example.com/s.json"}))
    (files / "bad-regex.json").write_text(json.dumps({"type": "string", "pattern": "[[["}))
    (files / "bad.jinja").write_text("Hello\n{{ input.review }\n")
    # a regex Python's re takes (the metaschema's format check) but the linear-time one not
    (files / "regex.json").write_text(json.dumps({"type": "string", "pattern": "(?=x)x"}))
    for paths, words in (
        ({"input_schema": "broken.json"}, ["broken.json:3", "input_schema", "not valid JSON"]),
        ({"output_schema": "nonsense.json"},
         ["nonsense.json", "output_schema.properties.price.type", "'money'"]),
        ({"input_schema": "outside.json"}, ["outside.json", "only local references"]),
        ({"prompt": "bad.jinja"}, ["bad.jinja:2", "not a valid jinja2 template"]),
        ({"output_schema": "bad-regex.json"}, ["bad-regex.json", "output_schema.pattern"]),
    ):  # fmt: skip
        proc = create(d, files, "broken", **paths)
        assert proc.returncode != 0
        assert all(w in proc.stderr for w in words), proc.stderr
    proc = create(d, files, "broken", output_schema="regex.json")  # the linear-time matcher
    assert proc.returncode == 2 and "output_schema.pattern" in proc.stderr
    assert "linear-time" in proc.stderr and "look-around" in proc.stderr
    proc = d.cli("endpoint", "create", "broken", "--model", "no-such-model",
                 "--input-schema", str(files / "in.json"), "--output-schema",
                 str(files / "out.json"), "--prompt", str(files / "review.jinja"))  # fmt: skip
    assert proc.returncode == 2 and "'no-such-model' is not a model" in proc.stderr
    assert "tiny" in proc.stderr  # the known ones are listed
    proc = create(d, files, "no/slash")
    assert proc.returncode != 0 and "name" in proc.stderr
    assert all(e["name"] != "broken" for e in d.get("/v1/endpoints").json()["data"])
    # the admin API itself names the field in the OpenAI error shape
    resp = loopback.post(f"{d.url}/api/v1/endpoints", json={"name": "x", "model": "tiny",
                      "input_schema": {}, "output_schema": {"type": 7}, "prompt": "p",
                      "colour": "red"}, timeout=30)  # fmt: skip
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "colour"
    # a taken name: 409 unless --replace
    assert create(d, files, "taken").returncode == 0
    again = create(d, files, "taken")
    assert again.returncode == 2 and "409" in again.stderr and "--replace" in again.stderr
    assert create(d, files, "taken", "--replace").returncode == 0


def test_endpoints_are_listed_with_an_openapi_document_each(served: tuple[Daemon, Path]) -> None:
    d, files = served
    assert create(d, files, "review-doc", "--replace", "--description", "Rates").returncode == 0
    listed = d.get("/v1/endpoints").json()
    assert listed["object"] == "list"
    entry = next(e for e in listed["data"] if e["name"] == "review-doc")
    assert entry["model"] == "tiny" and entry["description"] == "Rates"
    assert entry["url"] == f"{d.url}/v1/endpoints/review-doc" and entry["created"] > 0
    doc = loopback.get(entry["openapi"], timeout=30).json()
    assert doc["openapi"].startswith("3.1") and doc["info"]["title"] and doc["info"]["version"]
    assert doc["servers"] == [{"url": d.url}]
    assert list(doc["paths"]) == ["/v1/endpoints/review-doc"]
    post = doc["paths"]["/v1/endpoints/review-doc"]["post"]
    assert {p["name"] for p in post["parameters"]} == {"max_tokens", "temperature", "seed"}
    assert set(post["responses"]) >= {"200", "400", "404", "502"}
    schemas = doc["components"]["schemas"]
    assert schemas["Input"] == INPUT and schemas["Output"] == OUTPUT

    def check(value: Any, where: dict[str, Any]) -> None:
        """``value`` against a schema of the document, its $refs resolved in it."""
        ref = where["content"]["application/json"]["schema"]["$ref"]
        jsonschema.validate(value, {"$ref": ref, "components": doc["components"]})

    check(BODY, post["requestBody"])
    with pytest.raises(jsonschema.ValidationError):
        check({"review": 5}, post["requestBody"])
    check(assert_answers(d, "review-doc"), post["responses"]["200"])
    check(call(d, "review-doc", {}).json(), post["responses"]["400"])


def test_unknown_and_deleted_endpoints_are_404s(served: tuple[Daemon, Path]) -> None:
    d, files = served
    resp = call(d, "never-made", BODY)
    assert resp.status_code == 404
    assert resp.json()["error"]["code"] == "endpoint_not_found"
    assert "never-made" in resp.json()["error"]["message"]
    assert d.get("/v1/endpoints/never-made/openapi.json").status_code == 404
    assert create(d, files, "short-lived", "--replace").returncode == 0
    listed = d.cli("endpoint", "list")
    assert listed.returncode == 0 and "short-lived" in listed.stdout
    gone = d.cli("endpoint", "delete", "short-lived")
    assert gone.returncode == 0, gone.stderr
    assert call(d, "short-lived", BODY).status_code == 404
    again = d.cli("endpoint", "delete", "short-lived")
    assert again.returncode == 2 and "404" in again.stderr
    assert "short-lived" not in d.cli("endpoint", "list").stdout


def test_endpoints_survive_a_restart_of_the_daemon(served: tuple[Daemon, Path]) -> None:
    d, files = served
    assert create(d, files, "kept", "--replace").returncode == 0
    before = d.get("/api/v1/endpoints/kept").json()
    assert d.stop() == 0
    d.start()  # the same home: its workload is resumed
    assert d.get("/api/v1/endpoints/kept").json() == before
    assert_answers(d, "kept")


def test_endpoint_calls_take_inference_keys_and_making_them_admin_keys(
    served: tuple[Daemon, Path],
) -> None:
    """Last in the module: once keys exist every call needs one."""
    d, files = served
    assert create(d, files, "keyed", "--replace").returncode == 0
    made = loopback.post(f"{d.url}/api/v1/apikeys", json={"name": "ops", "scope": "admin"},
                      timeout=30)  # fmt: skip
    admin = made.json()["key"]
    inference = loopback.post(f"{d.url}/api/v1/apikeys", json={"name": "app"}, timeout=30,
                           headers={"Authorization": f"Bearer {admin}"}).json()["key"]  # fmt: skip
    assert call(d, "keyed", BODY).status_code == 401
    as_app = {"Authorization": f"Bearer {inference}"}
    resp = loopback.post(f"{d.url}/v1/endpoints/keyed", json=BODY, headers=as_app, timeout=300)
    assert resp.status_code == 200, resp.text
    jsonschema.validate(resp.json()["output"], OUTPUT)
    assert loopback.get(f"{d.url}/v1/endpoints", headers=as_app, timeout=30).status_code == 200
    refused = loopback.delete(f"{d.url}/api/v1/endpoints/keyed", headers=as_app, timeout=30)
    assert refused.status_code == 403 and "admin" in refused.json()["error"]["message"]
    listed = d.cli("endpoint", "list", "--json", key=admin)
    assert listed.returncode == 0 and "keyed" in listed.stdout
    # a key's tokens per minute are charged with the call's usage, as for a chat request
    thin = loopback.post(f"{d.url}/api/v1/apikeys", json={"name": "thin", "tpm": 10}, timeout=30,
                      headers={"Authorization": f"Bearer {admin}"}).json()["key"]  # fmt: skip
    as_thin = {"Authorization": f"Bearer {thin}"}
    first = loopback.post(f"{d.url}/v1/endpoints/keyed", json=BODY, headers=as_thin, timeout=300)
    assert first.status_code == 200 and first.json()["usage"]["total_tokens"] > 10
    second = loopback.post(f"{d.url}/v1/endpoints/keyed", json=BODY, headers=as_thin, timeout=300)
    assert second.status_code == 429, second.text
    assert int(second.headers["retry-after"]) >= 1
    assert "10 tokens per minute" in second.json()["error"]["message"]
