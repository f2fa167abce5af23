"""Finding engines, and choosing one for a workload.

Engines are found through the entry-point group ``kunlun.engines`` (pyproject.toml registers
the four built-ins there; a vendor package adds its own the same way). Like the device
plugins, an entry point that cannot be loaded is reported, not fatal. A built-in missing from
the group (package metadata installed before the group existed: reinstall to refresh it) is
still offered, with a note saying so.

:func:`choose_engine` answers which engine runs a model of a format on a device type, and why
every other engine was not chosen. ``auto`` is the engine measured fastest for this model,
device type and quantization (:mod:`kunlun.engines.measured`: ``kunlun-cli bench --record``)
when at least two engines that can run it were measured; otherwise Kunlun's own engine (the
plan's estimate is the same for every engine on one plan, and the embedded engine honours
every API field). The other engines are listed with their reasons (not installed, model
format, device type, measured slower).
"""

from __future__ import annotations

import dataclasses
import socket
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cache
from importlib.metadata import entry_points
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kunlun.engine.gguf_source import gguf_source
from kunlun.engine.launch import EMBEDDED_ENGINE
from kunlun.engines.adapter import EngineAdapter, EngineCommand, LaunchContext, find_binary
from kunlun.engines.measured import Measurement, faster_engine
from kunlun.errors import ConfigError, Location

if TYPE_CHECKING:
    from kunlun.planner.model_info import ModelInfo
    from kunlun.planner.plan import ExecutionPlan

ENTRY_POINT_GROUP = "kunlun.engines"
#: The built-ins, as pyproject.toml registers them.
BUILTINS: dict[str, str] = {
    "kunlun": "kunlun.engines.builtin:KunlunEngine",
    "llama.cpp": "kunlun.engines.builtin:LlamaCppEngine",
    "vllm": "kunlun.engines.builtin:VllmEngine",
    "sglang": "kunlun.engines.builtin:SglangEngine",
}
#: The embedded engine's name; ``embedded`` is its old spelling in specs.
DEFAULT_ENGINE = EMBEDDED_ENGINE
ALIASES: dict[str, str] = {"embedded": DEFAULT_ENGINE}


@dataclass
class LoadedEngines:
    """Engines by name, entry points that failed to load, and notes."""

    engines: dict[str, EngineAdapter]
    load_errors: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


def _instantiate(name: str, value: str, loaded: Any) -> EngineAdapter:
    if not (isinstance(loaded, type) and issubclass(loaded, EngineAdapter)):
        raise TypeError(f"{value} is not an EngineAdapter subclass")
    engine = loaded()
    if engine.name != name:
        raise TypeError(f"{value} is named {engine.name!r}, its entry point {name!r}")
    return engine


def load_engines() -> LoadedEngines:
    """Every engine registered in ``kunlun.engines``, plus built-ins the metadata lacks."""
    out = LoadedEngines({})
    for ep in sorted(entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name):
        if ep.name in out.engines:
            continue  # the same package seen twice on sys.path
        try:
            out.engines[ep.name] = _instantiate(ep.name, ep.value, ep.load())
        except Exception as exc:  # noqa: BLE001 - a broken engine must not stop the others
            out.load_errors[ep.name] = f"cannot load engine '{ep.name}' ({ep.value}): {exc!r}"
    for name, value in BUILTINS.items():
        if name not in out.engines and name not in out.load_errors:
            module, _, attr = value.partition(":")
            cls = getattr(__import__(module, fromlist=[attr]), attr)
            out.engines[name] = _instantiate(name, value, cls)
            out.notes.append(
                f"built-in engine {name} is not in the installed package's {ENTRY_POINT_GROUP} "
                "entry points (metadata older than the group; reinstall the package)"
            )
    return out


@cache
def _registered() -> LoadedEngines:
    """:func:`load_engines`, once per process (entry points do not change while it runs;
    whether an engine is installed is asked each time)."""
    return load_engines()


def registered_names() -> tuple[str, ...]:
    """Every engine name the registry knows: loaded, or registered and failing to load (a
    spec may name it; choosing it then says why it cannot run)."""
    loaded = _registered()
    return (*loaded.engines, *(n for n in loaded.load_errors if n not in loaded.engines))


@dataclass(frozen=True, slots=True)
class EngineChoice:
    """The engine chosen for a replica, and every other engine with why it was not."""

    requested: str
    chosen: str
    why: str
    rejected: list[tuple[str, str]]
    version: str | None = None
    """The chosen engine's version as installed here (:meth:`EngineAdapter.version`)."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "requested": self.requested,
            "chosen": self.chosen,
            "why": self.why,
            "version": self.version,
            "rejected": [{"engine": e, "reason": r} for e, r in self.rejected],
        }


def canonical(engine: str) -> str:
    """The engine's name, old spellings (``embedded``) mapped to the current one."""
    return ALIASES.get(engine, engine)


def why_not(
    engine: EngineAdapter, model_formats: str | tuple[str, ...], device_type: str
) -> str | None:
    """Why ``engine`` cannot run a model it has in ``model_formats`` on ``device_type`` here,
    or None."""
    problem = engine.takes(model_formats, device_type)
    if problem is not None:
        return problem
    available = engine.installed(device_type)
    return None if available else f"not installed: {available.reason}"


