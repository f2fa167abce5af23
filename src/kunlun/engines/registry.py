"""Finding engines, and choosing one for a workload.

Engines are found through the entry-point group ``kunlun.engines`` (pyproject.toml registers
the four built-ins there; a vendor package adds its own the same way). Like the device
plugins, an entry point that cannot be loaded is reported, not fatal. A built-in missing from
the group (package metadata installed before the group existed: reinstall to refresh it) is
still offered, with a note saying so.

:func:`choose_engine` answers which engine runs a model of a format on a device type, and why
every other engine was not chosen. In this slice ``auto`` is Kunlun's own engine whenever it
can run the model there; the other engines are listed with their reasons (not installed,
model format, device type).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cache
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, Any

from kunlun.engines.adapter import EngineAdapter
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
DEFAULT_ENGINE = "kunlun"
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


@dataclass(frozen=True, slots=True)
class EngineChoice:
    """The engine chosen for a replica, and every other engine with why it was not."""

    requested: str
    chosen: str
    why: str
    rejected: list[tuple[str, str]]

    def to_dict(self) -> dict[str, Any]:
        return {
            "requested": self.requested,
            "chosen": self.chosen,
            "why": self.why,
            "rejected": [{"engine": e, "reason": r} for e, r in self.rejected],
        }


def canonical(engine: str) -> str:
    """The engine's name, old spellings (``embedded``) mapped to the current one."""
    return ALIASES.get(engine, engine)


def why_not(engine: EngineAdapter, model_format: str, device_type: str) -> str | None:
    """Why ``engine`` cannot run a ``model_format`` model on ``device_type`` here, or None."""
    problem = engine.takes(model_format, device_type)
    if problem is not None:
        return problem
    available = engine.installed(device_type)
    return None if available else f"not installed: {available.reason}"


def choose_engine(
    requested: str,
    device_type: str,
    model_format: str,
    loaded: LoadedEngines | None = None,
) -> EngineChoice:
    """The engine for a ``model_format`` model on ``device_type``: ``requested`` when it is
    an engine's name (a :class:`ConfigError` naming why when it cannot run it here), or for
    ``auto`` Kunlun's own engine when it can; every other engine with its reason."""
    loaded = loaded or _registered()
    engines = loaded.engines
    requested = canonical(requested)
    if requested != "auto" and requested not in engines:
        broken = loaded.load_errors.get(requested)
        raise ConfigError(
            broken or f"engine {requested!r} is not registered (engines: {', '.join(engines)})",
            location=Location("engine"),
        )
    problems = {name: why_not(e, model_format, device_type) for name, e in engines.items()}
    if requested == "auto":
        chosen = DEFAULT_ENGINE
        problem = problems.get(chosen, "is not registered")
        if problem is not None:
            raise ConfigError(f"engine auto: {chosen} {problem}", location=Location("engine"))
        why = f"auto: {chosen}, the embedded engine, runs {model_format} models on {device_type}"
    else:
        chosen = requested
        if problems[chosen] is not None:
            raise ConfigError(
                f"engine {chosen} cannot run this workload: {problems[chosen]}",
                location=Location("engine"),
            )
        why = f"{chosen}: the spec's engine"
    rejected = [
        (name, problem or ("the spec asks for " + chosen if requested != "auto"
                           else f"could run it; auto prefers {chosen} (set engine: {name})"))
        for name, problem in problems.items()
        if name != chosen
    ]  # fmt: skip
    rejected += [(name, error) for name, error in loaded.load_errors.items()]
    return EngineChoice(requested, chosen, why, rejected)


def model_format(path: str | None) -> str:
    """``gguf`` for a model that is one ``.gguf`` file, else ``hf`` (a Hugging Face folder)."""
    return "gguf" if path is not None and str(path).lower().endswith(".gguf") else "hf"


def choose_plan_engines(
    requested: str, plans: list[ExecutionPlan], model: ModelInfo
) -> EngineChoice:
    """Choose the engine of every replica's plan (their device types may differ) and set it
    in the plans; the choice of the first replica, with its reasons, is returned."""
    loaded = _registered()
    choices = [choose_engine(requested, p.device_type, model_format(model.path), loaded)
               for p in plans]  # fmt: skip
    for plan, choice in zip(plans, choices, strict=True):
        plan.engine = choice.chosen
    return choices[0]


def refuse_external(engine: str) -> None:
    """Refuse a workload on an external engine: launching one is not built yet (the adapters
    say how; the node agent does not start them). ``auto`` and ``kunlun`` pass."""
    if canonical(engine) not in ("auto", DEFAULT_ENGINE):
        raise ConfigError(
            f"engine {engine}: launching external engines is not built yet; Kunlun plans "
            f"and describes the {engine} command (kunlun-cli plan --explain) but cannot "
            "start it",
            location=Location("engine"),
            hint="use engine: auto or kunlun (docs/engines.md)",
        )
