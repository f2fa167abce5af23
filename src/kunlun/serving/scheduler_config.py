"""``scheduler_config.yaml``: how the gateway queues and routes requests, reloaded live.

The file sits in ``KUNLUN_HOME`` (or wherever ``kunlun-platform --scheduler-config PATH``
says); every field is optional::

    policy: load-aware                  # round-robin | load-aware
    min_gpu_utilization_threshold: 0.7  # a fraction: 0.7 means 70 %
    priority_weights: {high: 3, normal: 2, low: 1}
    queue_limits: {high: 256, normal: 256, low: 256}
    max_queue_wait_s: 60                # longest wait in the queue; past it, 429
    sample_max_age_s: 10
    thermal: {limit_c: 85, duration_s: 30, weight_factor: 0.5}
    api_keys: {rpm: 600, tpm: 100000, allow_ips: [10.0.0.0/8, 127.0.0.1/32]}
    model_roots: [/srv/models]          # where admin model imports may read

:func:`load_scheduler_config` reports every problem with ``file:line`` and the field (YAML
line numbers as in ``device-plugin-config.yaml``). :class:`SchedulerConfigSource` holds the
config in force and re-reads the file when its modification time or size changes (checked at
most once a second by :meth:`~SchedulerConfigSource.poll`, or at once on SIGHUP through
:meth:`~SchedulerConfigSource.reload`); a file that no longer validates leaves the previous
config in force and logs the error.
"""

from __future__ import annotations

import difflib
import ipaddress
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from kunlun.errors import ConfigError, Location

FILE_NAME = "scheduler_config.yaml"
CHECK_INTERVAL_S = 1.0
"""How often :meth:`SchedulerConfigSource.poll` looks at the file, at most (seconds)."""

logger = logging.getLogger(__name__)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class PriorityWeights(_Strict):
    """Weighted-fair-queuing weights: a backlogged class is admitted in proportion to them."""

    high: float = Field(default=3.0, gt=0, le=1000, description="Weight of priority class high.")
    normal: float = Field(
        default=2.0, gt=0, le=1000, description="Weight of priority class normal."
    )
    low: float = Field(default=1.0, gt=0, le=1000, description="Weight of priority class low.")


class QueueLimits(_Strict):
    """Requests of one class that may wait in the gateway for one model; one more gets 429."""

    high: int = Field(
        default=256, ge=0, le=1_000_000, description="Waiting high requests per model."
    )
    normal: int = Field(
        default=256, ge=0, le=1_000_000, description="Waiting normal requests per model."
    )
    low: int = Field(default=256, ge=0, le=1_000_000, description="Waiting low requests per model.")


class ThermalConfig(_Strict):
    """A device hotter than ``limit_c`` for ``duration_s`` in a row is derated until it cools."""

    limit_c: float = Field(default=85.0, gt=0, le=200, description="Temperature limit, Celsius.")
    duration_s: float = Field(
        default=30.0,
        ge=0,
        le=3600,
        description="How long above the limit before derating, seconds.",
    )
    weight_factor: float = Field(
        default=0.5,
        gt=0,
        le=1,
        description="Load-aware weight of a derated device (1 = no derating).",
    )


class KeyDefaults(_Strict):
    """Limits of every API key that sets none of its own (``apikey create --rpm/--tpm/
    --allow-ip``); see :mod:`kunlun.serving.key_limits`."""

    rpm: int | None = Field(
        default=None, ge=1, le=1_000_000_000, description="Requests per minute per key."
    )
    tpm: int | None = Field(
        default=None,
        ge=1,
        le=1_000_000_000,
        description="Tokens (prompt + completion) per minute per key.",
    )
    allow_ips: list[str] | None = Field(
        default=None,
        max_length=64,
        description="Client networks (CIDRs) a key may be used from; absent: any.",
    )

    @field_validator("allow_ips")
    @classmethod
    def _networks(cls, value: list[str] | None) -> list[str] | None:
        if value is None:
            return None
        try:
            return [str(ipaddress.ip_network(item, strict=False)) for item in value]
        except ValueError as exc:
            raise ValueError(f"not a list of CIDRs such as 10.0.0.0/8: {exc}") from None


