"""``POST /api/v1/workloads/{workload}/measurements``: keep what a benchmark measured.

``kunlun-cli bench --record`` sends the output tokens/s it measured per concurrency against a
workload (requests named the workload, so one workload answered them all; a name served on
two engines, :mod:`kunlun.serving.pools`, is refused: its requests went to either). The daemon adds
what it alone knows, the workload's model, engine, device type and quantization (its plan),
and keeps the figures in the model's catalog record, where ``engine: auto`` reads them
(:mod:`kunlun.engines.measured`). Admin keys only, like every ``/api/v1`` route. The answer is
the measurement kept and every measurement of the model.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Body

from kunlun import catalog
from kunlun.engines import measured
from kunlun.errors import ConfigError, Location
from kunlun.workload.manager import ACTIVE

if TYPE_CHECKING:
    from kunlun.daemon.app import Platform


def measurements_router(platform: Platform) -> APIRouter:
    router = APIRouter()

    @router.post("/workloads/{workload}/measurements")
    async def record(workload: str, body: dict[str, Any] = Body(...)) -> dict[str, Any]:
        if set(body) != {"runs"}:
            unknown = sorted(set(body) - {"runs"}) or ["runs (missing)"]
            raise ConfigError(f"expected only 'runs'; got {', '.join(unknown)}",
                              location=Location("request body", field=unknown[0]))  # fmt: skip
        rates = measured.parse_runs(body["runs"])
        sharing = [w for w in platform.store.list_workloads()
                   if w.name == workload and w.state in ACTIVE]  # fmt: skip
        if len(sharing) > 1:  # one name on two engines: the bench's requests went to either
            engines = ", ".join(f"{w.workload_id} ({(w.placement.get('engine') or {}).get('chosen')})"
                                for w in sharing)  # fmt: skip
            raise ConfigError(
                f"{len(sharing)} workloads serve {workload!r}: {engines}; a measurement needs a "
                "name one workload serves",
                location=Location("workload", field=workload),
                hint="serve the engine to measure under its own --name, bench that name",
            )
        wl = platform.manager.get(workload)
        alias = catalog.resolve(platform.store, str(wl.spec.get("model"))).alias
        kept = measured.of_workload(wl.placement, wl.name, rates)
        await asyncio.to_thread(measured.record, platform.store, alias, kept)
        return {
            "model": alias,
            "measurement": kept.to_dict(),
            "measured": [m.to_dict() for m in measured.for_model(platform.store, alias)],
        }

    return router
