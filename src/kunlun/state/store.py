"""The state-store interface and its records.

Everything the daemon must remember across restarts goes through a :class:`StateStore`:
workloads, their events, replicas, API keys (hashes only), imported models, and the files
and jobs of the Batch API, canary rollouts, Request-as-a-Service endpoints and the Responses
API's kept answers. A single node
uses :class:`~kunlun.state.sqlite.SQLiteStore` under ``KUNLUN_HOME``; a cluster puts
:class:`~kunlun.state.etcd.EtcdStore` behind the same interface (:mod:`kunlun.cluster`).
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
    scope: str = "inference"
    """``admin`` (every route) or ``inference`` (the OpenAI API, not ``/api/v1``)."""
    rpm: int | None = None
    """Requests per minute; None: the daemon's default; 0: no limit."""
    tpm: int | None = None
    """Tokens (prompt + completion) per minute; None: the daemon's default; 0: no limit."""
    allow_ips: list[str] | None = None
    """Client networks (CIDRs) the key may be used from; None: the daemon's default."""


@dataclass
class ModelRecord:
    alias: str
    path: str
    source: str
    created: float
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass
class FileRecord:
    """An uploaded or generated file (the bytes live under ``KUNLUN_HOME/files``)."""

    file_id: str
    filename: str
    purpose: str
    bytes: int
    created_at: int
    expires_at: int | None = None
    """When the file is deleted (Unix seconds); None: kept until deleted."""


@dataclass
class BatchRecord:
    """A Batch API job; the fields are OpenAI's batch object's."""

    batch_id: str
    endpoint: str
    input_file_id: str
    completion_window: str
    status: str
    created_at: int
    expires_at: int
    request_counts: dict[str, int] = field(default_factory=dict)
    output_file_id: str | None = None
    error_file_id: str | None = None
    errors: list[dict[str, Any]] | None = None
    metadata: dict[str, str] | None = None
    in_progress_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    model: str | None = None
    """The model the input file's requests name (the first line's)."""
    usage: dict[str, int] = field(default_factory=dict)
    """Token totals of the answered requests: prompt, cached, completion, total."""
    output_expires_after_s: int | None = None
    """The output and error files expire this many seconds after they are written."""


ROLLOUT_ENDED = ("PROMOTED", "ROLLED_BACK", "ABORTED")
"""The final states of a :class:`RolloutRecord`."""


@dataclass
class RolloutRecord:
    """A canary rollout of a workload's model (:mod:`kunlun.rollout`)."""

    rollout_id: str
    workload_id: str
    """The baseline: the workload being replaced."""
    canary_workload_id: str
    """The new version, serving the same model name next to the baseline."""
    model: str
    """The model name clients send (both workloads serve it)."""
    baseline_model: str
    canary_model: str
    steps: list[float]
    """Canary traffic percentages, in order; reaching 100 promotes."""
    interval_s: float
    max_error_rate: float
    """A fraction (0.001 for 0.1 %)."""
    max_p95_regression: float
    """A fraction (0.05 for 5 %)."""
    min_requests: int
    state: str = "STARTING"
    """STARTING, PROGRESSING, then PROMOTED, ROLLED_BACK or ABORTED."""
    step: int = -1
    """Index into ``steps`` of the weight in force (-1 while the canary starts)."""
    step_started: float = 0.0
    """When the current gate window began (at the step's start, or when it was measured
    again)."""
    window: int = 0
    """The gate window in force, counted over the whole rollout: a new one at each step and
    each time a step is measured again; the gateway counts each request under one."""
    suspect: str | None = None
    """A latency regression seen at the end of the previous window of this step (the step
    is measured again over a fresh window; a second one rolls back)."""
    created: float = 0.0
    updated: float = 0.0
    finished: float | None = None
    retired: float | None = None
    """When the losing version (the canary rolled back, the baseline replaced) had stopped;
    None while it drains. A workload with a rollout not yet retired takes no new rollout."""
    reason: str | None = None
    gates: list[dict[str, Any]] = field(default_factory=list)
    """The latest evaluation of each gate (name, verdict, measured values, limit, samples)."""
    history: list[dict[str, Any]] = field(default_factory=list)
    """Each finished step: weight, start and end, and its gates."""
    canary_spec: dict[str, Any] = field(default_factory=dict)
    """The canary workload's spec (the baseline's with the new model and overrides)."""


@dataclass
class ResponseRecord:
    """A Responses API answer kept for ``previous_response_id``
    (:mod:`kunlun.serving.response_state`): the conversation up to and including it, as the
    Responses API's input items."""

    response_id: str
    model: str
    created: float
    items: list[dict[str, Any]]
    response: dict[str, Any] = field(default_factory=dict)
    """The response object as answered (``GET /v1/responses/{id}``)."""


@dataclass
class EndpointRecord:
    """A Request-as-a-Service endpoint (:mod:`kunlun.serving.endpoints`): ``POST
    /v1/endpoints/<name>`` validates its body against ``input_schema``, renders ``prompt``
    and answers the model's output held to ``output_schema``."""

    name: str
    model: str
    input_schema: dict[str, Any] | bool
    output_schema: dict[str, Any] | bool
    prompt: str
    """A jinja2 template (sandboxed); ``input`` is the validated body."""
    description: str = ""
    created: float = 0.0
    updated: float = 0.0
    """When it was last replaced (``created`` when never)."""


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

    # Batch API files and jobs
    @abstractmethod
    def put_file(self, record: FileRecord) -> None: ...

    @abstractmethod
    def get_file(self, file_id: str) -> FileRecord | None: ...

    @abstractmethod
    def list_files(self) -> list[FileRecord]:
        """Every file record, oldest first."""

    @abstractmethod
    def delete_file(self, file_id: str) -> bool:
        """Remove a file record; False when there is none."""

    @abstractmethod
    def put_batch(self, record: BatchRecord) -> None:
        """Insert or replace a batch job."""

    @abstractmethod
    def get_batch(self, batch_id: str) -> BatchRecord | None: ...

    @abstractmethod
    def list_batches(self) -> list[BatchRecord]:
        """Every batch job, newest first."""

    # canary rollouts
    @abstractmethod
    def put_rollout(self, record: RolloutRecord) -> None:
        """Insert or replace a rollout."""

    @abstractmethod
    def get_rollout(self, rollout_id: str) -> RolloutRecord | None: ...

    @abstractmethod
    def list_rollouts(self) -> list[RolloutRecord]:
        """Every rollout, oldest first."""

    # Request-as-a-Service endpoints
    @abstractmethod
    def put_endpoint(self, record: EndpointRecord) -> None:
        """Insert or replace an endpoint."""

    @abstractmethod
    def get_endpoint(self, name: str) -> EndpointRecord | None: ...

    @abstractmethod
    def list_endpoints(self) -> list[EndpointRecord]:
        """Every endpoint, by name."""

    @abstractmethod
    def delete_endpoint(self, name: str) -> bool:
        """Remove an endpoint; False when there is none."""

    # Responses API answers (previous_response_id)
    @abstractmethod
    def put_response(self, record: ResponseRecord) -> None:
        """Insert or replace a kept response."""

    @abstractmethod
    def get_response(self, response_id: str) -> ResponseRecord | None: ...

    @abstractmethod
    def delete_response(self, response_id: str) -> bool:
        """Forget one kept response; False when there is none."""

    @abstractmethod
    def delete_responses_before(self, created: float) -> int:
        """Forget the responses kept before ``created`` (Unix seconds); how many went."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release resources."""
