"""The engine adapter: what every inference engine Kunlun can run tells the platform.

Kunlun's own engine (:mod:`kunlun.engine`) and external servers (llama.cpp's ``llama-server``,
vLLM, SGLang) differ in everything but the questions the platform asks them: which model
formats and device types they take, whether they are installed here (asked cheaply, without
importing a heavy package), and the command line, environment, port, readiness and metrics
paths, stop signal and log file of one replica of a plan. An :class:`EngineAdapter` answers
them; adapters are registered through the entry-point group ``kunlun.engines``
(:mod:`kunlun.engines.registry`), so a vendor package can add one.

An adapter holds its engine's facts (for the external engines its rows per vendor family,
:class:`kunlun.engines.table.VendorRow`, and its spelling of dtypes and schemes) beside the
small amount of code that reads them.
"""

from __future__ import annotations

import functools
import importlib.util
import shutil
import signal
import subprocess
import sys
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from prometheus_client.parser import text_string_to_metric_families

from kunlun.errors import ConfigError, EngineLacks, Location
from kunlun.planner.plan import ExecutionPlan

ModelFormat = Literal["hf", "gguf"]
"""``hf``: a Hugging Face directory (config.json and safetensors); ``gguf``: one GGUF file."""
MODEL_FORMATS: tuple[ModelFormat, ...] = ("hf", "gguf")


@dataclass(frozen=True, slots=True)
class Availability:
    """Whether an engine can be started on this machine, and if not, why not."""

    installed: bool
    reason: str

    def __bool__(self) -> bool:
        return self.installed


@dataclass(frozen=True, slots=True)
class LaunchContext:
    """What one replica's launch knows beyond its plan: where the model is (in the format
    the engine takes), the name clients send, where the server listens, where its logs go."""

    model_path: Path
    served_name: str
    port: int
    log_file: Path
    """Where the server's output goes: the workload's log, next to the platform's own lines
    about it (``kunlun-cli workload logs``)."""
    host: str = "127.0.0.1"
    num_threads: int | None = None
    """Host threads (llama.cpp's ``--threads``); None: the plan's ``num_threads`` option."""
    launch_file: Path | None = None
    """Where the node agent writes the replica's :class:`~kunlun.engine.launch.EngineLaunch`
    before each start (an engine with :attr:`EngineAdapter.takes_launch_file` only)."""


@dataclass(frozen=True, slots=True)
class EngineCommand:
    """How to start, watch and stop one replica of a plan on one engine."""

    engine: str
    argv: list[str]
    env: dict[str, str]
    """Variables set on top of the agent's environment (device visibility first)."""
    host: str
    port: int
    ready_path: str | None
    """HTTP path that answers 200 once the server serves; None: the engine signals readiness
    another way (the embedded worker writes a ready file)."""
    metrics_path: str | None
    """HTTP path of the engine's own Prometheus metrics, or None."""
    stats_path: str | None
    """What liveness and health checks read for the engine's progress: its metrics when the
    adapter reads progress from them (:meth:`EngineAdapter.progress`), else its ready path
    (liveness only)."""
    log_file: Path
    """Where the process's stdout and stderr go."""
    key_env: str | None = None
    """The variable through which the server takes a key it then asks of every request but
    its health path (``Authorization: Bearer``): the node agent sets a new one at each start
    (:attr:`~kunlun.serving.replica.Replica.worker_key`). None: the server is given none."""
    stop_signal: signal.Signals = signal.SIGTERM
    stop_grace_s: float = 30.0
    """Seconds between ``stop_signal`` and SIGKILL."""
    notes: list[str] = field(default_factory=list)


