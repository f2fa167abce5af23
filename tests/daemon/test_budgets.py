"""Inputs that ask for unbounded work get a budget (issue 32, bugs 1-4 and 7), through a real
daemon serving the tiny model, with an admin key and an inference key as a hostile client
would hold. Each attack is refused with a 400 naming the input and its budget, fast, and a
normal chat request sent while the attack runs is answered within 5 s of its usual time.
"""

from __future__ import annotations

import json
import os
import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tests import loopback
from tests.daemons import TINY, Daemon, Profile, assert_unhurt, daemon_fixture, refused

from kunlun.budgets import BUDGETS, limit

budget_daemon = daemon_fixture(
    Profile("budgets-home", (TINY,), keys=(("ops", "admin"), ("app", "inference")))
)

CHAT = {"model": "tiny", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}


def post(d: Daemon, path: str, body: Any, key: str = "app", timeout: float = 120) -> httpx.Response:
    return loopback.post(d.url + path, content=json.dumps(body), timeout=timeout,  # NaN: as JS
                      headers={"Authorization": f"Bearer {d.keys[key]}",
                               "Content-Type": "application/json"})  # fmt: skip


def chat_seconds(d: Daemon) -> float:
    started = time.monotonic()
    reply = post(d, "/v1/chat/completions", CHAT)
    assert reply.status_code == 200, reply.text
    return time.monotonic() - started


def assert_chat_unhurt(d: Daemon, attack: Callable[[], httpx.Response]) -> list[int]:
    """A normal chat, sent while ``attack`` runs, takes at most 5 s more than usual; the
    attack's statuses."""
    return assert_unhurt(d, lambda: chat_seconds(d), attack)


def assert_over_budget(reply: httpx.Response, param: str, *words: str) -> dict[str, Any]:
    assert reply.status_code == 400, reply.text
    error: dict[str, Any] = reply.json()["error"]
    assert error["param"] == param, error
    assert error["code"] == "request.over_budget", error
    assert all(w in error["message"] for w in words), error
    return error


# ---- bug 1: a user's regex in an endpoint's schema ----

EVIL = "^(a+)+$"
"""Exponential on Python's backtracking ``re`` for ``a...ab`` (28 characters took 44 s)."""


@pytest.fixture(scope="module")
def evil_endpoint(budget_daemon: Daemon) -> Daemon:
    d = budget_daemon
    schema = {"type": "object", "required": ["s"], "properties": {
        "s": {"type": "string", "pattern": EVIL}}}  # fmt: skip
    made = post(d, "/api/v1/endpoints", {
        "name": "evil", "model": "tiny", "prompt": "{{ input.s }}", "input_schema": schema,
        "output_schema": {"type": "object", "properties": {"t": {"type": "string",
                                                                  "pattern": EVIL}}}},
        key="ops")  # fmt: skip
    assert made.status_code == 200, made.text
    return d


def test_a_backtracking_pattern_in_an_endpoint_schema_is_matched_in_linear_time(
    evil_endpoint: Daemon,
) -> None:
    d = evil_endpoint
    for s in ("a" * 28 + "b", "a" * 100_000 + "b"):
        started = time.monotonic()
        reply = post(d, "/v1/endpoints/evil", {"s": s})
        assert reply.status_code == 400, reply.text
        error = reply.json()["error"]
        assert error["param"] == "input.s" and "does not match" in error["message"]
        assert len(error["message"]) <= 300  # the value is quoted shortened
        print(f"{len(s):,} characters refused in {time.monotonic() - started:.3f} s")
    statuses = assert_chat_unhurt(d, lambda: post(d, "/v1/endpoints/evil", {"s": "a" * 28 + "b"}))
    assert set(statuses) == {400}


