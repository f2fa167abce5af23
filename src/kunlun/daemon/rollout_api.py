"""The rollout routes under ``/api/v1`` (what ``kunlun-cli rollout`` calls):

- ``POST /rollouts``: start one (a :class:`~kunlun.rollout.spec.RolloutSpec` as JSON);
- ``GET /rollouts`` and ``GET /rollouts/{id}``: state, step, weights, each gate's measured
  value against its limit, requests counted, time to the next step;
- ``POST /rollouts/{id}/promote`` and ``/abort``: carried out by the node that advances
  rollouts (the cluster's leader), answered once done.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Body

from kunlun.rollout.spec import parse_rollout

if TYPE_CHECKING:
    from kunlun.rollout.controller import RolloutController


def rollout_router(rollouts: RolloutController) -> APIRouter:
    router = APIRouter()

    @router.post("/rollouts")
    async def create(body: dict[str, Any] = Body(...)) -> dict[str, Any]:
        spec = parse_rollout(body)
        record = await asyncio.to_thread(rollouts.create, spec)
        return rollouts.status(record)

    @router.get("/rollouts")
    def list_rollouts() -> list[dict[str, Any]]:
        return [rollouts.status(r) for r in rollouts.records()]

    @router.get("/rollouts/{rollout_id}")
    def status(rollout_id: str) -> dict[str, Any]:
        return rollouts.status(rollouts.get(rollout_id))

    @router.post("/rollouts/{rollout_id}/promote")
    async def promote(rollout_id: str) -> dict[str, Any]:
        record = await asyncio.to_thread(rollouts.request, rollout_id, "promote")
        return rollouts.status(record)

    @router.post("/rollouts/{rollout_id}/abort")
    async def abort(rollout_id: str) -> dict[str, Any]:
        record = await asyncio.to_thread(rollouts.request, rollout_id, "abort")
        return rollouts.status(record)

    return router
