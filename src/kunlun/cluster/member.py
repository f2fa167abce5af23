"""One platform node in a cluster: its registration, the leader election, fenced writes, and
the watched view of the cluster that every other part reads.

Keys (under the store's prefix, ``/kunlun/``):

- ``cluster/nodes/<name>``: the node (URLs, devices, start time), written under the node's
  lease; a node whose lease expires is gone;
- ``cluster/drain/<name>``: the node is being drained (no lease: survives restarts);
- ``cluster/leader``: the leader's name, under its lease. The key's create revision is the
  leader's *term*: every controller write is a transaction that compares it, so a node that
  lost the key (paused past its lease, or cut off) cannot write (fencing);
- ``cluster/assign/<workload>``: which node runs each replica index (the leader writes it);
- ``cluster/replicas/<node>/<replica>``: each running replica as its node reports it, under
  the node's lease.

:class:`ClusterView` keeps a copy of all of it, fed by one etcd watch; nothing polls etcd.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from kunlun.errors import ClusterUnavailable, ConfigError, Location
from kunlun.state.certs import MemberTLS
from kunlun.state.etcd_client import Etcd
from kunlun.state.etcd_wire import KV, Compare, Op, WatchEvent

NODES, DRAIN, LEADER = "cluster/nodes/", "cluster/drain/", "cluster/leader"
ASSIGN, REPLICAS, WORKLOADS = "cluster/assign/", "cluster/replicas/", "workloads/"
DEFAULT_LEASE_TTL_S = 10


@dataclass(frozen=True)
class ClusterConfig:
    """How a node joins (``kunlun-platform --cluster-etcd ...``)."""

    endpoints: list[str]
    node_name: str
    api_url: str
    """Where this node's API listens (for ``node list``)."""
    peer_url: str
    """Where other nodes reach this node's replicas (``--advertise-url``)."""
    files_dir: Path | None = None
    """The directory every node shares for Batch API files and journals (``--cluster-files``)."""
    tls: MemberTLS | None = None
    lease_ttl_s: int = DEFAULT_LEASE_TTL_S
    prefix: str = "/kunlun/"

    def __post_init__(self) -> None:
        if not self.node_name or "/" in self.node_name:
            raise ConfigError(
                f"invalid node name {self.node_name!r}", location=Location("--node-name")
            )
        if self.tls is None:
            return
        for url, flag in ((self.peer_url, "--advertise-url"),
                          *((e, "--cluster-etcd") for e in self.endpoints)):  # fmt: skip
            if not url.startswith("https://"):
                raise ConfigError(
                    f"{url} is plain HTTP but the cluster uses TLS",
                    location=Location(flag),
                    hint="use https:// URLs, or --insecure-cluster (no certificates) on "
                    "every member for a test cluster",
                )


def cluster_config(
    etcd: str,
    node_name: str | None,
    host: str,
    port: int,
    peer_port: int,
    advertise_url: str | None,
    certs: Path | None,
    insecure: bool,
    lease_ttl_s: int,
    files: Path | None,
) -> ClusterConfig:
    """The :class:`ClusterConfig` of ``kunlun-platform``'s cluster flags; TLS unless
    ``--insecure-cluster``, which is refused together with certificates."""
    if not node_name:
        raise ConfigError("a cluster node needs a name", location=Location("--node-name"))
    endpoints = [url.strip().rstrip("/") for url in etcd.split(",") if url.strip()]
    if not endpoints:
        raise ConfigError(f"no etcd URL in {etcd!r}", location=Location("--cluster-etcd"))
    tls = None
    if certs is not None and insecure:
        raise ConfigError(
            "--cluster-certs and --insecure-cluster contradict each other",
            location=Location("--insecure-cluster"),
        )
    if certs is not None:
        tls = MemberTLS.from_dir(certs, node_name)
    elif not insecure:
        raise ConfigError(
            "a cluster talks TLS: no certificates given",
            location=Location("--cluster-certs"),
            hint="make them with `kunlun-cli cluster certs --out DIR --name NODE ...` and pass "
            "--cluster-certs DIR; plain HTTP between nodes only with --insecure-cluster",
        )
    if files is None or not files.is_dir():
        raise ConfigError(
            "a cluster node needs the directory all nodes share for Batch API files"
            + ("" if files is None else f": {files} is not a directory"),
            location=Location("--cluster-files"),
            hint="mount the same shared directory (NFS, CephFS, ...) on every node and pass it",
        )
    if advertise_url is None:
        if host in ("0.0.0.0", "::"):
            raise ConfigError(
                f"--host {host} says nothing of how other nodes reach this one",
                location=Location("--advertise-url"),
                hint="pass --advertise-url https://ADDRESS:PEER_PORT",
            )
        shown = f"[{host}]" if ":" in host else host
        advertise_url = f"{'http' if insecure else 'https'}://{shown}:{peer_port}"
    return ClusterConfig(endpoints, node_name, f"http://{host}:{port}",
                         advertise_url.rstrip("/"), files.resolve(), tls, lease_ttl_s)  # fmt: skip


