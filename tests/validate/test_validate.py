"""``kunlun-cli validate`` against a real daemon: the demo model passes, broken servers fail.

The positive run is the command ``docs/validation.md`` shows: the demo model served as an
fp32 and a bf16 workload, two columns, fp32 the reference (the whole battery where the CPU
computes bf16 natively, the rows of :data:`EMULATED_BF16_ROWS` elsewhere). The negative controls are real
HTTP servers on loopback (:mod:`tests.validate.faults`) in front of the same daemon, each
broken one way, and a workload whose weights carry noise; each must fail its own row.
"""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from tests.daemons import Daemon, battery_parts, bf16_is_native
from tests.serving.conftest import serve_in_thread
from tests.validate.conftest import validate
from tests.validate.faults import faulty_app

from kunlun.validate.accuracy import SHIPPED
from kunlun.validate.functional import batch_runner_installed

FP32, BF16, PERTURBED = "smollm2-fp32", "smollm2-bf16", "smollm2-perturbed"
ALLOWED_SKIPS = {"api.error_401": "the endpoint has no API keys"}


def load(out: Path) -> dict[str, Any]:
    return json.loads((out / "validation.json").read_text())


def status(run: dict[str, Any], column: str, row: str) -> str:
    return str(run["cells"][column][row]["status"])


EMULATED_BF16_ROWS = (
    "numerics.prompt_logprobs",
    "numerics.greedy_divergence",
    "functional.short_text",
    "functional.long_text",
    "api.sse",
    "api.usage",
    "perf.c1",
)
"""The rows run where the CPU has no native bf16: bf16 is emulated there, about 100x slower
than fp32, and the whole battery on it took 15 minutes of a 2-core CI machine. The numerics
rows are what bf16 changes; the whole battery runs on the fp32 column and, where the CPU
has native bf16, on bf16 too."""


PARTS = {part: rows for part, rows in battery_parts().items() if part != "accuracy"}
"""The battery's parts but accuracy's: scoring the whole evaluation set is the longest row by
far (about 25 s a column here), and the accuracy row is run on its own below."""


def parts(full: bool) -> dict[str, list[str]]:
    """The ``--only`` selections of the positive run, one per part of the battery (each a
    minute or less on two cores): its rows, or those of :data:`EMULATED_BF16_ROWS`."""
    return {part: [r for r in rows if full or r in EMULATED_BF16_ROWS]
            for part, rows in PARTS.items()}  # fmt: skip


@pytest.mark.parametrize("part", PARTS)
def test_demo_model_passes_with_fp32_reference_and_bf16(
    platform: Daemon, tmp_path: Path, part: str
) -> None:
    out = tmp_path / "out"
    full = bf16_is_native()
    selected = parts(full)[part]
    if not selected:  # (--only with nothing would be everything)
        pytest.skip(f"no row of part {part} is run where bf16 is emulated (EMULATED_BF16_ROWS)")
    only = [arg for row in selected for arg in ("--only", row)]
    proc = validate(platform, "--endpoint", platform.url, "--model", FP32, "--model", BF16,
                    "--reference", FP32, *only, "--out", str(out), "--seed", "7")  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    run = load(out)
    assert [c["name"] for c in run["columns"]] == [FP32, BF16]
    assert run["columns"][0]["reference"] is True
    allowed = dict(ALLOWED_SKIPS)
    if not batch_runner_installed():
        allowed["functional.batch"] = "batch runner not installed"
    for column in (FP32, BF16):
        cells = run["cells"][column]
        assert len(cells) == len(run["rows"]) >= len(selected) + 2  # + garbage and routing
        for row, cell in cells.items():
            if cell["status"] == "SKIP":
                assert row in allowed and allowed[row] in cell["detail"], (column, row, cell)
            else:
                assert cell["status"] == "PASS", (column, row, cell)
    assert run["cells"][BF16]["quality.routing"]["figure"] == "cpu:0"
    markdown = (out / "validation.md").read_text()
    if "numerics.prompt_logprobs" in selected:
        assert "mean" in run["cells"][BF16]["numerics.prompt_logprobs"]["figure"]
    if "functional.long_text" in selected:
        assert "| long text (3,000 chars) | PASS code found" in markdown
    # every format says the same
    assert f"| check | {FP32} (reference) | {BF16} |" in markdown
    suites = ET.parse(out / "validation.junit.xml").getroot()
    assert [s.get("name") for s in suites] == [FP32, BF16]
    assert all(s.get("failures") == "0" for s in suites)
    assert "<table>" in (out / "validation.html").read_text()
    assert "PASS" in proc.stdout and "written:" in proc.stdout


SERVING_FUNCTIONAL_ROWS = ("functional.concurrency", "functional.temperature", "functional.batch")
"""The functional rows of the serving path (20 requests at once, sampling, the batch runner):
the quantized and k-quant columns run only the rows a scheme changes
(``tests.daemons.QUALITY_ROWS``), so where bf16 is emulated (the positive run above cut to
:data:`EMULATED_BF16_ROWS`) these run on the fp32 column alone, below."""


