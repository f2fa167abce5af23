"""Durable platform state behind one interface: SQLite on one node, etcd in a cluster."""

from typing import TYPE_CHECKING, Any

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

if TYPE_CHECKING:
    from kunlun.state.etcd import EtcdStore


def __getattr__(name: str) -> Any:
    # the etcd store (and its client, TLS and HTTP stack) is imported only where a cluster
    # is used: a single node's daemon and every CLI command start without it
    if name == "EtcdStore":
        from kunlun.state.etcd import EtcdStore

        return EtcdStore
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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
