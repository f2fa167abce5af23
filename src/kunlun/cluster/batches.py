"""Batch API jobs in a cluster: each unfinished job is run by one node, its *owner*.

The node a job is created on owns it first (``cluster/batch-owner/<batch>``). The leader gives
the job of a lost node (lease expired) to the live node with the fewest, in a fenced write;
that node resumes it from the job's journals, which live in the directory every node shares
(``--cluster-files``), so each request is still answered exactly once. A node that sees one
of its jobs owned by another node stops running it. A cancel asked on another node is left
for the owner (``cluster/batch-cancel/<batch>``), which stops taking requests and ends the
job ``cancelled``.

The jobs run in the API's event loop; the cluster thread hands them over with
``call_soon_threadsafe``.
"""

from __future__ import annotations

import asyncio
import json
import time

from kunlun.batch.jobs import BatchJobs
from kunlun.batch.objects import TERMINAL
from kunlun.cluster.member import NODES, ClusterView, Membership
from kunlun.state.etcd_wire import Op

OWNER, CANCEL, BATCHES = "cluster/batch-owner/", "cluster/batch-cancel/", "batches/"


class BatchOwners:
    def __init__(self, member: Membership, view: ClusterView, jobs: BatchJobs) -> None:
        self.member, self.view, self.jobs = member, view, jobs
        self.name = member.config.node_name
        self.loop: asyncio.AbstractEventLoop | None = None
        """The API's event loop, where the jobs run (set when the daemon starts)."""

    # ---- called by BatchJobs (in the event loop) ----
    def claim(self, batch_id: str) -> None:
        self.member.etcd.put(self.member.key(OWNER + batch_id), json.dumps({"node": self.name}))

    def cancel_elsewhere(self, batch_id: str) -> bool:
        owner = self.view.items(OWNER).get(batch_id)
        if owner is None or owner.get("node") == self.name:
            return False
        self.member.etcd.put(self.member.key(CANCEL + batch_id), json.dumps({"ts": time.time()}))
        return True

    # ---- the leader ----
    def assign(self) -> tuple[list[Op], list[str]]:
        """The writes (to be fenced) giving each unfinished job of a lost node to a live
        one and removing the ownership of finished jobs, and what to say once they land."""
        nodes = set(self.view.items(NODES))
        owners = {bid: str(o.get("node")) for bid, o in self.view.items(OWNER).items()}
        load = {node: 0 for node in nodes}
        records = self.view.items(BATCHES)
        for bid, node in owners.items():
            if node in load and records.get(bid, {}).get("status") not in TERMINAL:
                load[node] += 1
        ops: list[Op] = []
        said: list[str] = []
        for bid, record in records.items():
            finished = record.get("status") in TERMINAL
            if finished:
                if bid in owners:
                    ops += [Op.delete(self.member.key(OWNER + bid)),
                            Op.delete(self.member.key(CANCEL + bid))]  # fmt: skip
                continue
            if owners.get(bid) in nodes or not nodes:
                continue
            node = min(sorted(nodes), key=lambda n: load[n])
            load[node] += 1
            was = owners.get(bid)
            said.append(f"cluster: batch {bid} to {node}" + (f" ({was} is gone)" if was else ""))
            ops.append(Op.put(self.member.key(OWNER + bid), json.dumps({"node": node})))
        return ops, said

    # ---- every node ----
    def reconcile(self) -> None:
        loop = self.loop
        if loop is None:
            return
        owners = {bid: str(o.get("node")) for bid, o in self.view.items(OWNER).items()}
        records = self.view.items(BATCHES)
        cancels = self.view.items(CANCEL)
        running = self.jobs.running()
        for bid, node in owners.items():
            if node == self.name and bid not in running:
                if records.get(bid, {}).get("status") not in TERMINAL:
                    loop.call_soon_threadsafe(self.jobs.resume, bid)
            elif node != self.name and bid in running:
                loop.call_soon_threadsafe(self.jobs.release, bid)
        for bid in cancels:
            if bid in running and owners.get(bid) == self.name:
                loop.call_soon_threadsafe(self.jobs.stop, bid)
