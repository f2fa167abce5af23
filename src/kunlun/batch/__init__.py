"""Batch inference: JSON-lines jobs that survive interruptions.

Two front ends share the same durable pieces:

- ``kunlun-cli batch run`` (:mod:`~kunlun.batch.task`, :mod:`~kunlun.batch.inputs`,
  :mod:`~kunlun.batch.runner`): a client that sends one request per input line to an
  OpenAI-compatible endpoint, ``batch_size`` in flight, and writes ``results.jsonl``,
  ``failures.jsonl`` and ``summary.json``; a rerun resumes where the last one stopped.
- The OpenAI Batch API on the daemon (:mod:`~kunlun.batch.files`, :mod:`~kunlun.batch.jobs`,
  :mod:`~kunlun.batch.sending`, :mod:`~kunlun.batch.outputs`): uploaded request files, batch
  jobs recorded in the state store and run in the background, resumed after a restart.

Both append results to a :class:`~kunlun.batch.journal.Journal` (each line fsynced; a torn
last line is discarded on recovery, so every id is written exactly once) and retry with
:class:`~kunlun.batch.retry.RetryPolicy` (exponential backoff with jitter, ``Retry-After``).
"""
