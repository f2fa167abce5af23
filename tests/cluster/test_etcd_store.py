"""The etcd client and the etcd state store against a real etcd 3.4 cluster (no mocks)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path

import httpx
import pytest
from tests.cluster.etcd_cluster import EtcdCluster

from kunlun.errors import ClusterUnavailable, ConfigError
from kunlun.state import etcd_watch as watch_module
from kunlun.state.certs import MemberTLS
from kunlun.state.etcd import EtcdStore
from kunlun.state.etcd_client import Etcd
from kunlun.state.etcd_wire import Compare, Op, WatchEvent
from kunlun.state.sqlite import SQLiteStore
from kunlun.state.store import (
    ApiKeyRecord,
    BatchRecord,
    EndpointRecord,
    EventRecord,
    FileRecord,
    ModelRecord,
    ResponseRecord,
    StateStore,
    WorkloadRecord,
)


@pytest.fixture
def etcd(etcd3: EtcdCluster) -> Iterator[Etcd]:
    client = Etcd(etcd3.endpoints, etcd3.tls("node-a"))
    yield client
    client.close()


@pytest.fixture
def store(etcd: Etcd, request: pytest.FixtureRequest) -> Iterator[EtcdStore]:
    """A store under a prefix of its own (the cluster is shared by the module's tests)."""
    store = EtcdStore(etcd, prefix=f"/t/{request.node.name}/")
    yield store
    store.close()


def eventually(check: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "not within the deadline"
        time.sleep(0.05)


def fill(store: StateStore) -> None:
    """The same writes, in the same order, for any store (lists out of every order)."""
    for wid, created in (("w2", 20.0), ("w1", 10.0), ("w3", 30.0)):
        spec = {"model": wid, "replicas": 2, "nested": {"a": [1, 2]}}
        store.put_workload(WorkloadRecord(wid, f"name-{wid}", spec, created=created))
    store.put_workload(
        WorkloadRecord("w2", "renamed", {}, "RUNNING", "ok", "gpu0", {"n": 1}, 20, 25)
    )
    for i in range(12):
        store.add_event(EventRecord("w1" if i % 3 else "w10", 1000.0 - i, f"k{i}", f"m{i}"))
    store.put_api_key(ApiKeyRecord("kb", "b", "h" * 64, 2.0, priority="high", rpm=5))
    store.put_api_key(
        ApiKeyRecord("ka", "a", "g" * 64, 1.0, scope="admin", allow_ips=["10.0.0.0/8"])
    )
    for alias in ("zeta", "alpha", "Mid"):
        store.put_model(ModelRecord(alias, f"/m/{alias}", "hf", 1.0, {"arch": alias}))
    for file_id, created in (("f2", 200), ("f1", 100), ("f3", 200)):
        store.put_file(FileRecord(file_id, f"{file_id}.jsonl", "batch", 10, created, None))
    store.put_file(FileRecord("f4", "out.jsonl", "batch_output", 99, 300, 400))
    for batch_id, created in (("b1", 100), ("b3", 300), ("b2", 200), ("b4", 300)):
        store.put_batch(
            BatchRecord(batch_id, "/v1/chat/completions", "f1", "24h", "validating", created,
                        created + 86400, {"total": 3}, metadata={"k": "v"}, usage={"total": 7})
        )  # fmt: skip


def everything(store: StateStore) -> dict[str, object]:
    return {
        "workloads": store.list_workloads(),
        "w2": store.get_workload("w2"),
        "absent": (store.get_workload("nope"), store.get_model("nope"), store.get_file("nope")),
        "events": store.list_events("w1"),
        "events10": store.list_events("w10"),
        "no events": store.list_events("w"),
        "keys": store.list_api_keys(),
        "models": store.list_models(),
        "model": store.get_model("alpha"),
        "files": store.list_files(),
        "file": store.get_file("f4"),
        "batches": store.list_batches(),
        "batch": store.get_batch("b2"),
    }


def test_etcd_store_keeps_what_sqlite_keeps_in_the_same_order(
    store: EtcdStore, tmp_path: Path
) -> None:
    sqlite = SQLiteStore(tmp_path / "state.db")
    for each in (sqlite, store):
        fill(each)
    expected = everything(sqlite)
    assert everything(store) == expected
    assert [w.workload_id for w in store.list_workloads()] == ["w1", "w2", "w3"]
    assert [e.kind for e in store.list_events("w1")] == ["k1", "k2", "k4", "k5", "k7", "k8", "k10", "k11"]  # fmt: skip
    assert [m.alias for m in store.list_models()] == ["Mid", "alpha", "zeta"]
    assert [b.batch_id for b in store.list_batches()] == ["b4", "b3", "b2", "b1"]
    for each in (sqlite, store):
        assert each.delete_file("f1") is True
        assert each.delete_file("f1") is False
        assert each.revoke_api_key("kb", 5.0) is True
        assert each.revoke_api_key("kb", 6.0) is False
        assert each.revoke_api_key("nope", 6.0) is False
    assert everything(store) == everything(sqlite)
    sqlite.close()


def test_etcd_store_keeps_endpoints_as_sqlite_does(store: EtcdStore, tmp_path: Path) -> None:
    """Request-as-a-Service endpoints round-trip through etcd: schemas (nested, booleans),
    the template text, listed by name, replaced in place, deleted once."""
    sqlite = SQLiteStore(tmp_path / "state.db")
    schema = {"type": "object", "required": ["a"], "properties": {"a": {"type": "array",
              "items": {"$ref": "#/$defs/x"}}}, "$defs": {"x": {"enum": [1, "ü", None]}}}  # fmt: skip
    for each in (sqlite, store):
        for name in ("zeta", "alpha-1", "Mid_2"):
            each.put_endpoint(EndpointRecord(name, "smollm2", schema, True, "{{ input.a }}\n",
                                             f"about {name}", 1.5, 1.5))  # fmt: skip
        each.put_endpoint(EndpointRecord("zeta", "other", False, schema, "x", "", 1.5, 9.0))
        assert each.get_endpoint("nope") is None
    assert store.list_endpoints() == sqlite.list_endpoints()
    assert [e.name for e in store.list_endpoints()] == ["Mid_2", "alpha-1", "zeta"]
    assert store.get_endpoint("alpha-1") == EndpointRecord(
        "alpha-1", "smollm2", schema, True, "{{ input.a }}\n", "about alpha-1", 1.5, 1.5
    )
    assert store.get_endpoint("zeta") == sqlite.get_endpoint("zeta")
    for each in (sqlite, store):
        assert each.delete_endpoint("zeta") is True
        assert each.delete_endpoint("zeta") is False
    assert store.list_endpoints() == sqlite.list_endpoints()
    sqlite.close()


def test_etcd_store_ignores_fields_it_does_not_know(store: EtcdStore, etcd: Etcd) -> None:
    etcd.put(store.prefix + "models/new", '{"alias": "new", "path": "/p", "source": "hf", '
             '"created": 1.0, "meta": {}, "added_later": 1}')  # fmt: skip
    assert store.get_model("new") == ModelRecord("new", "/p", "hf", 1.0, {})


def test_etcd_store_revokes_a_key_once_among_concurrent_revokers(
    etcd3: EtcdCluster, store: EtcdStore
) -> None:
    others = [
        Etcd(etcd3.endpoints[i:] + etcd3.endpoints[:i], etcd3.tls("node-b")) for i in range(3)
    ]
    stores = [store, *(EtcdStore(e, store.prefix) for e in others)]
    for round_ in range(5):
        key_id = f"k{round_}"
        store.put_api_key(ApiKeyRecord(key_id, "k", "h" * 64, 1.0))
        results = _race([partial(s.revoke_api_key, key_id, float(i)) for i, s in enumerate(stores)])
        assert sorted(results) == [False, False, False, True]
        (revoked,) = [k.revoked for k in store.list_api_keys() if k.key_id == key_id]
        assert revoked is not None
    for s, e in zip(stores[1:], others, strict=True):
        s.close()
        e.close()


def test_etcd_store_data_version_follows_writes_of_other_nodes(
    etcd3: EtcdCluster, store: EtcdStore
) -> None:
    other_etcd = Etcd(etcd3.endpoints[::-1], etcd3.tls("node-c"))
    other = EtcdStore(other_etcd, store.prefix)
    try:
        before, revision = store.data_version(), store.revision
        other.put_model(ModelRecord("m", "/m", "hf", 1.0))
        eventually(lambda: store.data_version() != before)
        assert store.revision > revision
        assert store.get_model("m") == ModelRecord("m", "/m", "hf", 1.0)
        # a write outside the prefix is no change of this store's
        settled = store.data_version()
        other_etcd.put("/elsewhere/x", "1")
        time.sleep(0.3)
        assert store.data_version() == settled
    finally:
        other.close()
        other_etcd.close()


def test_etcd_client_txn_leases_and_ranges(etcd: Etcd) -> None:
    key = "/txn/a"
    created = etcd.txn([Compare.create_revision(key, "==", 0)], [Op.put(key, "1"), Op.get(key)])
    assert created.succeeded and created.responses[0] == created.revision
    (kv,) = created.responses[1]
    assert (kv.key, kv.json(), kv.version) == (key, 1, 1)
    again = etcd.txn([Compare.create_revision(key, "==", 0)], [Op.put(key, "2")], [Op.get(key)])
    assert not again.succeeded and again.responses[0][0].value == b"1"
    by_value = etcd.txn([Compare.value(key, "==", b"1"), Compare.version(key, "<", 2)],
                        [Op.put(key, "3"), Op.delete("/txn/none")])  # fmt: skip
    assert by_value.succeeded and by_value.responses[1] == 0
    assert etcd.txn([Compare.mod_revision(key, ">", by_value.revision)], []).succeeded is False
    for i in range(3):
        etcd.put(f"/txn/p/{i}", str(i))
    etcd.put("/txn/q", "x")
    assert [kv.key for kv in etcd.range("/txn/p/")] == ["/txn/p/0", "/txn/p/1", "/txn/p/2"]
    assert etcd.delete("/txn/p/", prefix=True) == 3
    assert etcd.get("/txn/q") is not None and etcd.get("/txn/p/0") is None
    assert etcd.revision() >= by_value.revision

    lease = etcd.lease_grant(30)
    etcd.put("/txn/leased", "v", lease=lease)
    leased = etcd.get("/txn/leased")
    assert leased is not None and leased.lease == lease
    assert 0 < etcd.lease_keepalive(lease) <= 30
    etcd.lease_revoke(lease)
    assert etcd.get("/txn/leased") is None
    assert etcd.lease_keepalive(lease) == 0
    etcd.lease_revoke(lease)  # already gone: fine


def test_etcd_client_watch_delivers_in_order_and_reports_compaction(
    etcd3: EtcdCluster, etcd: Etcd
) -> None:
    seen: list[tuple[str, str, int]] = []
    batches: list[int] = []

    def on_events(events: list[WatchEvent], revision: int) -> None:
        batches.append(revision)
        seen.extend((e.type, e.kv.key, e.kv.mod_revision) for e in events)

    start = etcd.revision() + 1
    for i in range(10):
        etcd.put(f"/w/{i}", str(i))
    etcd.delete("/w/3")
    etcd.put("/x/other", "not watched")
    stop = threading.Event()
    thread = etcd.watch("/w/", start, on_events, stop)
    eventually(lambda: len(seen) == 11)
    assert [s[0] for s in seen] == ["PUT"] * 10 + ["DELETE"]
    assert [s[1] for s in seen] == [f"/w/{i}" for i in range(10)] + ["/w/3"]
    assert [s[2] for s in seen] == sorted(s[2] for s in seen)
    t0 = time.monotonic()
    stop.set()
    thread.join(timeout=2)
    assert not thread.is_alive() and time.monotonic() - t0 < 1.5

    # a watch from a compacted revision says so
    now = etcd.revision()
    with httpx.Client(verify=etcd3.tls("node-a").client_context()) as raw:
        raw.post(f"{etcd3.endpoints[0]}/v3/kv/compaction", json={"revision": str(now)})
    batches.clear()
    stop = threading.Event()
    thread = etcd.watch("/w/", start, on_events, stop)
    eventually(lambda: -now in batches)
    stop.set()
    thread.join(timeout=2)


def test_etcd_watch_reopens_an_idle_stream_without_losing_or_repeating(
    etcd: Etcd, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(watch_module, "WATCH_IDLE_S", 0.3)
    seen: list[str] = []
    stop = threading.Event()
    etcd.watch("/idle/", etcd.revision() + 1, lambda ev, _: seen.extend(e.kv.key for e in ev), stop)
    for name in ("a", "b", "c"):
        etcd.put(f"/idle/{name}", name)
        time.sleep(0.7)  # the stream is reopened meanwhile
    assert seen == ["/idle/a", "/idle/b", "/idle/c"]
    stop.set()


def test_etcd_refuses_a_foreign_certificate_clearly(etcd3: EtcdCluster, etcd_certs: Path) -> None:
    foreign = MemberTLS.from_dir(etcd_certs / "other", "node-x")
    with pytest.raises(
        ConfigError, match="certificate was refused: not signed by the CA in .*other"
    ) as refused:
        Etcd(etcd3.endpoints, foreign).get("/a")
    assert etcd3.endpoints[2] in str(refused.value)
    ours = etcd3.tls("node-a")
    mixed = MemberTLS(ours.ca, foreign.cert, foreign.key)  # trusts the cluster, not trusted
    with pytest.raises(ConfigError, match="refused this client's certificate .*node-x.crt"):
        Etcd(etcd3.endpoints, mixed).put("/a", "1")


def test_etcd_store_keeps_responses_as_sqlite_does(store: EtcdStore, tmp_path: Path) -> None:
    """Kept Responses API answers round-trip through etcd as through SQLite, are replaced in
    place, forgotten by age, and do not count as a change of state (the watch's version)."""
    sqlite = SQLiteStore(tmp_path / "state.db")
    items = [{"type": "message", "role": "user", "content": "hé"},
             {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"}]  # fmt: skip
    version = store.data_version()
    for each in (sqlite, store):
        each.put_response(ResponseRecord("resp_old", "m", 100.0, items[:1]))
        each.put_response(ResponseRecord("resp_new", "m", 200.0, items))
        each.put_response(ResponseRecord("resp_new", "m", 300.0, items[1:]))
        assert each.get_response("resp_new") == ResponseRecord("resp_new", "m", 300.0, items[1:])
        assert each.get_response("resp_nope") is None
        assert each.delete_responses_before(250.0) == 1
        assert each.get_response("resp_old") is None and each.get_response("resp_new")
        each.put_response(ResponseRecord("resp_gone", "m", 400.0, [], {"id": "resp_gone"}))
        assert each.get_response("resp_gone").response == {"id": "resp_gone"}  # type: ignore[union-attr]
        assert each.delete_response("resp_gone") is True
        assert each.delete_response("resp_gone") is False
    store.put_endpoint(EndpointRecord("marker", "m", True, True, "x"))  # one change of state
    deadline = time.monotonic() + 10
    while store.data_version() == version:  # the watch sees writes in order: the responses'
        assert time.monotonic() < deadline  # went before the marker's
        time.sleep(0.05)
    assert store.data_version() == version + 1  # the marker alone: responses are not state
    sqlite.close()


def test_etcd_endpoint_scheme_must_match_the_certificates(etcd_certs: Path) -> None:
    tls = MemberTLS.from_dir(etcd_certs, "node-a")
    with pytest.raises(ConfigError, match="http://127.0.0.1:1 is plain http"):
        Etcd(["https://127.0.0.1:2", "http://127.0.0.1:1"], tls)
    with pytest.raises(ConfigError, match="https://127.0.0.1:2 is https:// but no cluster"):
        Etcd(["https://127.0.0.1:2"])
    with pytest.raises(ConfigError, match="not an http"):
        Etcd(["127.0.0.1:2379"])


def test_etcd_store_plain_http_member(etcd1: EtcdCluster) -> None:
    etcd = Etcd(etcd1.endpoints)
    store = EtcdStore(etcd)
    store.put_model(ModelRecord("m", "/m", "hf", 1.0))
    assert store.list_models() == [ModelRecord("m", "/m", "hf", 1.0)]
    store.close()
    etcd.close()


def test_etcd_survives_a_dead_member_and_says_when_quorum_is_lost(etcd3_own: EtcdCluster) -> None:
    cluster = etcd3_own
    # A loaded machine can take a few seconds to elect a new raft leader.
    etcd = Etcd(cluster.endpoints, cluster.tls("node-a"), timeout_s=2.0, election_wait_s=6.0)
    writer = Etcd(cluster.endpoints[1:], cluster.tls("node-b"))
    store = EtcdStore(etcd)
    seen: list[str] = []
    stop = threading.Event()
    etcd.watch("/w/", etcd.revision() + 1, lambda ev, _: seen.extend(e.kv.key for e in ev), stop)
    writer.put("/w/0", "0")
    eventually(lambda: seen == ["/w/0"])

    cluster.kill(0)  # the member both the store and the watch were using
    store.put_model(ModelRecord("m", "/m", "hf", 1.0))
    assert store.get_model("m") is not None
    for i in range(1, 5):
        writer.put(f"/w/{i}", str(i))
    eventually(lambda: seen == [f"/w/{i}" for i in range(5)])

    cluster.kill(1)
    t0 = time.monotonic()
    with pytest.raises(ClusterUnavailable, match="unavailable") as lost:
        store.put_model(ModelRecord("n", "/n", "hf", 1.0))
    assert time.monotonic() - t0 < etcd.election_wait_s + 2 * etcd.timeout_s + 1
    message = str(lost.value)
    assert "connection refused at " in message
    assert all(endpoint in message for endpoint in cluster.endpoints)
    eventually(lambda: _quorum_lost(store), timeout_s=5)  # then it says so at once
    t0 = time.monotonic()
    with pytest.raises(ClusterUnavailable, match=r"no quorum \(etcdserver: no leader\)"):
        store.list_models()
    assert time.monotonic() - t0 < 1

    cluster.restart(1)
    eventually(lambda: _writable(store))
    writer.put("/w/5", "5")
    eventually(lambda: seen[-1] == "/w/5")
    assert seen == [f"/w/{i}" for i in range(6)]
    stop.set()
    store.close()
    etcd.close()
    writer.close()


def _race(calls: list[Callable[[], bool]]) -> list[bool]:
    """Run ``calls`` in threads released together; their results."""
    barrier = threading.Barrier(len(calls))
    results: list[bool] = []

    def run(call: Callable[[], bool]) -> None:
        barrier.wait()
        results.append(call())

    threads = [threading.Thread(target=run, args=(call,)) for call in calls]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


def _quorum_lost(store: EtcdStore) -> bool:
    try:
        store.list_models()
    except ClusterUnavailable as exc:
        return "no leader" in str(exc)
    return False


def _writable(store: EtcdStore) -> bool:
    try:
        store.put_model(ModelRecord("n", "/n", "hf", 1.0))
    except ClusterUnavailable:
        return False
    return True