def choose_engine(
    requested: str,
    device_type: str,
    model_formats: str | tuple[str, ...],
    loaded: LoadedEngines | None = None,
    measured: Sequence[Measurement] = (),
    quantization: str = "none",
) -> EngineChoice:
    """The engine for a model held in ``model_formats`` (``hf``; ``gguf`` too when the
    model was imported from a GGUF file still there) on ``device_type``: ``requested`` when it is
    an engine's name (a :class:`ConfigError` naming why when it cannot run it here), or for
    ``auto`` the one ``measured`` fastest at the plan's ``quantization`` among those that can
    run it, else Kunlun's own engine; every other engine with its reason."""
    loaded = loaded or _registered()
    engines = loaded.engines
    requested = canonical(requested)
    if requested != "auto" and requested not in engines:
        broken = loaded.load_errors.get(requested)
        raise ConfigError(
            broken or f"engine {requested!r} is not registered (engines: {', '.join(engines)})",
            location=Location("engine"),
        )
    problems = {name: why_not(e, model_formats, device_type) for name, e in engines.items()}
    verdict = None
    if requested == "auto":
        able = [name for name, problem in problems.items() if problem is None]
        verdict = faster_engine(measured, able, device_type, quantization)
        chosen = DEFAULT_ENGINE if verdict is None else verdict.engine
        problem = problems.get(chosen, "is not registered")
        if problem is not None:
            raise ConfigError(f"engine auto: {chosen} {problem}", location=Location("engine"))
        why = (f"auto: {chosen}, the embedded engine, runs this model on {device_type}; no two "
               "engines measured here (kunlun-cli bench --record)" if verdict is None
               else f"auto: {chosen}, {verdict.why(device_type, quantization)}")  # fmt: skip
    else:
        chosen = requested
        if problems[chosen] is not None:
            raise ConfigError(
                f"engine {chosen} cannot run this workload: {problems[chosen]}",
                location=Location("engine"),
            )
        why = f"{chosen}: the spec's engine"

    def reason(name: str) -> str:
        if requested != "auto":
            return "the spec asks for " + chosen
        if verdict is not None and name in verdict.rates:
            return f"{verdict.slower(name)} (set engine: {name})"
        return f"could run it; auto prefers {chosen} (set engine: {name})"

    rejected = [(name, problem or reason(name)) for name, problem in problems.items()
                if name != chosen]  # fmt: skip
    rejected += [(name, error) for name, error in loaded.load_errors.items()]
    return EngineChoice(requested, chosen, why, rejected, engines[chosen].version())


def model_files(path: str | Path | None) -> dict[str, Path]:
    """The model's files by format: ``hf`` (its Hugging Face directory) and, when it was
    imported from a GGUF file that is still there unchanged, ``gguf`` (that file); a model
    that is a ``.gguf`` path has only ``gguf``."""
    if path is None:
        return {}
    source = gguf_source(path)
    if Path(path).suffix.lower() == ".gguf":
        return {"gguf": source} if source is not None else {}
    return {"hf": Path(path), **({"gguf": source} if source is not None else {})}


def model_path_for(engine: EngineAdapter, path: str | Path) -> Path:
    """The file or directory of the model at ``path`` that ``engine`` serves (its first
    format the model has), or a :class:`ConfigError` naming what is missing."""
    files = model_files(path)
    for fmt in engine.formats:
        if fmt in files:
            return files[fmt]
    raise ConfigError(
        f"engine {engine.name} takes {', '.join(engine.formats)} models; {path} has "
        f"{', '.join(files) or 'no model files'} (a GGUF import whose file moved or changed "
        "has no gguf)",
        location=Location("engine"),
    )


def choose_plan_engines(
    requested: str, plans: list[ExecutionPlan], model: ModelInfo,
    measured: Sequence[Measurement] = (),
) -> EngineChoice:  # fmt: skip
    """Choose the engine of every replica's plan (their device types may differ) and set it
    in the plans; the choice of the first replica, with its reasons, is returned."""
    loaded = _registered()
    formats = tuple(model_files(model.path)) or ("hf",)
    choices = [choose_engine(requested, p.device_type, formats, loaded, measured, p.quantization)
               for p in plans]  # fmt: skip
    for plan, choice in zip(plans, choices, strict=True):
        plan.set_engine(choice.chosen)
    return choices[0]


def engine_command(
    plan: ExecutionPlan, model_path: str | Path, served_name: str, num_threads: int,
    log_file: Path, plan_dir: Path, launch_file: Path,
) -> EngineCommand:  # fmt: skip
    """The command of one replica of ``plan`` on its engine (``plan.engine``), from the
    engine's adapter, its output appended to ``log_file``. An engine that starts from a
    launch file (:attr:`~kunlun.engines.adapter.EngineAdapter.takes_launch_file`: the
    embedded one) reads it at ``launch_file`` and binds its own port. An external server
    listens on a free loopback port; its program is found on PATH or beside this
    interpreter, and runs after whatever the engine needs done to the model first
    (:meth:`~kunlun.engines.adapter.EngineAdapter.prepare_model`, e.g. an unquantized GGUF
    written into ``plan_dir``)."""
    engine = _registered().engines[plan.engine]
    if engine.takes_launch_file:
        return engine.command(plan, LaunchContext(Path(model_path), served_name, 0, log_file,
                                                  num_threads=num_threads,
                                                  launch_file=launch_file))  # fmt: skip
    served, first = engine.prepare_model(plan, model_path_for(engine, model_path),
                                         Path(model_path), plan_dir)  # fmt: skip
    context = LaunchContext(served, served_name, free_port(), log_file,
                            num_threads=num_threads)  # fmt: skip
    command = engine.command(plan, context)
    program, *args = command.argv
    # "python": the interpreter the engine's module was found importable in (this one)
    program = sys.executable if program == "python" else find_binary(program) or program
    return dataclasses.replace(command, argv=[*first, program, *args])


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on now (the engine binds it a moment later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def engine_named(name: str) -> EngineAdapter:
    """The registered engine ``name`` (a replica's engine, so it is registered)."""
    return _registered().engines[canonical(name)]