class ReplicaStatus(BaseModel):
    """One replica as its node reports it, under ``cluster/replicas/<node>/<replica id>``
    with the node's lease: running (ready or loading), or ``failed`` with why (then only
    ``workload_id`` and ``index`` besides). The leader places from these, every node routes
    to the others' ready ones, and ``node list`` shows them."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    workload_id: str
    index: int = Field(ge=0)
    failed: str | None = None
    """Why the replica cannot run on this node (the leader places it elsewhere)."""
    model: str | None = None
    device: str | None = None
    ready: bool = False
    ejected: str | None = None
    """Why this node's health checks took it out of routing (None: they did not)."""
    max_num_seqs: int | None = Field(default=None, ge=1)
    max_queue: int | None = Field(default=None, ge=1)
    priority: str | None = None
    max_model_len: int | None = None
    created: int = 0
    task: str | None = None
    reservations: tuple[dict[str, Any], ...] = ()
    """The device memory its placement holds, for the leader's next placements."""
    utilization_pct: float | None = None
    """Its device's utilization, rounded to 10 % (routing's load signal on other nodes)."""

    @model_validator(mode="after")
    def _a_running_one_says_what_it_serves(self) -> ReplicaStatus:
        missing = [name for name in ("model", "device", "max_num_seqs", "max_queue", "priority",
                                     "task") if getattr(self, name) is None]  # fmt: skip
        if self.failed is None and missing:
            raise ValueError(f"a running replica's status lacks {', '.join(missing)}")
        return self

    def to_json(self) -> str:
        return self.model_dump_json(exclude_none=True)


class ClusterView:
    """Everything under the prefix that the cluster's parts read, kept current by a watch."""

    def __init__(self, etcd: Etcd, prefix: str) -> None:
        self.etcd, self.prefix = etcd, prefix
        self._kvs: dict[str, KV] = {}
        self._lock = threading.Lock()
        self.changed = threading.Event()
        self.revision = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._bad_statuses: set[str] = set()

    def start(self) -> None:
        start = self.etcd.revision()
        self._apply(self.etcd.range(self.prefix))
        self._thread = self.etcd.watch(self.prefix, start + 1, self._on_events, self._stop)

    def stop(self) -> None:
        self._stop.set()

    def _apply(self, kvs: list[KV]) -> None:
        with self._lock:
            for kv in kvs:
                self._kvs[kv.key] = kv
        self.changed.set()

    def _on_events(self, events: list[WatchEvent], revision: int) -> None:
        if revision < 0:  # compacted past our revision: read everything again
            fresh = {kv.key: kv for kv in self.etcd.range(self.prefix)}
            with self._lock:
                self._kvs = fresh
            self.changed.set()
            return
        with self._lock:
            for event in events:
                key, old = event.kv.key, self._kvs.get(event.kv.key)
                if old is not None and old.mod_revision > event.kv.mod_revision:
                    continue  # already newer (read by the initial range)
                if event.type == "DELETE":
                    self._kvs.pop(key, None)
                else:
                    self._kvs[key] = event.kv
            self.revision = max(self.revision, revision)
        self.changed.set()

    def items(self, sub: str) -> dict[str, Any]:
        """``{rest of key: decoded JSON}`` under ``prefix + sub``."""
        start = self.prefix + sub
        with self._lock:
            found = [(k, kv) for k, kv in self._kvs.items() if k.startswith(start)]
        out = {}
        for key, kv in sorted(found):
            try:
                out[key[len(start) :]] = json.loads(kv.value)
            except ValueError:
                continue  # not ours: ignored
        return out

    def replica_statuses(self) -> dict[str, ReplicaStatus]:
        """``{node/replica id: status}`` of every replica reported; a record that is not a
        status (another version's node, a hand-written key) is said once and left out."""
        out = {}
        for key, data in self.items(REPLICAS).items():
            try:
                out[key] = ReplicaStatus.model_validate(data)
            except ValidationError as exc:
                if key not in self._bad_statuses:
                    self._bad_statuses.add(key)
                    problem = exc.errors()[0]
                    where = ".".join(str(p) for p in problem["loc"]) or "(status)"
                    print(f"cluster: {self.prefix}{REPLICAS}{key} is not a replica status "
                          f"({where}: {problem['msg']}); left out", flush=True)  # fmt: skip
        return out

    def kv(self, sub: str) -> KV | None:
        with self._lock:
            return self._kvs.get(self.prefix + sub)


