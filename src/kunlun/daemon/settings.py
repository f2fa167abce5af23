"""The daemon's settings: every option of ``kunlun-platform``, typed and written once.

:class:`DaemonSettings` is a frozen pydantic model with one field per option. A field holds
the option's name, type, default, bounds (``ge``/``le``) and help (its ``description``);
how it is spelled on the command line, where that is not ``--field-name``, and its
environment variable are a :class:`Flag` in the field's annotation. :func:`settings_command`
turns such a model into the parameters of a typer command (as vLLM builds its flags from
``EngineArgs``), so the command receives one validated settings object.

The ``--model`` options describe the workload served at start: each sets one field of the
:class:`~kunlun.workload.spec.WorkloadSpec` (:func:`spec_option`), and its help is that
field's own description, so the flag and the spec file say the same.
"""

from __future__ import annotations

import functools
import inspect
import ipaddress
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, TypeVar

import annotated_types
import typer
from pydantic import BaseModel, ConfigDict, Field
from pydantic.fields import FieldInfo

from kunlun.address import DEFAULT_HOST, DEFAULT_PORT
from kunlun.batch.jobs import MAX_RUNNING_JOBS
from kunlun.errors import ConfigError, Location
from kunlun.limits import DEFAULT_MAX_SEQUENCES
from kunlun.workload.spec import WorkloadSpec

Settings = TypeVar("Settings", bound=BaseModel)
SPEC_FIELD = "spec_field"
"""The key of a ``--model`` option's ``json_schema_extra``: the workload spec field it sets."""
DTYPES = {
    "auto": None,
    "float32": "fp32",
    "float": "fp32",
    "bfloat16": "bf16",
    "float16": "fp16",
    "half": "fp16",
    "fp32": "fp32",
    "bf16": "bf16",
    "fp16": "fp16",
}
"""``--dtype`` values: vLLM's spellings and Kunlun's, to the workload spec's (None: the
planner chooses)."""


@dataclass(frozen=True, slots=True)
class Flag:
    """How a settings field is spelled on the command line, where that is more than
    ``--field-name``; the field itself holds the type, default, bounds and help."""

    names: tuple[str, ...] = ()
    """The option's spellings, the first one shown in messages (``--a/--no-a`` for an
    on/off pair); none: ``--field-name``."""
    envvar: str | None = None
    """The environment variable read when the option is not given."""
    hidden: bool = False
    """Left out of ``--help`` (switches for tests)."""


def flag_of(field: FieldInfo) -> Flag:
    """The :class:`Flag` in ``field``'s annotation, or the plain one."""
    return next((m for m in field.metadata if isinstance(m, Flag)), Flag())


def flag_names(name: str, field: FieldInfo) -> tuple[str, ...]:
    """The spellings of the option of the field ``name``."""
    return flag_of(field).names or ("--" + name.replace("_", "-"),)


def option_parameters(model: type[BaseModel]) -> list[inspect.Parameter]:
    """One keyword parameter per field of ``model``, in order, as typer reads a command's
    options: the field's type, and a ``typer.Option`` with its default, help, bounds
    (``ge`` as ``min``, ``le`` as ``max``) and :class:`Flag`."""
    parameters = []
    for name, field in model.model_fields.items():
        flag = flag_of(field)
        bounds: dict[str, Any] = {}
        for bound in field.metadata:
            if isinstance(bound, annotated_types.Ge):
                bounds["min"] = bound.ge
            elif isinstance(bound, annotated_types.Le):
                bounds["max"] = bound.le
        option = typer.Option(field.default, *flag_names(name, field), help=field.description,
                              envvar=flag.envvar, hidden=flag.hidden, **bounds)  # fmt: skip
        parameters.append(inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=option,
                                            annotation=field.annotation))  # fmt: skip
    return parameters


def settings_command(
    model: type[Settings],
) -> Callable[[Callable[[typer.Context, Settings], None]], Callable[..., None]]:
    """Make ``run(ctx, settings)`` a typer command whose options are ``model``'s fields.

    typer reads a command's options from ``inspect.signature``, which honours a function's
    ``__signature__``: the command's is ``ctx`` and :func:`option_parameters`. typer parses
    and checks each option (type, bounds, environment variable); the values become one
    ``model``, validated once more by pydantic, and ``run`` gets it."""

    def decorate(run: Callable[[typer.Context, Settings], None]) -> Callable[..., None]:
        @functools.wraps(run)
        def command(ctx: typer.Context, **values: Any) -> None:
            run(ctx, model(**values))

        context = inspect.Parameter(
            "ctx", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=typer.Context
        )
        parameters = [context, *option_parameters(model)]
        command.__signature__ = inspect.Signature(parameters, return_annotation=None)  # type: ignore[attr-defined]
        command.__annotations__ = {p.name: p.annotation for p in parameters}
        return command

    return decorate


