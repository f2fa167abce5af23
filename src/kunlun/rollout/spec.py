"""What a canary rollout is asked to do (:class:`RolloutSpec`), and the parsing of the
values users type: percentages (``10%``), durations (``5m``, ``90s``), rates (``0.1%``)."""

from __future__ import annotations

import math
import re
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from kunlun.errors import ConfigError, Location

DEFAULT_STEPS = (10.0, 25.0, 50.0, 100.0)
DEFAULT_INTERVAL_S = 300.0
DEFAULT_MAX_ERROR_RATE = 0.001
DEFAULT_MAX_P95_REGRESSION = 0.05
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h)?\s*$")
_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, None: 1.0}


def parse_percent(value: Any, field: str) -> float:
    """``10%``, ``"10"`` or ``10`` -> 10.0 (a share of traffic, 0 to 100)."""
    number = _number(value, field, strip="%")
    if not 0 < number <= 100:
        raise ValueError(f"{field} must be a percentage above 0 and at most 100, got {value!r}")
    return number


def parse_rate(value: Any, field: str, most: float = 1.0) -> float:
    """``0.1%`` -> 0.001; a bare number is a fraction (``0.001``); at most ``most``."""
    text = str(value).strip()
    number = _number(text, field, strip="%")
    fraction = number / 100.0 if text.endswith("%") else number
    if not 0 <= fraction <= most:
        raise ValueError(f"{field} must be between 0% and {most:.0%}, got {value!r}")
    return fraction


MAX_INTERVAL_S = 7 * 24 * 3600.0
"""The longest step of a rollout (a week): longer is a typo, and a timer beyond it never
fires in practice (3.6e24 s was once accepted)."""


def parse_duration(value: Any, field: str, most: float = MAX_INTERVAL_S) -> float:
    """``5m``, ``90s``, ``500ms``, ``1h`` or a number of seconds -> seconds, above 0 and at
    most ``most``."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        seconds = float(value)
    else:
        match = _DURATION.match(str(value))
        if match is None:
            raise ValueError(f"{field} must look like 90s, 5m or 1h, got {value!r}")
        seconds = float(match.group(1)) * _UNITS[match.group(2)]
    if not 0 < seconds <= most:  # NaN fails too
        raise ValueError(f"{field} must be above 0 and at most {most:g} s (7 days), got {value!r}")
    return seconds


def _number(value: Any, field: str, strip: str) -> float:
    if isinstance(value, bool):
        raise ValueError(f"{field} must be a number, got {value!r}")
    if isinstance(value, int | float):
        number = float(value)
    else:
        try:
            number = float(str(value).strip().removesuffix(strip).strip())
        except ValueError:
            raise ValueError(f"{field} must be a number like 10 or 10%, got {value!r}") from None
    if not math.isfinite(number):
        raise ValueError(f"{field} must be a finite number, got {value!r}")
    return number


class RolloutSpec(BaseModel):
    """A rollout as ``kunlun-cli rollout create`` and ``POST /api/v1/rollouts`` take it."""

    model_config = ConfigDict(extra="forbid")

    workload: str = Field(min_length=1, description="The workload to roll out (id or name).")
    model: str = Field(min_length=1, description="The new version's model (alias or path).")
    canary: float | None = Field(
        None, description="The first step's share of traffic (10%); default the first step."
    )
    steps: list[float] = Field(
        default_factory=lambda: list(DEFAULT_STEPS),
        description="Canary shares of traffic in order (10,25,50,100); reaching 100 promotes.",
    )
    interval_s: float = Field(
        DEFAULT_INTERVAL_S, description="How long each step runs before its gates decide (5m)."
    )
    max_error_rate: float = Field(
        DEFAULT_MAX_ERROR_RATE,
        description="Most errors (5xx, engine errors) of the canary beyond the baseline's "
        "rate, as a fraction (0.1% = 0.001).",
    )
    max_p95_regression: float = Field(
        DEFAULT_MAX_P95_REGRESSION,
        description="Most the canary's p95 TTFT and end-to-end latency may exceed the "
        "baseline's (5% = 0.05).",
    )
    min_requests: int | None = Field(
        None,
        ge=1,
        description="Canary requests a step needs before its gates decide; default "
        "ceil(3 / max_error_rate).",
    )
    overrides: dict[str, Any] = Field(
        default_factory=dict,
        description="Workload spec fields the canary changes besides the model (a YAML file "
        "with --file), e.g. quantization or faults.",
    )

    @field_validator("canary", mode="before")
    @classmethod
    def _canary(cls, value: Any) -> float | None:
        return None if value is None else parse_percent(value, "canary")

    @field_validator("steps", mode="before")
    @classmethod
    def _steps(cls, value: Any) -> list[float]:
        items = value.split(",") if isinstance(value, str) else value
        if not isinstance(items, list) or not items:
            raise ValueError(
                f"steps must be a list of percentages like 10,25,50,100, got {value!r}"
            )
        return [parse_percent(item, "steps") for item in items]

    @field_validator("interval_s", mode="before")
    @classmethod
    def _interval(cls, value: Any) -> float:
        return parse_duration(value, "interval")

    @field_validator("max_error_rate", mode="before")
    @classmethod
    def _rate(cls, value: Any) -> float:
        return parse_rate(value, "max_error_rate")

    @field_validator("max_p95_regression", mode="before")
    @classmethod
    def _regression(cls, value: Any) -> float:
        return parse_rate(value, "max_p95_regression", most=10.0)  # up to 11 times slower

    @model_validator(mode="after")
    def _ordered(self) -> RolloutSpec:
        steps = self.steps
        if self.canary is not None:
            steps = [self.canary] + [s for s in steps if s > self.canary]
        if any(b <= a for a, b in zip(steps, steps[1:], strict=False)):
            raise ValueError(f"steps must grow, got {','.join(f'{s:g}' for s in steps)}")
        if steps[-1] != 100:
            steps = [*steps, 100.0]
        self.steps = steps
        self.canary = steps[0]
        return self

    def needed_requests(self) -> int:
        """``min_requests``, or enough to see three errors at ``max_error_rate``."""
        if self.min_requests is not None:
            return self.min_requests
        return math.ceil(3 / self.max_error_rate) if self.max_error_rate > 0 else 100


def parse_rollout(data: object) -> RolloutSpec:
    """Validate ``data``; an error names the field and the value."""
    if not isinstance(data, dict):
        raise ConfigError("a rollout must be a JSON object", location=Location("request"))
    try:
        return RolloutSpec.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "rollout"
        message = first["msg"].removeprefix("Value error, ")
        if first["type"] == "extra_forbidden":
            message = f"unknown field (fields: {', '.join(RolloutSpec.model_fields)})"
        raise ConfigError(
            f"{where}: {message}", location=Location("request", field=where)
        ) from None
