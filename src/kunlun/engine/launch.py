"""The launch contract: everything one engine worker is started with, as one typed object.

An :class:`EngineLaunch` crosses the process boundary between the platform and a worker as a
JSON file; the worker takes ``--launch FILE`` and nothing else. The workload manager makes it
from the execution plan (engine settings) and the device plugin (device type, torch
extension module, distributed backend), writes it next to the plan in the plan cache, and the
node agent adds the replica's own settings (ready file, sandbox) and writes it into the
replica's run folder before each start. No other channel carries engine settings, so a fact
about a launch is spelled in one place.

Contract:

- the model is strict (``extra="forbid"``, frozen): an unknown or misspelled field, or a
  value out of range, is refused by :func:`read_launch` with a :class:`ConfigError` that
  names the file, the field and the value;
- engine settings left None take the engine's own defaults (:class:`EngineConfig` owns
  them); :meth:`EngineLaunch.engine_config` turns the launch into the engine's config;
- the module imports neither torch nor the rest of the engine, so the daemon writes launches
  without loading torch.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from kunlun.device.dtypes import TORCH_NAMES
from kunlun.errors import ConfigError, Location

if TYPE_CHECKING:
    from kunlun.device.plugin import DevicePlugin
    from kunlun.engine.engine_config import EngineConfig

Dtype = Literal["fp32", "bf16", "fp16"]
"""Weight and KV dtypes the engine runs, by the names plans and workload specs use."""
Task = Literal["generate", "embed"]
"""What a served model answers: generated text (chat, completions) or embeddings."""
Pooling = Literal["mean", "last"]
"""How an embedding model's per-token hidden states become one vector (kunlun.engine.pooling)."""


EMBEDDED_ENGINE = "kunlun"
"""The embedded engine's name: its adapter's, and the engine of a plan, a replica or a probe
when none other is named."""


DEFAULT_MAX_NUM_SEQS = 64
"""Sequences decoded together when nothing sized them: the engine used as a library, a launch
without the field, a replica recorded without a plan. A plan always sizes its own
(:mod:`kunlun.planner.batching`)."""


