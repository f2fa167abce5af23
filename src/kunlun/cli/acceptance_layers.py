"""What ``kunlun-cli acceptance`` gathers from the live platform for layers 3 to 5 (the
checkpoints are :mod:`kunlun.validate.acceptance`'s).

- layer 3 starts one replica of ``--model`` per Ready device of one type, sends concurrent
  requests while it samples every device's utilisation, and stops it;
- layer 4 asks the planner for a dry-run placement of ``--model`` on any device;
- layer 5 reads every node of a cluster (through the ``api_url`` each registers): the leader
  it names, its ``workload list``, and, after ``--lost-node``, waits (``--recovery-s``) for
  the cluster to get over the loss; and the canary rollout (``--rollout``, default the
  newest ended one).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter
from typing import Any

from kunlun.cli.client import DaemonClient
from kunlun.console import err_console
from kunlun.errors import ConfigError, KunlunError, Location, NotClustered
from kunlun.state.store import ROLLOUT_ENDED
from kunlun.validate import acceptance as layers


def layer_three(client: DaemonClient, model: str, device_type: str | None) -> dict[str, Any]:
    """One replica of ``model`` per Ready device of ``device_type`` (default: the type with
    the most, two at least) under four clients per device."""
    devices = client.get("/api/v1/devices")
    count = Counter(d["type"] for d in devices if d["status"] == "Ready")
    kind = device_type or max(count, key=lambda t: count[t], default=None)
    subject = {"model": model, "device_type": kind, "node": client.endpoint}
    if kind is None or count[kind] < 2:
        few = ("needs two or more Ready devices of one type; here: "
               + (", ".join(f"{t} {n}" for t, n in sorted(count.items())) or "none"))  # fmt: skip
        checks = [layers.Checkpoint(f"utilisation spread < {layers.BALANCE_LIMIT_PCT:g} points",
                                    layers.NOT_RUN, "not run", few),
                  layers.Checkpoint("no OOM or timeout", layers.NOT_RUN, "not run", few)]  # fmt: skip
        return layers.report(3, subject, checks)
    ids = [d["id"] for d in devices if d["status"] == "Ready" and d["type"] == kind]
    from kunlun.cli.adapt_stages import workload_name

    name = workload_name("acceptance", model, "balance")
    spec = {"model": model, "name": name, "replicas": len(ids), "preferred_device_types": [kind]}
    job, _, failed_start = client.run_workload(spec, 900)
    try:
        why = failed_start or all_ready(client, job, len(ids), 900)
        if why is not None:
            raise ConfigError(f"{model} did not start on every {kind} device: {why}",
                              location=Location("--model"))  # fmt: skip
        requests = 8 * len(ids)
        result, samples = under_load(client, name, ids, 4 * len(ids), requests)
        failed = [e for run in result["runs"] for e in run.get("errors") or []]
        after = client.get(f"/api/v1/workloads/{job}")["replicas"]
        lost = [f"{r['replica_id']} restarted {r['restarts']} times" for r in after
                if r.get("restarts") or not r["ready"]]  # fmt: skip
    finally:
        client.post(f"/api/v1/workloads/{job}/stop")
    return layers.report(3, subject, layers.layer3(kind, samples, requests, failed, lost))


def all_ready(client: DaemonClient, job: str, wanted: int, timeout_s: float) -> str | None:
    deadline = time.monotonic() + timeout_s
    while True:
        row = client.get(f"/api/v1/workloads/{job}")
        ready = sum(1 for r in row["replicas"] if r["ready"])
        if ready >= wanted:
            return None
        if row["state"] in ("FAILED", "STOPPED") or time.monotonic() > deadline:
            return f"{ready} of {wanted} replicas ready ({row['state']}: {row.get('reason')})"
        time.sleep(0.5)


def under_load(
    client: DaemonClient, name: str, devices: list[str], clients: int, requests: int
) -> tuple[dict[str, Any], dict[str, list[float]]]:
    """A streamed benchmark run of ``name`` and each device's utilisation sampled meanwhile."""
    from kunlun.bench.load import Target
    from kunlun.bench.suite import BenchOptions, run

    samples: dict[str, list[float]] = {d: [] for d in devices}
    failed: list[Exception] = []
    done = threading.Event()

    def sample() -> None:
        try:
            while not done.is_set():
                for d in client.get("/api/v1/devices"):
                    if d["id"] in samples and d.get("utilization_pct") is not None:
                        samples[d["id"]].append(float(d["utilization_pct"]))
                time.sleep(0.25)
        except Exception as exc:  # raised in the command's thread once the load is done
            failed.append(exc)

    err_console.print(f"load on {name}: {clients} clients, {requests} requests", markup=False)
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        result = asyncio.run(run(BenchOptions(
            Target(client.endpoint, name, client.api_key), concurrencies=(clients,),
            num_prompts=requests, input_len=16, output_len=16)))  # fmt: skip
    finally:
        done.set()
        sampler.join(10)
    if failed:
        raise failed[0]
    return result, samples


