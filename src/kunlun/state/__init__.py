"""Durable platform state behind one interface: SQLite on a node (etcd for a cluster, later)."""

from kunlun.state.sqlite import SQLiteStore
from kunlun.state.store import (
    ApiKeyRecord,
    BatchRecord,
    EventRecord,
    FileRecord,
    ModelRecord,
    StateStore,
    WorkloadRecord,
)

__all__ = [
    "ApiKeyRecord",
    "BatchRecord",
    "EventRecord",
    "FileRecord",
    "ModelRecord",
    "SQLiteStore",
    "StateStore",
    "WorkloadRecord",
]