class FaultSpec(BaseModel):
    """Faults a workload's workers inject into client requests (testing only; :mod:`kunlun.serving.faults` injects them)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    error_rate: float = Field(
        0.0,
        ge=0.0,
        le=1.0,
        description="Fraction of requests answered 500 (engine error, code fault_injected).",
    )
    delay_ms: int = Field(
        0, ge=0, le=600_000, description="Added before each request reaches the engine."
    )
    step_delay_ms: int = Field(
        0,
        ge=0,
        le=1_000,
        description="Added after every engine step (a slow device): each token of every "
        "request, health probes included, comes this much later.",
    )
    seed: int | None = Field(None, description="Seed of the error draws (None: random).")


class EngineLaunch(BaseModel):
    """One worker's launch: the model, the device, the engine settings, the worker's own."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # ---- the model ----
    model_dir: Path = Field(description="HF model directory, or a .gguf file imported once.")
    served_name: str = Field(min_length=1, description="The model name clients send.")

    # ---- the device, as its device plugin describes it ----
    device: str = Field(
        "cpu",
        min_length=1,
        description="torch device string (cpu, cuda:0, npu:1); cpu:N is torch's one cpu.",
    )
    device_type: str = Field(
        "cpu", min_length=1, description="The device plugin's device type (cpu, ascend...)."
    )
    torch_module: str | None = Field(
        None,
        description="The torch extension module that registers the device type (torch_npu, "
        "torch_gcu...), from the plugin; None when torch has the type built in.",
    )
    distributed_backend: str | None = Field(
        None,
        description="torch.distributed backend between ranks, from the plugin (gloo, nccl...).",
    )

    # ---- the engine (None: the engine's default) ----
    dtype: Dtype = Field("fp32", description="Weight and KV dtype.")
    quantization: str = Field("none", description="Weight quantization scheme.")
    group_size: int | None = Field(None, ge=1, description="w4a16 group size (32 or 128).")
    tensor_parallel_size: int = Field(1, ge=1, description="Ranks one replica runs on.")
    max_num_seqs: int | None = Field(None, ge=1, description="Most sequences in one step.")
    max_num_batched_tokens: int | None = Field(None, ge=1, description="Token budget of one step.")
    max_model_len: int | None = Field(
        None, ge=1, description="Longest prompt + output; None: the model's."
    )
    kv_cache_memory_bytes: int | None = Field(
        None, ge=1, description="KV cache size in bytes (exclusive with num_blocks)."
    )
    num_blocks: int | None = Field(
        None, ge=1, description="KV blocks (exclusive with kv_cache_memory_bytes)."
    )
    block_size: int | None = Field(None, ge=1, description="Token slots per KV block.")
    enable_prefix_caching: bool | None = Field(None, description="Reuse the KV of prompt prefixes.")
    num_threads: int | None = Field(None, ge=1, description="CPU threads for torch.")
    graph_batch_sizes: list[int] = Field(
        default_factory=list,
        description="Decode batch sizes captured as device graphs (the plan's; empty: none).",
    )
    seed: int | None = Field(None, description="Seed of requests that bring none.")
    chat_template: str | None = Field(
        None,
        min_length=1,
        description="Chat template text used instead of the model's own (the workload "
        "spec's chat_template); None: the model's.",
    )

    # ---- the worker process ----
    task: Task = Field(
        "generate",
        description="generate: chat and completions; embed: /v1/embeddings only "
        "(kunlun.serving.embeddings).",
    )
    pooling: Pooling = Field(
        "mean", description="With task embed: mean of the tokens' hidden states, or the last's."
    )
    stream_interval: int = Field(
        1,
        ge=1,
        le=256,
        description="Tokens a completion's streamed delta holds before it is sent, after the "
        "first (kunlun.engine.async_engine); 1: every token as soon as it is made.",
    )
    host: str = Field("127.0.0.1", min_length=1, description="Address to serve on.")
    port: int = Field(0, ge=0, le=65535, description="Port to serve on; 0 picks a free one.")
    ready_file: Path | None = Field(
        None, description="Where the worker writes its ready JSON once serving."
    )
    plan_dir: Path | None = Field(
        None,
        description="Plan-cache entry: weights cast to dtype are kept in (and reused from) "
        "plan_dir/weights.",
    )
    nice: int | None = Field(
        None,
        ge=0,
        le=19,
        description="Scheduling niceness; None: KUNLUN_WORKER_NICE or the worker's default.",
    )
    access_key: str | None = Field(
        None,
        min_length=16,
        repr=False,
        description="The key the worker asks of every request (the X-Kunlun-Worker-Key "
        "header), new at each start; set by the node agent, absent when the worker is "
        "started by hand (then nothing is asked).",
    )
    sandbox: dict[str, Any] | None = Field(
        None,
        description="The worker's confinement, a WorkerSandbox (kunlun.sandbox) as a "
        "JSON object; set by the node agent, absent when the worker is started by hand.",
    )
    trace_prefix: str | None = Field(
        None,
        description="Advanced profiling: a Chrome trace of engine steps to "
        "PREFIX.<pid>.trace.json.",
    )
    profiling_interval_ms: float = Field(
        50.0, ge=0, description="With trace_prefix: at most one traced step per interval."
    )
    faults: FaultSpec | None = Field(
        None,
        description="Faults injected into client requests (testing; injected by kunlun.serving.faults).",
    )

    @field_validator("device")
    @classmethod
    def _torch_device(cls, value: str) -> str:
        kind, sep, index = value.strip().partition(":")
        if not kind or (sep and not index.isdigit()):
            raise ValueError(f"device must look like TYPE or TYPE:INDEX, got {value!r}")
        return "cpu" if kind == "cpu" else value.strip()

    @field_validator("quantization")
    @classmethod
    def _scheme(cls, value: str) -> str:
        from kunlun.engine.quant import SCHEMES

        if value not in SCHEMES:
            raise ValueError(f"quantization must be one of {', '.join(SCHEMES)}, got {value!r}")
        return value

    @field_validator("sandbox")
    @classmethod
    def _sandbox(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is not None:
            from kunlun.sandbox import WorkerSandbox

            WorkerSandbox.from_json(json.dumps(value))  # ValueError naming what is wrong
        return value

    @model_validator(mode="after")
    def _one_kv_size(self) -> EngineLaunch:
        if self.kv_cache_memory_bytes is not None and self.num_blocks is not None:
            raise ValueError(
                f"kv_cache_memory_bytes={self.kv_cache_memory_bytes} and "
                f"num_blocks={self.num_blocks} are exclusive: set one"
            )
        return self

    @property
    def torch_device_type(self) -> str:
        """The torch device type of :attr:`device` (``npu`` for ``npu:1``)."""
        return self.device.split(":", 1)[0]

    def engine_config(self, model_dir: str | Path | None = None) -> EngineConfig:
        """The engine's config for this launch (imports torch). ``model_dir`` replaces
        :attr:`model_dir` when the worker prepared the weights elsewhere (a GGUF import, the
        plan's cast weights); settings left None keep :class:`EngineConfig`'s defaults."""
        import torch

        from kunlun.engine.engine_config import EngineConfig

        settings = {
            name: getattr(self, name)
            for name in (
                "max_num_seqs",
                "max_num_batched_tokens",
                "max_model_len",
                "kv_cache_memory_bytes",
                "num_blocks",
                "block_size",
                "enable_prefix_caching",
                "num_threads",
                "seed",
                "chat_template",
            )  # fmt: skip
            if getattr(self, name) is not None
        }
        if self.graph_batch_sizes:
            settings["graph_batch_sizes"] = tuple(self.graph_batch_sizes)
        return EngineConfig(
            self.model_dir if model_dir is None else model_dir,
            device=self.device,
            dtype=getattr(torch, TORCH_NAMES[self.dtype]),
            quantization=self.quantization,
            group_size=self.group_size,
            tensor_parallel_size=self.tensor_parallel_size,
            distributed_backend=self.distributed_backend,
            **settings,
        )

    def write(self, path: str | Path) -> Path:
        """Write this launch to ``path`` as JSON, atomically (a reader never sees half a
        file); returns the path."""
        return write_atomically(path, self.model_dump_json(indent=2) + "\n")


def write_atomically(path: str | Path, text: str) -> Path:
    """``text`` to ``path`` through a temporary file renamed into place: a reader never sees
    half of it; only its owner may read it (a worker's launch holds its key). Returns the
    path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with os.fdopen(os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w",
                   encoding="utf-8") as out:  # fmt: skip
        out.write(text)
    os.replace(temporary, path)
    return path


def worker_command(launch_file: str | Path) -> list[str]:
    """The command line that starts a worker (:mod:`kunlun.serving.worker`) from ``launch_file``
    with this interpreter. The one place it is spelled: the embedded engine's adapter, tests
    and benchmarks call it."""
    return [sys.executable, "-m", "kunlun.serving.worker", "--launch", str(launch_file)]


class Rank(BaseModel):
    """One process of a replica: its rank in the tensor-parallel group, pid and device."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    rank: int = Field(ge=0)
    pid: int = Field(ge=1)
    device: str


class ReadyInfo(BaseModel):
    """What a replica reports once it serves: a worker writes it to its launch's
    ``ready_file`` (atomically, :meth:`write`) once it accepts connections; for an external
    engine the node agent makes it when the server's ready path answers. The node agent
    reads it (:meth:`read`) and ``workload describe`` shows it as the replica's
    ``startup``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    port: int = Field(ge=1, le=65535)
    """The loopback port it serves on."""
    pid: int | None = None
    """The worker's pid (None: an external engine's server, whose pid the agent has)."""
    engine: str | None = None
    """An external engine's name (None: the embedded engine's worker)."""
    load_time_s: float = Field(ge=0)
    """Seconds to load (an external server: from its start until its ready path answered)."""
    compile_time_s: float | None = None
    """Seconds of conversion and compilation before the load (the worker's ``Compilation
    Time``; None: not measured, an external server)."""
    warmup_ttft_ms: float | None = None
    """The warm-up generation's time to first token (the embedded engine)."""
    ranks: tuple[Rank, ...] = ()
    """Each process of the replica, rank 0 first (the embedded engine)."""
    handoff: str | None = None
    """The worker's direct-stream socket, an abstract Unix socket name (the embedded
    engine; :mod:`kunlun.serving.handoff`)."""

    def write(self, path: str | Path) -> Path:
        """Write to ``path`` as JSON, atomically (a reader never sees half a file)."""
        return write_atomically(path, self.model_dump_json(exclude_none=True))

    @classmethod
    def read(cls, path: str | Path) -> ReadyInfo | None:
        """The ready record at ``path``; None while there is none yet. A file that is not
        one raises :class:`ConfigError` naming the file and the field."""
        try:
            text = Path(path).read_text(encoding="utf-8")
        except FileNotFoundError:
            return None
        try:
            return cls.model_validate_json(text)
        except ValidationError as exc:
            first = exc.errors()[0]
            field = ".".join(str(p) for p in first["loc"]) or None
            raise ConfigError(f"not a ready record: {first['msg']}",
                              location=Location(str(path), field=field)) from None  # fmt: skip