def test_the_serving_functional_rows_pass_on_fp32(platform: Daemon, tmp_path: Path) -> None:
    if bf16_is_native():
        pytest.skip("the whole battery ran on the fp32 and bf16 columns above")
    only = [arg for row in SERVING_FUNCTIONAL_ROWS for arg in ("--only", row)]
    proc = validate(platform, "--endpoint", platform.url, "--model", FP32, *only,
                    "--out", str(tmp_path), "--seed", "7")  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    cells = load(tmp_path)["cells"][FP32]
    for row in SERVING_FUNCTIONAL_ROWS:
        skipped = row == "functional.batch" and not batch_runner_installed()
        assert cells[row]["status"] == ("SKIP" if skipped else "PASS"), (row, cells[row])


def test_the_baseline_gate_passes_the_same_speed_and_fails_a_regression(
    platform: Daemon, tmp_path: Path
) -> None:
    # The gate against a baseline, both ways, on the fp32 column (the gate is the same for
    # every column; fp32 is the fast one on CPUs without native bf16). Two runs' speeds
    # differ on a loaded machine, so each baseline's speed figures are set far on one side of
    # a first run's: 1000x slower (no regression) or 1000x faster (a regression); the gate's
    # logic is what is tested.
    out, again = tmp_path / "out", tmp_path / "again"
    proc = validate(platform, "--endpoint", platform.url, "--model", FP32, "--only", "perf.c1",
                    "--only", "api.models", "--out", str(out))  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    slower = load(out)
    metrics = slower["cells"][FP32]["perf.c1"]["metrics"]
    metrics["output_tok_s"] /= 1000
    metrics["ttft_ms"] *= 1000
    (tmp_path / "slower.json").write_text(json.dumps(slower))
    proc = validate(platform, "--endpoint", platform.url, "--model", FP32, "--only", "perf.c1",
                    "--only", "api.models", "--baseline", str(tmp_path / "slower.json"),
                    "--out", str(again))  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert status(load(again), FP32, "regression.baseline") == "PASS"
    doctored = load(out)
    doctored["cells"][FP32]["perf.c1"]["metrics"]["output_tok_s"] *= 1000
    (tmp_path / "doctored.json").write_text(json.dumps(doctored))
    proc = validate(platform, "--endpoint", platform.url, "--model", FP32, "--only", "perf.c1",
                    "--baseline", str(tmp_path / "doctored.json"), "--out", str(again))  # fmt: skip
    assert proc.returncode == 1, proc.stdout + proc.stderr
    cell = load(again)["cells"][FP32]["regression.baseline"]
    assert cell["status"] == "FAIL" and "perf.c1 output_tok_s" in cell["detail"]


