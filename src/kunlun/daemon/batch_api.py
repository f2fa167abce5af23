"""The OpenAI Batch API routes, and how the daemon's batch jobs reach its own gateway.

``POST /v1/files`` (multipart: ``file``, ``purpose=batch``, optional
``expires_after[anchor]=created_at`` and ``expires_after[seconds]``), ``GET /v1/files`` (``purpose``,
``limit``, ``after``, ``order``), ``GET /v1/files/{id}``, ``GET /v1/files/{id}/content``,
``DELETE /v1/files/{id}`` (refused with a 409 while an unfinished batch reads the file);
``POST /v1/batches`` (optional ``output_expires_after``), ``GET /v1/batches`` (``limit``, ``after``), ``GET /v1/batches/{id}``,
``POST /v1/batches/{id}/cancel``. Bodies and errors are OpenAI's shapes; the routes sit
behind the same API-key middleware as every other route.

Batch requests go through the gateway *in-process* (:func:`in_process_sender`): an ASGI
call into an app holding only the gateway's routes, sharing its state. So they take the same
admission (queue limits, draining), replica choice and relay as any client's request, and
appear in the request log, without depending on the address the daemon is bound to or
needing an API key of their own, and without a loopback HTTP hop.
"""

from __future__ import annotations

import asyncio
from typing import Any
from urllib.parse import quote

import httpx
from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import FileResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.datastructures import UploadFile
from starlette.types import ASGIApp

from kunlun import headers as http_headers
from kunlun.batch.files import FileStore, expiry_seconds, file_object
from kunlun.batch.jobs import BatchJobs
from kunlun.batch.objects import batch_object
from kunlun.batch.sending import Reply, Send
from kunlun.protocol.openai_errors import param_error
from kunlun.protocol.request_body import parse_request
from kunlun.serving.gateway import mount_gateway
from kunlun.serving.gateway_state import GatewayState
from kunlun.serving.replica import ReplicaSet


class CreateBatch(BaseModel):
    """``POST /v1/batches``; a field it does not know is a 400 naming it (never dropped)."""

    model_config = ConfigDict(extra="forbid")

    input_file_id: str
    endpoint: str
    completion_window: str
    metadata: dict[str, str] | None = Field(None, max_length=16)
    output_expires_after: dict[str, Any] | None = None
    """``{"anchor": "created_at", "seconds": N}`` for the files the batch writes."""


def batch_router(files: FileStore, jobs: BatchJobs) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/files")
    async def upload(request: Request) -> dict[str, Any]:
        async with request.form(max_files=1, max_fields=8) as form:
            upload = form.get("file")
            purpose = form.get("purpose")
            if not isinstance(upload, UploadFile):
                raise param_error("file", "'file' (a multipart file field) is required")
            if not isinstance(purpose, str):
                raise param_error("purpose", "'purpose' (a form field, 'batch') is required")
            anchor, seconds = form.get("expires_after[anchor]"), form.get("expires_after[seconds]")
            ttl = (
                None
                if anchor is None and seconds is None
                else expiry_seconds(anchor, seconds, "expires_after")
            )
            name = upload.filename or "upload.jsonl"
            record = await asyncio.to_thread(files.upload, upload.file, name, purpose, ttl)
        return file_object(record)

    @router.get("/v1/files")
    async def list_files(
        purpose: str | None = None,
        limit: str | None = None,
        after: str | None = None,
        order: str = "desc",
    ) -> dict[str, Any]:
        count = limit_param(limit, 10_000, 10_000)
        if order not in ("asc", "desc"):
            raise param_error("order", f"'order' must be 'asc' or 'desc', got {order!r}")
        records = files.page(count + 1, after, purpose, newest_first=order == "desc")
        return page_object([file_object(r) for r in records[:count]], len(records) > count)

    @router.get("/v1/files/{file_id}")
    async def retrieve_file(file_id: str) -> dict[str, Any]:
        return file_object(files.get(file_id))

    @router.delete("/v1/files/{file_id}")
    async def delete_file(file_id: str) -> dict[str, Any]:
        files.delete(file_id, jobs.readers(file_id))  # on the loop: no batch can start meanwhile
        return {"id": file_id, "object": "file", "deleted": True}

    @router.get("/v1/files/{file_id}/content")
    async def file_content(file_id: str) -> FileResponse:
        record = files.get(file_id)
        return FileResponse(
            files.path(file_id), media_type="application/octet-stream", filename=record.filename
        )

    @router.post("/v1/batches")
    async def create(request: Request) -> dict[str, Any]:
        body = parse_request(CreateBatch, await request.body())
        policy = body.output_expires_after
        ttl = (
            None
            if policy is None
            else expiry_seconds(policy.get("anchor"), policy.get("seconds"), "output_expires_after")
        )
        record = jobs.create(
            body.input_file_id, body.endpoint, body.completion_window, body.metadata, ttl
        )
        return batch_object(record)

    @router.get("/v1/batches")
    async def list_batches(limit: str | None = None, after: str | None = None) -> dict[str, Any]:
        count = limit_param(limit, 20, 100)
        records = jobs.page(count + 1, after)
        return page_object([batch_object(r) for r in records[:count]], len(records) > count)

    @router.get("/v1/batches/{batch_id}")
    async def retrieve(batch_id: str) -> dict[str, Any]:
        return batch_object(jobs.get(batch_id))

    @router.post("/v1/batches/{batch_id}/cancel")
    async def cancel(batch_id: str) -> dict[str, Any]:
        return batch_object(jobs.cancel(batch_id))

    return router


def limit_param(raw: str | None, default: int, maximum: int) -> int:
    """A list route's ``limit``: 1 to ``maximum``, or an OpenAI-shaped 400 naming it."""
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if not 1 <= value <= maximum:
        raise param_error("limit", f"'limit' must be an integer from 1 to {maximum}, got {raw!r}")
    return value


def page_object(data: list[dict[str, Any]], has_more: bool) -> dict[str, Any]:
    """OpenAI's cursor page: the next page starts ``after`` ``last_id``."""
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": has_more,
    }


def gateway_app(replicas: ReplicaSet, state: GatewayState) -> FastAPI:
    """An app with only the gateway's ``/v1`` inference routes, sharing ``state``."""
    app = FastAPI(openapi_url=None, docs_url=None, redoc_url=None)
    mount_gateway(app, replicas, state)
    return app


_SAFE = "".join(chr(c) for c in range(0x21, 0x7F) if chr(c) != "%")
"""Printable ASCII but ``%``: what a request id keeps as is in its header."""


def in_process_sender(app: ASGIApp) -> Send:
    """A :data:`~kunlun.batch.sending.Send` that calls ``app`` directly (no socket)."""
    client = httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://kunlun-batch", timeout=None
    )

    async def send(path: str, body: bytes, request_id: str) -> Reply:
        # a header is ASCII: a custom_id in other scripts travels percent-encoded
        headers = {
            "content-type": "application/json",
            http_headers.REQUEST_ID: quote(request_id, _SAFE),
        }
        resp = await client.post(path, content=body, headers=headers)
        return Reply(resp.status_code, resp.headers, resp.content)

    return send