def device_fields(plugin: DevicePlugin, device: str) -> dict[str, Any]:
    """The launch fields that describe ``device`` (a torch device string), taken from its
    device plugin, the one owner of these facts: device type, torch extension module and
    distributed backend."""
    return {
        "device": device,
        "device_type": plugin.device_type,
        "torch_module": plugin.torch_module,
        "distributed_backend": getattr(plugin, "distributed_backend", None),
    }


def read_launch(path: str | Path) -> EngineLaunch:
    """The launch in ``path``; a :class:`ConfigError` naming the file, the field and the value
    when it cannot be read, is not JSON, or does not hold a valid launch."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        why = exc.strerror if isinstance(exc, OSError) else str(exc)
        raise ConfigError(
            f"cannot read the launch file: {why}", location=Location(str(path))
        ) from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(
            f"the launch file is not JSON: {exc.msg}", location=Location(str(path), exc.lineno)
        ) from None
    if not isinstance(data, dict):
        raise ConfigError(
            f"a launch file holds a JSON object, got {type(data).__name__}",
            location=Location(str(path)),
        )
    try:
        return EngineLaunch.model_validate(data)
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            field = ".".join(str(p) for p in err["loc"]) or "(launch)"
            if err["type"] == "extra_forbidden":
                problems.append(f"{field}: unknown field")
            elif field == "(launch)":
                problems.append(err["msg"].removeprefix("Value error, "))
            else:
                message = err["msg"].removeprefix("Value error, ")
                problems.append(f"{field}={err.get('input')!r}: {message}")
        first = exc.errors()[0]["loc"]
        raise ConfigError(
            "invalid launch: " + "; ".join(problems),
            location=Location(str(path), field=".".join(str(p) for p in first) or None),
        ) from None