class EngineAdapter(ABC):
    """One inference engine. Subclasses set the class attributes and build the command."""

    name: str
    """The name specs use (``engine: vllm``) and the entry point's name."""
    formats: tuple[ModelFormat, ...]
    device_types: tuple[str, ...]
    """Kunlun device types (device plugins' ``device_type``) the engine runs on."""
    takes_launch_file: bool = False
    """The engine starts from an :class:`~kunlun.engine.launch.EngineLaunch` file that the
    node agent completes (ready file, sandbox) and writes before each start; it binds a free
    port itself and says which in its ready file. An external server takes its settings on
    its command line and listens where its command says."""

    version_command: tuple[str, ...] = ()
    """The command that prints the installed engine's version (a binary and its flag), or
    empty: :meth:`version` then says None unless the adapter overrides it."""

    def version(self) -> str | None:
        """The installed engine's version as it prints it, or None (not known, not installed);
        recorded in a workload's placement and in known-good snapshots."""
        return printed_version(self.version_command)

    @abstractmethod
    def installed(self, device_type: str | None = None) -> Availability:
        """Whether the engine (and, for ``device_type``, its vendor build or plugin) is
        installed here. Cheap: looks for modules and binaries, imports nothing heavy."""

    @abstractmethod
    def command(self, plan: ExecutionPlan, context: LaunchContext) -> EngineCommand:
        """The command of one replica of ``plan``; a plan setting the engine cannot express is
        a :class:`~kunlun.errors.ConfigError` naming the engine, the field and the value."""

    progress_metrics: dict[str, tuple[str, ...]] = {}
    """The engine's own metric series whose sums are the worker's ``/stats`` counters
    ``num_steps`` and ``num_unfinished_requests``, so that the health checker tells a busy
    engine from a stalled one; empty: the engine's health answer is liveness only."""

    def progress(self, metrics_text: str) -> dict[str, Any]:
        """The engine's progress counters from its ``/metrics`` text (see
        :attr:`progress_metrics`); a counter none of whose series is there is left out."""
        values: dict[str, float] = {}
        for family in text_string_to_metric_families(metrics_text):
            for sample in family.samples:
                values[sample.name] = values.get(sample.name, 0.0) + sample.value
        out: dict[str, Any] = {}
        for counter, names in self.progress_metrics.items():
            found = [values[n] for n in names if n in values]
            if found:
                out[counter] = int(sum(found))
        return out

    serves: tuple[str, ...] = ("/v1/chat/completions", "/v1/completions")
    """The gateway's inference paths this engine answers (an external engine's requests are
    checked against :meth:`request_body`; another path is a 400 naming the engine)."""

    def request_body(self, path: str, payload: dict[str, Any]) -> dict[str, Any]:
        """``payload`` (already valid for Kunlun's own API at ``path``) as this engine takes
        it: fields it spells differently renamed; a field it does not honour is a
        :class:`~kunlun.errors.EngineLacks` naming it (never dropped). The embedded
        engine's is the payload itself."""
        return payload

    def prepare_model(
        self, plan: ExecutionPlan, path: Path, model_dir: Path, plan_dir: Path
    ) -> tuple[Path, list[str]]:
        """The model file the engine serves for ``plan`` (``path``: the model in the
        engine's format; ``model_dir``: its Kunlun directory; ``plan_dir``: the plan's
        cache directory), and the command, if any, that must run before the engine's own to
        make it (its argv ends with ``--``; it then execs the engine). Default: ``path`` as
        it is."""
        return path, []

    def takes(self, model_formats: str | tuple[str, ...], device_type: str) -> str | None:
        """Why this engine cannot run a model it has in ``model_formats`` on ``device_type``,
        or None."""
        have = (model_formats,) if isinstance(model_formats, str) else model_formats
        if not set(have) & set(self.formats):
            return f"does not take {' or '.join(have)} models (takes {', '.join(self.formats)})"
        if device_type not in self.device_types:
            return f"does not run on {device_type} devices (runs on {', '.join(self.device_types)})"
        return None

    def refuse(self, field_name: str, value: object, why: str) -> ConfigError:
        """The error for a plan setting this engine cannot express."""
        return ConfigError(
            f"engine {self.name} cannot run {field_name}={value!r}: {why}",
            location=Location(field_name),
        )


def module_available(module: str) -> Availability:
    """Whether ``module`` can be imported here, found without importing it."""
    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        found = False
    if found:
        return Availability(True, f"python module {module} is importable")
    return Availability(False, f"python module {module} is not importable")


@functools.cache
def printed_version(argv: tuple[str, ...]) -> str | None:
    """The first line ``argv`` prints that names a version (``version: 11434 (8f3ab1c)``), once
    per process; None when the binary is missing, fails or says nothing."""
    binary = find_binary(argv[0]) if argv else None
    if binary is None:
        return None
    try:
        done = subprocess.run([binary, *argv[1:]], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    lines = [line.strip() for line in (done.stdout + "\n" + done.stderr).splitlines()]
    return next((line[:200] for line in lines if "version" in line.lower()), None)


def find_binary(binary: str) -> str | None:
    """Where ``binary`` is: on ``PATH``, else beside this interpreter (the virtual
    environment's ``bin``, where ``make setup`` links llama-server); None when nowhere."""
    return shutil.which(binary) or shutil.which(binary, path=str(Path(sys.executable).parent))


def binary_available(binary: str) -> Availability:
    """Whether ``binary`` is on ``PATH`` or beside this interpreter."""
    path = find_binary(binary)
    if path is not None:
        return Availability(True, f"{binary} is {path}")
    return Availability(False, f"{binary} is not on PATH nor in {Path(sys.executable).parent}")


def lacks(engine: str, field_name: str, what: str) -> EngineLacks:
    """The 400 for a request field ``engine`` does not honour (``what`` it would ask for)."""
    return EngineLacks(
        f"'{field_name}' is not supported by engine {engine}, which serves this model "
        f"({what}); remove it, or send it to a model served by the kunlun engine",
        location=Location("request", field=field_name),
    )