class SchedulerConfig(_Strict):
    """The gateway's admission and routing settings (defaults when the file is absent)."""

    policy: Literal["round-robin", "load-aware"] = Field(
        default="load-aware",
        description="Replica choice: take turns, or least outstanding tokens with the "
        "utilization threshold and thermal derating.",
    )
    min_gpu_utilization_threshold: float = Field(
        default=0.7,
        description="load-aware: a device busier than this fraction (0 to 1) gets no new "
        "requests while another candidate's device is at or below it.",
    )
    priority_weights: PriorityWeights = Field(default_factory=PriorityWeights)
    queue_limits: QueueLimits = Field(default_factory=QueueLimits)
    max_queue_wait_s: float = Field(
        default=60.0,
        gt=0,
        le=86400,
        description="Longest time a request waits in the gateway's queue for a replica slot, "
        "seconds; past it the request gets 429 with a Retry-After estimated from the queue's "
        "drain rate.",
    )
    sample_max_age_s: float = Field(
        default=10.0,
        gt=0,
        le=3600,
        description="Device samples older than this are ignored, seconds.",
    )
    thermal: ThermalConfig = Field(default_factory=ThermalConfig)
    api_keys: KeyDefaults = Field(default_factory=KeyDefaults)
    default_model: str | None = Field(
        default=None,
        min_length=1,
        max_length=128,
        description="The model a request that names none means (SGLang's front-end names "
        "none); default: the only generation model served (else such a request is a 400).",
    )
    model_roots: list[str] = Field(
        default_factory=list,
        max_length=64,
        description="Absolute directories admin model imports may read from, besides "
        "--model-root, KUNLUN_MODEL_ROOTS and the defaults.",
    )

    @field_validator("model_roots")
    @classmethod
    def _absolute(cls, value: list[str]) -> list[str]:
        for item in value:
            if not os.path.isabs(item):
                raise ValueError(f"{item!r} is not an absolute directory")
        return value

    @field_validator("min_gpu_utilization_threshold")
    @classmethod
    def _a_fraction(cls, value: float) -> float:
        if not 0.0 <= value <= 1.0:
            raise ValueError("must be a fraction from 0 to 1 (0.7 means 70 %)")
        return value


def load_scheduler_config(path: str | Path) -> SchedulerConfig:
    """Read and validate ``path``; a :class:`ConfigError` lists every problem with
    ``file:line (field)`` and the offending value."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(
            f"cannot read the scheduler config: {exc.strerror}", location=Location(str(path))
        ) from None
    return parse_scheduler_config(text, str(path))


def parse_scheduler_config(text: str, path: str) -> SchedulerConfig:
    """Like :func:`load_scheduler_config`, from the file's text."""
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(
            f"not valid YAML: {problem}",
            location=Location(path, mark.line + 1 if mark is not None else None),
        ) from None
    if data is None:
        return SchedulerConfig()
    if not isinstance(data, dict):
        raise ConfigError(
            "the scheduler config must be a mapping of fields (policy, ...)",
            location=Location(path, 1),
        )
    try:
        return SchedulerConfig.model_validate(data)
    except ValidationError as exc:
        lines = _field_lines(root)
        problems = [_describe(err, path, lines) for err in exc.errors()]
        raise ConfigError(
            f"{len(problems)} problem(s) in {path}:\n  " + "\n  ".join(problems),
            hint="every field is documented in docs/scheduling.md; "
            "remove a field to take its default",
        ) from None


