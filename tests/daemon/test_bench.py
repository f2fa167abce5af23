"""``kunlun-cli bench`` against a real daemon serving the tiny model, at tiny sizes."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import pytest
from tests.daemons import Daemon

from kunlun.bench.report import run_label
from kunlun.bench.suite import CLIENT_CPU_WARN

INPUT_LEN, OUTPUT_LEN, NUM_PROMPTS = 8, 4, 3


def test_bench_sweep_poisson_json_and_chart(tiny_daemon: Daemon, tmp_path: Path) -> None:
    daemon = tiny_daemon
    out = tmp_path / "bench"
    proc = daemon.cli(
        "bench",
        "--endpoint",
        daemon.url + "/v1",
        "--model",
        "tiny",
        "--concurrency",
        "1,2",
        "--rate",
        "8",
        "--num-prompts",
        str(NUM_PROMPTS),
        "--input-len",
        str(INPUT_LEN),
        "--output-len",
        str(OUTPUT_LEN),
        "--slo-ttft-ms",
        "60000",
        "--slo-tpot-ms",
        "1",
        "--out",
        str(out),
        remote=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for word in (
        "concurrency 1",
        "concurrency 2",
        "Poisson 8/s",
        "TTFT ms p50/p90/p99",
        "platform memory",
        "start-up of",
    ):
        assert word in proc.stdout
    doc = json.loads((out / "bench.json").read_text())
    assert [(r["mode"], r["concurrency"], r["rate"]) for r in doc["runs"]] == [
        ("concurrency", 1, None),
        ("concurrency", 2, None),
        ("poisson", None, 8.0),
    ]
    for run in doc["runs"]:
        assert (run["num_requests"], run["num_ok"], run["num_errors"]) == (
            NUM_PROMPTS,
            NUM_PROMPTS,
            0,
        )
        assert run["total_output_tokens"] == NUM_PROMPTS * OUTPUT_LEN  # ignore_eos held
        assert run["total_prompt_tokens"] == NUM_PROMPTS * INPUT_LEN  # token-id prompts, exact
        # the rates come from the unrounded duration; duration_s is rounded to 0.1 ms, which
        # on a fast run (12 tokens in 0.04 s) is more than 0.1 % of it
        assert within_rounding(run["output_tokens_per_s"], run["total_output_tokens"], run)
        assert within_rounding(run["requests_per_s"], NUM_PROMPTS, run)
        # The SLO count follows the per-request figures, whatever speed this machine has: a
        # request meets the 1 ms TPOT SLO only when its TPOT was measured and is that low.
        met = [
            r
            for r in run["requests"]
            if r["ttft_ms"] <= 60000 and r["tpot_ms"] is not None and r["tpot_ms"] <= 1
        ]
        assert run["num_slo_met"] == len(met)
        # one met request in 0.04 s: duration_s's rounding alone is over 0.1 % of the rate
        assert within_rounding(run["goodput_requests_per_s"], len(met), run)
        for request in run["requests"]:
            assert request["num_output_tokens"] == OUTPUT_LEN
            assert request["num_prompt_tokens"] == INPUT_LEN
            assert 0 < request["ttft_ms"] <= request["e2e_ms"]
            assert 1 <= request["num_chunks"] <= OUTPUT_LEN
            assert request["e2e_ms"] <= run["duration_s"] * 1e3 + 0.1  # duration: 0.1 ms steps
            if request["tpot_ms"] is None:
                # every chunk came in one network read (a client behind on a loaded machine):
                # the time between tokens was never seen, so bench reports none (stats.py)
                # rather than a near-zero TPOT, and the request cannot meet the TPOT SLO
                assert request not in met
                continue
            tpot = (request["e2e_ms"] - request["ttft_ms"]) / (OUTPUT_LEN - 1)
            assert request["tpot_ms"] == pytest.approx(tpot, abs=0.01)
        assert run["ttft_ms"]["p50"] <= run["ttft_ms"]["p99"] <= run["e2e_ms"]["p99"]
        assert run["peak_memory_bytes"] > 0
    # the benchmark's own CPU, per run and in all; a run over 5 % of its wall time is named
    for part in [*(r["client"] for r in doc["runs"]), doc["client"]]:
        assert part["cpu_s"] >= 0 and part["wall_s"] > 0
        # (from the unrounded times: the rounded ones are 0.5 ms off each)
        slack = 1e-3 + 1e-3 / part["wall_s"]
        assert part["cpu_share"] == pytest.approx(part["cpu_s"] / part["wall_s"], abs=slack)
    over = [run_label(r) for r in doc["runs"] if r["client"]["cpu_share"] > CLIENT_CPU_WARN]
    assert [w.split(":")[0] for w in doc["warnings"]] == over
    assert "this benchmark's own CPU: " in proc.stdout
    memory = doc["memory"]
    assert memory["idle_bytes"] > 0 and memory["one_request_bytes"] > 0
    assert memory["full_concurrency_bytes"] == doc["runs"][1]["peak_memory_bytes"]
    (startup,) = doc["startup"]
    assert startup["device"] == "cpu:0" and startup["load_s"] > 0 and startup["total_s"] > 0
    png = (out / "bench.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and png[12:16] == b"IHDR"
    width, height = struct.unpack(">II", png[16:24])
    assert (width, height) == (1200, 450)  # 12 x 4.5 inches at 100 dpi
    from PIL import Image

    with Image.open(out / "bench.png") as image:
        image.verify()  # the whole file decodes


def test_bench_errors(tiny_daemon: Daemon, tmp_path: Path) -> None:
    daemon = tiny_daemon
    wrong = daemon.cli(
        "bench",
        "--endpoint",
        daemon.url,
        "--model",
        "no-such-model",
        "--out",
        str(tmp_path),
        remote=False,
    )
    assert wrong.returncode == 1
    assert "warm-up request" in wrong.stderr and "no-such-model" in wrong.stderr
    bad = daemon.cli(
        "bench",
        "--endpoint",
        daemon.url,
        "--model",
        "tiny",
        "--concurrency",
        "1,x",
        remote=False,
    )
    assert bad.returncode == 2 and "--concurrency" in bad.stderr and "'1,x'" in bad.stderr
    url = daemon.cli("bench", "--endpoint", "localhost:8470", "--model", "m", remote=False)
    assert url.returncode == 2 and "not an http(s) URL" in url.stderr


def within_rounding(rate: float, count: int, run: dict[str, Any]) -> bool:
    """Whether ``rate`` is ``count`` over some duration that rounds to ``duration_s``."""
    duration = run["duration_s"]
    return count / (duration + 5e-5) * (1 - 1e-4) <= rate <= count / (duration - 5e-5) * (1 + 1e-4)
