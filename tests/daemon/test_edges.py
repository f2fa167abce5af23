"""Bad input at the daemon's edges, on a real daemon with real clients.

Text UTF-8 cannot hold (lone surrogates) and JSON nested past the limit are 400s in the
OpenAI error shape naming the field or the limit: on the inference routes, in a batch input
file (line and field) and in the admin API; the request log keeps writing after such a
request. Fields the server does not implement, and unknown ones, are 400s naming them;
sequences per request (prompts x n) are capped; a key given in full to ``apikey revoke`` is
never echoed. Clients that leave while queued or mid-stream are counted and logged as 499.
"""

from __future__ import annotations

import json
import re
import socket
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from tests import loopback
from tests.daemons import TINY, Daemon, Profile, daemon_fixture, settled_request_log

from kunlun.json_text import MAX_DEPTH

SURROGATE = '"\\ud800"'
"""A lone surrogate as JSON text (Python's json decodes it; UTF-8 cannot encode it)."""


def post_raw(daemon: Daemon, path: str, body: str, **headers: str) -> httpx.Response:
    return loopback.post(
        daemon.url + path,
        content=body.encode(),
        headers={"content-type": "application/json", **headers},
        timeout=60,
    )


def assert_error(resp: httpx.Response, status: int, param: str | None, *words: str) -> str:
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param, error
    for word in words:
        assert word in error["message"], error
    return str(error["message"])


def wait_until(check: Any, what: str, timeout: float = 120) -> Any:
    deadline = time.monotonic() + timeout
    while not (result := check()):
        assert time.monotonic() < deadline, f"not within {timeout}s: {what}"
        time.sleep(0.2)
    return result


def logged(home: Path, request_id: str) -> dict[str, Any] | None:
    path = home / "logs" / "requests.jsonl"
    if not path.exists():
        return None
    for line in path.read_text().splitlines():
        entry = json.loads(line)
        if entry["request_id"] == request_id:
            return dict(entry)
    return None


@pytest.fixture(scope="module")
def bare(bare_daemon: Daemon) -> Daemon:
    """A daemon with no model and no key, for the admin API's and batch upload's checks."""
    return bare_daemon


# ---- lone surrogates ----


def test_lone_surrogates_are_refused_naming_the_field_and_the_log_goes_on(
    tiny_daemon: Daemon,
) -> None:
    daemon = tiny_daemon
    resp = post_raw(daemon, "/v1/completions", f'{{"model": {SURROGATE}, "prompt": "x"}}')
    assert_error(resp, 400, "model", "not valid Unicode")
    chat = (
        '{"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}, '
        f'{{"role": "user", "content": [{{"type": "text", "text": {SURROGATE}}}]}}]}}'
    )
    resp = post_raw(daemon, "/v1/chat/completions", chat)
    assert_error(resp, 400, "messages.1.content.0.text", "not valid Unicode")
    # surrogate pairs (an escaped emoji) are valid text
    emoji = '{"model": "tiny", "max_tokens": 2, "prompt": "\\ud83d\\ude00"}'
    assert post_raw(daemon, "/v1/completions", emoji).status_code == 200
    # the writer survived the refused requests: a later request reaches the file
    request_id = f"after-surrogate-{uuid.uuid4().hex[:8]}"
    good = post_raw(daemon, "/v1/completions", '{"model": "tiny", "prompt": "x", '
                    '"max_tokens": 1}', **{"x-request-id": request_id})  # fmt: skip
    assert good.status_code == 200, good.text
    entry = wait_until(lambda: logged(daemon.home, request_id), "the request logged")
    assert entry["status"] == 200
    entries = settled_request_log(daemon.home)
    assert any(e["status"] == 400 and e["model"] is None for e in entries)


def test_admin_bodies_with_lone_surrogates_are_400_naming_the_field(bare: Daemon) -> None:
    resp = post_raw(bare, "/api/v1/apikeys", f'{{"name": {SURROGATE}}}')
    assert_error(resp, 400, "name", "not valid Unicode")
    assert bare.get("/api/v1/apikeys").json() == []  # no key was made (auth stays off)
    resp = post_raw(bare, "/api/v1/models/import-gguf", f'{{"path": "/tmp/{SURROGATE[1:]}}}')
    assert_error(resp, 400, "path", "not valid Unicode")
    assert bare.get("/healthz").status_code == 200


