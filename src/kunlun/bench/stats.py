"""Benchmark math on plain timestamps: one :class:`RequestRecord` per request, one summary
per run. Every time is a ``time.perf_counter()`` reading in seconds taken by the client.

Definitions (also in ``docs/telemetry.md``):

- TTFT: from sending the request to receiving the first chunk whose text is not empty;
- E2E: from sending the request to the end of its stream;
- TPOT: (E2E - TTFT) / (output tokens - 1), for requests with at least two output tokens;
  output tokens are the server's ``usage.completion_tokens``. Chunks are timed once per
  network read, so chunks that arrived together share one time; when every chunk with
  text arrived in one read (a client that could not keep up, or a server that sent the
  whole answer at once), the time between tokens was never observed and TPOT is not
  measured (None), rather than a near-zero figure;
- ITL: the gaps between consecutive chunks with text, pooled over every request of the run
  (a chunk may carry more than one token, so ITL and TPOT differ);
- requests/s and output tokens/s: over the run's duration, from the first request sent to
  the last stream ended; only successful requests count;
- goodput: successful requests per second that met every SLO given (TTFT <= ``slo_ttft_ms``,
  TPOT <= ``slo_tpot_ms``; a one-token request has no TPOT and meets that SLO, a longer
  request whose TPOT was not measured does not).

Percentiles interpolate linearly between the two nearest ranks (numpy's default).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

QUANTILES = (50, 90, 99)


@dataclass
class RequestRecord:
    """The client's view of one streamed request."""

    start: float
    """When the request was sent."""
    end: float | None = None
    """When its stream ended (None when it never did)."""
    chunk_times: list[float] = field(default_factory=list)
    """Arrival of every chunk that carried text (one time per network read: chunks that
    arrived in the same read share it)."""
    num_output_tokens: int | None = None
    """``usage.completion_tokens`` from the server (None when it sent no usage)."""
    num_prompt_tokens: int | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.end is not None and bool(self.chunk_times)

    @property
    def ttft(self) -> float | None:
        return self.chunk_times[0] - self.start if self.chunk_times else None

    @property
    def e2e(self) -> float | None:
        return None if self.end is None else self.end - self.start

    @property
    def tpot(self) -> float | None:
        ttft, e2e, tokens = self.ttft, self.e2e, self.num_output_tokens
        if ttft is None or e2e is None or tokens is None or tokens < 2:
            return None
        if self.chunk_times[-1] == self.chunk_times[0]:
            return None  # every token arrived in one read: no time between them was seen
        return (e2e - ttft) / (tokens - 1)

    @property
    def itl(self) -> list[float]:
        times = self.chunk_times
        return [later - earlier for earlier, later in zip(times, times[1:], strict=False)]

    def meets(self, slo_ttft_s: float | None, slo_tpot_s: float | None) -> bool:
        """Whether it succeeded within the SLOs (None: no SLO on that figure)."""
        if not self.ok:
            return False
        ttft, tpot = self.ttft, self.tpot
        if slo_ttft_s is not None and (ttft is None or ttft > slo_ttft_s):
            return False
        if slo_tpot_s is None or (self.num_output_tokens or 0) < 2:
            return True
        return tpot is not None and tpot <= slo_tpot_s

    def to_dict(self) -> dict[str, Any]:
        return {
            "ttft_ms": _ms(self.ttft),
            "tpot_ms": _ms(self.tpot),
            "e2e_ms": _ms(self.e2e),
            "num_output_tokens": self.num_output_tokens,
            "num_prompt_tokens": self.num_prompt_tokens,
            "num_chunks": len(self.chunk_times),
            "error": self.error,
        }


def percentile(values: list[float], q: float) -> float:
    """The ``q``-th percentile (0..100) of a non-empty list, linear between ranks."""
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def distribution_ms(values: list[float]) -> dict[str, float | None]:
    """Mean and percentiles of ``values`` (seconds), in milliseconds; None when empty."""
    if not values:
        return {"mean": None, **{f"p{q}": None for q in QUANTILES}}
    out: dict[str, float | None] = {"mean": round(sum(values) / len(values) * 1e3, 3)}
    for q in QUANTILES:
        out[f"p{q}"] = round(percentile(values, q) * 1e3, 3)
    return out


def summarize(
    records: list[RequestRecord],
    slo_ttft_ms: float | None = None,
    slo_tpot_ms: float | None = None,
) -> dict[str, Any]:
    """The summary of one run (see the module docstring for every definition)."""
    ok = [r for r in records if r.ok]
    ends = [r.end for r in records if r.end is not None]
    duration = max(ends) - min(r.start for r in records) if records and ends else 0.0
    output_tokens = sum(r.num_output_tokens or 0 for r in ok)
    has_slo = slo_ttft_ms is not None or slo_tpot_ms is not None
    slo_ttft_s = None if slo_ttft_ms is None else slo_ttft_ms / 1e3
    slo_tpot_s = None if slo_tpot_ms is None else slo_tpot_ms / 1e3
    good = sum(r.meets(slo_ttft_s, slo_tpot_s) for r in ok) if has_slo else None
    return {
        "num_requests": len(records),
        "num_ok": len(ok),
        "num_errors": len(records) - len(ok),
        "errors": sorted({r.error or "no text received" for r in records if not r.ok})[:5],
        "duration_s": round(duration, 4),
        "requests_per_s": _rate(len(ok), duration),
        "output_tokens_per_s": _rate(output_tokens, duration),
        "total_output_tokens": output_tokens,
        "total_prompt_tokens": sum(r.num_prompt_tokens or 0 for r in ok),
        "num_slo_met": good,
        "goodput_requests_per_s": None if good is None else _rate(good, duration),
        "ttft_ms": distribution_ms([r.ttft for r in ok if r.ttft is not None]),
        "tpot_ms": distribution_ms([r.tpot for r in ok if r.tpot is not None]),
        "itl_ms": distribution_ms([gap for r in ok for gap in r.itl]),
        "e2e_ms": distribution_ms([r.e2e for r in ok if r.e2e is not None]),
    }


def _rate(count: float, duration: float) -> float | None:
    return round(count / duration, 4) if duration > 0 else None


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1e3, 3)
