"""The matrix in every output format, saved runs, and the regression gate."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from kunlun.errors import ConfigError
from kunlun.validate import baseline, report
from kunlun.validate.matrix import Column, Matrix, Row, Status, failed, load_matrix, passed, skipped

ROWS = [Row("functional.short_text", "short text"), Row("perf.c1", "performance, concurrency 1"),
        Row("numerics.prompt_logprobs", "teacher-forced logprobs vs reference")]  # fmt: skip


def sample() -> Matrix:
    m = Matrix(list(ROWS), [Column("fp32", "http://h:1", "m", reference=True),
                            Column("bf16", "http://h:1", "m2")])  # fmt: skip
    m.set("fp32", "functional.short_text", passed("3/3 correct"))
    m.set("fp32", "perf.c1", passed("40 tok/s", output_tok_s=40.0, ttft_ms=80.0))
    m.set("fp32", "numerics.prompt_logprobs", passed("mean 0.0000", mean_abs_delta=0.0))
    m.set("bf16", "functional.short_text", failed("1/3 correct", "'x' -> 'y' | z"))
    m.set("bf16", "perf.c1", passed("30 tok/s", output_tok_s=30.0, ttft_ms=90.0))
    m.set("bf16", "numerics.prompt_logprobs", skipped("no reference"))
    m.meta["duration_s"] = 12.5
    return m


def test_markdown() -> None:
    text = report.to_markdown(sample())
    assert "| check | fp32 (reference) | bf16 |" in text
    assert "| short text | PASS 3/3 correct | FAIL 1/3 correct |" in text
    assert "- **FAIL** `functional.short_text` on `bf16`: 'x' -> 'y' \\| z" in text
    assert "4 PASS, 1 FAIL, 1 SKIP in 12.5 s" in text


def test_junit_and_html() -> None:
    root = ET.fromstring(report.to_junit(sample()).split("\n", 1)[1])
    bf16 = root.findall("testsuite")[1]
    assert (bf16.get("name"), bf16.get("failures"), bf16.get("skipped")) == ("bf16", "1", "1")
    failure = bf16.find("testcase[@name='functional.short_text']/failure")
    assert failure is not None and failure.get("message") == "1/3 correct"
    page = report.to_html(sample())
    assert '<td style="background:#f9d0d0" title="&#x27;x&#x27; -&gt; &#x27;y&#x27; | z">' in page


def test_json_round_trip(tmp_path: Path) -> None:
    paths = report.write_all(sample(), tmp_path)
    assert sorted(p.name for p in paths.values()) == sorted(report.FILES.values())
    again = load_matrix(paths["json"])
    assert again.to_dict() == sample().to_dict()


def test_bad_baseline_files_are_named(tmp_path: Path) -> None:
    path = tmp_path / "b.json"
    path.write_text("{not json")
    with pytest.raises(ConfigError, match="b.json: the baseline is not JSON"):
        load_matrix(path)
    path.write_text(json.dumps({"format": 99}))
    with pytest.raises(ConfigError, match="format 1 .format: 99"):
        load_matrix(path)
    with pytest.raises(ConfigError, match="cannot read the baseline"):
        load_matrix(tmp_path / "missing.json")


def test_baseline_regressions() -> None:
    base = sample()
    now = sample()
    now.set("fp32", "functional.short_text", failed("0/3 correct"))
    now.set("bf16", "perf.c1", passed("20 tok/s", output_tok_s=20.0, ttft_ms=95.0))
    now.columns.append(Column("new", "http://h:2", "m"))
    baseline.compare(now, base)
    fp32 = now.get("fp32", baseline.ROW.id)
    bf16 = now.get("bf16", baseline.ROW.id)
    new = now.get("new", baseline.ROW.id)
    assert fp32 is not None and fp32.status is Status.FAIL
    assert "functional.short_text PASS -> FAIL" in fp32.detail
    assert bf16 is not None and bf16.status is Status.FAIL
    assert bf16.detail == "perf.c1 output_tok_s 30 -> 20"  # -33 %; TTFT +5 ms is within limits
    assert new is not None and new.status is Status.SKIP and "no column 'new'" in new.detail
    same = sample()
    baseline.compare(same, base)
    assert all(c.get(baseline.ROW.id).status is Status.PASS for c in same.cells.values())  # type: ignore[union-attr]
