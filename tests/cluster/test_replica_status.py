"""The replica status a node reports in etcd is a typed record (``ReplicaStatus``): what a
node writes is what the others read, and a record that is not one is left out, said once."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from kunlun.cluster.member import REPLICAS, ClusterView, ReplicaStatus
from kunlun.state.etcd_wire import KV

RUNNING = ReplicaStatus(workload_id="wl-1", index=0, model="smollm2", device="cpu:0",
                        ready=True, max_num_seqs=8, max_queue=64, priority="normal",
                        task="generate", reservations=({"device": "cpu:0", "mb": 512},))  # fmt: skip


def test_a_status_round_trips_and_a_failed_one_says_only_why() -> None:
    assert ReplicaStatus.model_validate_json(RUNNING.to_json()) == RUNNING
    failed = ReplicaStatus(workload_id="wl-1", index=1, failed="no device with 2 GiB free")
    assert ReplicaStatus.model_validate_json(failed.to_json()) == failed
    assert set(failed.model_dump(exclude_none=True)) <= {
        "workload_id",
        "index",
        "failed",
        "ready",
        "created",
        "reservations",
    }


def test_a_running_status_must_say_what_it_serves() -> None:
    with pytest.raises(ValidationError, match="lacks model, device, max_num_seqs"):
        ReplicaStatus(workload_id="wl-1", index=0, ready=True, max_queue=64,
                      priority="normal", task="generate")  # fmt: skip
    with pytest.raises(ValidationError, match="colour"):
        ReplicaStatus.model_validate({**RUNNING.model_dump(), "colour": "red"})


def test_the_view_leaves_out_a_record_that_is_not_a_status(
    capsys: pytest.CaptureFixture[str],
) -> None:
    view = ClusterView(etcd=None, prefix="/k/")  # type: ignore[arg-type]
    for key, value in (("node-a/wl-1-r0", RUNNING.to_json()),
                       ("node-b/wl-1-r1", '{"workload_id": "wl-1", "index": -1}')):  # fmt: skip
        full = f"/k/{REPLICAS}{key}"
        view._kvs[full] = KV(full, value.encode(), 1, 1, 1, 0)
    assert view.replica_statuses() == {"node-a/wl-1-r0": RUNNING}
    assert view.replica_statuses() == {"node-a/wl-1-r0": RUNNING}
    said = capsys.readouterr().out
    assert said.count("node-b/wl-1-r1 is not a replica status (index:") == 1, said
