"""Durable platform state behind one interface: SQLite on a node (etcd for a cluster, later)."""

from kunlun.state.sqlite import SQLiteStore
from kunlun.state.store import ApiKeyRecord, EventRecord, ModelRecord, StateStore, WorkloadRecord

__all__ = [
    "ApiKeyRecord",
    "EventRecord",
    "ModelRecord",
    "SQLiteStore",
    "StateStore",
    "WorkloadRecord",
]