@dataclass
class Membership:
    """This node's lease, registration and leadership, and the fenced write."""

    config: ClusterConfig
    etcd: Etcd
    devices: Callable[[], list[dict[str, Any]]]
    lease: int = 0
    term: int = 0
    """The leader key's create revision while this node leads; 0 otherwise."""
    fenced_writes: int = 0
    """Controller writes refused because this node no longer held the leader key."""
    elections_won: int = 0
    lease_losses: int = 0
    unavailable_since: float | None = None
    """Since when etcd could not be reached (None: it can)."""
    last_error: str | None = None
    started: float = field(default_factory=time.time)
    rejoined: threading.Event = field(default_factory=threading.Event)
    _lease_lock: threading.Lock = field(default_factory=threading.Lock)

    def key(self, sub: str) -> str:
        return self.config.prefix + sub

    @property
    def leader(self) -> bool:
        return self.term > 0

    def register(self) -> None:
        """A new lease and this node's key under it."""
        self.lease = self.etcd.lease_grant(self.config.lease_ttl_s)
        self.etcd.put(self.key(NODES + self.config.node_name), json.dumps(self.describe()),
                      lease=self.lease)  # fmt: skip
        self.rejoined.set()

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.config.node_name,
            "api_url": self.config.api_url,
            "peer_url": self.config.peer_url,
            "devices": self.devices(),
            "started": self.started,
        }

    def keepalive(self) -> bool:
        """Renew the lease; a lost one (expired while this node was paused or cut off) is
        replaced and the node registered again. False when etcd cannot be reached."""
        try:
            with self._lease_lock:  # the lease thread and the cluster loop both may ask
                if self.lease == 0 or self.etcd.lease_keepalive(self.lease) <= 0:
                    if self.lease:
                        self.lease_losses += 1
                        print(f"cluster: lease of {self.config.node_name} expired; "
                              "registering again", flush=True)  # fmt: skip
                    self.register()
        except ClusterUnavailable as exc:
            self._unavailable(exc)
            return False
        self.unavailable_since, self.last_error = None, None
        return True

    def _unavailable(self, exc: ClusterUnavailable) -> None:
        if self.unavailable_since is None:
            self.unavailable_since = time.time()
            print(f"cluster: {exc}", flush=True)
        self.last_error = str(exc)

    def campaign(self) -> bool:
        """Take the leader key if nobody holds it; True when this node now leads."""
        if self.leader or self.lease == 0:
            return self.leader
        value = json.dumps({"name": self.config.node_name, "since": time.time()})
        result = self.etcd.txn(
            [Compare.create_revision(self.key(LEADER), "==", 0)],
            [Op.put(self.key(LEADER), value, lease=self.lease)],
        )
        if result.succeeded:
            self.term = result.revision
            self.elections_won += 1
            print(f"cluster: {self.config.node_name} is the leader (term {self.term})", flush=True)
        return self.leader

    def fenced(self, ops: list[Op]) -> bool:
        """Apply ``ops`` only while this node still holds the leader key of its term. A
        refused write ends this node's leadership (it is a follower from then on)."""
        if not self.leader or not ops:
            return self.leader
        result = self.etcd.txn([Compare.create_revision(self.key(LEADER), "==", self.term)], ops)
        if not result.succeeded:
            self.fenced_writes += 1
            print(f"cluster: controller write refused (fenced): {self.config.node_name} no "
                  f"longer holds the leader key of term {self.term}; now a follower",
                  flush=True)  # fmt: skip
            self.term = 0
        return result.succeeded

    def resign(self) -> None:
        if self.leader:
            self.etcd.txn(
                [Compare.create_revision(self.key(LEADER), "==", self.term)],
                [Op.delete(self.key(LEADER))],
            )
            self.term = 0

    def leave(self) -> None:
        """At shutdown: give up leadership and the lease (the node's keys go with it)."""
        try:
            self.resign()
            if self.lease:
                self.etcd.lease_revoke(self.lease)
        except ClusterUnavailable:
            pass
        self.lease = 0
