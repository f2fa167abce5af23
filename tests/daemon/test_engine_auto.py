"""``engine: auto`` picks by measured speed: ``kunlun-cli bench --record`` against each engine's
workload of the demo model, then a new ``auto`` workload runs on the one measured faster.

Everything is real: the daemon, the embedded engine's worker, ``llama-server``, and the bench
CLI's requests; which engine is faster on this machine is whatever the two runs measured, and
the test checks that ``auto`` follows the figures the daemon kept (and says them).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tests import loopback
from tests.daemons import SPEC, Daemon, Profile, daemon_fixture, submit_demo

from kunlun.engines.adapter import find_binary
from kunlun.engines.measured import Measurement, faster_engine

pytestmark = pytest.mark.skipif(
    find_binary("llama-server") is None, reason="llama-server is not built (make llama-server)"
)


daemon = daemon_fixture(Profile(
    "engine-auto-home", (SPEC, SPEC + "name: smollm2-llama\nengine: llama.cpp\n"), demo=True
))  # fmt: skip
"""The demo model twice: ``smollm2`` on the embedded engine, ``smollm2-llama`` on llama.cpp."""


def bench(daemon: Daemon, workload: str, tmp_path: Path) -> dict[str, float]:
    proc = daemon.cli("bench", "--endpoint", daemon.url, "--model", workload, "--concurrency",
                      "1,2", "--num-prompts", "2", "--input-len", "8", "--output-len", "8",
                      "--out", str(tmp_path / workload), "--record")  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "recorded for model smollm2:" in proc.stdout
    doc = json.loads((tmp_path / workload / "bench.json").read_text())
    return {str(r["concurrency"]): r["output_tokens_per_s"] for r in doc["runs"]}


def test_auto_runs_the_engine_measured_faster(daemon: Daemon, tmp_path: Path) -> None:
    dry = daemon.cli("workload", "submit", "--model", "smollm2", "--name", "third",
                     "--dry-run", "--json")  # fmt: skip
    assert dry.returncode == 0, dry.stderr
    before = json.loads(dry.stdout)["placement"]["engine"]
    assert before["chosen"] == "kunlun" and "no two engines measured here" in before["why"]

    kunlun, llama = bench(daemon, "smollm2", tmp_path), bench(daemon, "smollm2-llama", tmp_path)
    (model,) = [m for m in daemon.get("/api/v1/models").json() if m["alias"] == "smollm2"]
    kept = {m["engine"]: m for m in model["meta"]["measured"]}
    assert kept["kunlun"]["tokens_per_s"] == kunlun and kept["llama.cpp"]["tokens_per_s"] == llama
    assert {m["device_type"] for m in kept.values()} == {"cpu"}
    faster = "llama.cpp" if llama["2"] > kunlun["2"] else "kunlun"
    slower = "kunlun" if faster == "llama.cpp" else "llama.cpp"

    dry = daemon.cli("workload", "submit", "--model", "smollm2", "--name", "third",
                     "--dry-run", "--json")  # fmt: skip
    assert dry.returncode == 0, dry.stderr
    engine = json.loads(dry.stdout)["placement"]["engine"]
    assert engine["chosen"] == faster
    assert (
        f"measured fastest on cpu at quantization {kept[faster]['quantization']}" in (engine["why"])
    )
    assert f"{faster} {max(llama['2'], kunlun['2']):.1f}" in engine["why"]
    (other,) = [r["reason"] for r in engine["rejected"] if r["engine"] == slower]
    assert other.startswith(f"measured slower: {min(llama['2'], kunlun['2']):.1f} vs {faster}")

    forced = daemon.cli("workload", "submit", "--model", "smollm2", "--name", "third", "--engine", slower,
                        "--dry-run", "--json")  # fmt: skip
    assert forced.returncode == 0, forced.stderr
    assert json.loads(forced.stdout)["placement"]["engine"]["chosen"] == slower


def test_a_bad_measurement_is_refused_naming_what(daemon: Daemon) -> None:
    url = daemon.url + "/api/v1/workloads/smollm2/measurements"
    bad = loopback.post(url, json={"runs": [{"concurrency": 0, "output_tokens_per_s": 3}]})
    assert bad.status_code == 400 and "concurrency 0 is not an integer >= 1" in bad.text
    bad = loopback.post(url, json={"runs": [], "extra": 1})
    assert bad.status_code == 400 and "extra" in bad.text
    missing = loopback.post(daemon.url + "/api/v1/workloads/nope/measurements",
                         json={"runs": [{"concurrency": 1, "output_tokens_per_s": 3}]})  # fmt: skip
    assert missing.status_code == 400 and "no workload 'nope'" in missing.text


def test_faster_engine_compares_at_the_highest_shared_concurrency() -> None:
    def m(engine: str, rates: dict[int, float], quantization: str = "none") -> Measurement:
        return Measurement(engine, "cpu", quantization, rates, engine, 0.0)

    measured = [m("kunlun", {1: 20, 4: 60, 16: 90}), m("llama.cpp", {1: 25, 4: 50}),
                m("vllm", {16: 999}, quantization="w8a16")]  # fmt: skip
    verdict = faster_engine(measured, ["kunlun", "llama.cpp", "vllm"], "cpu", "none")
    assert verdict is not None and (verdict.engine, verdict.concurrency) == ("kunlun", 4)
    assert faster_engine(measured, ["kunlun", "llama.cpp"], "nvidia", "none") is None
    assert faster_engine(measured[:1], ["kunlun", "llama.cpp"], "cpu", "none") is None
    assert faster_engine(measured, ["kunlun"], "cpu", "none") is None  # llama.cpp cannot run it


def test_a_name_served_on_two_engines_is_not_measured(daemon: Daemon) -> None:
    second = submit_demo(daemon, "engine: llama.cpp\n")  # smollm2 on llama.cpp beside kunlun
    try:
        refused = loopback.post(daemon.url + "/api/v1/workloads/smollm2/measurements",
                             json={"runs": [{"concurrency": 1, "output_tokens_per_s": 3}]})  # fmt: skip
        assert refused.status_code == 400, refused.text
        message = refused.json()["error"]["message"]
        assert "2 workloads serve 'smollm2'" in message and f"{second} (" in message
    finally:
        assert daemon.cli("workload", "stop", second).returncode == 0