# ---- deep nesting ----


def test_deep_json_is_400_naming_the_limit_everywhere(tiny_daemon: Daemon, bare: Daemon) -> None:
    daemon = tiny_daemon
    deep = "[" * 1000 + "]" * 1000
    for path in ("/v1/completions", "/v1/chat/completions"):
        resp = post_raw(daemon, path, f'{{"model": "tiny", "prompt": {deep}}}')
        assert_error(resp, 400, None, f"at most {MAX_DEPTH} levels")
    unclosed = post_raw(daemon, "/v1/completions", '{"model": "tiny", "prompt": ' + "[" * 5000)
    assert_error(unclosed, 400, None, f"at most {MAX_DEPTH} levels")
    for path in ("/api/v1/workloads", "/api/v1/apikeys", "/v1/batches"):
        resp = post_raw(bare, path, f'{{"name": {deep}}}')
        assert_error(resp, 400, None, f"at most {MAX_DEPTH} levels")
    # as deep as the limit is fine for the parser (and then refused for its content)
    limit = "[" * (MAX_DEPTH - 1) + "1" + "]" * (MAX_DEPTH - 1)
    resp = post_raw(daemon, "/v1/completions", f'{{"model": "tiny", "prompt": {limit}}}')
    assert_error(resp, 400, "prompt", "expected")


# ---- batch input files ----


def upload(daemon: Daemon, lines: list[str]) -> httpx.Response:
    data = ("\n".join(lines) + "\n").encode()
    return loopback.post(
        daemon.url + "/v1/files",
        files={"file": ("in.jsonl", data, "application/jsonl")},
        data={"purpose": "batch"},
        timeout=60,
    )


def batch_line(custom_id: str, prompt: str = '"hi"') -> str:
    return (
        f'{{"custom_id": {custom_id}, "method": "POST", "url": "/v1/completions", '
        f'"body": {{"model": "tiny", "max_tokens": 2, "prompt": {prompt}}}}}'
    )


def test_batch_upload_refuses_surrogates_and_deep_lines_by_line_and_field(bare: Daemon) -> None:
    files_before = sorted(p.name for p in (bare.home / "files").glob("*")) if (
        bare.home / "files").exists() else []  # fmt: skip
    resp = upload(
        bare,
        [
            batch_line('"a"'),
            batch_line(SURROGATE),
            batch_line('"c"', SURROGATE),
            batch_line('"d"', "[" * 5000 + "]" * 5000),
        ],
    )
    message = assert_error(resp, 400, "file", "3 problem(s)")
    assert "in.jsonl:2 (custom_id)" in message
    assert "in.jsonl:3 (body.prompt)" in message
    assert re.search(rf"in\.jsonl:4: JSON nested more than {MAX_DEPTH} levels", message), message
    files_after = sorted(p.name for p in (bare.home / "files").glob("*"))
    assert files_after == files_before  # nothing was kept of the refused upload


# ---- fields the server does not implement ----


def test_unimplemented_and_unknown_fields_are_400_through_the_sdk(tiny_daemon: Daemon) -> None:
    client = openai.OpenAI(base_url=tiny_daemon.url + "/v1", api_key="unused", max_retries=0)
    question = [{"role": "user", "content": "What is 2+2?"}]
    tool = {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}
    cases: list[tuple[dict[str, Any], str]] = [
        (
            {"tools": [tool], "tool_choice": {"type": "function", "function": {"name": "sub"}}},
            "tool_choice.function.name",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "nonsense"}},
                }
            },
            "response_format.json_schema.schema",
        ),
        ({"logit_bias": {"50": -100}}, "logit_bias"),
        ({"extra_body": {"temprature": 0.5}}, "temprature"),
    ]
    for kwargs, param in cases:
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(model="tiny", messages=question, max_tokens=2,
                                           **kwargs)  # fmt: skip
        body = caught.value.body
        assert isinstance(body, dict) and body["param"] == param, body
        assert param in body["message"]
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model="tiny", prompt="x", max_tokens=2, best_of=2)
    assert isinstance(caught.value.body, dict) and caught.value.body["param"] == "best_of"
    # accepted on purpose: ignored fields, and unsupported ones that ask for nothing
    reply = client.chat.completions.create(
        model="tiny", messages=question, max_tokens=2, user="u1", metadata={"k": "v"},
        store=False, tools=[], tool_choice="none", parallel_tool_calls=False,
    )  # fmt: skip
    assert reply.choices[0].message.content is not None


