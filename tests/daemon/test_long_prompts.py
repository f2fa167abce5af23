"""Prompts that cannot fit the context are refused before they are tokenized; long prompts are
tokenized off the worker's event loop, so other streams go on. Through the real daemon."""

from __future__ import annotations

import re
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
from tests import loopback
from tests.daemons import TINY, Daemon, Profile, daemon_fixture

HUGE = 10 << 20
"""A 10 MB prompt."""
MAX_MODEL_LEN = 1024
"""The shared daemon's workload (``tests.daemons.TINY_SPEC``)."""
STREAM_TOKENS = 400
"""The stream that goes on meanwhile: long (``ignore_eos``) so that it is still running
when the long prompts have been answered (asserted)."""
STEP_DELAY_MS = 20
"""Every engine step of ``paced``'s replica comes this much later (an injected slow device),
so the stream lasts at least ``STREAM_TOKENS * STEP_DELAY_MS`` (8 s) however fast the
machine decodes the tiny model: beside ``stress-ng --cpu 2`` 900 unpaced tokens once ended
before the four long prompts were answered."""
paced = daemon_fixture(
    Profile("long-prompts-paced", (TINY + f"faults:\n  step_delay_ms: {STEP_DELAY_MS}\n",))
)


def completion(daemon: Daemon, prompt: object, **extra: object) -> httpx.Response:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 4, **extra}
    return loopback.post(daemon.url + "/v1/completions", json=body, timeout=300)


def assert_refused_untokenized(answer: httpx.Response) -> int:
    """The early refusal's byte bound."""
    assert answer.status_code == 400, answer.text[:500]
    error = answer.json()["error"]
    assert error["code"] == "context_length_exceeded"
    assert f"max_model_len = {MAX_MODEL_LEN} tokens" in error["message"]
    assert "refused without tokenizing it" in error["message"]
    found = re.search(r"over (\d+) bytes of UTF-8", error["message"])
    assert found is not None, error["message"]
    return int(found.group(1))


def assert_refused_from_its_first_pieces(answer: httpx.Response) -> None:
    """Issue 32: a prompt under the byte bound that cannot fit either (1.25 MB took 16 s to
    tokenize whole) is refused once its first pieces hold more than max_model_len tokens."""
    assert answer.status_code == 400, answer.text[:500]
    error = answer.json()["error"]
    assert error["code"] == "context_length_exceeded"
    assert re.search(rf"cannot fit max_model_len = {MAX_MODEL_LEN} tokens: its first \d+ "
                     r"characters are already \d+ tokens, so the rest was not tokenized",
                     error["message"]), error["message"]  # fmt: skip


def test_a_prompt_under_the_byte_bound_is_refused_from_its_first_pieces(
    tiny_daemon: Daemon,
) -> None:
    bound = assert_refused_untokenized(completion(tiny_daemon, "a" * HUGE))
    words = " ".join(f"w{i % 977}" for i in range(bound))
    just_under = words.encode()[: bound - 16].decode(errors="ignore")
    assert_refused_from_its_first_pieces(completion(tiny_daemon, just_under))
    chat = loopback.post(
        tiny_daemon.url + "/v1/chat/completions",
        timeout=300,
        json={
            "model": "tiny",
            "max_tokens": 4,
            "messages": [{"role": "user", "content": just_under[: bound // 2]}],
        },
    )  # the template's too
    assert_refused_from_its_first_pieces(chat)


def test_a_10_mb_prompt_is_refused_naming_max_model_len(tiny_daemon: Daemon) -> None:
    daemon = tiny_daemon
    bound = assert_refused_untokenized(completion(daemon, "a" * HUGE))
    assert MAX_MODEL_LEN <= bound < HUGE
    chat = loopback.post(
        daemon.url + "/v1/chat/completions",
        json={
            "model": "tiny",
            "max_tokens": 4,
            "messages": [{"role": "user", "content": "é" * (HUGE // 2)}],
        },  # fmt: skip
        timeout=300,
    )
    assert assert_refused_untokenized(chat) == bound
    # just over the bound in bytes, not in characters: refused too
    assert assert_refused_untokenized(completion(daemon, "é" * (bound // 2 + 1))) == bound
    ids = completion(daemon, [1] * (MAX_MODEL_LEN + 5))
    assert ids.status_code == 400, ids.text
    assert ids.json()["error"]["code"] == "context_length_exceeded"
    assert f"the max_model_len is {MAX_MODEL_LEN} tokens" in ids.json()["error"]["message"]


def test_other_streams_go_on_while_long_prompts_are_tokenized(paced: Daemon) -> None:
    daemon = paced
    bound = assert_refused_untokenized(completion(daemon, "a" * HUGE))
    lines: list[str] = []
    started = threading.Event()

    def stream() -> None:
        body = {"model": "tiny", "prompt": "Count slowly:", "max_tokens": STREAM_TOKENS,
                "ignore_eos": True, "stream": True}  # fmt: skip
        with loopback.stream("POST", daemon.url + "/v1/completions", json=body, timeout=300) as r:
            lines.append(f"status {r.status_code}")
            for line in r.iter_lines():
                if line:
                    lines.append(line)
                    started.set()
        started.set()

    streaming = threading.Thread(target=stream)
    streaming.start()
    assert started.wait(120), lines
    words = " ".join(f"w{i % 977}" for i in range(bound))  # under the bound, many tokens
    allowed = words.encode()[: bound - 16].decode(errors="ignore")
    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda _: completion(daemon, allowed), range(4)))
    num_lines_then = len(lines)
    streaming.join(300)
    assert len(lines) > num_lines_then, "the stream had ended before the long prompts' answers"
    for answer in answers:  # under the byte bound: tokenized (in pieces, until surely over)
        assert_refused_from_its_first_pieces(answer)
    assert lines[0] == "status 200" and lines[-1] == "data: [DONE]", lines[-3:]
    assert len([line for line in lines if '"text"' in line]) >= 60
    assert not any('"error"' in line for line in lines)
