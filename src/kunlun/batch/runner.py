"""The engine of ``kunlun-cli batch run``: send every input line, ``batch_size`` in flight.

Output under ``output_dir``:

- ``results.jsonl``: one line per id that succeeded, ``{id, result, finish_reason, usage,
  latency_ms, attempts}``, written through a :class:`~kunlun.batch.journal.Journal` (fsynced
  line by line). A rerun skips the ids already there and runs the rest.
- ``failures.jsonl``: this run's failures, ``{id, line, attempts, error}``, bad input lines
  first; rewritten by every run (a failed id is tried again by the next run).
- ``summary.json``: counts, tokens, duration and tokens/s of this run, written at the end.

Each attempt carries ``X-Request-Id: <task_name>:<id>:<attempt>`` (attempts count from 1 in
every run), so the server's request log shows exactly what was sent.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from kunlun.batch.inputs import CHAT_COMPLETIONS, BatchRequest, read_inputs
from kunlun.batch.journal import Journal
from kunlun.batch.retry import RetryPolicy, is_retryable, retry_after_s
from kunlun.batch.task import BatchTask

RESULTS = "results.jsonl"
FAILURES = "failures.jsonl"
SUMMARY = "summary.json"

OnResult = Callable[[bool, int], None]
"""Called after each request finishes: (succeeded, completion tokens)."""


@dataclass
class RunSummary:
    """What ``summary.json`` holds. Token counts and rates are this run's."""

    task_name: str
    model_alias: str
    endpoint: str
    input_file: str
    output_dir: str
    num_requests: int = 0
    """Runnable input lines."""
    num_bad_lines: int = 0
    num_done_before: int = 0
    """Ids already in results.jsonl when the run started (skipped)."""
    num_torn_lines_discarded: int = 0
    num_succeeded: int = 0
    num_failed: int = 0
    num_retries: int = 0
    num_results: int = 0
    """Input ids with a line in results.jsonl at the end."""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    duration_s: float = 0.0
    tokens_per_s: float = 0.0
    """Completion tokens per second of wall time."""
    complete: bool = False
    """Every runnable input id has a result and no input line was bad."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class _Outcome:
    """One finished request: its results.jsonl record, or its failures.jsonl record."""

    result: dict[str, Any] | None = None
    failure: dict[str, Any] | None = None
    retries: int = 0


@dataclass
class BatchRunner:
    """Runs one :class:`BatchTask` against ``endpoint`` (the server root, e.g.
    ``http://127.0.0.1:8470``)."""

    task: BatchTask
    endpoint: str
    api_key: str | None = None
    policy: RetryPolicy | None = None
    on_result: OnResult | None = None
    on_start: Callable[[int, int], None] | None = None
    """Called once the work is known: (requests to send, requests already done)."""
    _summary: RunSummary = field(init=False)

    async def run(self) -> RunSummary:
        task = self.task
        policy = self.policy or RetryPolicy(max_retries=task.max_retries)
        requests, bad = read_inputs(task.input_file)
        task.output_dir.mkdir(parents=True, exist_ok=True)
        results = Journal.open(task.output_dir / RESULTS, "id")
        summary = self._summary = RunSummary(
            task.task_name,
            task.model_alias,
            self.endpoint,
            str(task.input_file),
            str(task.output_dir),
            num_requests=len(requests),
            num_bad_lines=len(bad),
            num_torn_lines_discarded=results.num_discarded,
        )
        pending = [r for r in requests if r.key not in results.ids]
        summary.num_done_before = len(requests) - len(pending)
        if self.on_start is not None:
            self.on_start(len(pending), summary.num_done_before)
        started = time.monotonic()
        try:
            with (task.output_dir / FAILURES).open("w", encoding="utf-8") as failures:
                for line in bad:
                    _write_line(failures, line.to_record())
                async with self._client() as client:
                    work = iter(pending)
                    workers = [
                        self._worker(client, policy, work, results, failures)
                        for _ in range(min(task.batch_size, len(pending)))
                    ]
                    await asyncio.gather(*workers)
        finally:
            results.close()
        summary.duration_s = round(time.monotonic() - started, 3)
        if summary.duration_s > 0:
            summary.tokens_per_s = round(summary.completion_tokens / summary.duration_s, 2)
        summary.num_results = sum(1 for r in requests if r.key in results.ids)
        summary.complete = summary.num_results == len(requests) and not bad
        _write_atomically(task.output_dir / SUMMARY, json.dumps(summary.to_dict(), indent=2))
        return summary

    def _client(self) -> httpx.AsyncClient:
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        size = self.task.batch_size
        return httpx.AsyncClient(
            base_url=self.endpoint.rstrip("/"),
            headers=headers,
            timeout=self.task.timeout_seconds,
            limits=httpx.Limits(max_connections=size, max_keepalive_connections=size),
        )

    async def _worker(
        self,
        client: httpx.AsyncClient,
        policy: RetryPolicy,
        work: Iterator[BatchRequest],
        results: Journal,
        failures: Any,
    ) -> None:
        for request in work:  # a shared iterator: each request goes to exactly one worker
            outcome = await self._send(client, policy, request)
            summary = self._summary
            summary.num_retries += outcome.retries
            tokens = 0
            if outcome.result is not None:
                await results.append(outcome.result)
                usage = outcome.result.get("usage") or {}
                tokens = int(usage.get("completion_tokens") or 0)
                summary.num_succeeded += 1
                summary.prompt_tokens += int(usage.get("prompt_tokens") or 0)
                summary.completion_tokens += tokens
                summary.total_tokens += int(usage.get("total_tokens") or 0)
            else:
                _write_line(failures, outcome.failure or {})
                summary.num_failed += 1
            if self.on_result is not None:
                self.on_result(outcome.result is not None, tokens)

    async def _send(
        self, client: httpx.AsyncClient, policy: RetryPolicy, request: BatchRequest
    ) -> _Outcome:
        """Send ``request`` until it succeeds, fails for good or runs out of retries."""
        body = {"model": self.task.model_alias, **request.params}
        attempt = 0
        while True:
            attempt += 1
            request_id = f"{self.task.task_name}:{request.key}:{attempt}"
            started = time.monotonic()
            status: int | None = None
            wait: float | None = None
            try:
                resp = await client.post(
                    request.path, json=body, headers={"X-Request-Id": request_id}
                )
            except httpx.TimeoutException:
                error = {
                    "code": "timeout",
                    "message": f"no answer within {self.task.timeout_seconds:g}s",
                }
            except httpx.TransportError as exc:
                error = {"code": "connection_error", "message": f"{type(exc).__name__}: {exc}"}
            else:
                status = resp.status_code
                latency_ms = round((time.monotonic() - started) * 1000, 1)
                if status < 300:
                    try:
                        return _Outcome(
                            _result(request, resp.json(), latency_ms, attempt), retries=attempt - 1
                        )
                    except (ValueError, KeyError, IndexError, TypeError) as exc:
                        status, error = (
                            None,
                            {"code": "bad_response", "message": f"unreadable answer: {exc!r}"},
                        )
                else:
                    error = _error_of(resp)
                    wait = retry_after_s(resp.headers.get("retry-after"))
            if not is_retryable(status) or attempt > policy.max_retries:
                failure = {
                    "id": request.id,
                    "line": request.line,
                    "attempts": attempt,
                    "error": {"status": status, **error},
                }
                return _Outcome(failure=failure, retries=attempt - 1)
            await asyncio.sleep(policy.delay_s(attempt, wait))


def _result(
    request: BatchRequest, body: dict[str, Any], latency_ms: float, attempts: int
) -> dict[str, Any]:
    """The results.jsonl line for a successful answer (one text, or a list for n > 1)."""
    choices = body["choices"]
    chat = request.path == CHAT_COMPLETIONS
    texts = [c["message"]["content"] if chat else c["text"] for c in choices]
    reasons = [c.get("finish_reason") for c in choices]
    return {
        "id": request.id,
        "result": texts[0] if len(texts) == 1 else texts,
        "finish_reason": reasons[0] if len(reasons) == 1 else reasons,
        "usage": body.get("usage"),
        "latency_ms": latency_ms,
        "attempts": attempts,
    }


def _error_of(resp: httpx.Response) -> dict[str, Any]:
    """``{code, message}`` from an error answer (OpenAI shape when there is one)."""
    try:
        error = resp.json()["error"]
        return {"code": error.get("code") or error.get("type"), "message": str(error["message"])}
    except (ValueError, KeyError, TypeError, AttributeError):
        return {"code": f"http_{resp.status_code}", "message": resp.text[:500]}


def _write_line(handle: Any, record: dict[str, Any]) -> None:
    handle.write(json.dumps(record, ensure_ascii=False) + "\n")
    handle.flush()


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text + "\n", encoding="utf-8")
    os.replace(tmp, path)