def spec_option(field: str, more: str = "", *, ge: int | None = None) -> Any:
    """A ``--model`` option, None unless given: it sets the workload spec's ``field``, and
    its help is that field's description, then ``more`` (what only the flag takes)."""
    described = WorkloadSpec.model_fields[field].description
    return Field(None, ge=ge, description=f"With --model, the spec's {field}: {described}{more}",
                 json_schema_extra={SPEC_FIELD: field})  # fmt: skip


class DaemonSettings(BaseModel):
    """Every option of ``kunlun-platform`` (one field each: see the module's docstring)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    host: str = Field(DEFAULT_HOST, description="Address to bind.")
    port: int = Field(DEFAULT_PORT, ge=1, le=65535, description="Port to bind.")
    allow_insecure: bool = Field(False, description="Allow a non-loopback bind with no API key.")
    allowed_origins: Annotated[str | None, Flag(envvar="KUNLUN_ALLOWED_ORIGINS")] = Field(
        None,
        description="Browser origins allowed to call the API (CORS), comma-separated, e.g. "
        "https://app.example.com; '*' for any. Without it: no CORS headers.",
    )
    forwarded_allow_ips: Annotated[str | None, Flag(envvar="KUNLUN_FORWARDED_ALLOW_IPS")] = Field(
        None,
        description="Proxies whose X-Forwarded-For (the client's address, which API keys' "
        "allow-lists check) and X-Forwarded-Proto are believed: comma-separated addresses "
        "or networks, e.g. 10.0.0.5,10.1.0.0/16. Without it no proxy header is believed.",
    )
    api_key: Annotated[str | None, Flag(envvar="KUNLUN_API_KEY")] = Field(
        None,
        description="A fixed admin API key for this run, not stored (containers, CI); stored "
        "keys (kunlun-cli apikey) work beside it.",
    )
    config: Path | None = Field(
        None,
        description="device-plugin-config.yaml (default: KUNLUN_HOME/device-plugin-config.yaml "
        "if present).",
    )
    demo: bool = Field(False, description="Import the demo model and serve it as 'smollm2'.")
    model: str | None = Field(
        None,
        description="Serve this model from the start: an alias, a model directory, a GGUF "
        "file, or a Hugging Face repo id already in the local cache (nothing is downloaded).",
    )
    served_model_name: str | None = spec_option("name")
    dtype: str | None = spec_option(
        "dtype",
        f" The flag also takes vLLM's: {', '.join(k for k, v in DTYPES.items() if k != v)}.",
    )
    max_model_len: int | None = spec_option("max_model_len", ge=1)
    max_num_seqs: int | None = spec_option("max_num_seqs", ge=1)
    tensor_parallel_size: int | None = spec_option("tensor_parallel_size", ge=1)
    quantization: Annotated[str | None, Flag(("--quantization", "--quantize"))] = spec_option(
        "quantization", " Quantized while loading."
    )
    task: str | None = spec_option("task")
    pooling: str | None = spec_option("pooling")
    gpu_memory_utilization: float | None = spec_option("memory_utilization")
    chat_template: str | None = spec_option(
        "chat_template", " The flag takes a template file, or the template text."
    )
    scheduler_config: Path | None = Field(
        None,
        description="scheduler_config.yaml (default: KUNLUN_HOME/scheduler_config.yaml if "
        "present); reloaded when it changes.",
    )
    request_log_max_mb: Annotated[int, Flag(envvar="KUNLUN_REQUEST_LOG_MAX_MB")] = Field(
        64, ge=1, description="Rotate KUNLUN_HOME/logs/requests.jsonl past this many MiB."
    )
    request_log_backups: Annotated[int, Flag(envvar="KUNLUN_REQUEST_LOG_BACKUPS")] = Field(
        5, ge=0, description="Rotated request logs kept (requests.jsonl.1 ... .N)."
    )
    request_log_flush_s: Annotated[float, Flag(envvar="KUNLUN_REQUEST_LOG_FLUSH_S")] = Field(
        0.5,
        ge=0.01,
        le=60.0,
        description="Longest time a request log entry waits in memory before it is written.",
    )
    batch_max_jobs: Annotated[int, Flag(envvar="KUNLUN_BATCH_MAX_JOBS")] = Field(
        MAX_RUNNING_JOBS,
        ge=1,
        description="Batch API jobs that run at once; later ones wait (status 'validating').",
    )
    model_root: list[Path] | None = Field(
        None,
        description="A directory GGUF imports through the daemon may read from (repeatable; "
        "also KUNLUN_MODEL_ROOTS, ':'-separated, and model_roots in scheduler_config.yaml; "
        "KUNLUN_HOME/models and the demo package always are).",
    )
    max_sequences_per_request: Annotated[int, Flag(envvar="KUNLUN_MAX_SEQUENCES_PER_REQUEST")] = (
        Field(
            DEFAULT_MAX_SEQUENCES,
            ge=1,
            description="Most sequences one inference request may ask for (prompts x n); more: 400.",
        )
    )
    worker_sandbox: Annotated[
        bool, Flag(("--worker-sandbox/--no-worker-sandbox",), envvar="KUNLUN_WORKER_SANDBOX")
    ] = Field(
        True,
        description="Confine engine workers (clean environment, rlimits, seccomp; "
        "docs/sandbox.md). Off is for debugging only.",
    )
    worker_self_test: Annotated[str | None, Flag(envvar="KUNLUN_WORKER_SELF_TEST", hidden=True)] = (
        Field(None, description="A sandbox self-test the workers run (tests only).")
    )
    # watching engine workers: the liveness kill (kunlun.node.liveness), the health checks'
    # ejection from routing (kunlun.node.health, docs/health-checks.md)
    worker_answer_deadline_s: Annotated[float, Flag(envvar="KUNLUN_WORKER_ANSWER_DEADLINE_S")] = (
        Field(
            15.0,
            ge=0.5,
            description="A ready engine worker that answers no health probe for this long is "
            "killed and restarted; its requests get 504.",
        )
    )
    worker_progress_deadline_s: Annotated[
        float, Flag(envvar="KUNLUN_WORKER_PROGRESS_DEADLINE_S")
    ] = Field(
        120.0,
        ge=0.5,
        description="An engine worker with requests in flight whose engine makes no step for "
        "this long is killed and restarted; its requests get 504.",
    )
    health_check_interval: Annotated[float, Flag(envvar="KUNLUN_HEALTH_CHECK_INTERVAL_S")] = Field(
        5.0,
        ge=0.2,
        description="Seconds between two health probes (a 1-token generation) of each ready "
        "replica.",
    )
    health_check_timeout: Annotated[float, Flag(envvar="KUNLUN_HEALTH_CHECK_TIMEOUT_S")] = Field(
        2.0,
        ge=0.05,
        description="Seconds a health probe waits; a replica that answers neither it nor "
        "/stats leaves routing at once.",
    )
    health_check_failures: Annotated[int, Flag(envvar="KUNLUN_HEALTH_CHECK_FAILURES")] = Field(
        2,
        ge=1,
        description="Failed health probes in a row (an error answer, or an engine with "
        "requests and no step) that take a replica out of routing until one passes.",
    )
    upstream_first_byte_timeout_s: Annotated[
        float, Flag(envvar="KUNLUN_UPSTREAM_FIRST_BYTE_TIMEOUT_S")
    ] = Field(
        900.0,
        ge=1.0,
        description="Longest wait for a worker's response head (a non-streamed answer comes "
        "whole, once generated); past it, 504.",
    )
    require_signed: Annotated[bool, Flag(envvar="KUNLUN_REQUIRE_SIGNED")] = Field(
        False,
        description="Serve only models installed from signed packages (kunlun-installer), and "
        "only a device-plugin-config.yaml with a valid detached signature (.sig).",
    )
    trusted_keys: list[Path] | None = Field(
        None,
        description="Trusted public keys: a directory of *.pub or a key file (repeatable; "
        "default KUNLUN_HOME/trusted-keys).",
    )
    integrity_interval_s: Annotated[
        float, Flag(("--integrity-interval",), envvar="KUNLUN_INTEGRITY_INTERVAL_S")
    ] = Field(
        300.0,
        ge=1.0,
        description="Seconds between re-hashes of the served packages and the platform's files.",
    )
    # a cluster (docs/cluster.md): the options after --cluster-etcd need it
    cluster_etcd: Annotated[str | None, Flag(envvar="KUNLUN_CLUSTER_ETCD")] = Field(
        None,
        description="Join a cluster: its etcd client URLs, comma-separated (docs/cluster.md). "
        "The state then lives in etcd, shared by every node.",
    )
    node_name: Annotated[str | None, Flag(envvar="KUNLUN_NODE_NAME")] = Field(
        None, description="This node's name in the cluster."
    )
    peer_port: int | None = Field(
        None,
        ge=1,
        le=65535,
        description="Port other nodes relay requests to (default: --port + 1).",
    )
    advertise_url: str | None = Field(
        None,
        description="How other nodes reach this node's peer port (default: "
        "https://HOST:PEER_PORT).",
    )
    cluster_certs: Annotated[Path | None, Flag(envvar="KUNLUN_CLUSTER_CERTS")] = Field(
        None,
        description="Directory with ca.crt and NODE_NAME.crt/.key (kunlun-cli cluster certs): "
        "TLS to etcd and between nodes.",
    )
    cluster_files: Annotated[Path | None, Flag(envvar="KUNLUN_CLUSTER_FILES")] = Field(
        None,
        description="A directory every node of the cluster mounts (shared storage): Batch API "
        "files and journals, so another node can resume a lost node's batch.",
    )
    insecure_cluster: bool = Field(
        False,
        description="Plain HTTP to etcd and between nodes, no certificates (a test cluster only).",
    )
    cluster_lease_ttl_s: Annotated[int, Flag(("--cluster-lease-ttl",))] = Field(
        10,
        ge=2,
        le=300,
        description="Seconds a node stays in the cluster without renewing its lease (a lost "
        "node is noticed, and a new leader elected, within this).",
    )
    direct_streams: Annotated[
        bool, Flag(("--direct-streams/--no-direct-streams",), envvar="KUNLUN_DIRECT_STREAMS")
    ] = Field(
        True,
        description="A worker on this node writes a streamed answer to the client's "
        "connection itself; off: every answer goes through the gateway's relay.",
    )
    upstream_read_timeout_s: Annotated[float, Flag(envvar="KUNLUN_UPSTREAM_READ_TIMEOUT_S")] = (
        Field(
            300.0,
            ge=1.0,
            description="Longest silence between two pieces of a worker's streamed answer; past "
            "it, the stream ends with a 504 error event.",
        )
    )

    def proxies(self) -> tuple[str, ...]:
        """``--forwarded-allow-ips``: the addresses or networks of the proxies whose
        ``X-Forwarded-For`` and ``X-Forwarded-Proto`` are believed; a :class:`ConfigError`
        naming the bad one. None (the default): no proxy header is believed, a client is its
        TCP peer."""
        proxies = _listed(self.forwarded_allow_ips)
        for proxy in proxies:
            try:
                ipaddress.ip_network(proxy, strict=False)
            except ValueError:
                raise ConfigError(
                    f"{proxy!r} is not an IP address or network (such as 10.0.0.5 or 10.1.0.0/16)",
                    location=Location("--forwarded-allow-ips"),
                ) from None
        return proxies

    def origins(self) -> tuple[str, ...]:
        """``--allowed-origins``: ``scheme://host[:port]`` origins, or ``*``; a
        :class:`ConfigError` naming the bad one."""
        origins = _listed(self.allowed_origins)
        for origin in origins:
            if origin == "*":
                continue
            scheme, sep, rest = origin.partition("://")
            if scheme not in ("http", "https") or not sep or not rest or "/" in rest:
                raise ConfigError(
                    f"{origin!r} is not an origin (scheme://host[:port], no path) or *",
                    location=Location("--allowed-origins"),
                )
        return origins

    def served_fields(self) -> dict[str, Any]:
        """The ``--model`` options given, by the workload spec field each sets."""
        return {
            spec: value
            for name, spec in self.spec_fields().items()
            if (value := getattr(self, name)) is not None
        }

    def served_flags(self) -> list[str]:
        """The ``--model`` options given, as flags (to name them when ``--model`` is not)."""
        fields = type(self).model_fields
        return [
            flag_names(name, fields[name])[0]
            for name in self.spec_fields()
            if getattr(self, name) is not None
        ]

    @classmethod
    def spec_fields(cls) -> dict[str, str]:
        """Each ``--model`` option's field, to the workload spec field it sets."""
        return {
            name: str(field.json_schema_extra[SPEC_FIELD])
            for name, field in cls.model_fields.items()
            if isinstance(field.json_schema_extra, dict) and SPEC_FIELD in field.json_schema_extra
        }


def _listed(value: str | None) -> tuple[str, ...]:
    """The items of a comma-separated option, stripped; none for None."""
    return tuple(item.strip() for item in (value or "").split(",") if item.strip())