def layer_four(client: DaemonClient, model: str) -> dict[str, Any]:
    """The planner's dry-run choice of a device for ``model`` among every Ready one."""
    types = sorted({d["type"] for d in client.get("/api/v1/devices") if d["status"] == "Ready"})
    subject = {"model": model, "node": client.endpoint}
    try:
        made = client.post("/api/v1/workloads", json={"model": model}, params={"dry_run": True})
    except KunlunError as exc:
        if exc.exit_code == 3:
            raise
        return layers.report(4, subject, layers.layer4(None, str(exc).split(": ", 1)[-1], types))
    return layers.report(4, subject, layers.layer4(made.get("placement"), None, types))


def layer_five(
    client: DaemonClient, lost: str | None, rollout_id: str | None, recovery_s: float
) -> dict[str, Any]:
    """Every node's leader and workload list, the recovery after ``lost``, the canary."""
    subject = {"node": client.endpoint, "lost_node": lost or "none"}
    try:
        nodes = client.get("/api/v1/nodes")
    except KunlunError as exc:
        if getattr(exc, "remote_code", None) != NotClustered.code:
            raise
        why = f"not a cluster: {str(exc).split(': ', 1)[-1]}"
        checks = [layers.Checkpoint(n, layers.NOT_RUN, "single node", why) for n in (
            "one leader every node agrees on", "a lost node: workload list complete")]  # fmt: skip
        return layers.report(5, subject, [*checks, canary(client, rollout_id)])
    recovery = None
    if lost is not None:
        known = {n["name"] for n in nodes}
        err_console.print(f"waiting up to {recovery_s:g} s for the cluster to get over losing "
                          f"{lost} (members now: {', '.join(sorted(known))})", markup=False)  # fmt: skip
        recovery = wait_recovered(client, lost, recovery_s)
        nodes = client.get("/api/v1/nodes")
    leaders = {n["name"]: leader_of(client, n) for n in nodes}
    return layers.report(5, subject, layers.layer5(leaders, recovery, *rollout(client, rollout_id)))


def peer(client: DaemonClient, node: dict[str, Any]) -> DaemonClient:
    return DaemonClient(node.get("api_url") or client.endpoint, timeout=30,
                        api_key=client.api_key)  # fmt: skip


def leader_of(client: DaemonClient, node: dict[str, Any]) -> str | None:
    try:
        return peer(client, node).get("/api/v1/cluster")["leader"]
    except KunlunError as exc:
        return f"(no answer: {exc})"


def wait_recovered(client: DaemonClient, lost: str, within_s: float) -> dict[str, Any]:
    """:func:`layers.recovered` once it holds, or as it stands after ``within_s``."""
    began = time.monotonic()
    while True:
        nodes = client.get("/api/v1/nodes")
        lists: dict[str, Any] = {}
        for node in nodes:
            try:
                lists[node["name"]] = peer(client, node).get("/api/v1/workloads")
            except KunlunError as exc:
                lists[node["name"]] = str(exc)
        found = layers.recovered(lost, nodes, lists)
        took = time.monotonic() - began
        if found["ok"] or took > within_s:
            found["waited_s"] = round(took, 1)
            if not found["ok"]:
                found["detail"] = f"not within {within_s:g} s: {found['detail']}"
            return found
        time.sleep(1)


def rollout(client: DaemonClient, rollout_id: str | None) -> tuple[dict[str, Any] | None, str]:
    """The rollout to judge: ``rollout_id``, or the newest that has ended; else why none."""
    if rollout_id is not None:
        return client.get(f"/api/v1/rollouts/{rollout_id}"), ""
    rows = client.get("/api/v1/rollouts")
    ended = [r for r in rows if r["state"] in ROLLOUT_ENDED]
    if not ended:
        going = ", ".join(f"{r['rollout_id']} {r['state']}" for r in rows)
        return None, (f"no rollout has ended yet ({going})" if going else
                      "no canary rollout here: start one (kunlun-cli rollout start) and run "
                      "layer 5 once it has ended")  # fmt: skip
    return max(ended, key=lambda r: r.get("finished") or r.get("created") or 0), ""


def canary(client: DaemonClient, rollout_id: str | None) -> layers.Checkpoint:
    return layers.canary(*rollout(client, rollout_id))
