"""The workload spec: what to serve, read from the CLI, a YAML file or the API."""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    AliasChoices,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from kunlun.engine.launch import FaultSpec, Pooling, Task
from kunlun.engine.schemes import SCHEMES
from kunlun.errors import ConfigError, Location
from kunlun.telemetry.spec import TelemetrySpec
from kunlun.workload.chat_template import MAX_CHAT_TEMPLATE_CHARS, template_problem

Priority = Literal["high", "normal", "low"]
_MAX_SHOWN = 120
"""Characters of a bad value an error repeats (a chat template can be long)."""
OLD_NAMES = {"batch_size": "max_num_seqs"}
"""Earlier names of fields, still read: spec files, API requests and stored workloads written
before the rename keep working; a spec is written back under the new name."""


class WorkloadSpec(BaseModel):
    """One model to serve, and how. Only ``model`` is required."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(
        description="Model alias (see `kunlun-cli model list`) or local HF directory."
    )
    name: str | None = Field(
        None,
        pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$",
        description="The model name clients use; defaults to the model alias.",
    )
    device: str | None = Field(None, description="Explicit device, e.g. cpu:0 or ascend:1.")
    dtype: Literal["fp32", "bf16", "fp16"] | None = Field(
        None,
        description="Compute dtype: fp32, bf16 or fp16; default: the best the device supports "
        "(fp32 on CPU).",
    )
    quantization: str = Field(
        "none",
        json_schema_extra={"enum": list(SCHEMES)},
        description="Weight quantization (kunlun.engine.schemes.SCHEMES): none; w8a8 (int8 "
        "weights and activations, needs int8 in the device's supported_dtypes); w8a16 (int8 "
        "weights); w4a16 (4-bit weights in groups of 128, or 32 where the layers need it). "
        "A checkpoint that is already quantized keeps its own scheme.",
    )
    tensor_parallel_size: int | None = Field(
        None,
        ge=1,
        le=16,
        description="Ranks each replica's model is split over; default: the "
        "smallest the memory and topology need. Refused with the reason when the devices or "
        "the model's heads cannot take it. On a host CPU device the ranks share it and its "
        "cores (only when asked for).",
    )
    scorer: Literal["performance", "roofline", "binpack", "spread"] = Field(
        "performance",
        description="How placement ranks devices that fit: declared compute throughput for "
        "the compute dtype (performance; int8 TOPS for w8a8), decode estimate from compute and "
        "memory bandwidth (roofline), fewest free MiB left (binpack) or most free MiB (spread).",
    )
    max_num_seqs: int | None = Field(
        None,
        ge=1,
        le=256,
        validation_alias=AliasChoices("max_num_seqs", "batch_size"),
        description="Sequences one replica decodes together (vLLM's max_num_seqs; batch_size, "
        "its old name, is still read); default: sized per plan from the KV memory it "
        "reserves, the average context and where the device's decode estimate saturates "
        "(kunlun.planner.batching).",
    )
    max_num_batched_tokens: int | None = Field(
        None,
        ge=1,
        le=65536,
        description="Tokens one engine step computes, prefill chunks and decodes together (the "
        "chunked-prefill budget: smaller starts the first tokens of a burst sooner and stalls "
        "running streams less, larger prefills faster); default: sized per plan "
        "(kunlun.planner.batching).",
    )
    task: Task = Field(
        "generate",
        description="generate (default): chat and completions; embed: the model is served "
        "for /v1/embeddings only (docs/embeddings.md).",
    )
    pooling: Pooling | None = Field(
        None,
        description="With task embed: mean (default) of the input tokens' final hidden "
        "states, or the last token's.",
    )
    stream_interval: int = Field(
        1,
        ge=1,
        le=256,
        description="Streaming: after a completion's first token, its tokens are sent once "
        "this many are made (or it finishes). 1 (default): every token at once; tokens that are already waiting when the "
        "worker writes go out together whatever this is. Larger: fewer, larger SSE events.",
    )
    priority: Priority = Field("normal", description="Scheduling class: high, normal or low.")
    preferred_device_types: list[str] = Field(
        default_factory=list, description="Device types to try first, in order."
    )
    replicas: int = Field(1, ge=1, le=16, description="Engine processes serving this workload.")
    max_queue: int = Field(
        64, ge=1, le=10000, description="Requests queued or running per replica before 429."
    )
    max_model_len: int | None = Field(
        None, ge=16, description="Context limit; default: the model's."
    )
    kv_cache_memory_mb: int | None = Field(None, ge=1, description="KV-cache budget per replica.")
    memory_cap_mb: int | None = Field(
        None,
        ge=1,
        description="Host memory cap of each replica's worker in MiB (default: the plan's "
        "weights and host KV plus the runtime, with a margin); a worker past it is stopped "
        "and the workload fails.",
    )
    memory_utilization: float | None = Field(
        None,
        gt=0,
        le=1,
        validation_alias=AliasChoices("memory_utilization", "gpu_memory_utilization"),
        description="Fraction of each device's memory (0 < F <= 1) this workload's plans may "
        "use for weights and KV cache, less what is already in use (vLLM's "
        "gpu_memory_utilization, also accepted as that name); default 0.9. On a CPU device "
        "it also lifts the default 1 GiB KV cap: KV is then what the fraction of RAM leaves "
        "after weights, up to what the batch can use.",
    )
    chat_template: str | None = Field(
        None,
        max_length=MAX_CHAT_TEMPLATE_CHARS,
        description="A jinja2 chat template (the text) used instead of the model's own, for "
        "chat, /tokenize and tool calls (vLLM's --chat-template); checked when submitted.",
    )
    engine: str = Field(
        "auto",
        max_length=64,
        description="Inference engine (kunlun.engines): auto (the plan chooses) or a registered "
        "engine's name: kunlun (the embedded engine; embedded is its old name), llama.cpp, "
        "vllm, sglang, or one a package registers under the kunlun.engines entry points.",
    )
    telemetry: TelemetrySpec | None = Field(
        None, description="Per-step engine profiling (advanced_profiling, profiling_interval_ms)."
    )
    faults: FaultSpec | None = Field(
        None,
        description="Testing only: faults the workers inject into client requests "
        "(error_rate, delay_ms, step_delay_ms, seed; kunlun.serving.faults), e.g. to try rollout gates on a "
        "real broken version.",
    )

    @model_validator(mode="before")
    @classmethod
    def _one_name_each(cls, data: Any) -> Any:
        """A field given under its name and its old name (:data:`OLD_NAMES`) is refused,
        naming both; one of them None (a stored spec merged with a request) is dropped."""
        if not isinstance(data, dict):
            return data
        for old, new in OLD_NAMES.items():
            if old in data and new in data:
                if data[old] is not None and data[new] is not None:
                    raise ValueError(
                        f"{new} and {old} (its old name) are both given ({data[new]!r} and "
                        f"{data[old]!r}); give {new} only"
                    )
                data = {k: v for k, v in data.items() if k != (old if data[old] is None else new)}
        return data

    @field_validator("pooling")
    @classmethod
    def _pooling_embeds(cls, value: Pooling | None, info: ValidationInfo) -> Pooling | None:
        if value is not None and info.data.get("task") != "embed":
            raise ValueError("pooling applies only with task: embed")
        return value

    @field_validator("quantization")
    @classmethod
    def _scheme(cls, value: str) -> str:
        if value not in SCHEMES:  # the schemes' owner: kunlun.engine.schemes
            raise ValueError(f"quantization must be one of {', '.join(SCHEMES)}, got {value!r}")
        return value

    @field_validator("engine")
    @classmethod
    def _engine_name(cls, value: str) -> str:
        if value == "auto":
            return value
        # the registry owns the names (built-ins and entry points), loaded once per process
        from kunlun.engines.registry import canonical, registered_names

        name = canonical(value)  # old spellings in specs and state stores
        if name not in (names := registered_names()):
            raise ValueError(f"engine must be auto or a registered engine "
                             f"({', '.join(sorted(names))}), got {value!r}")  # fmt: skip
        return name

    @field_validator("chat_template")
    @classmethod
    def _template_compiles(cls, value: str | None) -> str | None:
        if value is not None and (why := template_problem(value)) is not None:
            raise ValueError(why)
        return value

    @property
    def embed_pooling(self) -> Pooling:
        """The pooling an embedding model runs (mean unless the spec says)."""
        return self.pooling or "mean"

    @field_validator("device")
    @classmethod
    def _device_form(cls, value: str | None) -> str | None:
        if value is not None:
            kind, sep, index = value.partition(":")
            if not kind or (sep and not index.isdigit()):
                raise ValueError(f"device must look like TYPE:INDEX (e.g. cpu:0), got {value!r}")
            if not sep:
                value = f"{value}:0"
        return value

    @property
    def served_name(self) -> str:
        return self.name or Path(self.model).name


def parse_spec(data: object, source: str = "request") -> WorkloadSpec:
    """Validate ``data``; errors name the field and value (and the file, for YAML)."""
    if not isinstance(data, dict):
        raise ConfigError("a workload spec must be a mapping", location=Location(source))
    try:
        return WorkloadSpec.model_validate(data)
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            field = ".".join(str(p) for p in err["loc"])
            message = err["msg"].removeprefix("Value error, ")
            if not field:  # the spec as a whole: its input is the whole mapping
                problems.append(message)
            elif err["type"] == "extra_forbidden":
                names = [*WorkloadSpec.model_fields, *OLD_NAMES]
                close = [OLD_NAMES.get(c, c) for c in difflib.get_close_matches(field, names, n=1)]
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                problems.append(f"{field}: unknown field{hint}")
            else:
                got = repr(err.get("input"))
                got = got if len(got) <= _MAX_SHOWN else got[: _MAX_SHOWN - 3] + "..."
                problems.append(f"{field}: {message} (got {got})")
        first = ".".join(str(p) for p in exc.errors()[0]["loc"]) or None
        raise ConfigError(
            "invalid workload spec: " + "; ".join(problems),
            location=Location(source, field=first),
        ) from None


def current_names(fields: dict[str, Any]) -> dict[str, Any]:
    """A spec's ``fields`` with each old name (:data:`OLD_NAMES`) replaced by its current
    one, so that a workload stored before a rename reads as one stored after; where both
    names are given, both are kept (the spec refuses them, naming both)."""
    renamed = {old: new for old, new in OLD_NAMES.items() if new not in fields}
    return {renamed.get(k, k): v for k, v in fields.items()}


def read_spec_fields(path: str | Path) -> dict[str, Any]:
    """The mapping of workload spec fields in the YAML file ``path``, not yet checked (a
    whole spec, or overrides of one); a :class:`ConfigError` naming the file (and line)."""
    import yaml  # only where a file is read: the daemon's --help shows this spec's fields

    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(
            f"cannot read spec: {exc.strerror}", location=Location(str(path))
        ) from exc
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        raise ConfigError(
            f"not valid YAML: {getattr(exc, 'problem', exc)}",
            location=Location(str(path), mark.line + 1 if mark else None),
        ) from None
    if not isinstance(data, dict):
        raise ConfigError(
            f"must be a mapping of workload spec fields, not {type(data).__name__}",
            location=Location(str(path)),
        )
    return data


def load_spec_file(path: str | Path) -> WorkloadSpec:
    return parse_spec(read_spec_fields(path), str(path))
