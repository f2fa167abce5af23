"""Waiting in the gateway's queue is bounded (``max_queue_wait_s``): past it, 429 in the
OpenAI shape with a ``Retry-After`` from the queue's drain rate. Through the real daemon, one
replica that takes one request at a time."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
from tests import loopback
from tests.daemons import TINY, Daemons, Profile, stream_lines

NUM_QUEUED = 6
CONTEXT = 2048
"""The workload's max_model_len (the tiny model's every position): room for a stream that
holds the slot well past the queue's bound (asserted)."""
STEP_DELAY_MS = 20
"""Every engine step of the one replica comes this much later (an injected slow device), so
the holder's stream lasts at least ``CONTEXT * STEP_DELAY_MS`` (about 40 s) however fast the
machine decodes the tiny model: its length no longer races the queue's bound."""


ONE_SLOT = Profile(
    "queue-wait-home",
    (TINY.replace("max_num_seqs: 8", "max_num_seqs: 1").replace("max_model_len: 1024",
                                                            f"max_model_len: {CONTEXT}")
     + f"faults:\n  step_delay_ms: {STEP_DELAY_MS}\n",),
    files=(("scheduler_config.yaml", "max_queue_wait_s: 0.5\n"),),
)  # fmt: skip


def test_requests_queued_past_max_queue_wait_get_429_with_a_drain_rate_retry_after(
    daemons: Daemons,
) -> None:
    with daemons.serve(ONE_SLOT) as daemon:
        lines: list[str] = []
        started, leave = threading.Event(), threading.Event()
        holder = threading.Thread(
            target=stream_lines,
            args=(daemon.url, lines, started, CONTEXT - 16, leave),
            kwargs={"model": "tiny"},
        )
        holder.start()  # takes the one slot for the whole test
        assert started.wait(120), lines

        def queued(_: int) -> httpx.Response:
            return loopback.post(
                daemon.url + "/v1/completions",
                json={"model": "tiny", "prompt": "hi", "max_tokens": 2},
                timeout=120,
            )

        with ThreadPoolExecutor(NUM_QUEUED) as pool:
            answers = list(pool.map(queued, range(NUM_QUEUED)))
        assert holder.is_alive(), "the slot holder ended before the queue bound was tested"
        retry_after = []
        for answer in answers:
            assert answer.status_code == 429, answer.text
            error = answer.json()["error"]
            assert error["type"] == "rate_limit_error"
            assert error["code"] == "rate_limit_exceeded"
            assert "max_queue_wait_s = 0.5" in error["message"]
            retry_after.append(int(answer.headers["Retry-After"]))
        # from the drain rate (one admission in the last second or more): the first refused
        # had the most still waiting behind it, the last none
        assert min(retry_after) >= 1
        assert max(retry_after) > min(retry_after), retry_after
        leave.set()  # the holder's client leaves; its slot is given back
        holder.join(300)
        assert lines[0] == "status 200" and lines[-1].startswith("data: {")
        deadline = time.monotonic() + 120
        while (after := queued(0)).status_code == 429:  # until the abort has freed the slot
            assert time.monotonic() < deadline, after.text
            time.sleep(0.2)
        assert after.status_code == 200, after.text
