"""etcd implementation of the state store, for a cluster: every node sees the same state.

Each record is one key under the prefix (default ``/kunlun/``), its value the JSON of
``dataclasses.asdict(record)``:

    workloads/<workload_id>   apikeys/<key_id>   models/<alias>
    files/<file_id>           batches/<batch_id>          rollouts/<rollout_id>
    endpoints/<name>            responses/<response_id>
    events/<workload_id>/<time_ns:020d>-<8 hex>

Lists are sorted as :class:`~kunlun.state.sqlite.SQLiteStore` sorts them: workloads and API
keys by ``created``, models and endpoints by name, files in the order they were first written, batches
newest first (by ``created_at``, then by when first written) and events in the order they
were written. "When first written" is etcd's ``create_revision``: one order for every node,
whatever their clocks.
Fields a record does not know (written by a newer version) are ignored when read.

:meth:`EtcdStore.data_version` costs no request: a watch on the prefix, started with the
store, counts the changes to records it sees (this store's writes and every other node's;
not the cluster's own keys under ``cluster/`` nor events and kept responses, which change all
the time) and keeps
:attr:`EtcdStore.revision`, the store's revision as of the latest one. Every method raises
:class:`~kunlun.errors.ClusterUnavailable` when no quorum of etcd answers in time.
"""

from __future__ import annotations

import dataclasses
import json
import os
import threading
import time
from dataclasses import asdict
from typing import Any, TypeVar

from kunlun.state.etcd_client import Etcd
from kunlun.state.etcd_wire import KV, Compare, Op, WatchEvent
from kunlun.state.store import (
    ApiKeyRecord,
    BatchRecord,
    EndpointRecord,
    EventRecord,
    FileRecord,
    ModelRecord,
    ResponseRecord,
    RolloutRecord,
    StateStore,
    WorkloadRecord,
)

R = TypeVar("R")


