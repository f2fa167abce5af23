"""A batch job's output and error files: what they hold, and their records once it ends.

A job appends its answers to two journals under the file store's directory (output: 2xx,
errors: anything else), named by the ids in its record but not yet files of the API.
:func:`count_answers` reads back how many lines each holds (and the output's token usage),
so the counts are true after a resume or a crash; :func:`register_outputs` makes them files
of the API (purpose ``batch_output``) when the job ends, the error file only when it holds
failures; :func:`keep_written` does the same for a job that fails on an internal error,
keeping what was answered and removing the empty files. Kept apart from
:class:`~kunlun.batch.jobs.BatchJobs`, which runs the jobs and decides when they end.
"""

from __future__ import annotations

from kunlun.batch.files import FileStore
from kunlun.batch.journal import Journal
from kunlun.batch.objects import token_usage
from kunlun.state.store import BatchRecord


def count_answers(record: BatchRecord, files: FileStore) -> None:
    """Set the record's ``completed`` and ``failed`` counts, and its token usage, from what
    its output and error files hold."""
    counts = record.request_counts
    for file_id, name in (
        (record.output_file_id, "completed"),
        (record.error_file_id, "failed"),
    ):
        if file_id is not None:
            journal = Journal.open(files.path(file_id), "custom_id")
            counts[name] = len(journal.ids)
            if file_id == record.output_file_id:
                record.usage = token_usage(journal.records())
            journal.close()


def register_outputs(record: BatchRecord, files: FileStore) -> None:
    """Record the output file, and the error file when requests failed, as the job's
    ``batch_output`` files (expiring after ``output_expires_after_s``)."""
    counts = record.request_counts
    ttl = record.output_expires_after_s
    if record.output_file_id is not None:
        files.register(
            record.output_file_id, f"{record.batch_id}_output.jsonl", "batch_output", ttl
        )
        if counts["failed"] and record.error_file_id is not None:
            files.register(
                record.error_file_id, f"{record.batch_id}_error.jsonl", "batch_output", ttl
            )


def keep_written(record: BatchRecord, files: FileStore) -> None:
    """Before a job fails on an internal error: register the output and error files that
    hold lines (so what was answered can still be read) and remove the empty ones, so
    no unregistered file is left behind."""
    for name in ("output_file_id", "error_file_id"):
        file_id = getattr(record, name)
        if file_id is None:
            continue
        path = files.path(file_id)
        try:
            if path.exists() and path.stat().st_size > 0:
                kind = "output" if name == "output_file_id" else "error"
                files.register(
                    file_id,
                    f"{record.batch_id}_{kind}.jsonl",
                    "batch_output",
                    record.output_expires_after_s,
                )
                continue
            path.unlink(missing_ok=True)
        except OSError as exc:  # a broken disk: say so, the job still fails cleanly
            print(f"batch {record.batch_id}: cannot keep {path}: {exc}", flush=True)
        setattr(record, name, None)
