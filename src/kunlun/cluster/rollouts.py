"""Rollouts in a cluster: what :class:`~kunlun.rollout.controller.RolloutController` asks of
the cluster (:func:`rollout_hooks`).

- The rollout records are read from the node's watched view (``rollouts/<id>``); only the
  leader writes them, each write fenced on its term like every controller write, so a
  paused old leader cannot move a rollout on.
- Every node counts its own gateway's requests per version and publishes them under its
  lease (``cluster/rollout-stats/<node>``, at most once a second); the leader merges them
  with its own before the gates decide, so a new leader after a failover judges the step
  with every node's counts.
- ``rollout promote`` and ``abort`` on any node write ``cluster/rollout-requests/<id>``; the
  leader carries it out at its next tick and deletes it.
"""

from __future__ import annotations

import dataclasses
import json
import time
from typing import TYPE_CHECKING, Any

from kunlun.rollout.controller import ClusterHooks
from kunlun.serving.canary_window import RolloutStats, VersionWindow
from kunlun.state.etcd_client import LeaseNotFound
from kunlun.state.etcd_wire import Op
from kunlun.state.store import RolloutRecord

if TYPE_CHECKING:
    from kunlun.cluster.node import ClusterNode

ROLLOUTS, STATS, REQUESTS = "rollouts/", "cluster/rollout-stats/", "cluster/rollout-requests/"
PUBLISH_EVERY_S = 1.0
_FIELDS = frozenset(f.name for f in dataclasses.fields(RolloutRecord))


def rollout_hooks(node: ClusterNode, stats: RolloutStats) -> ClusterHooks:
    member, view, own = node.member, node.view, node.config.node_name
    published: dict[str, Any] = {"at": 0.0, "value": None}

    def write(record: RolloutRecord) -> bool:
        value = json.dumps(dataclasses.asdict(record))
        return member.fenced([Op.put(member.key(ROLLOUTS + record.rollout_id), value)])

    def records() -> list[RolloutRecord]:
        found = [RolloutRecord(**{k: v for k, v in data.items() if k in _FIELDS})
                 for data in view.items(ROLLOUTS).values() if isinstance(data, dict)]  # fmt: skip
        return sorted(found, key=lambda r: r.created)

    def requests() -> dict[str, str]:
        return {rid: str(data.get("action")) for rid, data in view.items(REQUESTS).items()
                if isinstance(data, dict)}  # fmt: skip

    def request(rollout_id: str, action: str) -> None:
        member.etcd.put(member.key(REQUESTS + rollout_id),
                        json.dumps({"action": action, "node": own, "ts": time.time()}))  # fmt: skip

    def done(rollout_id: str) -> None:
        member.fenced([Op.delete(member.key(REQUESTS + rollout_id))])

    def remote_windows(rollout_id: str, step: int) -> list[dict[str, VersionWindow]]:
        out = []
        for name, snapshot in view.items(STATS).items():
            windows = snapshot.get(f"{rollout_id}/{step}") if isinstance(snapshot, dict) else None
            if name != own and isinstance(windows, dict):
                out.append({role: VersionWindow.from_dict(w) for role, w in windows.items()})
        return out

    def publish() -> None:
        now = time.monotonic()
        if now - published["at"] < PUBLISH_EVERY_S or member.lease == 0:
            return
        value = json.dumps(stats.snapshot(), sort_keys=True)
        if value == published["value"] and now - published["at"] < 5 * PUBLISH_EVERY_S:
            return
        try:
            member.etcd.put(member.key(STATS + own), value, lease=member.lease)
        except LeaseNotFound:
            return  # expired while paused: the lease thread registers again
        published["at"], published["value"] = now, value

    return ClusterHooks(lambda: member.leader, write, records, requests, request, done,
                        remote_windows, publish)  # fmt: skip