# ---- sequences per request ----


def test_sequences_per_request_are_capped_naming_the_limit_and_the_count(
    tiny_daemon: Daemon,
) -> None:
    daemon = tiny_daemon
    body = {"model": "tiny", "prompt": [f"p{i}" for i in range(100)], "n": 128}
    resp = loopback.post(daemon.url + "/v1/completions", json=body, timeout=60)
    assert_error(resp, 400, "n", "12800 sequences", "100 prompt(s) x n=128", "at most 256")
    resp = loopback.post(
        daemon.url + "/v1/chat/completions",
        json={"model": "tiny", "messages": [{"role": "user", "content": "x"}], "n": 300},
        timeout=60,
    )
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "n"
    ok = loopback.post(
        daemon.url + "/v1/completions",
        json={"model": "tiny", "prompt": ["a", "b"], "n": 2, "max_tokens": 1},
        timeout=120,
    )
    assert ok.status_code == 200 and len(ok.json()["choices"]) == 4


# ---- apikey revoke never echoes a key ----


def test_revoke_with_a_full_key_never_echoes_it(keyed_daemon: Daemon) -> None:
    """On the shared keyed daemon: only a key this test makes is revoked."""
    d, key = keyed_daemon, keyed_daemon.keys["admin"]
    wrong = key[:-6] + "XXXXXX"
    secret = wrong.split("-", 2)[2]
    for remote in (True, False):
        proc = d.cli("apikey", "revoke", wrong, remote=remote, key=key)
        assert proc.returncode == 2, proc.stderr
        output = proc.stdout + proc.stderr
        assert secret not in output and secret[:12] not in output, output
        assert "kl-" + key.split("-")[1] in output  # the key id part, to know which
    # the key itself revokes it (through the daemon), and is not echoed either
    other = json.loads(d.cli("apikey", "create", "edges-ci", "--json", key=key).stdout)["key"]
    proc = d.cli("apikey", "revoke", other, key=key)
    assert proc.returncode == 0, proc.stderr
    assert other not in proc.stdout + proc.stderr and "(edges-ci)" in proc.stdout
    resp = loopback.get(d.url + "/v1/models", headers={"authorization": f"Bearer {other}"})
    assert resp.status_code == 401


# ---- clients that leave: 499 ----


LONG_CONTEXT = 2048
"""``one_slot``'s max_model_len: the tiny model's every position."""


def _raw_request(daemon: Daemon, body: dict[str, Any], request_id: str) -> socket.socket:
    data = json.dumps(body).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\nX-Request-Id: {request_id}\r\n\r\n"
    ).encode()
    sock = socket.create_connection(("127.0.0.1", daemon.port), timeout=120)
    sock.sendall(head + data)
    return sock


def _requests_total(daemon: Daemon, status: str, replica: str | None = None) -> float:
    total = 0.0
    for line in daemon.get("/metrics").text.splitlines():
        ours = line.startswith("kunlun_requests_total{") and f'status="{status}"' in line
        if ours and (replica is None or f'replica="{replica}"' in line):
            total += float(line.rsplit(" ", 1)[1])
    return total


