"""Helpers of the rollout tests and ``benchmarks/rollout.py``: a steady request load that
records which version answered, and REST calls to a daemon's ``/api/v1/rollouts``."""

from __future__ import annotations

import threading
import time
from collections import Counter
from typing import Any

import httpx
from tests import loopback
from tests.daemons import ONE_THREAD

from kunlun.state.store import ROLLOUT_ENDED as ENDED

__all__ = ["ONE_THREAD"]  # the benchmark declares one thread per worker too
FAST = {"interval_s": "1.5s", "min_requests": 20, "max_error_rate": "5%"}
"""Rollout settings for tests: short steps, few samples, a loose error limit."""


class Load:
    """``concurrency`` threads sending short completions for ``model`` to ``url`` until
    stopped; counts answers per (status, X-Kunlun-Version role)."""

    def __init__(self, url: str, model: str, concurrency: int = 3, max_tokens: int = 2) -> None:
        self.url, self.model = url, model
        self.concurrency, self.max_tokens = concurrency, max_tokens
        self.answers: Counter[tuple[int, str]] = Counter()
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()

    def __enter__(self) -> Load:
        for i in range(self.concurrency):
            thread = threading.Thread(target=self._run, args=(i,), daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=120)

    def count(self, role: str, status: int | None = None) -> int:
        with self._lock:
            return sum(n for (code, r), n in self.answers.items()
                       if r == role and (status is None or code == status))  # fmt: skip

    def _run(self, index: int) -> None:
        with httpx.Client(base_url=self.url, timeout=120) as client:
            n = 0
            while not self._stop.is_set():
                n += 1
                # a new short prompt each time: a version's prefix cache gives it no head start
                body = {"model": self.model, "max_tokens": self.max_tokens, "temperature": 0,
                        "prompt": f"{index}-{n}: one, two,"}  # fmt: skip
                try:
                    answer = client.post("/v1/completions", json=body)
                except httpx.HTTPError as exc:
                    with self._lock:
                        self.failures.append(repr(exc))
                    time.sleep(0.1)
                    continue
                role = answer.headers.get("x-kunlun-version", "").partition(":")[0] or "none"
                with self._lock:
                    self.answers[(answer.status_code, role)] += 1


def create(url: str, **body: Any) -> dict[str, Any]:
    answer = loopback.post(url + "/api/v1/rollouts", json=body, timeout=120)
    assert answer.status_code == 200, answer.text
    return dict(answer.json())


def status(url: str, rollout_id: str) -> dict[str, Any]:
    answer = loopback.get(f"{url}/api/v1/rollouts/{rollout_id}", timeout=30)
    assert answer.status_code == 200, answer.text
    return dict(answer.json())


def wait_for(
    url: str, rollout_id: str, states: tuple[str, ...] = ENDED, timeout_s: float = 300
) -> dict[str, Any]:
    """The rollout once in one of ``states``; an ended one once its losing version stopped."""
    deadline = time.monotonic() + timeout_s
    while True:
        found = status(url, rollout_id)
        if found["state"] in states and (found["state"] not in ENDED or found["retired"]):
            return found
        if time.monotonic() > deadline:
            raise AssertionError(f"rollout not {states} within {timeout_s} s: {found}")
        time.sleep(0.2)
