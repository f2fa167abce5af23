"""Three real platform nodes on a real three-member etcd cluster, all TLS, on loopback.

The tiny model runs with two replicas, on two of the nodes. In order: a request to the node
without a replica is answered by another node's; keys, workloads and nodes are the same from
every node; losing one etcd member changes nothing and losing two (no quorum) keeps serving
but refuses writes with a 503 naming the cause, until quorum returns; a leader paused past
its lease is fenced and comes back a follower; a killed leader node is replaced within the
lease and its replica placed elsewhere while streams on the other nodes go on; then the
layer 5 acceptance report of the two nodes left (the loss, and a canary promoted on them).
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from tests import loopback
from tests.cluster.etcd_cluster import EtcdCluster
from tests.cluster.platform_nodes import (
    LEASE_TTL_S,
    ClusterNodeProc,
    chat,
    dump,
    make_node,
    rollout_ended,
    serving_replicas,
    tiny_record,
    wait_for,
)

from kunlun.state.etcd import EtcdStore
from kunlun.state.etcd_client import Etcd

WORKLOAD = {"model": "tiny", "replicas": 2, "max_num_seqs": 4, "max_model_len": 1024,
            "kv_cache_memory_mb": 16}  # fmt: skip


@dataclass
class Cluster:
    etcd: EtcdCluster
    nodes: list[ClusterNodeProc]
    workload_id: str
    certs: Path
    shared: Path

    def up(self) -> list[ClusterNodeProc]:
        return [n for n in self.nodes if n.proc is not None and n.proc.poll() is None]

    def leader(self, among: list[ClusterNodeProc] | None = None) -> ClusterNodeProc:
        names = {n.api("/api/v1/cluster")["leader"] for n in (among or self.up())}
        assert len(names) == 1 and None not in names, names
        return next(n for n in self.nodes if n.name in names)


@pytest.fixture(scope="module")
def cluster(
    etcd3: EtcdCluster,
    etcd_certs: Path,
    tiny_model: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Cluster]:
    root = tmp_path_factory.mktemp("nodes")
    store = EtcdStore(Etcd(etcd3.endpoints, etcd3.tls("node-a")))
    store.put_model(tiny_record(tiny_model))
    store.close()
    nodes = [make_node(root, name, etcd3.endpoints, etcd_certs)
             for name in ("node-a", "node-b", "node-c")]  # fmt: skip
    try:
        for node in nodes:
            node.launch()
        created = nodes[0].post("/api/v1/apikeys", {"name": "ops", "scope": "admin"})
        assert created.status_code == 200, created.text
        for node in nodes:
            node.key = created.json()["key"]
        submitted = nodes[1].post("/api/v1/workloads", WORKLOAD)
        assert submitted.status_code == 200, submitted.text
        wid = submitted.json()["workload_id"]
        c = Cluster(etcd3, nodes, wid, etcd_certs, root / "shared-files")
        try:
            wait_for("two replicas serving on two nodes", lambda: _spread(c, 2), timeout=300)
        except AssertionError:
            raise AssertionError(dump(nodes)) from None
        yield c
    finally:
        for node in nodes:
            node.stop_all()


def _spread(c: Cluster, count: int) -> bool:
    """``count`` replicas ready, each on one node, on ``count`` different nodes, as every
    node that is up sees it."""
    for node in c.up():
        serving = serving_replicas(node, c.workload_id)
        if len(serving) != count or any(len(where) != 1 for where in serving.values()):
            return False
        if len({where[0] for where in serving.values()}) != count:
            return False
    return True


def test_a_node_without_the_model_answers_through_another(cluster: Cluster) -> None:
    serving = serving_replicas(cluster.nodes[0], cluster.workload_id)
    holders = {where[0] for where in serving.values()}
    spare = next(n for n in cluster.nodes if n.name not in holders)
    for _ in range(3):
        resp = chat(spare)
        assert resp.status_code == 200, resp.text
        device = resp.headers["x-kunlun-device"]
        assert device.split("/")[0] in holders and device.endswith("cpu:0"), device
        assert resp.json()["choices"][0]["message"]["content"]
    holder = next(n for n in cluster.nodes if n.name in holders)
    local = chat(holder)
    assert local.status_code == 200 and "/" not in local.headers["x-kunlun-device"]


def test_keys_workloads_and_nodes_are_the_same_from_every_node(cluster: Cluster) -> None:
    lists = [sorted((w["workload_id"], w["state"], w["ready_replicas"])
                    for w in n.api("/api/v1/workloads")) for n in cluster.nodes]  # fmt: skip
    assert lists[0] == lists[1] == lists[2] and (cluster.workload_id, "RUNNING", 2) in lists[0]
    for node in cluster.nodes:
        assert loopback.get(node.url + "/v1/models", timeout=10).status_code == 401
        views = node.api("/api/v1/nodes")
        assert sorted(v["name"] for v in views) == ["node-a", "node-b", "node-c"]
        assert sum(v["leader"] for v in views) == 1
        assert all(v["state"] == "Ready" and v["devices"] for v in views)
    # a key made on node-c works on node-a at once
    made = cluster.nodes[2].post("/api/v1/apikeys", {"name": "app"})
    assert made.status_code == 200, made.text
    key = made.json()["key"]
    resp = wait_for("the new key accepted on node-a", lambda: loopback.get(
        cluster.nodes[0].url + "/v1/models", headers={"Authorization": f"Bearer {key}"},
        timeout=10).status_code == 200, timeout=10)  # fmt: skip
    assert resp
    # on a node's machine, `apikey list` without KUNLUN_ENDPOINT asks its daemon (the keys
    # are in etcd, not in the home's state.db)
    local = cluster.nodes[1].cli("apikey", "list", "--json", remote=False, key=cluster.nodes[1].key)
    assert local.returncode == 0, local.stderr
    assert {k["name"] for k in json.loads(local.stdout)} == {"ops", "app"}
    for node in cluster.nodes:  # the CLI against each node: the same, complete list
        listed = node.cli("workload", "list", "--json", key=node.key)
        assert listed.returncode == 0, listed.stderr
        assert [w["workload_id"] for w in json.loads(listed.stdout)] == [cluster.workload_id]
    proc = cluster.nodes[0].cli("node", "list", key=cluster.nodes[0].key)
    assert proc.returncode == 0 and "node-b" in proc.stdout and "*" in proc.stdout, proc.stderr
    # the dashboard's Devices page on node-a lists every node's devices
    with httpx.Client(base_url=cluster.nodes[0].url, timeout=30) as browser:
        assert browser.post("/ui/login", data={"key": cluster.nodes[0].key}).status_code == 303
        page = browser.get("/ui/devices")
    assert page.status_code == 200, page.text
    for device in ("cpu:0", "node-b/cpu:0", "node-c/cpu:0"):
        assert f'<tr data-device="{device}">' in page.text, device


def test_etcd_member_loss_and_quorum(cluster: Cluster) -> None:
    a, b, c = cluster.nodes
    cluster.etcd.kill(0)

    # one member down: still serving and accepting workloads, once the two left have elected
    # a raft leader (the killed member may have been it; on a loaded machine this can take
    # longer than the client's 3 s wait, and the write is then a 503 naming the election)
    def placed() -> httpx.Response | None:
        answer = b.post("/api/v1/workloads", {**WORKLOAD, "replicas": 1, "name": "second"})
        return None if answer.status_code == 503 else answer

    second = wait_for("a write after one etcd member is lost", placed, timeout=30, every=1)
    assert second.status_code == 200, second.text
    wid = second.json()["workload_id"]
    wait_for("the second workload placed", lambda: a.api(f"/api/v1/workloads/{wid}")["state"]
             in ("LOADING", "RUNNING"), timeout=60)  # fmt: skip
    assert a.post(f"/api/v1/workloads/{wid}/stop").status_code == 200
    cluster.etcd.kill(1)  # quorum lost
    try:
        for node in cluster.nodes:
            resp = chat(node)
            assert resp.status_code == 200, (node.name, resp.text)
        started = time.monotonic()
        refused = c.post("/api/v1/workloads", {**WORKLOAD, "name": "third"}, timeout=60)
        assert time.monotonic() - started < 30
        assert refused.status_code == 503, refused.text
        error = refused.json()["error"]
        assert error["code"] == "cluster.unavailable", error
        assert "etcd" in error["message"], error
    finally:
        cluster.etcd.restart(0)
    third = wait_for("writes accepted again", lambda: c.post(
        "/api/v1/workloads", {**WORKLOAD, "replicas": 1, "name": "third"}), timeout=60)  # fmt: skip
    assert third.status_code == 200, third.text
    assert c.post(f"/api/v1/workloads/{third.json()['workload_id']}/stop").status_code == 200
    cluster.etcd.restart(1)


def test_a_paused_leader_is_fenced_and_rejoins_as_a_follower(cluster: Cluster) -> None:
    old = cluster.leader()
    others = [n for n in cluster.nodes if n is not old]
    assert old.proc is not None
    os.kill(old.proc.pid, signal.SIGSTOP)
    try:
        new = wait_for("a new leader", lambda: (leader := cluster.leader(others)) is not old
                       and leader, timeout=LEASE_TTL_S * 3)  # fmt: skip
        # paused past its lease already: the new leader holds the key, by its own account
        wait_for("the new leader's own view", lambda: new.api("/api/v1/cluster")["is_leader"],
                 timeout=30)  # fmt: skip
    finally:
        os.kill(old.proc.pid, signal.SIGCONT)
    # its first controller write is refused; its view then catches up with the new leader
    status = wait_for("the old leader fenced, a follower of the new one", lambda: (
        s := old.api("/api/v1/cluster"))["fenced_writes"] >= 1 and not s["is_leader"]
        and s["leader"] == new.name and s, timeout=30)  # fmt: skip
    assert status["term"] == 0, status
    assert cluster.leader() is new
    metrics = loopback.get(old.url + "/metrics", headers=old.headers(), timeout=10).text
    assert f'kunlun_cluster_fenced_writes_total{{node="{old.name}"}} 1.0' in metrics
    # every replica serves on exactly one node once the moves settle: nothing runs twice
    wait_for("two replicas, each on one node", lambda: _spread(cluster, 2), timeout=300)


def test_drain_moves_replicas_off_a_node_while_it_serves(cluster: Cluster) -> None:
    leader = cluster.leader()
    holders = {w[0] for w in serving_replicas(leader, cluster.workload_id).values()}
    target = next(n for n in cluster.nodes if n.name in holders and n is not leader)
    proc = leader.cli("node", "drain", target.name, key=leader.key)
    assert proc.returncode == 0, proc.stderr
    answered = []

    def moved() -> bool:
        resp = chat(target)
        answered.append(resp.status_code)
        serving = serving_replicas(leader, cluster.workload_id)
        return _spread(cluster, 2) and all(target.name not in w for w in serving.values())

    wait_for("the drained node's replica moved", moved, timeout=300, every=1.0)
    assert set(answered) == {200}, answered
    state = {n["name"]: n["state"] for n in leader.api("/api/v1/nodes")}
    assert state[target.name] == "Draining", state
    assert leader.cli("node", "undrain", target.name, key=leader.key).returncode == 0
    wait_for("the node ready again", lambda: {n["name"]: n["state"] for n in
             leader.api("/api/v1/nodes")}[target.name] == "Ready", timeout=10)  # fmt: skip


BATCH_LINES = 40


def _start_batch(cluster: Cluster, node: ClusterNodeProc) -> tuple[str, Callable[[], Path]]:
    """A batch of chat requests created on ``node`` (which then runs it); its id and the
    path of its output journal in the shared directory, once known."""
    body = "".join(json.dumps({"custom_id": f"r{i}", "method": "POST",
                               "url": "/v1/chat/completions",
                               "body": {"model": "tiny", "max_tokens": 200,
                                        "ignore_eos": True, "messages": [
                                   {"role": "user", "content": f"Tell me about number {i}."}]}})
                   + "\n" for i in range(BATCH_LINES))  # fmt: skip
    upload = loopback.post(node.url + "/v1/files", headers=node.headers(), timeout=60,
                        files={"file": ("batch.jsonl", body.encode())},
                        data={"purpose": "batch"})  # fmt: skip
    assert upload.status_code == 200, upload.text
    created = node.post("/v1/batches", {"input_file_id": upload.json()["id"],
                                        "endpoint": "/v1/chat/completions",
                                        "completion_window": "24h"})  # fmt: skip
    assert created.status_code == 200, created.text
    batch_id = created.json()["id"]
    store = EtcdStore(Etcd(cluster.etcd.endpoints, cluster.etcd.tls("node-a")))

    def journal() -> Path:
        record = store.get_batch(batch_id)
        output = record.output_file_id if record is not None else None
        return cluster.shared / (output or "not-yet")

    return batch_id, journal


def _stream(node: ClusterNodeProc, lines: list[str], started: threading.Event) -> None:
    """A long streamed completion from ``node`` into ``lines`` (status first)."""
    body = {"model": "tiny", "prompt": "Count slowly:", "max_tokens": 600,
            "ignore_eos": True, "stream": True}  # fmt: skip
    with loopback.stream("POST", node.url + "/v1/completions", json=body, headers=node.headers(),
                      timeout=300) as resp:  # fmt: skip
        lines.append(f"status {resp.status_code} {resp.headers.get('x-kunlun-device')}")
        for line in resp.iter_lines():
            if line:
                lines.append(line)
                started.set()
    started.set()


def test_a_killed_leader_node_is_replaced_and_its_replica_moves(cluster: Cluster) -> None:
    victim = cluster.leader()
    survivors = [n for n in cluster.nodes if n is not victim]
    held = serving_replicas(victim, cluster.workload_id)
    assert any(victim.name in where for where in held.values()), held  # (after the drain)
    holder = next(n for n in survivors
                  if any(n.name in where for where in
                         serving_replicas(n, cluster.workload_id).values()))  # fmt: skip
    batch_id, journal = _start_batch(cluster, victim)
    wait_for("the batch under way on the node to be killed",
             lambda: journal().exists() and len(journal().read_bytes().splitlines()) >= 4,
             timeout=120)  # fmt: skip
    written = journal()  # the output journal the lost node writes
    lines: list[str] = []
    started = threading.Event()
    stream = threading.Thread(target=_stream, args=(holder, lines, started), daemon=True)
    stream.start()
    assert started.wait(120)
    killed = time.monotonic()
    victim.kill_node()
    # the batch was cut short: what follows is a resume, not a batch that had finished
    assert len(written.read_bytes().splitlines()) < BATCH_LINES
    assert not (lines and lines[-1] == "data: [DONE]"), "the stream ended before the kill"
    new = wait_for("a new leader", lambda: (leader := cluster.leader(survivors)) is not victim
                   and leader, timeout=LEASE_TTL_S * 3)  # fmt: skip
    without = time.monotonic() - killed
    assert new in survivors and without < LEASE_TTL_S * 3, without
    stream.join(600)
    assert lines[0] == "status 200 cpu:0" and lines[-1] == "data: [DONE]", lines[:3] + lines[-3:]
    wait_for("both replicas serving on the two nodes left",
             lambda: _spread(cluster, 2), timeout=600)  # fmt: skip
    lists = [sorted(w["workload_id"] for w in n.api("/api/v1/workloads")) for n in survivors]
    assert lists[0] == lists[1] and cluster.workload_id in lists[0]
    # the batch the lost node ran: resumed by another, every line answered exactly once
    done = wait_for("the batch completed elsewhere", lambda: (b := survivors[0].api(
        f"/v1/batches/{batch_id}"))["status"] in ("completed", "failed", "expired") and b,
        timeout=600)  # fmt: skip
    assert done["status"] == "completed", done
    assert done["output_file_id"] == written.name  # continued, not started again
    assert done["request_counts"] == {"total": BATCH_LINES, "completed": BATCH_LINES, "failed": 0}
    out = loopback.get(f"{survivors[1].url}/v1/files/{done['output_file_id']}/content",
                    headers=survivors[1].headers(), timeout=30)  # fmt: skip
    answers = [json.loads(line) for line in out.text.splitlines()]
    assert sorted(a["custom_id"] for a in answers) == sorted(f"r{i}" for i in range(BATCH_LINES))
    assert {a["response"]["status_code"] for a in answers} == {200}
    assert [n["name"] for n in survivors[0].api("/api/v1/nodes")] == sorted(
        n.name for n in survivors
    )


def _load(node: ClusterNodeProc, stop: threading.Event, failures: list[str]) -> None:
    while not stop.is_set():
        try:
            resp = chat(node, max_tokens=4)
        except httpx.HTTPError as exc:
            failures.append(repr(exc))
        else:
            if resp.status_code != 200:
                failures.append(f"{resp.status_code} {resp.text[:200]}")


def test_layer_five_acceptance_report_after_the_node_loss(cluster: Cluster, tmp_path: Path) -> None:
    """``kunlun-cli acceptance --layer 5`` on the cluster the last test left two nodes of: the
    node killed there named as lost, and a canary rollout of the workload promoted under
    load first; a signed report with every checkpoint's figure, refused once changed."""
    lost = next(n for n in cluster.nodes if n not in cluster.up())
    node = cluster.up()[0]
    before = node.cli("acceptance", "--layer", "5", "--no-screenshots", "--out", str(tmp_path / "early"),
                      key=node.key, timeout=300)  # fmt: skip
    assert before.returncode == 1, before.stdout + before.stderr  # proves nothing yet
    assert "NOT RUN  a lost node" in before.stdout and "no rollout" in before.stdout, before.stdout
    assert "INCOMPLETE (2 of 3 checkpoints not run)" in before.stdout
    name = node.api(f"/api/v1/workloads/{cluster.workload_id}")["name"]
    made = node.post("/api/v1/rollouts", {
        "workload": name, "model": "tiny", "steps": "50", "interval_s": "3s",
        "min_requests": 4, "max_error_rate": "10%", "max_p95_regression": "1000%"})  # fmt: skip
    assert made.status_code == 200, made.text
    rollout_id = made.json()["rollout_id"]
    stop, failures = threading.Event(), []
    load = [threading.Thread(target=_load, args=(n, stop, failures), daemon=True)
            for n in cluster.up()]  # fmt: skip
    for thread in load:
        thread.start()
    try:
        ended = rollout_ended(node, rollout_id)
    finally:
        stop.set()
        for thread in load:
            thread.join(120)
    assert ended["state"] == "PROMOTED", (ended, dump(cluster.up()))
    assert not failures, failures[:3]  # the loss was over before the rollout began
    keys = tmp_path / "keys"
    assert node.cli("keys", "generate", "--out", str(keys), remote=False).returncode == 0
    done = node.cli("acceptance", "--layer", "5", "--lost-node", lost.name, "--out",
                    str(tmp_path / "layer5"), "--sign", str(keys / "kunlun-signing.key"),
                    key=node.key, timeout=900)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    print(done.stdout)
    report = tmp_path / "layer5" / "acceptance-layer5.json"
    doc = json.loads(report.read_text())
    assert doc["verdict"] == "PASS" and doc["not_run"] == [], doc
    leader, loss, canary = doc["checkpoints"]
    survivors = sorted(n.name for n in cluster.up())
    assert leader["data"]["leaders"].keys() == set(survivors) and leader["status"] == "PASS"
    assert loss["status"] == "PASS" and loss["data"]["nodes"] == survivors, loss
    assert loss["figure"].startswith(f"{lost.name} gone; 2 nodes list the same "), loss
    assert loss["data"]["ready"][ended["canary_workload_id"]] == 2, loss
    assert canary["status"] == "PASS" and canary["data"]["rollout"] == rollout_id, canary
    assert "error_rate 0.0% (limit" in canary["figure"] and "p95_ttft" in canary["figure"]
    assert list(doc["screenshots"]["files"]) == ["/ui/nodes", "/ui/rollouts"], doc["screenshots"]
    public = ["--public-key", str(keys / "kunlun-signing.pub")]
    verified = node.cli("acceptance", "verify", str(report), *public, remote=False)
    assert verified.returncode == 0 and "layer 5 (HA and canaries) PASS" in verified.stdout
    report.write_text(report.read_text().replace(lost.name, "node-z"))
    forged = node.cli("acceptance", "verify", str(report), *public, remote=False)
    assert forged.returncode != 0 and "signature" in forged.stderr.lower(), forged.stderr
