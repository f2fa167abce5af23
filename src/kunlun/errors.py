"""One error hierarchy for all of Kunlun, with stable codes.

Every error the project raises on purpose is a :class:`KunlunError`. Each class carries a
stable ``code`` (what scripts and clients match on), the CLI exit status and the HTTP status
it maps to. The CLI and (later) the gateway map errors to exit codes and HTTP responses in one
place each, by reading these attributes; nothing else decides them. An error that crossed the
API comes back by its code (:func:`error_class`), so the CLI exits with the same status
whether it did the work itself or the daemon did.

    KunlunError                      kunlun.error          exit 1   http 500
    ├── ConfigError                  config.invalid        exit 2   http 400
    ├── DeviceError                  device.error          exit 1   http 500
    │   └── ToolError                device.tool_failed    exit 1   http 500
    ├── ModelError                   model.error           exit 1   http 400
    │   ├── UnsupportedArchitecture  model.unsupported_architecture
    │   ├── UnknownModel             model.unknown         exit 2
    │   ├── ModelFileMissing         model.file_missing
    │   └── CorruptWeights           model.corrupt_weights
    ├── StateError                   state.unusable        exit 2   http 500
    ├── ClusterUnavailable           cluster.unavailable   exit 2   http 503
    ├── RequestError                 request.invalid       exit 2   http 400
    │   └── PromptTooLong            request.prompt_too_long
    ├── PermissionDenied             auth.permission_denied exit 2  http 403
    ├── PackageError                 package.invalid       exit 3   http 400
    │   └── SignatureError           package.signature
    └── EngineError                  engine.error          exit 1   http 500
        └── RequestAborted           engine.aborted

Messages name the value, the field and, when there is one, the place (``file:line``).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Location:
    """Where a bad input sits: a file and, when known, a line and a field."""

    path: str
    line: int | None = None
    field: str | None = None

    def __str__(self) -> str:
        text = self.path if self.line is None else f"{self.path}:{self.line}"
        return f"{text} ({self.field})" if self.field else text


class KunlunError(Exception):
    """Base of every error Kunlun raises on purpose.

    ``message`` says what is wrong, naming the offending value; ``location`` says where;
    ``hint`` says what to do about it.

    Each class is its own entry of the error catalog: its stable ``code`` (CLI messages,
    logs, the admin API), the CLI's ``exit_code``, the ``http_status`` it answers, and the
    ``openai_type`` and ``openai_code`` of the OpenAI-shaped body the inference API answers
    it with (``openai_code`` None: ``code``). ``tests/test_error_catalog.py`` walks every
    subclass.
    """

    code = "kunlun.error"
    openai_code: str | None = None
    exit_code = 1
    http_status = 500
    openai_type = "server_error"

    def __init__(
        self, message: str, *, location: Location | None = None, hint: str | None = None
    ) -> None:
        self.message = message
        self.location = location
        self.hint = hint
        super().__init__(self.__str__())

    def __str__(self) -> str:
        text = f"{self.location}: {self.message}" if self.location else self.message
        return f"{text} (hint: {self.hint})" if self.hint else text

    def to_dict(self) -> dict[str, object]:
        """A JSON-ready form, used by ``--json`` outputs and (later) API error bodies."""
        return {
            "code": self.code,
            "message": self.message,
            "location": str(self.location) if self.location else None,
            "hint": self.hint,
        }


class ConfigError(KunlunError):
    """A configuration file or CLI argument is invalid."""

    code = "config.invalid"
    exit_code = 2
    http_status = 400
    openai_type = "invalid_request_error"


class DeviceError(KunlunError):
    """A device could not be discovered or used."""

    code = "device.error"


class ToolError(DeviceError):
    """A vendor tool failed, timed out, or printed output that could not be parsed."""

    code = "device.tool_failed"


class ModelError(KunlunError):
    """A model could not be loaded."""

    code = "model.error"
    http_status = 400
    openai_type = "invalid_request_error"


class UnsupportedArchitecture(ModelError):
    code = "model.unsupported_architecture"


class UnknownModel(ModelError):
    """A model name that is no alias, local directory or shipped configuration (bad input)."""

    code = "model.unknown"
    exit_code = 2


class ModelFileMissing(ModelError):
    code = "model.file_missing"


class CorruptWeights(ModelError):
    code = "model.corrupt_weights"


class StateError(KunlunError):
    """The state store (``KUNLUN_HOME/state.db``) is present but cannot be used: empty,
    not a database, damaged, or without Kunlun's tables. Never treated as a fresh install."""

    code = "state.unusable"
    exit_code = 2


class NotClustered(ConfigError):
    """A cluster route (``/api/v1/cluster``, ``/api/v1/nodes``) asked of a single daemon."""

    code = "cluster.single_node"


class ClusterUnavailable(KunlunError):
    """The cluster's state store (etcd) cannot be reached or has no quorum: every endpoint
    refused, timed out or answered that it has no leader. The message names the cause and
    the endpoints. A write that timed out may still have been applied."""

    code = "cluster.unavailable"
    exit_code = 2
    http_status = 503
    openai_type = "service_unavailable_error"


class RequestError(KunlunError):
    """A request (to the engine or the API) has an invalid parameter."""

    code = "request.invalid"
    exit_code = 2
    http_status = 400
    openai_type = "invalid_request_error"


class EngineLacks(RequestError):
    """A valid request field (or route) the engine serving the model does not honour: an
    external engine's gap, refused by name rather than dropped."""

    code = "request.unsupported_by_engine"


class PromptTooLong(RequestError):
    code = "request.prompt_too_long"
    openai_code = "context_length_exceeded"


class OverBudget(RequestError):
    """An input asks for more work than its budget (:mod:`kunlun.budgets`): a size, a count,
    a nesting depth, or the time to compile or match a user's schema, regex or grammar."""

    code = "request.over_budget"
    exit_code = 3


class PermissionDenied(KunlunError):
    """The caller is known but may not do this: a key without the scope a route needs, a
    client address outside its key's allow-list, a model path outside the model roots."""

    code = "auth.permission_denied"
    openai_code = "permission_denied"
    exit_code = 2
    http_status = 403
    openai_type = "permission_error"


class PackageError(KunlunError):
    """A signed package or bundle that is refused: damaged, incomplete, unsafe, older than
    what is installed, or (:class:`SignatureError`) not signed by a trusted key."""

    code = "package.invalid"
    exit_code = 3
    http_status = 400
    openai_type = "invalid_request_error"


class SignatureError(PackageError):
    code = "package.signature"


class EngineError(KunlunError):
    """The engine failed while serving a request."""

    code = "engine.error"


class RequestAborted(EngineError):
    code = "engine.aborted"


def error_class(code: str) -> type[KunlunError] | None:
    """The error class whose stable ``code`` is ``code``, among those imported; None if none."""
    pending: list[type[KunlunError]] = [KunlunError]
    while pending:
        cls = pending.pop()
        if cls.code == code:
            return cls
        pending.extend(cls.__subclasses__())
    return None