one_slot = daemon_fixture(Profile(
    "edges-one-slot",
    (TINY.replace("max_num_seqs: 8", "max_num_seqs: 1").replace("max_model_len: 1024",
                                                            f"max_model_len: {LONG_CONTEXT}")
     + "faults:\n  step_delay_ms: 10\n",),
    env=(("KUNLUN_MAX_SEQUENCES_PER_REQUEST", "4"),),
))  # fmt: skip
"""A daemon whose replica runs one request at a time (``max_num_seqs: 1``), taking at most 4
sequences per request (set by its environment variable). Its context holds the tiny model's
2,048 positions and each step is followed by an injected 10 ms wait (``faults``), so a long
stream lasts at least 20 s on any machine: longer than what the test does meanwhile."""


def test_clients_that_leave_queued_or_mid_stream_are_counted_and_logged_499(
    one_slot: Daemon,
) -> None:
    # as long as the context allows (ignore_eos): still streaming when the client leaves
    long = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": LONG_CONTEXT - 16,
            "ignore_eos": True, "stream": True}  # fmt: skip
    queued_before = _requests_total(one_slot, "499", "-")
    all_before = _requests_total(one_slot, "499")
    streamer = _raw_request(one_slot, long, "edges-streamer")
    try:
        first = streamer.recv(4096)  # the stream has started: it holds the only slot
        assert b"200" in first.split(b"\r\n", 1)[0], first
        waiter = _raw_request(one_slot, {**long, "stream": False}, "edges-waiter")
        waiter.close()  # leaves while it waits for the slot
        wait_until(
            lambda: _requests_total(one_slot, "499", "-") == queued_before + 1,
            "the queued request counted 499 with no replica",
        )
        assert streamer.recv(4096)  # still streaming: the waiter never got the slot
    finally:
        streamer.close()  # leaves mid-stream
    wait_until(
        lambda: _requests_total(one_slot, "499") == all_before + 2,
        "the aborted stream counted 499",
    )
    statuses = wait_until(
        lambda: (
            (a := logged(one_slot.home, "edges-streamer")) and (b := logged(one_slot.home,
            "edges-waiter")) and (a["status"], b["status"])
        ),
        "both requests in the request log",
    )  # fmt: skip
    assert statuses == (499, 499)
    # the replica is free again: a new request is answered
    ok = loopback.post(one_slot.url + "/v1/completions",
                    json={"model": "tiny", "prompt": "x", "max_tokens": 1}, timeout=300)  # fmt: skip
    assert ok.status_code == 200, ok.text


def test_a_client_that_closes_on_done_has_its_answer_and_is_counted_200(
    one_slot: Daemon,
) -> None:
    """The openai SDK closes a stream as soon as it reads ``[DONE]``, which may be before the
    end of the chunked body reaches the gateway: that exchange is a 200, not a 499."""
    body = {"model": "tiny", "prompt": "Hi", "max_tokens": 2, "stream": True}
    gone_before, ok_before = _requests_total(one_slot, "499"), _requests_total(one_slot, "200")
    for i in range(6):
        sock = _raw_request(one_slot, body, f"edges-done-{i}")
        seen = b""
        while b"data: [DONE]\n\n" not in seen:
            piece = sock.recv(4096)
            assert piece, seen
            seen += piece
        sock.close()  # at once, as the SDK does
    wait_until(
        lambda: (
            _requests_total(one_slot, "200") + _requests_total(one_slot, "499")
            >= ok_before + gone_before + 6
        ),
        "the 6 streams counted",
    )
    assert _requests_total(one_slot, "499") == gone_before
    assert _requests_total(one_slot, "200") == ok_before + 6
    for i in range(6):
        entry = wait_until(lambda i=i: logged(one_slot.home, f"edges-done-{i}"), "logged")
        assert entry["status"] == 200, entry


def test_the_sequence_limit_is_configurable(one_slot: Daemon) -> None:
    body = {"model": "tiny", "prompt": ["a", "b", "c"], "n": 2, "max_tokens": 1}
    resp = loopback.post(one_slot.url + "/v1/completions", json=body, timeout=60)
    assert_error(resp, 400, "n", "6 sequences", "at most 4")
    resp = loopback.post(one_slot.url + "/v1/completions", json={**body, "n": 1}, timeout=300)
    assert resp.status_code == 200, resp.text
