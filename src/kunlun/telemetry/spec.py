"""The ``telemetry`` section of a workload spec: per-step engine profiling.

```yaml
model: smollm2
telemetry:
  advanced_profiling: true     # off by default
  profiling_interval_ms: 50    # trace one step every 50 ms at most; 0 traces every step
```

With ``advanced_profiling`` on, each replica's worker writes its sampled engine steps as a
Chrome trace (:mod:`kunlun.engine.step_profiler`) to
``KUNLUN_HOME/logs/traces/<replica id>.<worker pid>.trace.json``; a restarted worker starts
a new file. It is a workload setting so that one model can be profiled while the others run
untouched, without restarting the daemon.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

TRACE_SUFFIX = ".trace.json"


class TelemetrySpec(BaseModel):
    """Telemetry settings of one workload."""

    model_config = ConfigDict(extra="forbid")

    advanced_profiling: bool = Field(
        False,
        description="Write per-step engine timings as a Chrome trace (costly: off by default).",
    )
    profiling_interval_ms: float = Field(
        50, ge=0, le=60_000, description="Trace at most one step per interval; 0 traces every step."
    )


def trace_dir(log_dir: Path) -> Path:
    """Where workers write their traces: ``<log dir>/traces``."""
    return log_dir / "traces"


def worker_profiling(
    spec: TelemetrySpec | None, log_dir: Path, replica_id: str
) -> dict[str, str | float]:
    """The worker's launch fields for ``spec`` (``trace_prefix``, ``profiling_interval_ms``;
    none when profiling is off)."""
    if spec is None or not spec.advanced_profiling:
        return {}
    prefix = trace_dir(log_dir) / replica_id
    return {"trace_prefix": str(prefix), "profiling_interval_ms": spec.profiling_interval_ms}


def trace_path(prefix: str | Path, pid: int) -> Path:
    """The trace file of the worker with ``pid`` (``<prefix>.<pid>.trace.json``)."""
    return Path(f"{prefix}.{pid}{TRACE_SUFFIX}")
