"""The checkpoints of acceptance layers 3 to 5 judged from what a run gathered (the runs
against a live platform are ``tests/daemon/test_acceptance.py`` and, for layer 5 on a real
cluster, ``tests/cluster/test_cluster_failover.py``): the utilisation spread of a balanced
load, the recovery after a node loss, a canary's gates, and the layer's verdict."""

from __future__ import annotations

from kunlun.validate import acceptance as layers


def test_balance_is_the_spread_of_the_devices_mean_utilisation() -> None:
    even = {"npu:0": [80.0, 90.0], "npu:1": [85.0, 85.0], "npu:2": [90.0, 80.0]}
    spread, errors = layers.layer3("npu", even, 24, [], [])
    assert spread.status == layers.PASS and spread.data["std_dev"] == 0.0
    assert (
        errors.status == layers.PASS and errors.figure == "0 of 24 requests failed, 0 replicas lost"
    )
    skewed = {"npu:0": [95.0], "npu:1": [60.0]}  # means 95 and 60: 17.5 points either side
    spread, _ = layers.layer3("npu", skewed, 8, [], [])
    assert spread.status == layers.FAIL and spread.figure == "17.5 points", spread
    assert "npu:0 95 %, npu:1 60 %" in spread.detail
    silent = {"npu:0": [50.0], "npu:1": []}  # one device reports no utilisation
    spread, _ = layers.layer3(
        "npu", silent, 8, ["HTTP 500: out of memory"], ["r1 restarted 1 times"]
    )
    assert spread.status == layers.NOT_RUN and "1 of 2 npu devices" in spread.detail
    checks = layers.layer3("npu", silent, 8, ["HTTP 500: out of memory"], ["r1 restarted 1 times"])
    assert checks[1].status == layers.FAIL and "out of memory" in checks[1].detail
    assert layers.verdict(checks) == layers.FAIL


def node(name: str, *replicas: tuple[str, str, bool]) -> dict:
    return {"name": name, "replicas": [{"replica_id": r, "workload_id": w, "ready": ready}
                                       for r, w, ready in replicas]}  # fmt: skip


ROWS = [{"workload_id": "wl-1", "name": "chat", "state": "RUNNING", "replicas": 2},
        {"workload_id": "wl-0", "name": "old", "state": "STOPPED", "replicas": 1}]  # fmt: skip


def test_a_node_loss_is_over_when_every_node_left_agrees_and_replicas_are_back() -> None:
    nodes = [node("a", ("r0", "wl-1", True)), node("b", ("r1", "wl-1", True))]
    done = layers.recovered("c", nodes, {"a": ROWS, "b": list(reversed(ROWS))})
    assert (
        done["ok"]
        and done["figure"] == "c gone; 2 nodes list the same 2 workloads; 2 of 2 replicas ready"
    )
    # the lost node still a member, a replica short, a node that does not answer, lists that differ
    nodes = [node("a", ("r0", "wl-1", True)), node("c", ("r1", "wl-1", True)), node("b")]
    found = layers.recovered("c", nodes, {"a": ROWS, "b": ROWS[:1], "c": "connection refused"})
    assert not found["ok"]
    for problem in ("c is still a member", "c did not answer: connection refused",
                    "the nodes list different workloads", "replica r1 still on c"):  # fmt: skip
        assert problem in found["detail"], found["detail"]
    short = layers.recovered("c", [node("a", ("r0", "wl-1", True))], {"a": ROWS})
    assert not short["ok"] and "chat: 1 of 2 replicas ready" in short["detail"]


def rollout(state: str, *steps: list[dict]) -> dict:
    return {"rollout_id": "ro-1", "state": state, "reason": None,
            "history": [{"step": i, "gates": gates} for i, gates in enumerate(steps)]}  # fmt: skip


def gate(name: str, verdict: str, canary: float, limit: float) -> dict:
    return {"gate": name, "verdict": verdict, "canary": canary, "limit": limit}


def test_a_canary_passes_only_promoted_with_no_gate_failed() -> None:
    good = [gate("error_rate", "pass", 0.0, 0.1), gate("p95_ttft", "pass", 21.0, 214.0)]
    check = layers.canary(rollout("PROMOTED", good, good), "")
    assert check.status == layers.PASS
    assert check.figure == "error_rate 0.0% (limit 10.0%), p95_ttft 21 ms (limit 214 ms)"
    slow = [gate("error_rate", "pass", 0.0, 0.1), gate("p95_ttft", "fail", 900.0, 214.0)]
    assert layers.canary(rollout("ROLLED_BACK", good, slow), "").status == layers.FAIL
    assert layers.canary(rollout("PROMOTED", good, slow), "").status == layers.FAIL
    going = layers.canary(rollout("PROGRESSING", good), "")
    assert going.status == layers.NOT_RUN and "has not ended" in going.detail
    unsure = [gate("error_rate", "inconclusive", 0.0, 0.1)]
    assert "too few requests" in layers.canary(rollout("PROMOTED", unsure), "").detail
    assert layers.canary(None, "no canary rollout here").status == layers.NOT_RUN


def test_a_layer_with_a_checkpoint_not_run_is_incomplete() -> None:
    leaders = {"a": "a", "b": "a"}
    checks = layers.layer5(leaders, None, None, "no canary rollout here")
    assert [c.status for c in checks] == [layers.PASS, layers.NOT_RUN, layers.NOT_RUN]
    doc = layers.report(5, {"node": "a"}, checks)
    assert doc["verdict"] == layers.INCOMPLETE and len(doc["not_run"]) == 2
    assert layers.verdict_text(doc) == "INCOMPLETE (2 of 3 checkpoints not run)"
    split = layers.layer5({"a": "a", "b": "b"}, None, None, "")
    assert split[0].status == layers.FAIL and split[0].figure == "2 nodes disagree"


def test_mixed_chip_choice_says_why_not_each_other_class() -> None:
    placement = {"target_device": "nvidia:0", "why": "fastest decode estimate",
                 "plan": {"dtype": "bf16"}, "engine": {"chosen": "kunlun"},
                 "rejected": {"cpu:0": "ranked lower by performance"}}  # fmt: skip
    choice, others = layers.layer4(placement, None, ["cpu", "nvidia"])
    assert (
        choice.figure == "nvidia:0 (bf16, engine kunlun)"
        and choice.detail == "fastest decode estimate"
    )
    assert others.status == layers.PASS and others.figure == "1 of 1 other classes explained"
    unsaid = layers.layer4({**placement, "rejected": {}}, None, ["ascend", "cpu", "nvidia"])[1]
    assert unsaid.status == layers.FAIL and "no reason given for ascend, cpu" in unsaid.detail
    refused = layers.layer4(None, "no device has 40 GiB free", ["cpu"])
    assert [c.status for c in refused] == [layers.FAIL, layers.NOT_RUN]
    assert refused[0].detail == "no device has 40 GiB free"