def _describe(err: Any, path: str, lines: dict[tuple[str, ...], int]) -> str:
    loc = tuple(str(p) for p in err["loc"])
    line = next((lines[loc[:n]] for n in range(len(loc), 0, -1) if loc[:n] in lines), 1)
    field = ".".join(loc) or "(file)"
    if err["type"] == "extra_forbidden":
        close = difflib.get_close_matches(loc[-1], _fields_at(loc[:-1]), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        return f"{Location(path, line, field)}: unknown field{hint}"
    message = err["msg"].removeprefix("Value error, ")
    return f"{Location(path, line, field)}: {message} (got {err.get('input')!r})"


def _fields_at(loc: tuple[str, ...]) -> list[str]:
    """Field names of the (sub-)model at ``loc`` (for did-you-mean)."""
    model: type[BaseModel] = SchedulerConfig
    for name in loc:
        info = model.model_fields.get(name)
        annotation = info.annotation if info is not None else None
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return []
        model = annotation
    return list(model.model_fields)


def _field_lines(
    node: yaml.Node | None, prefix: tuple[str, ...] = ()
) -> dict[tuple[str, ...], int]:
    """The line of every mapping key, by its path from the root."""
    lines: dict[tuple[str, ...], int] = {}
    if isinstance(node, yaml.MappingNode):
        for key, value in node.value:
            where = (*prefix, str(key.value))
            lines[where] = key.start_mark.line + 1
            lines.update(_field_lines(value, where))
    return lines


class SchedulerConfigSource:
    """The scheduler config in force, re-read when its file changes.

    ``path`` None or a missing file means the defaults. The request path reads
    :attr:`config` (a plain attribute); a background task calls :meth:`poll`, and SIGHUP
    calls :meth:`reload`. Listeners registered with :meth:`on_change` get each new config.
    """

    def __init__(
        self, path: Path | None = None, check_interval_s: float = CHECK_INTERVAL_S
    ) -> None:
        self.path = path
        self.check_interval_s = check_interval_s
        self.config = SchedulerConfig()
        self.last_error: ConfigError | None = None
        """The error of the last reload that failed (cleared by one that succeeds)."""
        self._signature: tuple[int, int] | None = None
        self._checked = 0.0
        self._listeners: list[Callable[[SchedulerConfig], None]] = []

    def load(self) -> SchedulerConfig:
        """Read the file now; raises :class:`ConfigError` (the daemon refuses to start)."""
        self._signature = self._stat()
        self.apply(self._read())
        return self.config

    def poll(self) -> bool:
        """Reload if the file changed since the last look (looks at most once a second).
        Returns whether a new config took effect."""
        now = time.monotonic()
        if now - self._checked < self.check_interval_s:
            return False
        self._checked = now
        if self._stat() == self._signature:
            return False
        return self.reload()

    def reload(self) -> bool:
        """Re-read the file; on an error keep the config in force and log the error."""
        signature = self._stat()
        try:
            config = self._read()
        except ConfigError as exc:
            self._signature = signature  # do not re-report the same bad file every second
            self.last_error = exc
            logger.error("scheduler config not reloaded, the previous one stays in force: %s", exc)
            return False
        self._signature = signature
        self.last_error = None
        self.apply(config)
        logger.warning("scheduler config reloaded from %s: policy %s", self.path, config.policy)
        return True

    def on_change(self, listener: Callable[[SchedulerConfig], None]) -> None:
        """Call ``listener(config)`` now and after every successful (re)load."""
        self._listeners.append(listener)
        listener(self.config)

    def apply(self, config: SchedulerConfig) -> None:
        """Put ``config`` in force (and tell the listeners), as a reload of the file would."""
        self.config = config
        for listener in self._listeners:
            listener(config)

    def _read(self) -> SchedulerConfig:
        """The file's config, or the defaults when there is no file."""
        if self.path is None or not self.path.exists():
            return SchedulerConfig()
        return load_scheduler_config(self.path)

    def _stat(self) -> tuple[int, int] | None:
        if self.path is None:
            return None
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return (st.st_mtime_ns, st.st_size)
