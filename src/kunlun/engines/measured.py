"""Measured engine speeds, and how ``engine: auto`` uses them.

The plan's roofline estimate cannot tell two engines apart: for one plan (the same weights,
dtype and quantization on the same device) it predicts the same bytes and FLOPs per token,
whichever program runs them. What tells them apart is a measurement. ``kunlun-cli bench
--record`` against a Kunlun daemon sends its output tokens/s per concurrency to ``POST
/api/v1/workloads/{name}/measurements``; the daemon knows that workload's model, engine,
device type and quantization (its plan) and keeps the figures in the model's catalog record
(``ModelRecord.meta["measured"]``), so every node of a cluster reads the same ones.

:func:`faster_engine` is what ``auto`` asks: among the engines that can run the model on a
device type, the one measured fastest at the plan's quantization, compared at the highest
concurrency every one of them was measured at. With fewer than two engines measured there,
it has no answer and ``auto`` keeps Kunlun's own engine (ties in the estimate go to the engine
that honours every API field). One record per (device type, engine, quantization): a newer
measurement replaces the older one.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from kunlun.errors import ConfigError, Location
from kunlun.state.store import StateStore

META_KEY = "measured"


@dataclass(frozen=True)
class Measurement:
    """One bench run's throughput of one workload: output tokens/s by concurrency."""

    engine: str
    device_type: str
    quantization: str
    tokens_per_s: dict[int, float]
    """Output tokens per second, by the number of concurrent requests."""
    workload: str
    at: float
    """When it was recorded (Unix seconds)."""

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["tokens_per_s"] = {str(k): v for k, v in self.tokens_per_s.items()}
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Measurement:
        rates = {int(k): float(v) for k, v in (data.get("tokens_per_s") or {}).items()}
        return cls(str(data["engine"]), str(data["device_type"]), str(data["quantization"]),
                   rates, str(data.get("workload", "")), float(data.get("at", 0.0)))  # fmt: skip

    @property
    def key(self) -> tuple[str, str, str]:
        return (self.device_type, self.engine, self.quantization)


def parse_runs(runs: Any, where: str = "runs") -> dict[int, float]:
    """``[{"concurrency": N, "output_tokens_per_s": X}, ...]`` (what ``kunlun-cli bench``
    measured) as ``{N: X}``; a :class:`ConfigError` naming the bad entry."""
    if not isinstance(runs, list) or not runs:
        raise ConfigError("expected a non-empty list of runs", location=Location(where))
    out: dict[int, float] = {}
    for i, run in enumerate(runs):
        at = Location(where, field=f"[{i}]")
        if not isinstance(run, dict) or set(run) != {"concurrency", "output_tokens_per_s"}:
            raise ConfigError(
                "each run is {concurrency: int >= 1, output_tokens_per_s: number > 0}", location=at
            )
        concurrency, rate = run["concurrency"], run["output_tokens_per_s"]
        if isinstance(concurrency, bool) or not isinstance(concurrency, int) or concurrency < 1:
            raise ConfigError(f"concurrency {concurrency!r} is not an integer >= 1", location=at)
        if isinstance(rate, bool) or not isinstance(rate, int | float) or not rate > 0:
            raise ConfigError(f"output_tokens_per_s {rate!r} is not a number > 0", location=at)
        out[concurrency] = float(rate)
    return out


def of_workload(placement: dict[str, Any], name: str, rates: dict[int, float]) -> Measurement:
    """A measurement of the workload whose placement is ``placement`` (its plan says the
    engine, device type and quantization)."""
    plan = placement.get("plan") or {}
    engine, device_type = plan.get("engine"), plan.get("device_type")
    if not engine or not device_type:
        raise ConfigError(f"workload {name} has no plan yet", location=Location("workload"))
    return Measurement(engine, device_type, str(plan.get("quantization") or "none"), rates,
                       name, time.time())  # fmt: skip


def record(store: StateStore, alias: str, measurement: Measurement) -> None:
    """Keep ``measurement`` in model ``alias``'s catalog record (replacing the one of the same
    device type, engine and quantization)."""
    model = store.get_model(alias)
    if model is None:
        raise ConfigError(f"model {alias!r} is not in the catalog", location=Location("model"))
    kept = [m for m in recorded(model.meta) if m.key != measurement.key]
    meta = {**model.meta, META_KEY: [m.to_dict() for m in (*kept, measurement)]}
    store.put_model(dataclasses.replace(model, meta=meta))


def recorded(meta: dict[str, Any] | None) -> list[Measurement]:
    """The measurements kept in a model record's ``meta`` (entries that do not parse are
    skipped: a record written by a newer version must not stop placement)."""
    out = []
    for entry in (meta or {}).get(META_KEY) or []:
        try:
            out.append(Measurement.from_dict(entry))
        except (KeyError, TypeError, ValueError):
            continue
    return out


def for_model(store: StateStore | None, alias: str) -> list[Measurement]:
    """Model ``alias``'s measurements (none for a model outside the catalog)."""
    model = store.get_model(alias) if store is not None else None
    return recorded(model.meta) if model is not None else []


@dataclass(frozen=True)
class Verdict:
    """Which engine was measured fastest, and the figures that say so."""

    engine: str
    concurrency: int
    rates: dict[str, float]
    """Each compared engine's output tokens/s at :attr:`concurrency`."""
    measured_at: dict[str, float]

    def why(self, device_type: str, quantization: str) -> str:
        figures = ", ".join(f"{e} {r:.1f}" for e, r in
                            sorted(self.rates.items(), key=lambda item: -item[1]))  # fmt: skip
        when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(max(self.measured_at.values())))
        return (f"measured fastest on {device_type} at quantization {quantization}: {figures} "
                f"output tokens/s at {self.concurrency} concurrent (kunlun-cli bench --record, "
                f"latest {when})")  # fmt: skip

    def slower(self, engine: str) -> str:
        return (f"measured slower: {self.rates[engine]:.1f} vs {self.engine} "
                f"{self.rates[self.engine]:.1f} output tokens/s at {self.concurrency} concurrent")  # fmt: skip


def faster_engine(
    measured: Sequence[Measurement], candidates: Iterable[str], device_type: str,
    quantization: str,
) -> Verdict | None:  # fmt: skip
    """The fastest of ``candidates`` on ``device_type`` at ``quantization``, compared at the
    highest concurrency all measured ones share; None with fewer than two measured."""
    found = {m.engine: m for m in measured
             if m.device_type == device_type and m.quantization == quantization
             and m.engine in set(candidates)}  # fmt: skip
    if len(found) < 2:
        return None
    shared = set.intersection(*(set(m.tokens_per_s) for m in found.values()))
    if not shared:
        return None
    level = max(shared)
    rates = {e: m.tokens_per_s[level] for e, m in found.items()}
    best = max(sorted(rates), key=lambda e: rates[e])
    return Verdict(best, level, rates, {e: m.at for e, m in found.items()})
