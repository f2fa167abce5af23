"""The state-store interface and its records.

Everything the daemon must remember across restarts goes through a :class:`StateStore`:
workloads, their events, replicas, API keys (hashes only) and imported models. A single node
uses :class:`~kunlun.state.sqlite.SQLiteStore` under ``KUNLUN_HOME``; a cluster (later) puts
an etcd implementation behind the same interface.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any


@dataclass
class WorkloadRecord:
    workload_id: str
    name: str
    spec: dict[str, Any]
    state: str = "PENDING"
    reason: str | None = None
    target_device: str | None = None
    placement: dict[str, Any] = field(default_factory=dict)
    created: float = 0.0
    updated: float = 0.0


@dataclass
class EventRecord:
    workload_id: str
    ts: float
    kind: str
    message: str


@dataclass
class ApiKeyRecord:
    key_id: str
    name: str
    key_hash: str
    created: float
    revoked: float | None = None
    priority: str | None = None
    """Priority class of the key's requests (high, normal, low); None: the workload's."""


@dataclass
class ModelRecord:
    alias: str
    path: str
    source: str
    created: float
    meta: dict[str, Any] = field(default_factory=dict)


class StateStore(ABC):
    """Durable state. Every method is atomic and safe to call from any thread."""

    # workloads
    @abstractmethod
    def put_workload(self, record: WorkloadRecord) -> None:
        """Insert or replace a workload."""

    @abstractmethod
    def get_workload(self, workload_id: str) -> WorkloadRecord | None: ...

    @abstractmethod
    def list_workloads(self) -> list[WorkloadRecord]:
        """Every workload, oldest first."""

    # events
    @abstractmethod
    def add_event(self, event: EventRecord) -> None: ...

    @abstractmethod
    def list_events(self, workload_id: str) -> list[EventRecord]:
        """A workload's events, oldest first."""

    # API keys
    @abstractmethod
    def put_api_key(self, record: ApiKeyRecord) -> None: ...

    @abstractmethod
    def list_api_keys(self) -> list[ApiKeyRecord]: ...

    @abstractmethod
    def revoke_api_key(self, key_id: str, when: float) -> bool:
        """Mark a key revoked; False when no such active key."""

    # models
    @abstractmethod
    def put_model(self, record: ModelRecord) -> None: ...

    @abstractmethod
    def get_model(self, alias: str) -> ModelRecord | None: ...

    @abstractmethod
    def list_models(self) -> list[ModelRecord]: ...

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release resources."""
