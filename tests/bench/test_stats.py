"""The benchmark math on synthetic timestamps: every figure computed by hand."""

from __future__ import annotations

import pytest

from kunlun.bench.stats import RequestRecord, distribution_ms, percentile, summarize


def record(start: float, chunks: list[float], end: float, tokens: int | None) -> RequestRecord:
    return RequestRecord(
        start=start, end=end, chunk_times=chunks, num_output_tokens=tokens, num_prompt_tokens=10
    )


def test_one_request_figures() -> None:
    r = record(10.0, [10.2, 10.3, 10.5], 10.6, tokens=5)
    assert r.ok
    assert r.ttft == pytest.approx(0.2)
    assert r.e2e == pytest.approx(0.6)
    assert r.tpot == pytest.approx((0.6 - 0.2) / 4)  # (E2E - TTFT) / (tokens - 1)
    assert r.itl == pytest.approx([0.1, 0.2])


def test_tpot_needs_two_tokens_and_usage() -> None:
    assert record(0, [0.1], 0.1, tokens=1).tpot is None
    assert record(0, [0.1, 0.2], 0.3, tokens=None).tpot is None


def test_tokens_that_arrived_in_one_read_have_no_tpot() -> None:
    # Four tokens in chunks that all came with one network read: the time between tokens was
    # never observed, so there is no TPOT (not a near-zero one) and a TPOT SLO is not met.
    r = record(0.0, [0.5, 0.5, 0.5], 0.5001, tokens=4)
    assert r.ok and r.ttft == pytest.approx(0.5)
    assert r.tpot is None
    assert not r.meets(slo_ttft_s=10.0, slo_tpot_s=0.001)
    assert r.meets(slo_ttft_s=10.0, slo_tpot_s=None)
    # One token has no TPOT either, and meets a TPOT SLO by definition.
    assert record(0.0, [0.5], 0.5, tokens=1).meets(slo_ttft_s=None, slo_tpot_s=0.001)
    # Two reads: measured as usual.
    assert record(0.0, [0.5, 0.5, 0.8], 0.8, tokens=4).tpot == pytest.approx(0.1)


def test_failed_and_empty_requests_are_not_ok() -> None:
    assert not RequestRecord(start=0, end=1, error="HTTP 500: boom").ok
    assert not RequestRecord(start=0, end=1).ok  # no text ever came
    assert not RequestRecord(start=0, chunk_times=[0.5]).ok  # never ended


def test_percentile_interpolates_between_ranks() -> None:
    values = [1.0, 2.0, 3.0, 4.0]
    assert percentile(values, 50) == pytest.approx(2.5)
    assert percentile(values, 90) == pytest.approx(3.7)
    assert percentile(values, 0) == 1.0 and percentile(values, 100) == 4.0
    assert percentile([7.0], 99) == 7.0
    assert distribution_ms([]) == {"mean": None, "p50": None, "p90": None, "p99": None}
    assert distribution_ms([0.001, 0.003]) == {"mean": 2.0, "p50": 2.0, "p90": 2.8, "p99": 2.98}


def test_summary_of_a_run() -> None:
    records = [
        record(0.0, [0.1, 0.2, 0.3], 0.4, tokens=4),  # ttft 100 ms, tpot 100 ms
        record(0.5, [0.9, 1.0], 1.1, tokens=3),  # ttft 400 ms, tpot 100 ms
        record(1.0, [1.05, 1.1], 2.0, tokens=3),  # ttft 50 ms, tpot 475 ms
        RequestRecord(start=1.5, end=1.6, error="HTTP 429: queue full"),
    ]
    s = summarize(records, slo_ttft_ms=200, slo_tpot_ms=200)
    assert (s["num_requests"], s["num_ok"], s["num_errors"]) == (4, 3, 1)
    assert s["errors"] == ["HTTP 429: queue full"]
    assert s["duration_s"] == pytest.approx(2.0)  # first send 0.0 to last end 2.0
    assert s["requests_per_s"] == pytest.approx(1.5)  # 3 successful / 2 s
    assert s["total_output_tokens"] == 10
    assert s["output_tokens_per_s"] == pytest.approx(5.0)
    assert s["total_prompt_tokens"] == 30
    assert s["num_slo_met"] == 1  # only the first meets both
    assert s["goodput_requests_per_s"] == pytest.approx(0.5)
    assert s["ttft_ms"]["p50"] == pytest.approx(100)
    assert s["ttft_ms"]["mean"] == pytest.approx((100 + 400 + 50) / 3, abs=1e-3)  # rounded
    assert s["tpot_ms"]["p50"] == pytest.approx(100)
    # ITL pools the gaps of every request: 100, 100, 100, 50 ms
    assert s["itl_ms"]["mean"] == pytest.approx(87.5)
    assert s["itl_ms"]["p50"] == pytest.approx(100)
    assert s["e2e_ms"]["p50"] == pytest.approx(600)


def test_goodput_needs_an_slo_and_each_slo_alone() -> None:
    records = [record(0, [0.1, 0.2], 0.3, tokens=3), record(0, [0.5, 0.6], 0.7, tokens=3)]
    assert summarize(records)["goodput_requests_per_s"] is None
    assert summarize(records, slo_ttft_ms=200)["num_slo_met"] == 1
    assert summarize(records, slo_tpot_ms=50)["num_slo_met"] == 0  # both tpot 100 ms
    single = [record(0, [0.1], 0.1, tokens=1)]  # no TPOT: meets a TPOT SLO
    assert summarize(single, slo_tpot_ms=1)["num_slo_met"] == 1


def test_summary_of_nothing_useful() -> None:
    s = summarize([RequestRecord(start=0, end=0.1, error="HTTP 404: no such model")])
    assert s["num_ok"] == 0 and s["requests_per_s"] == 0 and s["ttft_ms"]["p50"] is None
