"""Why a placement chose what it chose, and why each alternative lost.

The filters say why a class cannot run a demand at all; this module words the rest: why the
chosen devices won (:func:`why`), why a ranked candidate lost (:func:`lost`), why a class
the placer did not evaluate could not have won (:func:`skipped`), and why a class that fits
had no device left (:func:`taken`). Reasons for the alternatives are only worded when
someone reads them (:meth:`Ranking.explain`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kunlun.planner.capacity import DeviceCapacity
from kunlun.planner.estimate import compute_dtype
from kunlun.planner.plan import Demand, Option, Rejection
from kunlun.workload.ledger import Ledger
from kunlun.workload.placement.scorers import RATED, Candidate, Judged, rates
from kunlun.workload.pool import DevicePool


@dataclass
class Ranking:
    """One placement decision: rejections, candidates best first, classes not evaluated."""

    rejected: list[Rejection]
    candidates: list[Candidate]
    unranked: list[Judged]

    def explain(self, demand: Demand) -> list[Rejection]:
        best = self.candidates[0]
        out = list(self.rejected)
        for c in self.candidates[1:]:
            out.append(Rejection(c.pool.label, c.option.dtype, c.option.tp, lost(demand, best, c)))
        for j in self.unranked:
            out.append(Rejection(j.pool.label, None, None, skipped(demand, best, j)))
        return out


def decode(rate: float | None) -> str:
    return "no decode estimate" if rate is None else f"decode estimate {rate:.0f} tokens/s"


def compute(demand: Demand, pool: DevicePool, option: Option) -> str:
    """The declared compute throughput of ``option`` on ``pool``, with the figure behind it."""
    dtype = compute_dtype(option.dtype, demand.quantization)
    figure = pool.first.compute.get(dtype)
    if figure is None or option.compute_tokens_per_s is None:
        return f"no {dtype} compute declared"
    unit = "TOPS" if dtype == "int8" else "TFLOPS"
    times = f" x{option.tp}" if option.tp > 1 else ""
    return f"{dtype} compute {figure:g} {unit}{times} = {option.compute_tokens_per_s:.0f} tokens/s"


def figures(demand: Demand, pool: DevicePool, option: Option) -> str:
    """What a rated scorer ranks ``option`` on ``pool`` by."""
    if demand.scorer == "roofline":
        return decode(option.tokens_per_s)
    return f"{compute(demand, pool, option)}, {decode(option.tokens_per_s)}"


def rate(demand: Demand, c: Candidate) -> str:
    return figures(demand, c.pool, c.option)


def why(demand: Demand, ranking: Ranking) -> str:
    best = ranking.candidates[0]
    pool, option = best.pool, best.option
    chose = f"{', '.join(pool.caps[i].device_id for i in best.group)} ({option.dtype}"
    chose += f", {demand.quantization}" if demand.quantization != "none" else ""
    chose += f", tp={option.tp})"
    if demand.device:
        return f"explicit device {demand.device}: {chose}"
    parts = [chose]
    if pool.first.device_type in demand.preferred_device_types:
        parts.append(f"preferred device type {pool.first.device_type}")
    if pool.first.degraded:
        parts.append("Degraded, but nothing Ready fits")
    if demand.scorer in RATED:
        parts.append(f"{demand.scorer}: {rate(demand, best)}")
        if (other := disagreement(demand, ranking)) is not None:
            parts.append(other)
    else:
        parts.append(f"{demand.scorer}: {best.headroom:.0f} MiB free before placing")
    others = len(ranking.candidates) + len(ranking.unranked) - 1
    if others:
        parts.append(f"{others} other candidate class(es) ranked lower")
    return "; ".join(parts)


def disagreement(demand: Demand, ranking: Ranking) -> str | None:
    """Under ``performance``, a class the decode estimate would put ahead of the winner (under
    ``roofline``, one that declares more compute), among the classes only the scorer separated
    from it; said so that the operator can choose the other scorer."""
    best = ranking.candidates[0]
    rivals = [(c.pool, c.option) for c in ranking.candidates[1:] if c.rank[:2] == best.rank[:2]]
    rivals += [(j.pool, j.found[0]) for j in ranking.unranked if j.bound[:2] == best.rank[:2]]
    other = "roofline" if demand.scorer == "performance" else "performance"

    def figure(option: Option) -> float:
        value = option.tokens_per_s if other == "roofline" else option.compute_tokens_per_s
        return value or 0.0

    mine = figure(best.option)
    for pool, option in rivals:
        if figure(option) > 1.05 * mine:
            what = "decode estimate" if other == "roofline" else (
                f"declared {compute_dtype(option.dtype, demand.quantization)} compute")  # fmt: skip
            return (f"{pool.label} would rank ahead under scorer {other} ({what} "
                    f"{figure(option):.0f} vs {mine:.0f} tokens/s)")  # fmt: skip
    return None


def _before_scoring(demand: Demand, winner: tuple[Any, ...], rank: tuple[Any, ...]) -> str | None:
    """Why a class lost before the scorer compared it (``rank`` and ``winner`` start with
    Degraded and the preferred-type position), or None."""
    if winner[0] != rank[0]:
        return "Degraded; a Ready device fits"
    if winner[1] != rank[1]:
        return f"not earlier in preferred_device_types {list(demand.preferred_device_types)}"
    return None


def lost(demand: Demand, winner: Candidate, loser: Candidate) -> str:
    if (why := _before_scoring(demand, winner.rank, loser.rank)) is not None:
        return why
    if demand.scorer in RATED:
        return (f"ranked lower by {demand.scorer}: {rate(demand, loser)} vs "
                f"{rate(demand, winner)}")  # fmt: skip
    return (
        f"ranked lower by {demand.scorer}: {loser.headroom:.0f} MiB free vs {winner.headroom:.0f}"
    )


def skipped(demand: Demand, best: Candidate, j: Judged) -> str:
    """Why a class that was not evaluated could not have won."""
    if (why := _before_scoring(demand, best.rank, j.bound)) is not None:
        return why
    if demand.scorer in RATED:
        option = min(j.found, key=lambda o: rates(demand.scorer, o))
        return (f"ranked lower by {demand.scorer}: at best {figures(demand, j.pool, option)} vs "
                f"{rate(demand, best)}")  # fmt: skip
    return f"ranked lower by {demand.scorer}: {best.headroom:.0f} MiB free on the chosen device"


def taken(
    pool: DevicePool,
    demand: Demand,
    option: Option,
    ledger: Ledger,
    by_id: dict[str, DeviceCapacity],
) -> str:
    """Why a class that can run ``demand`` got no candidate: its devices are in use."""
    need = option.need.weights_mb + option.need.min_kv_mb
    what = f"{option.dtype} tp={option.tp} needs {need:.0f} MiB for weights + KV"
    if demand.device is not None:
        free = ledger.headroom(by_id[demand.device])
        return (
            f"{demand.device} is taken: {what} at its {demand.priority} share; {free:.0f} MiB free"
        )
    most = pool.sorted[-1][0]
    return f"every device is taken: {what} at its {demand.priority} share; most free {most:.0f} MiB"


def by_label(rejected: list[Rejection]) -> dict[str, str]:
    """The rejections merged into one line per device class."""
    out: dict[str, str] = {}
    for r in rejected:
        what = " ".join(x for x in (r.dtype, f"tp={r.tp}" if r.tp else None) if x)
        line = f"{what}: {r.reason}" if what else r.reason
        out[r.devices] = f"{out[r.devices]}; {line}" if r.devices in out else line
    return out
