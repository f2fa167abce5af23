"""Batch API jobs: created from an uploaded file, run in the background, resumed on restart.

A job moves ``validating -> in_progress -> finalizing -> completed``; or ``failed`` (the
input does not fit the endpoint), ``cancelling -> cancelled``, ``expired`` (past its 24 h
window). At most ``max_running_jobs`` jobs are ``in_progress`` at once; a validated job waits
for a free slot as ``validating`` (oldest first), so many jobs cannot flood the replicas.
Each request goes through :attr:`BatchJobs.send` (the daemon passes its own gateway,
in-process) with ``X-Request-Id: <batch_id>:<custom_id>:<attempt>``, a bounded number in
flight, each until it is answered for good (:mod:`kunlun.batch.sending`). Answers are
appended to the job's output file (2xx) or error file (anything else, after retries) through
a :class:`~kunlun.batch.journal.Journal`, fsynced line by line; they become files of the API
when the job ends (:mod:`kunlun.batch.outputs`).

Durability: the record (status, timestamps, totals) is in the state store; progress is the
two journals themselves. After a crash, :meth:`BatchJobs.start` reopens every unfinished
job, discards a torn last line, and sends only the ``custom_id`` values in neither file, so
each appears exactly once in the output.

While the jobs run, expired files are swept every ``sweep_interval_s``
(:meth:`~kunlun.batch.files.FileStore.sweep`); a file an unfinished job reads is kept until
the job ends.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from kunlun.batch.files import SUPPORTED_URLS, BatchLine, FileStore, NotFound, iter_lines
from kunlun.batch.journal import Journal
from kunlun.batch.objects import (
    TERMINAL,
    add_usage,
    batch_error,
    token_usage,
)
from kunlun.batch.outputs import count_answers, keep_written, register_outputs
from kunlun.batch.retry import RetryPolicy
from kunlun.batch.sending import Send, send_line
from kunlun.errors import Location, RequestError
from kunlun.state.store import BatchRecord, StateStore

COMPLETION_WINDOW_S = {"24h": 24 * 3600}
MAX_RUNNING_JOBS = 4
"""Default number of jobs sending requests at once (``kunlun-platform --batch-max-jobs``)."""
SWEEP_INTERVAL_S = 60.0
"""How often expired files are removed."""


@dataclass
class _Job:
    record: BatchRecord
    task: asyncio.Task[None] | None = None
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    """Set on cancel: take no new requests."""


class BatchOwners(Protocol):
    """Which cluster node runs each batch job (:class:`kunlun.cluster.batches.BatchOwners`)."""

    def claim(self, batch_id: str) -> None: ...

    def cancel_elsewhere(self, batch_id: str) -> bool: ...


class BatchJobs:
    """Creates, runs, cancels and resumes batch jobs within the daemon's event loop."""

    def __init__(
        self,
        store: StateStore,
        files: FileStore,
        send: Send,
        concurrency: int = 8,
        policy: RetryPolicy | None = None,
        request_timeout_s: float = 600.0,
        max_running_jobs: int = MAX_RUNNING_JOBS,
        sweep_interval_s: float = SWEEP_INTERVAL_S,
    ) -> None:
        self.store = store
        self.files = files
        self.send = send
        self.concurrency = concurrency
        """Requests in flight per job."""
        self.policy = policy or RetryPolicy(max_retries=2, max_delay_s=10.0)
        """For 5xx and transport failures; 429 and 503 are waited out
        (:data:`~kunlun.batch.sending.WAIT_STATUSES`)."""
        self.request_timeout_s = request_timeout_s
        self.max_running_jobs = max_running_jobs
        """Jobs in progress at once, across all jobs (each with ``concurrency`` requests)."""
        self.sweep_interval_s = sweep_interval_s
        self._slots = asyncio.Semaphore(max_running_jobs)
        self._jobs: dict[str, _Job] = {}
        self._sweeper: asyncio.Task[None] | None = None
        self.owners: BatchOwners | None = None
        """In a cluster (:mod:`kunlun.cluster.batches`): which node runs each job; this node
        runs only its own (:meth:`resume`, :meth:`release`), not every unfinished one."""

    # ---- lifecycle (the daemon's lifespan) ----
    async def start(self) -> None:
        """Run every job left unfinished by an earlier daemon (in a cluster: the leader
        gives each to a node)."""
        for record in reversed(self.store.list_batches() if self.owners is None else []):
            if record.status not in TERMINAL:  # oldest first: first to a slot
                print(f"batch {record.batch_id}: resuming ({record.status})", flush=True)
                self._spawn(record)
        self._sweeper = asyncio.create_task(self._sweep_forever(), name="batch-file-sweeper")

    async def _sweep_forever(self) -> None:
        while True:
            # an expired file cannot become a new batch's input, so the snapshot stays true
            in_use = {
                job.record.input_file_id
                for job in self._jobs.values()
                if job.record.status not in TERMINAL
            }
            try:
                for file_id in await asyncio.to_thread(self.files.sweep, in_use):
                    print(f"file {file_id}: expired, removed", flush=True)
            except OSError as exc:  # a full or read-only disk: report, keep serving
                print(f"expired files: sweep failed: {exc}", flush=True)
            await asyncio.sleep(self.sweep_interval_s)

    async def close(self) -> None:
        """Stop the running jobs where they are; :meth:`start` resumes them."""
        tasks = [job.task for job in self._jobs.values() if job.task is not None]
        if self._sweeper is not None:
            tasks.append(self._sweeper)
            self._sweeper = None
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._jobs.clear()

    # ---- the API ----
    def create(
        self,
        input_file_id: str,
        endpoint: str,
        completion_window: str,
        metadata: dict[str, str] | None = None,
        output_expires_after_s: int | None = None,
    ) -> BatchRecord:
        if endpoint not in SUPPORTED_URLS:
            raise _param(
                "endpoint",
                f"endpoint {endpoint!r} is not supported; use one of {', '.join(SUPPORTED_URLS)}",
            )
        if completion_window not in COMPLETION_WINDOW_S:
            raise _param(
                "completion_window",
                f"completion_window {completion_window!r} is not supported; use '24h'",
            )
        source = self.files.get(input_file_id)
        if source.purpose != "batch":
            raise _param(
                "input_file_id",
                f"file {input_file_id!r} has purpose {source.purpose!r}, not 'batch'",
            )
        now = int(time.time())
        record = BatchRecord(
            batch_id="batch_" + secrets.token_hex(12),
            endpoint=endpoint,
            input_file_id=input_file_id,
            completion_window=completion_window,
            status="validating",
            created_at=now,
            expires_at=now + COMPLETION_WINDOW_S[completion_window],
            request_counts={"total": 0, "completed": 0, "failed": 0},
            metadata=metadata,
            output_expires_after_s=output_expires_after_s,
        )
        if self.owners is not None:  # owned before it exists: no other node takes it
            self.owners.claim(record.batch_id)
        self.store.put_batch(record)
        self._spawn(record)
        return record

    # ---- in a cluster: the jobs this node owns ----
    def running(self) -> set[str]:
        return set(self._jobs)

    def resume(self, batch_id: str) -> None:
        """Run a job given to this node (its earlier owner was lost): from its journals,
        each request still answered exactly once."""
        record = self.store.get_batch(batch_id)
        if batch_id in self._jobs or record is None or record.status in TERMINAL:
            return
        print(f"batch {batch_id}: taken over ({record.status})", flush=True)
        self._spawn(record)

    def release(self, batch_id: str) -> None:
        """Stop running a job another node now owns (it resumes it from the journals)."""
        job = self._jobs.pop(batch_id, None)
        if job is not None and job.task is not None:
            job.task.cancel()

    def stop(self, batch_id: str) -> None:
        """A cancel asked on another node: stop taking requests, end ``cancelled``."""
        job = self._jobs.get(batch_id)
        if job is not None and not job.stop.is_set():
            job.record.status = "cancelling"
            job.record.cancelling_at = job.record.cancelling_at or int(time.time())
            job.stop.set()

    def get(self, batch_id: str) -> BatchRecord:
        job = self._jobs.get(batch_id)
        if job is not None:
            return job.record
        record = self.store.get_batch(batch_id)
        if record is None:
            raise NotFound(
                f"no batch with id {batch_id!r}", location=Location("request", field="batch_id")
            )
        return record

    def page(self, limit: int = 20, after: str | None = None) -> list[BatchRecord]:
        """Newest first; ``after`` is the last id of the previous page."""
        records = [
            self._jobs[r.batch_id].record if r.batch_id in self._jobs else r
            for r in self.store.list_batches()
        ]
        if after is not None:
            ids = [r.batch_id for r in records]
            records = records[ids.index(after) + 1 :] if after in ids else []
        return records[:limit]

    def readers(self, file_id: str) -> list[str]:
        """The unfinished batches whose input is ``file_id``."""
        return [
            job.record.batch_id
            for job in self._jobs.values()
            if job.record.input_file_id == file_id and job.record.status not in TERMINAL
        ]

    def cancel(self, batch_id: str) -> BatchRecord:
        """Stop taking requests; in-flight ones finish, then the job is ``cancelled``."""
        record = self.get(batch_id)
        if record.status in TERMINAL or record.status == "cancelling":
            raise RequestError(
                f"batch {batch_id} is already {record.status}",
                location=Location("request", field="batch_id"),
            )
        record.status, record.cancelling_at = "cancelling", int(time.time())
        self.store.put_batch(record)
        job = self._jobs.get(batch_id)
        if job is not None:
            job.stop.set()
        elif self.owners is not None and self.owners.cancel_elsewhere(batch_id):
            pass  # its owner stops it
        else:
            self._spawn(record)
        return record

    # ---- running ----
    def _spawn(self, record: BatchRecord) -> None:
        job = _Job(record)
        if record.status == "cancelling":
            job.stop.set()
        job.task = asyncio.get_running_loop().create_task(self._run(job))
        self._jobs[record.batch_id] = job

    async def _run(self, job: _Job) -> None:
        record = job.record
        try:
            if record.status == "validating":
                await self._validate(record)
            if record.status in ("validating", "in_progress") and await self._take_slot(job):
                try:
                    self._begin(record)
                    await self._execute(job)
                finally:
                    self._slots.release()
            if record.status in ("validating", "in_progress", "finalizing", "cancelling"):
                self._finalize(record)
        except asyncio.CancelledError:
            raise  # the daemon is stopping: the job resumes at the next start
        except Exception as exc:  # a bug or a broken disk: fail this job, keep the daemon
            if isinstance(exc, ExceptionGroup):  # from the workers' task group
                exc = exc.exceptions[0]
            keep_written(record, self.files)
            self._fail(record, [batch_error("internal_error", f"{type(exc).__name__}: {exc}")])
        finally:
            if record.status in TERMINAL:
                self._jobs.pop(record.batch_id, None)

    async def _validate(self, record: BatchRecord) -> None:
        """Every line must target the batch's endpoint; count the requests."""
        path = self.files.path(record.input_file_id)
        lines = await asyncio.to_thread(lambda: list(iter_lines(path)))
        if record.status != "validating":  # cancelled meanwhile
            return
        errors = [
            batch_error(
                "invalid_url",
                f"line {line.line} is for {line.url}, but the batch's "
                f"endpoint is {record.endpoint}",
                line.line,
                "url",
            )
            for line in lines
            if line.url != record.endpoint
        ]
        if errors:
            self._fail(record, errors[:20])
            return
        record.request_counts = {"total": len(lines), "completed": 0, "failed": 0}
        record.model = lines[0].body["model"] if lines else None
        self.store.put_batch(record)

    async def _take_slot(self, job: _Job) -> bool:
        """Wait for one of the ``max_running_jobs`` slots: True holding it, False when the
        job was cancelled or expired meanwhile (then no slot is held)."""
        acquire = asyncio.ensure_future(self._slots.acquire())
        stopped = asyncio.ensure_future(job.stop.wait())
        keep = False
        try:
            left_s = max(0.0, job.record.expires_at - time.time())
            await asyncio.wait(
                {acquire, stopped}, timeout=left_s, return_when=asyncio.FIRST_COMPLETED
            )
            keep = acquire.done() and not self._stopping(job)
            return keep
        finally:
            stopped.cancel()
            acquire.cancel()  # a no-op once it holds the slot
            if not keep and acquire.done() and not acquire.cancelled():
                self._slots.release()

    def _begin(self, record: BatchRecord) -> None:
        """``validating -> in_progress`` (a resumed job is already there)."""
        if record.status != "validating":
            return
        record.output_file_id, record.error_file_id = FileStore.new_id(), FileStore.new_id()
        record.status, record.in_progress_at = "in_progress", int(time.time())
        self.store.put_batch(record)

    async def _execute(self, job: _Job) -> None:
        record = job.record
        assert record.output_file_id and record.error_file_id  # set by _validate
        output = Journal.open(self.files.path(record.output_file_id), "custom_id")
        errors = Journal.open(self.files.path(record.error_file_id), "custom_id")
        try:
            done = output.ids | errors.ids
            record.request_counts.update(completed=len(output.ids), failed=len(errors.ids))
            record.usage = token_usage(output.records())
            if done:
                print(
                    f"batch {record.batch_id}: resumed with {len(done)} of "
                    f"{record.request_counts['total']} requests done",
                    flush=True,
                )
            lines = (
                line
                for line in iter_lines(self.files.path(record.input_file_id))
                if line.custom_id not in done
            )
            async with asyncio.TaskGroup() as workers:  # one failing stops the others
                for _ in range(self.concurrency):
                    workers.create_task(self._worker(job, lines, output, errors))
        finally:
            output.close()
            errors.close()

    async def _worker(
        self, job: _Job, lines: Iterator[BatchLine], output: Journal, errors: Journal
    ) -> None:
        counts = job.record.request_counts
        for line in lines:  # shared: each line goes to one worker
            if self._stopping(job):
                return
            ok, entry = await send_line(
                self.send, line, job.record.batch_id, job.stop, self.policy, self.request_timeout_s
            )
            if entry is None:  # cancelled while waiting
                return
            if await (output if ok else errors).append(entry):
                counts["completed" if ok else "failed"] += 1
                if ok:
                    add_usage(job.record.usage, entry)

    @staticmethod
    def _stopping(job: _Job) -> bool:
        """Cancelled, or past the completion window (the job then ends ``expired``)."""
        if time.time() > job.record.expires_at:
            job.stop.set()
        return job.stop.is_set()

    def _finalize(self, record: BatchRecord) -> None:
        """Count what the files hold, register them, and end the job: ``cancelled`` when
        asked, ``expired`` when requests were left, else ``finalizing -> completed``."""
        count_answers(record, self.files)
        counts = record.request_counts
        now = int(time.time())
        if record.status == "cancelling":
            final = "cancelled"
        elif counts["completed"] + counts["failed"] < counts["total"]:
            final = "expired"
        else:
            final = "completed"
            record.status, record.finalizing_at = "finalizing", now
            self.store.put_batch(record)
        register_outputs(record, self.files)
        record.status = final
        setattr(record, f"{final}_at", now)
        self.store.put_batch(record)
        print(f"batch {record.batch_id}: {final} {counts}", flush=True)

    def _fail(self, record: BatchRecord, errors: list[dict[str, Any]]) -> None:
        record.errors = errors
        record.status, record.failed_at = "failed", int(time.time())
        self.store.put_batch(record)
        print(f"batch {record.batch_id}: failed: {errors[0]['message']}", flush=True)


def _param(field: str, message: str) -> RequestError:
    return RequestError(message, location=Location("request", field=field))