class EtcdStore(StateStore):
    """State in etcd under ``prefix``. The caller owns ``etcd`` (and closes it)."""

    def __init__(self, etcd: Etcd, prefix: str = "/kunlun/") -> None:
        self.etcd = etcd
        self.prefix = prefix if prefix.endswith("/") else prefix + "/"
        self.revision = etcd.revision()
        """The store's revision as of the latest change under the prefix seen by the watch."""
        self._changes = 0
        self._busy = (self.prefix + "cluster/", self.prefix + "events/", self.prefix + "responses/")
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._watch = etcd.watch(self.prefix, self.revision + 1, self._on_events, self._stop)

    # workloads
    def put_workload(self, record: WorkloadRecord) -> None:
        self._put("workloads", record.workload_id, record)

    def get_workload(self, workload_id: str) -> WorkloadRecord | None:
        return self._get(WorkloadRecord, "workloads", workload_id)

    def list_workloads(self) -> list[WorkloadRecord]:
        records = self._list(WorkloadRecord, "workloads")
        return [r for _, r in sorted(records, key=lambda kr: kr[1].created)]

    # events
    def add_event(self, event: EventRecord) -> None:
        suffix = f"{time.time_ns():020d}-{os.urandom(4).hex()}"
        self._put("events", f"{event.workload_id}/{suffix}", event)

    def list_events(self, workload_id: str) -> list[EventRecord]:
        records = self._list(EventRecord, f"events/{workload_id}")
        return [r for _, r in sorted(records, key=lambda kr: kr[0].create_revision)]

    # API keys
    def put_api_key(self, record: ApiKeyRecord) -> None:
        self._put("apikeys", record.key_id, record)

    def list_api_keys(self) -> list[ApiKeyRecord]:
        records = self._list(ApiKeyRecord, "apikeys")
        return [r for _, r in sorted(records, key=lambda kr: kr[1].created)]

    def revoke_api_key(self, key_id: str, when: float) -> bool:
        """A transaction on the key's mod_revision: of concurrent revocations (from any
        node) exactly one returns True."""
        key = self._key("apikeys", key_id)
        while True:
            kv = self.etcd.get(key)
            if kv is None:
                return False
            record = _record(ApiKeyRecord, kv)
            if record.revoked is not None:
                return False
            record.revoked = when
            done = self.etcd.txn(
                [Compare.mod_revision(key, "==", kv.mod_revision)],
                [Op.put(key, json.dumps(asdict(record)))],
            )
            if done.succeeded:
                return True  # else changed meanwhile: read it again

    # models
    def put_model(self, record: ModelRecord) -> None:
        self._put("models", record.alias, record)

    def get_model(self, alias: str) -> ModelRecord | None:
        return self._get(ModelRecord, "models", alias)

    def list_models(self) -> list[ModelRecord]:
        return sorted((r for _, r in self._list(ModelRecord, "models")), key=lambda r: r.alias)

    # Batch API files and jobs
    def put_file(self, record: FileRecord) -> None:
        self._put("files", record.file_id, record)

    def get_file(self, file_id: str) -> FileRecord | None:
        return self._get(FileRecord, "files", file_id)

    def list_files(self) -> list[FileRecord]:
        records = self._list(FileRecord, "files")
        return [r for _, r in sorted(records, key=lambda kr: kr[0].create_revision)]

    def delete_file(self, file_id: str) -> bool:
        return self.etcd.delete(self._key("files", file_id)) > 0

    def put_batch(self, record: BatchRecord) -> None:
        self._put("batches", record.batch_id, record)

    def get_batch(self, batch_id: str) -> BatchRecord | None:
        return self._get(BatchRecord, "batches", batch_id)

    def list_batches(self) -> list[BatchRecord]:
        records = self._list(BatchRecord, "batches")
        records.sort(key=lambda kr: (kr[1].created_at, kr[0].create_revision), reverse=True)
        return [r for _, r in records]

    def put_rollout(self, record: RolloutRecord) -> None:
        self._put("rollouts", record.rollout_id, record)

    def get_rollout(self, rollout_id: str) -> RolloutRecord | None:
        return self._get(RolloutRecord, "rollouts", rollout_id)

    def list_rollouts(self) -> list[RolloutRecord]:
        records = self._list(RolloutRecord, "rollouts")
        records.sort(key=lambda kr: (kr[1].created, kr[0].create_revision))
        return [r for _, r in records]

    # Request-as-a-Service endpoints
    def put_endpoint(self, record: EndpointRecord) -> None:
        self._put("endpoints", record.name, record)

    def get_endpoint(self, name: str) -> EndpointRecord | None:
        return self._get(EndpointRecord, "endpoints", name)

    def list_endpoints(self) -> list[EndpointRecord]:
        return sorted((r for _, r in self._list(EndpointRecord, "endpoints")),
                      key=lambda r: r.name)  # fmt: skip

    def delete_endpoint(self, name: str) -> bool:
        return self.etcd.delete(self._key("endpoints", name)) > 0

    # Responses API answers
    def put_response(self, record: ResponseRecord) -> None:
        self._put("responses", record.response_id, record)

    def get_response(self, response_id: str) -> ResponseRecord | None:
        return self._get(ResponseRecord, "responses", response_id)

    def delete_response(self, response_id: str) -> bool:
        return self.etcd.delete(self._key("responses", response_id)) > 0

    def delete_responses_before(self, created: float) -> int:
        old = [kv.key for kv, r in self._list(ResponseRecord, "responses") if r.created < created]
        return sum(self.etcd.delete(key) for key in old)

    # change detection
    def data_version(self) -> int:
        """Changes whenever anything under the prefix changes, on any node: the number of
        changes the watch has seen (no request)."""
        return self._changes

    def close(self) -> None:
        """Stop the watch (the etcd client stays open: its owner closes it)."""
        self._stop.set()
        self._watch.join(timeout=self.etcd.timeout_s)

    # plumbing
    def _on_events(self, events: list[WatchEvent], revision: int) -> None:
        """A watch batch: changes (or, empty, a progress report) at ``revision``; a
        negative one is a compaction, which may have hidden changes: counted as one."""
        records = [e for e in events if not e.kv.key.startswith(self._busy)]
        with self._lock:
            self.revision = max(self.revision, abs(revision))
            if records or revision < 0:
                self._changes += 1

    def _key(self, kind: str, name: str) -> str:
        return f"{self.prefix}{kind}/{name}"

    def _put(self, kind: str, name: str, record: Any) -> None:
        self.etcd.put(self._key(kind, name), json.dumps(asdict(record)))

    def _get(self, cls: type[R], kind: str, name: str) -> R | None:
        kv = self.etcd.get(self._key(kind, name))
        return None if kv is None else _record(cls, kv)

    def _list(self, cls: type[R], kind: str) -> list[tuple[KV, R]]:
        return [(kv, _record(cls, kv)) for kv in self.etcd.range(self._key(kind, ""))]


def _record(cls: type[R], kv: KV) -> R:
    """The record stored in ``kv``, without the fields ``cls`` does not have."""
    data = kv.json()
    names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    return cls(**{k: v for k, v in data.items() if k in names})
