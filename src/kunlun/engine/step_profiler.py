"""Per-step engine timings written as a Chrome trace (the ``advanced_profiling`` switch).

A :class:`StepProfiler` records, for the steps it samples, how long each phase of
:meth:`LLMEngine.step` took and what the batch held, and appends them to a trace file in the
Trace Event Format that ``chrome://tracing`` and Perfetto (ui.perfetto.dev) open:

- one complete event (``"ph": "X"``) named ``step`` per traced step, with ``args``
  ``step``, ``batch_size``, ``num_tokens``, ``num_prefill``, ``num_decode``;
- one complete event per phase inside it, in order: ``schedule`` (the scheduler picks the
  batch), ``prepare`` (flat batch tensors and attention metadata), ``forward`` (model and
  logits), ``sample``, ``postprocess`` (scheduler bookkeeping, failed requests),
  ``detokenize`` (tokens to text deltas);
- one counter event (``"ph": "C"``) named ``batch`` with ``seqs`` and ``tokens``.

Sampling: a step is traced when at least ``interval_ms`` have passed since the start of the
last traced step (0 traces every step), which bounds the file's growth and the cost.

The file uses the format's JSON-array form: ``[`` then events separated by commas, and ``]``
when the profiler is closed. The closing bracket is optional in that form, so a trace cut
short by a crash still opens. Events are buffered and written at most about once a second.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any, TextIO

_FLUSH_EVERY_S = 1.0
_FLUSH_EVERY_EVENTS = 512


class StepTrace:
    """The phase boundaries of one traced step (see :class:`StepProfiler.begin`)."""

    active = True

    def __init__(self, profiler: StepProfiler) -> None:
        self._profiler = profiler
        self._marks: list[tuple[str, int]] = [("", time.perf_counter_ns())]

    def mark(self, phase: str) -> None:
        """``phase`` ended now (it began at the previous mark, or at the step's start)."""
        self._marks.append((phase, time.perf_counter_ns()))

    def end(self, num_new_tokens: list[int]) -> None:
        """The step is over (it computed ``num_new_tokens`` per sequence; a sequence with
        more than one is a prefill chunk): hand its events to the profiler."""
        num_prefill = sum(n > 1 for n in num_new_tokens)
        self._profiler.record(self._marks, len(num_new_tokens), sum(num_new_tokens), num_prefill)


class _NoTrace(StepTrace):
    """What an untraced step uses: every call does nothing."""

    active = False

    def __init__(self) -> None:
        pass

    def mark(self, phase: str) -> None:
        pass

    def end(self, num_new_tokens: list[int]) -> None:
        pass


NO_TRACE: StepTrace = _NoTrace()
"""The trace of a step that is not profiled."""


class StepProfiler:
    """Writes sampled engine steps to ``path`` as a Chrome trace; see the module docstring.

    ``begin`` and ``record`` are called from the engine thread; ``close`` from any thread.
    """

    def __init__(self, path: str | Path, interval_ms: float = 0.0, *, name: str = "engine") -> None:
        if interval_ms < 0:
            raise ValueError(f"interval_ms={interval_ms} must be >= 0")
        self.path = Path(path)
        self.interval_ns = int(interval_ms * 1e6)
        self.num_traced = 0
        self._num_steps = 0
        self._last_start: int | None = None
        self._origin = time.perf_counter_ns()
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self._pending: list[dict[str, Any]] = []
        self._last_flush = time.monotonic()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file: TextIO | None = self.path.open("w", encoding="utf-8")
        self._first = True
        meta = {
            "name": "process_name",
            "ph": "M",
            "pid": self._pid,
            "tid": 0,
            "args": {"name": f"kunlun {name} (pid {self._pid})"},
        }
        thread = {
            "name": "thread_name",
            "ph": "M",
            "pid": self._pid,
            "tid": 0,
            "args": {"name": "engine steps"},
        }
        self._pending += [meta, thread]
        self.flush()

    def begin(self) -> StepTrace:
        """Start of a step: its trace, or :data:`NO_TRACE` when the step is not sampled."""
        self._num_steps += 1
        now = time.perf_counter_ns()
        if self._file is None or (
            self._last_start is not None and now - self._last_start < self.interval_ns
        ):
            return NO_TRACE
        self._last_start = now
        return StepTrace(self)

    def record(
        self, marks: list[tuple[str, int]], batch_size: int, num_tokens: int, num_prefill: int
    ) -> None:
        """Queue the events of one traced step (``marks``: phase name, end time in ns)."""
        start, end = marks[0][1], marks[-1][1]
        common = {"pid": self._pid, "tid": 0, "cat": "engine"}
        args = {
            "step": self._num_steps,
            "batch_size": batch_size,
            "num_tokens": num_tokens,
            "num_prefill": num_prefill,
            "num_decode": batch_size - num_prefill,
        }
        events = [
            {
                "name": "step",
                "ph": "X",
                "ts": self._us(start),
                "dur": (end - start) / 1e3,
                "args": args,
                **common,
            }
        ]
        for (_, began), (phase, ended) in zip(marks, marks[1:], strict=False):
            events.append(
                {
                    "name": phase,
                    "ph": "X",
                    "ts": self._us(began),
                    "dur": (ended - began) / 1e3,
                    **common,
                }
            )
        events.append(
            {
                "name": "batch",
                "ph": "C",
                "ts": self._us(start),
                "pid": self._pid,
                "tid": 0,
                "args": {"seqs": batch_size, "tokens": num_tokens},
            }
        )
        with self._lock:
            self._pending += events
            self.num_traced += 1
            due = time.monotonic() - self._last_flush >= _FLUSH_EVERY_S
        if due or len(self._pending) >= _FLUSH_EVERY_EVENTS:
            self.flush()

    def flush(self) -> None:
        """Write the queued events to the file."""
        with self._lock:
            events, self._pending = self._pending, []
            if self._file is None or not events:
                return
            text = ",\n".join(json.dumps(e, separators=(",", ":")) for e in events)
            self._file.write(("[" if self._first else ",\n") + text)
            self._file.flush()
            self._first = False
            self._last_flush = time.monotonic()

    def close(self) -> None:
        """Write what is queued and the closing bracket; later steps are not traced."""
        self.flush()
        with self._lock:
            if self._file is not None:
                self._file.write("]\n")  # the metadata events were written at once
                self._file.close()
                self._file = None

    def _us(self, ns: int) -> float:
        return (ns - self._origin) / 1e3