def test_patterns_a_linear_matcher_cannot_take_are_refused_at_definition(
    budget_daemon: Daemon,
) -> None:
    d = budget_daemon
    for pattern, words in (("(?=a)a", "look-around"), ("(a)\\1", "back-references"),
                           ("(\\w{1000}){100}", "compiled")):  # fmt: skip
        reply = post(d, "/api/v1/endpoints", {
            "name": "refused", "model": "tiny", "prompt": "x", "input_schema": {},
            "output_schema": {"properties": {"t": {"type": "string", "pattern": pattern}}}},
            key="ops")  # fmt: skip
        assert reply.status_code == 400, reply.text
        error = reply.json()["error"]
        assert error["param"] == "output_schema.properties.t.pattern", error
        assert words in error["message"], error
    big = {"enum": ["x" * 1000] * (int(limit("schema_bytes")) // 1000 + 1)}
    reply = post(d, "/api/v1/endpoints", {"name": "big", "model": "tiny", "prompt": "x",
                                          "input_schema": big, "output_schema": {}}, key="ops")  # fmt: skip
    assert_over_budget(reply, "input_schema", "over the budget", "KUNLUN_BUDGET_SCHEMA_BYTES")


# ---- bug 2: guided_choice of 100,000 strings ----


def test_a_hundred_thousand_choices_are_refused_naming_the_budget(budget_daemon: Daemon) -> None:
    d = budget_daemon
    choices = [f"option {i}" for i in range(100_000)]

    def attack() -> httpx.Response:
        return post(d, "/v1/chat/completions", {**CHAT, "guided_choice": choices})

    assert_over_budget(
        attack(), "guided_choice", "100,000 strings", "1,024", "KUNLUN_BUDGET_CHOICES"
    )
    assert set(assert_chat_unhurt(d, attack)) == {400}
    within = post(d, "/v1/chat/completions",
                  {**CHAT, "guided_choice": choices[: int(limit("choices"))]})  # fmt: skip
    assert within.status_code == 200, within.text
    assert within.json()["choices"][0]["message"]["content"] in choices


# ---- bug 3: a constraint the matcher gives up on ----


@pytest.mark.parametrize("stream", [False, True])
def test_a_constraint_the_grammar_engine_gives_up_on_fails_and_never_ends_as_stop(
    budget_daemon: Daemon, stream: bool
) -> None:
    d = budget_daemon
    body = {**CHAT, "max_tokens": 16, "guided_regex": "a{1000000}", "stream": stream}
    reply = post(d, "/v1/chat/completions", body)
    if not stream:
        error = assert_over_budget(reply, "guided_regex", "grammar engine")
        assert "stop" not in json.dumps(reply.json().get("choices", []))
        print(error["message"])
        return
    assert reply.status_code == 200  # the stream began before the engine gave up
    events = [line[6:] for line in reply.text.splitlines() if line.startswith("data: ")]
    finishes = [c.get("finish_reason") for e in events if e != "[DONE]"
                for c in json.loads(e).get("choices", [])]  # fmt: skip
    assert "stop" not in finishes, events
    errors = [json.loads(e)["error"] for e in events if e != "[DONE]" and "error" in json.loads(e)]
    assert errors and "grammar engine" in errors[0]["message"], events


# ---- bug 4: JSON inside a string field ----


def test_json_text_inside_a_field_keeps_the_nesting_limit(budget_daemon: Daemon) -> None:
    d = budget_daemon
    deep = '{"type": "object", "properties": {"a": ' * 1000 + "{}" + "}}" * 1000
    reply = post(d, "/v1/chat/completions", {**CHAT, "guided_json": deep})
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == "guided_json" and "nested more than" in error["message"], error
    brackets = "[" * 5000 + "]" * 5000
    reply = post(d, "/generate", {"text": "hi", "sampling_params": {
        "max_new_tokens": 4, "json_schema": brackets}})  # fmt: skip
    assert reply.status_code == 400, reply.text
    body = reply.text
    assert "RecursionError" not in body and "nested more than" in body, body
    assert "sampling_params.json_schema" in body, body


# ---- bug 7: /detokenize of a million ids ----


def test_detokenize_counts_its_ids_against_a_budget(budget_daemon: Daemon) -> None:
    d = budget_daemon
    million = {"model": "tiny", "tokens": [5] * 1_000_000}

    def attack() -> httpx.Response:
        return post(d, "/detokenize", million)

    started = time.monotonic()
    assert_over_budget(attack(), "tokens", "1,000,000 token ids", "65,536")
    print(f"1M ids refused in {time.monotonic() - started:.2f} s")
    assert set(assert_chat_unhurt(d, attack)) == {400}
    ok = post(d, "/detokenize", {"model": "tiny", "tokens": [5] * 1000})
    assert ok.status_code == 200 and ok.json()["prompt"], ok.text


# ---- the budgets themselves ----


@pytest.mark.parametrize(
    ("variable", "value"), [("KUNLUN_BUDGET_CHOICES", "many"), ("KUNLUN_UI_SAMPLE_S", "often")]
)
def test_a_bad_budget_variable_stops_the_start_naming_it(
    tmp_path: Any, variable: str, value: str
) -> None:
    proc = refused(tmp_path / "home", env={variable: value})
    assert proc.returncode != 0
    assert variable in proc.stderr and f"'{value}'" in proc.stderr, proc.stderr
    assert set(BUDGETS) >= {"choices", "schema_bytes", "regex_program_bytes", "detokenize_ids"}


# ---- weak points: values that parse but mean nothing ----


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"text": "hi", "sampling_params": {"temperature": float("inf")}},
         "temperature", "temperature"),
        ({"text": "hi", "sampling_params": {"max_new_tokens": 2, "stop_token_ids": [10**6]}},
         "stop_token_ids.0", "not an id of this model"),
        ({"text": ["hi", "ho"], "rid": ["same", "same"], "sampling_params": {"max_new_tokens": 2}},
         "rid", "given twice"),
    ],
)  # fmt: skip
def test_generate_refuses_values_that_mean_nothing(
    budget_daemon: Daemon, body: dict[str, Any], param: str, words: str
) -> None:
    reply = post(budget_daemon, "/generate", body)
    assert reply.status_code == 400, reply.text
    assert words in reply.text and param in reply.text, reply.text


