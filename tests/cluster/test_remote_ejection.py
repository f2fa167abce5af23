"""A replica its own node's health checks ejected is reported with the reason, and every
other node leaves it out of routing until it is reported back in (fakes for etcd and the
cluster view: the report and its reading, no network)."""

from __future__ import annotations

import threading
from types import SimpleNamespace
from typing import Any

from kunlun.cluster.local import LocalReplicas
from kunlun.cluster.member import NODES, ReplicaStatus
from kunlun.serving.replica import Replica, ReplicaSet
from kunlun.serving.routing import DeviceSamples


class FakeEtcd:
    def __init__(self) -> None:
        self.values: dict[str, str] = {}

    def put(self, key: str, value: str, lease: int = 0) -> None:
        self.values[key] = value

    def delete(self, key: str) -> None:
        self.values.pop(key, None)


def node(name: str, replicas: ReplicaSet, workers: dict[str, Any]) -> LocalReplicas:
    member = SimpleNamespace(
        config=SimpleNamespace(node_name=name), lease=7, rejoined=threading.Event(),
        etcd=FakeEtcd(), key=lambda sub: sub,
    )  # fmt: skip
    view = SimpleNamespace(items=lambda prefix: {
        "node-a": {"peer_url": "http://a:1"}, "node-b": {"peer_url": "http://b:1"}
    } if prefix == NODES else {})  # fmt: skip
    manager = SimpleNamespace(agent=SimpleNamespace(workers=workers))
    return LocalReplicas(member, view, manager, replicas, DeviceSamples())  # type: ignore[arg-type]


def test_an_ejected_replica_is_out_of_routing_on_every_node() -> None:
    local = Replica("wl-1-r0", "wl-1", "smollm2", "cpu:0", "http://127.0.0.1:9", ready=True)
    a = node("node-a", ReplicaSet(), {"wl-1-r0": SimpleNamespace(replica=local)})
    b_replicas = ReplicaSet()
    b = node("node-b", b_replicas, {})

    def report() -> dict[str, ReplicaStatus]:
        a._publish()
        values = a.member.etcd.values  # type: ignore[attr-defined]
        raw = values["cluster/replicas/node-a/wl-1-r0"]
        return {"node-a/wl-1-r0": ReplicaStatus.model_validate_json(raw)}

    b._remote(report())
    remote = b_replicas.get("node-a/wl-1-r0")
    assert remote is not None and remote.routable and remote.ejected is None
    local.ejected = "answers no request: its health probe got no answer within 2 s"
    status = report()
    assert status["node-a/wl-1-r0"].ejected == local.ejected
    b._remote(status)
    assert remote.ready and remote.ejected == local.ejected and not remote.routable
    assert b_replicas.ready("smollm2") == []
    local.ejected = None
    b._remote(report())
    assert remote.routable and b_replicas.ready("smollm2") == [remote]