def test_all_pools_makes_one_column_per_pool(platform: Daemon, tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = validate(platform, "--all-pools", "--model", FP32, "--only", "functional.short_text",
                    "--only", "functional.batch", "--out", str(out))  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    run = load(out)
    assert [(c["name"], c["pool"]) for c in run["columns"]] == [("cpu", "cpu")]
    assert status(run, "cpu", "functional.short_text") == "PASS"
    # the batch runner reaches the pool through the relay (once it is installed)
    assert status(run, "cpu", "functional.batch") == (
        "PASS" if batch_runner_installed() else "SKIP"
    )
    assert run["cells"]["cpu"]["quality.routing"]["figure"] == "cpu:0"


@pytest.fixture(scope="module")
def faulty(platform: Daemon) -> Iterator[str]:
    """The broken endpoints' root: ``{root}/{fault}`` is one endpoint per fault."""
    server, base_url, thread = serve_in_thread(faulty_app(platform.url))
    yield base_url
    server.should_exit = True  # type: ignore[attr-defined]
    thread.join(10)


FAULT_ROWS = {
    "bad_sse": {"api.sse": "no 'data: [DONE]' event"},
    "wrong_usage": {"api.usage": "length finish miscounted"},
    "flaky_500": {"functional.concurrency": "HTTP 500"},
    "garbage": {"functional.short_text": "capital of", "quality.garbage": "a run of"},
    "drop_history": {"functional.multi_turn": "prompt_tokens did not grow"},
    "truncate": {"functional.long_text": "truncated?"},
    "drop_tools": {"api.tools": "expected tool_calls"},
}
"""For each broken endpoint: the rows that must fail, and words their figure or detail must
hold."""


@pytest.mark.parametrize("fault", sorted(FAULT_ROWS))
def test_broken_endpoint_fails_its_row(
    platform: Daemon, faulty: str, fault: str, tmp_path: Path
) -> None:
    rows = FAULT_ROWS[fault]
    only = [arg for row in rows if row != "quality.garbage" for arg in ("--only", row)]
    proc = validate(platform, "--target", f"{fault}={faulty}/{fault},model={FP32}", *only,
                    "--out", str(tmp_path))  # fmt: skip
    assert proc.returncode == 1, proc.stdout + proc.stderr
    cells = load(tmp_path)["cells"][fault]
    for row, words in rows.items():
        said = f"{cells[row]['figure']}: {cells[row]['detail']}"
        assert cells[row]["status"] == "FAIL" and words in said, cells[row]
        assert f"FAIL {row} on {fault}: " in proc.stdout


def test_healthy_proxy_passes_the_rows_the_faults_fail(
    platform: Daemon, faulty: str, tmp_path: Path
) -> None:
    """The control: the same proxy forwarding untouched fails none of those rows."""
    rows = sorted({row for rows in FAULT_ROWS.values() for row in rows} - {"quality.garbage"})
    only = [arg for row in rows for arg in ("--only", row)]
    # the seed of the passing run of these rows (a random one left the demo model to
    # forget the number of the 5-turn row once: a chance of the model, not of the proxy)
    proc = validate(platform, "--target", f"healthy={faulty}/healthy,model={FP32}", *only,
                    "--out", str(tmp_path), "--seed", "7")  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    cells = load(tmp_path)["cells"]["healthy"]
    assert {row: cells[row]["status"] for row in [*rows, "quality.garbage"]} == {
        row: "PASS" for row in [*rows, "quality.garbage"]
    }


@pytest.mark.parametrize(
    "rows",
    [("numerics.prompt_logprobs", "numerics.greedy_divergence"), ("numerics.cross_engine",)],
    ids=["echo", "no-echo"],
)
def test_perturbed_weights_fail_the_numerics(
    platform: Daemon, tmp_path: Path, rows: tuple[str, ...]
) -> None:
    only = [arg for row in rows for arg in ("--only", row)]
    proc = validate(platform, "--endpoint", platform.url, "--model", FP32, "--model", PERTURBED,
                    *only, "--out", str(tmp_path))  # fmt: skip
    assert proc.returncode == 1, proc.stdout + proc.stderr
    run = load(tmp_path)
    for row in rows:
        assert status(run, FP32, row) == "PASS"  # the reference against itself
        assert status(run, PERTURBED, row) == "FAIL", run["cells"][PERTURBED][row]


def test_wrong_key_gets_401_once_keys_exist(platform: Daemon, tmp_path: Path) -> None:
    created = platform.cli("apikey", "create", "validate-test", "--scope", "admin", "--json")
    assert created.returncode == 0, created.stderr
    key, key_id = json.loads(created.stdout)["key"], json.loads(created.stdout)["key_id"]
    try:
        proc = validate(platform, "--endpoint", platform.url, "--model", FP32, "--only",
                        "api.error_401", "--api-key", key, "--out", str(tmp_path))  # fmt: skip
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert status(load(tmp_path), FP32, "api.error_401") == "PASS"
    finally:
        assert platform.cli("apikey", "revoke", key_id, key=key).returncode == 0


def test_adapting_noisy_weights_against_the_served_model_fails_accuracy_and_numerics(
    platform: Daemon, tmp_path: Path
) -> None:
    """Day one with bad weights: ``kunlun-cli adapt`` of the perturbed copy (a model
    directory) held to the demo model the platform serves (``--reference-model``). On every
    tenth item of the shipped set (23; the whole set's figures are in docs/validation.md) the
    demo scores far above chance and the copy more than the gate's 5 points below it; its
    logprobs are off too; the run exits 1 and stops the workload it started."""
    subset = tmp_path / "every-third.jsonl"
    subset.write_text("\n".join(SHIPPED.read_text().splitlines()[::10]) + "\n")
    out = tmp_path / "adapt"
    proc = platform.cli("adapt", "--model", str(platform.home / "perturbed"), "--reference-model",
                        FP32, "--only", "numerics.prompt_logprobs", "--only", "accuracy",
                        "--eval", str(subset), "--requests", "2", "--output-len", "4", "--concurrency", "2",
                        "--out", str(out), timeout=900)  # fmt: skip
    assert proc.returncode == 1, proc.stdout + proc.stderr
    (column,) = json.loads((out / "adapt.json").read_text())["columns"]
    gates = column["verdicts"]
    print(
        {gate: f"{v['status']} {v['figure']}" for gate, v in gates.items()},
        json.loads((out / "adapt.json").read_text())["seconds"],
    )
    assert {g: gates[g]["status"] for g in ("plan", "start", "smoke", "numerics", "accuracy")} == {
        "plan": "PASS",
        "start": "PASS",
        "smoke": "PASS",
        "numerics": "FAIL",
        "accuracy": "FAIL",
    }
    assert "more than 5 points" in gates["accuracy"]["why"], gates["accuracy"]
    cells = load(out)["cells"]
    ours = cells[f"reference:{FP32}"]["accuracy.multiple_choice"]
    assert ours["status"] == "PASS" and ours["metrics"]["chance"] == 0.25, ours
    assert ours["metrics"]["items"] == 23 and ours["metrics"]["accuracy"] >= 0.5, ours
    noisy = cells[column["column"]]["accuracy.multiple_choice"]
    assert noisy["metrics"]["reference_accuracy"] == ours["metrics"]["accuracy"]
    states = {w["name"]: w["state"] for w in platform.get("/api/v1/workloads").json()}
    assert states[column["name"]] == "STOPPED" and states[FP32] == "RUNNING"
