"""One model on two engines on the same device type: pools per engine, and validation of one
against the other.

A real daemon serves the demo model as ``smollm2`` twice on cpu:0, once on the embedded engine
and once on llama.cpp (its plan ``fp32, quantization none``: llama.cpp serves an unquantized
copy of the GGUF, so both compute fp32). ``X-Kunlun-Pool: cpu/llama.cpp`` and ``cpu/kunlun``
reach one engine's replica each; ``kunlun-cli validate --all-pools`` (the real CLI) makes one
column per engine, and the cross-engine numerics check, which needs no ``echo``, passes on the
llama.cpp column against the embedded one.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
from tests import loopback
from tests.daemons import PATIENT, SPEC, Daemon, Profile, daemon_fixture

from kunlun.engines.adapter import find_binary
from kunlun.validate.numerics import MAX_ABS_MAX, MEAN_ABS_MAX

pytestmark = pytest.mark.skipif(
    find_binary("llama-server") is None, reason="llama-server is not built (make llama-server)"
)
SMALL = "engine: {}\nmax_num_seqs: 4\n"  # two plans on one cpu:0, small KV caches each


ENGINES = ("kunlun", "llama.cpp")
two_engines = daemon_fixture(Profile(
    "engines-home", tuple(SPEC + SMALL.format(e) for e in ENGINES), files=(PATIENT,), demo=True
))  # fmt: skip
"""A daemon serving ``smollm2`` on the embedded engine and on llama.cpp, both on cpu:0 with
one thread each."""


@pytest.fixture(scope="module")
def engines(two_engines: Daemon) -> Daemon:
    """The daemon; ``d.by_engine`` maps engine -> workload id."""
    two_engines.by_engine = dict(zip(ENGINES, two_engines.jobs, strict=True))  # type: ignore[attr-defined]
    return two_engines


def complete(daemon: Daemon, pool: str) -> httpx.Response:
    return loopback.post(daemon.url + "/v1/completions", headers={"X-Kunlun-Pool": pool},
                      json={"model": "smollm2", "prompt": "Hi", "max_tokens": 2},
                      timeout=120)  # fmt: skip


def test_an_engine_pool_routes_only_to_that_engines_replicas(engines: Daemon) -> None:
    for engine, job in engines.by_engine.items():  # type: ignore[attr-defined]
        for _ in range(3):
            reply = complete(engines, f"cpu/{engine}")
            assert reply.status_code == 200, reply.text
            assert reply.headers["x-kunlun-replica"] == f"{job}-r0"
            assert reply.headers["x-kunlun-device"] == "cpu:0"
    assert complete(engines, "cpu").status_code == 200  # the device type: either engine


@pytest.mark.parametrize(("pool", "status"), [("cpu/vllm", 404), ("cuda", 404), ("cpu/", 400),
                                              ("cpu/llama.cpp/x", 400)])  # fmt: skip
def test_a_pool_serving_nothing_or_malformed_is_refused_naming_the_header(
    engines: Daemon, pool: str, status: int
) -> None:
    reply = complete(engines, pool)
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert error["param"] == "X-Kunlun-Pool" and repr(pool) in error["message"]
    if status == 404:
        assert "pools serving it: cpu, cpu/kunlun, cpu/llama.cpp" in error["message"]


def test_a_third_workload_of_the_name_must_name_yet_another_engine(engines: Daemon) -> None:
    spec = engines.home / "third.yaml"
    for engine in ("auto", "llama.cpp"):
        spec.write_text(f"model: smollm2\nengine: {engine}\n")
        proc = engines.cli("workload", "submit", "--file", str(spec))
        assert proc.returncode != 0 and "already serves 'smollm2'" in proc.stderr, proc.stderr
        assert "another engine" in proc.stderr


def validate_all_pools(
    engines: Daemon, out: Path, *rows: str, sent: tuple[str, ...] = ENGINES
) -> tuple[dict[str, dict], dict[str, dict], str]:
    """``kunlun-cli validate --all-pools`` on the numerics ``rows``: the cells of the kunlun
    column and of the llama.cpp column, and the printed matrix. The completions of the columns
    of the engines ``sent`` came from their own engine's replica, and only from it (checked)."""
    only = [arg for row in rows for arg in ("--only", row)]
    proc = engines.cli("validate", "--all-pools", "--model", "smollm2", *only,
                       "--out", str(out), "--seed", "7", timeout=900)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    run = json.loads((out / "validation.json").read_text())
    assert [(c["name"], c["pool"], c["reference"]) for c in run["columns"]] == [
        ("cpu/kunlun", "cpu/kunlun", True),
        ("cpu/llama.cpp", "cpu/llama.cpp", False),
    ]
    kunlun, llama = run["cells"]["cpu/kunlun"], run["cells"]["cpu/llama.cpp"]
    assert {row: cell["status"] for row, cell in kunlun.items()} == dict.fromkeys(kunlun, "PASS")
    assert set(rows) <= set(kunlun) and set(rows) <= set(llama)
    jobs = engines.by_engine  # type: ignore[attr-defined]
    for cells, engine in ((kunlun, "kunlun"), (llama, "llama.cpp")):
        routing = cells["quality.routing"]
        if engine not in sent:
            assert routing["status"] == "SKIP", routing
            continue
        assert routing["status"] == "PASS" and routing["figure"] == "cpu:0"
        replicas = routing["detail"].partition("; replicas ")[2]
        assert replicas.startswith(f"{jobs[engine]}-r0 x") and "," not in replicas, routing
    return kunlun, llama, proc.stdout


def test_validate_all_pools_compares_the_engines(engines: Daemon, tmp_path: Path) -> None:
    _, llama, printed = validate_all_pools(engines, tmp_path / "validate", "numerics.cross_engine")
    cross = llama["numerics.cross_engine"]
    assert cross["status"] == "PASS", cross
    assert cross["metrics"]["mean_abs_delta"] <= MEAN_ABS_MAX
    assert cross["metrics"]["max_abs_delta"] <= MAX_ABS_MAX
    assert "against the reference" in cross["detail"]
    assert "cpu/llama.cpp" in printed and "(no echo)" in printed


def test_the_echo_rows_run_on_the_engine_with_echo_and_skip_on_the_other(
    engines: Daemon, tmp_path: Path
) -> None:
    echo_rows = ("numerics.prompt_logprobs", "numerics.greedy_divergence")
    _, llama, _ = validate_all_pools(engines, tmp_path / "validate", *echo_rows, sent=("kunlun",))
    for row in echo_rows:  # kunlun's PASS is checked by validate_all_pools
        assert llama[row]["status"] == "SKIP" and "lacks echo" in llama[row]["detail"]
