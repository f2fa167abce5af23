"""The gates of ``kunlun-cli adapt`` judged from what a run measured (the daemon run is
``tests/daemon/test_adapt.py``): throughput against the best engine of the same pool type,
accuracy and numerics from the battery's rows, and nothing judged after a failed step."""

from __future__ import annotations

from kunlun.validate.gates import (
    FAIL,
    NOT_RUN,
    PASS,
    Candidate,
    Verdict,
    judge,
    pool_verdicts,
    run_failed,
)
from kunlun.validate.matrix import failed, passed, skipped

PLAN = {"dtype": "fp32", "quantization": "none", "tensor_parallel_size": 1, "devices": ["cpu:0"]}


def ran(pool: str, engine: str, rate: float, cells: dict | None = None) -> Candidate:
    c = Candidate(pool, engine, f"m-{engine}", plan=PLAN, workload_id=f"wl-{engine}")
    c.smoke = Verdict(PASS, "10 ms")
    c.cells = cells if cells is not None else {"api.models": passed("ok")}
    c.bench = {"runs": [{"concurrency": 1, "output_tokens_per_s": rate / 2, "num_errors": 0},
                        {"concurrency": 4, "output_tokens_per_s": rate, "num_errors": 0}]}  # fmt: skip
    return c


def test_throughput_is_judged_against_the_best_engine_of_the_pool() -> None:
    fast, slow, alone = ran("cpu", "a", 100.0), ran("cpu", "b", 70.0), ran("npu", "a", 5.0)
    verdicts = judge([fast, slow, alone], accuracy_points=5, throughput_share=0.8)
    assert verdicts["cpu/a"]["throughput"].status == PASS
    assert verdicts["cpu/b"]["throughput"].status == FAIL
    assert "70% of the best on cpu" in verdicts["cpu/b"]["throughput"].figure
    assert verdicts["npu/a"]["throughput"].status == PASS  # the only one on its pool
    assert judge([fast, slow], 5, 0.7)["cpu/b"]["throughput"].status == PASS


def test_accuracy_and_numerics_come_from_their_rows() -> None:
    cells = {"numerics.prompt_logprobs": passed("mean 0.01"),
             "numerics.cross_engine": skipped("the engine serving it lacks echo"),
             "accuracy.multiple_choice": failed("60.0%", "13.5 points below the reference")}  # fmt: skip
    verdicts = judge([ran("cpu", "a", 10.0, cells)], 5, 0.8)["cpu/a"]
    assert verdicts["numerics"].status == PASS and verdicts["accuracy"].status == FAIL
    assert "13.5 points" in verdicts["accuracy"].why
    assert verdicts["battery"].status == FAIL  # a failed row fails the battery too
    only_skips = judge([ran("cpu", "a", 10.0, {"accuracy.multiple_choice": skipped("no echo")})],
                       5, 0.8)["cpu/a"]  # fmt: skip
    assert only_skips["accuracy"].status == NOT_RUN and "no echo" in only_skips["accuracy"].why


def test_nothing_is_judged_after_a_failed_step() -> None:
    refused = Candidate("cpu", "vllm", "m-vllm", refused="vllm is not installed")
    broken = Candidate("cpu", "b", "m-b", plan=PLAN, workload_id="wl-b",
                       start_error="FAILED: out of memory")  # fmt: skip
    verdicts = judge([refused, broken], 5, 0.8)
    assert verdicts["cpu/vllm"]["plan"].status == FAIL
    assert verdicts["cpu/b"]["start"].status == FAIL and "out of memory" in (
        verdicts["cpu/b"]["start"].why)  # fmt: skip
    for column in verdicts:
        assert {v.status for g, v in verdicts[column].items() if g not in ("plan", "start")} == {
            NOT_RUN
        }


def test_a_run_is_held_to_its_last_known_good_snapshot() -> None:
    good = {"id": "m-cpu-a-1", "figures": {"accuracy": 0.70, "tokens_per_s": 100.0}}
    cells = {"accuracy.multiple_choice": passed("70.0%", accuracy=0.70)}
    same = ran("cpu", "a", 90.0, cells)
    same.known_good = good
    assert judge([same], 5, 0.8)["cpu/a"]["regression"].status == PASS
    slower = ran("cpu", "a", 50.0, cells)
    slower.known_good = good
    verdict = judge([slower], 5, 0.8)["cpu/a"]["regression"]
    assert verdict.status == FAIL and "50.0 tok/s against 100.0" in verdict.why
    worse = ran("cpu", "a", 100.0, {"accuracy.multiple_choice": passed("60.0%", accuracy=0.6)})
    worse.known_good = good
    verdict = judge([worse], 5, 0.8)["cpu/a"]["regression"]
    assert verdict.status == FAIL and "accuracy 60.0% against 70.0%" in verdict.why
    assert judge([ran("cpu", "a", 10.0)], 5, 0.8)["cpu/a"]["regression"].status == NOT_RUN


def test_a_pool_is_adapted_by_its_fastest_engine_that_failed_no_gate() -> None:
    fast, slow = ran("cpu", "a", 100.0), ran("cpu", "b", 60.0)
    refused = Candidate("npu", "a", "m-npu", refused="no plan fits 32 GiB")
    candidates = [fast, slow, refused]
    verdicts = judge(candidates, 5, 0.8)
    pools = pool_verdicts(candidates, verdicts)
    assert pools["cpu"].status == PASS and pools["cpu"].engine == "a"
    assert "not chosen: b: throughput 60.0 tok/s" in pools["cpu"].why, pools["cpu"].why
    assert pools["npu"].status == FAIL and "no plan fits 32 GiB" in pools["npu"].why
    assert run_failed(verdicts, pools, every_engine=False)  # npu is not adapted
    only_cpu = judge([fast, slow], 5, 0.8)
    assert not run_failed(only_cpu, pool_verdicts([fast, slow], only_cpu), every_engine=False)
    # --every-engine: b's throughput FAIL fails the run although the pool is adapted
    assert run_failed(only_cpu, pool_verdicts([fast, slow], only_cpu), every_engine=True)
    # the fastest engine that failed a gate is not chosen: the slower one that passed is
    broken = ran("cpu", "a", 100.0, {"api.models": failed("500", "no answer")})
    both = judge([broken, ran("cpu", "b", 90.0)], 5, 0.8)
    chosen = pool_verdicts([broken, ran("cpu", "b", 90.0)], both)["cpu"]
    assert chosen.status == PASS and chosen.engine == "b" and "a: battery" in chosen.why
