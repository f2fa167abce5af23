"""``POST /api/v1/workloads/{id}/scale`` with ``{"replicas": N}``: more or fewer replicas of a
running workload (:mod:`kunlun.workload.scale`); ``kunlun-cli workload scale JOB N`` and the
dashboard's Workloads page call it. An admin route, like every route under ``/api/v1``."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Request
from pydantic import Field

from kunlun.protocol.fields import StrictModel
from kunlun.protocol.request_body import parse_request
from kunlun.workload.scale import scale

if TYPE_CHECKING:
    from kunlun.daemon.app import Platform


class ScaleBody(StrictModel):
    replicas: int = Field(ge=1, le=16, description="Replicas to run (1 to 16).")


def scale_router(platform: Platform) -> APIRouter:
    """The route, to mount under ``/api/v1``."""
    router = APIRouter()

    @router.post("/workloads/{workload_id}/scale")
    async def scale_workload(workload_id: str, request: Request) -> dict[str, Any]:
        body = parse_request(ScaleBody, await request.body())
        record = await asyncio.to_thread(scale, platform.manager, workload_id, body.replicas)
        return {"workload_id": record.workload_id, "state": record.state,
                "replicas": record.spec["replicas"]}  # fmt: skip

    return router