# ---- close the class: user programs, fuzzed ----

PROGRAM_EXAMPLES = 8 * int(os.environ.get("KUNLUN_FUZZ_EXAMPLES", "6"))
"""Generated programs per run (48 in CI; ``KUNLUN_FUZZ_EXAMPLES=25`` for a longer run)."""
ANSWER_BOUND_S = 30.0
"""The longest any one of them may take to be answered: the 5 s program budget, a few
tokens of generation, and room for a loaded machine."""

ATOMS = st.sampled_from(["a", "b", "[a-z]", "\\d", ".", "\\w", "(a|b)", "x?", "[^\\n]"])


def _quantified(inner: st.SearchStrategy[str]) -> st.SearchStrategy[str]:
    counts = st.sampled_from(["*", "+", "?", "{2}", "{0,40}", "{1000}", "{1000000}", "{3,}"])
    return st.tuples(inner, counts).map(lambda p: f"({p[0]}){p[1]}")


REGEXES = st.recursive(
    ATOMS,
    lambda inner: (
        _quantified(inner)
        | st.lists(inner, min_size=2, max_size=3).map("".join)
        | st.lists(inner, min_size=2, max_size=3).map(lambda xs: "(" + "|".join(xs) + ")")
    ),
    max_leaves=6,
)
SCHEMAS = st.recursive(
    st.builds(lambda p, n: {"type": "string", "pattern": p, "maxLength": n}, REGEXES,
              st.integers(0, 10**6))
    | st.just({"type": "integer", "minimum": 0, "maximum": 10**12})
    | st.lists(st.text(max_size=8), min_size=1, max_size=50).map(lambda xs: {"enum": xs}),
    lambda inner: st.dictionaries(st.text("abcxyz", min_size=1, max_size=4), inner,
                                  min_size=1, max_size=3).map(
        lambda props: {"type": "object", "properties": props, "required": sorted(props)})
    | inner.map(lambda s: {"type": "array", "items": s, "maxItems": 3}),
    max_leaves=5,
)  # fmt: skip
PROGRAMS = st.one_of(
    REGEXES.map(lambda r: ("/v1/chat/completions", {**CHAT, "guided_regex": r})),
    SCHEMAS.map(lambda s: ("/v1/chat/completions", {**CHAT, "guided_json": s})),
    SCHEMAS.map(lambda s: ("/v1/chat/completions", {**CHAT, "guided_json": json.dumps(s)})),
    st.sampled_from([1, 7, 1024, 1025, 3000]).flatmap(
        lambda n: st.lists(st.text(min_size=1, max_size=30), min_size=n, max_size=n)).map(
        lambda c: ("/v1/chat/completions", {**CHAT, "guided_choice": c})),
    REGEXES.map(lambda r: ("/v1/chat/completions",
                           {**CHAT, "guided_grammar": f"start: item+\nitem: /{r}/ \" \"\n"})),
    SCHEMAS.map(lambda s: ("/v1/chat/completions", {**CHAT, "tool_choice": "required", "tools": [
        {"type": "function", "function": {"name": "f", "parameters": s}}]})),
    st.tuples(SCHEMAS, SCHEMAS).map(lambda p: ("/api/v1/endpoints?replace=true", {
        "name": "fuzzed", "model": "tiny", "prompt": "{{ input }}", "input_schema": p[0],
        "output_schema": p[1]})),
    REGEXES.map(lambda r: ("/generate", {"text": "hi", "sampling_params": {
        "max_new_tokens": 4, "regex": r}})),
)  # fmt: skip


