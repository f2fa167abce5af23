"""Durable platform state behind one interface: SQLite on one node, etcd in a cluster."""

from kunlun.state.etcd import EtcdStore
from kunlun.state.sqlite import SQLiteStore
from kunlun.state.store import (
    ApiKeyRecord,
    BatchRecord,
    EndpointRecord,
    EventRecord,
    FileRecord,
    ModelRecord,
    StateStore,
    WorkloadRecord,
)

__all__ = [
    "ApiKeyRecord",
    "BatchRecord",
    "EndpointRecord",
    "EtcdStore",
    "EventRecord",
    "FileRecord",
    "ModelRecord",
    "SQLiteStore",
    "StateStore",
    "WorkloadRecord",
]