def test_user_programs_get_no_server_error_no_hang_and_hurt_no_one(budget_daemon: Daemon) -> None:
    """Regexes, schemas (as objects and as text), choices, grammars, tools, endpoint
    definitions and SGLang's regex, generated by hypothesis with hostile quantifiers and
    sizes: each is answered below 500 within ANSWER_BOUND_S, and a chat sent all the while
    is answered within 5 s of its usual time."""
    d = budget_daemon
    seen: dict[int, int] = {}
    slowest = 0.0

    @settings(max_examples=PROGRAM_EXAMPLES, deadline=None, derandomize=True,
              suppress_health_check=list(HealthCheck), database=None)  # fmt: skip
    @given(PROGRAMS)
    def one(case: tuple[str, dict[str, Any]]) -> None:
        nonlocal slowest
        path, body = case
        key = "ops" if path.startswith("/api/") else "app"
        started = time.monotonic()
        reply = post(d, path, body, key=key, timeout=ANSWER_BOUND_S * 2)
        took = time.monotonic() - started
        slowest = max(slowest, took)
        seen[reply.status_code] = seen.get(reply.status_code, 0) + 1
        assert reply.status_code < 500, (path, json.dumps(body)[:300], reply.text[:500])
        assert took <= ANSWER_BOUND_S, (path, json.dumps(body)[:300], took)
        if path.startswith("/api/v1/endpoints") and reply.status_code == 200:
            called = post(d, "/v1/endpoints/fuzzed", {"a": "x"}, timeout=ANSWER_BOUND_S * 2)
            assert called.status_code < 500 or called.status_code == 502, called.text[:500]

    usual = statistics.median(chat_seconds(d) for _ in range(3))
    raised: list[BaseException] = []

    def run() -> None:
        try:
            one()
        except BaseException as exc:  # noqa: BLE001 - handed to the test's thread below
            raised.append(exc)

    fuzzing = threading.Thread(target=run)
    fuzzing.start()
    during = [chat_seconds(d)]
    while fuzzing.is_alive():
        during.append(chat_seconds(d))
    fuzzing.join()
    if raised:
        raise raised[0]
    print(f"programs: statuses {dict(sorted(seen.items()))}, slowest {slowest:.2f} s; chat "
          f"usual {usual:.2f} s, at most {max(during):.2f} s over {len(during)} meanwhile")  # fmt: skip
    assert sum(seen.values()) == PROGRAM_EXAMPLES  # every case ran (none raised in the thread)
    assert max(during) <= usual + 5
