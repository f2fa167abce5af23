"""The model a request means and what a ready replica of it answers, for the gateway's own
routes besides the relayed inference calls: SGLang's (``/get_model_info``...), vLLM's
(``/load``, ``/tokenizer_info``...) and model-less ``/tokenize``.

A request without ``model`` means ``default_model`` of ``scheduler_config.yaml`` when set,
else the only generation model served (an embedding model beside it does not count), else
it is a 400 naming ``model`` (:func:`only_model`). A call answered by one replica goes to the
least busy ready one (:func:`replica_answer`) and is passed on as it is (:func:`relayed`);
these routes answer their own refusals in the OpenAI error shape (:func:`error_response`).
"""

from __future__ import annotations

from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from kunlun.http_client import UpstreamError
from kunlun.protocol.openai_errors import (
    ModelNotFound,
    ServiceUnavailable,
    WorkerDied,
    error_status_and_body,
    param_error,
)
from kunlun.serving.replica import Replica, ReplicaSet


def only_model(given: Any, replicas: ReplicaSet, default: str | None = None) -> str:
    """The model a request means: ``given``, else ``default`` (``default_model`` of
    ``scheduler_config.yaml``), else the only generation model served (else a 400 naming
    ``model``)."""
    if isinstance(given, str):
        return given
    if given is not None:
        raise param_error("model", "model must be a string")
    if default is not None:
        return default
    served = replicas.models(task="generate")
    if len(served) == 1:
        return served[0]
    raise param_error("model", f"the platform serves {len(served)} generation models "
                      f"({', '.join(served) or 'none'}): name one in 'model', or set "
                      "default_model in scheduler_config.yaml")  # fmt: skip


def default_model(state: Any) -> str | None:
    """``default_model`` of the gateway's ``scheduler_config.yaml`` in force."""
    name: str | None = state.scheduler.config.default_model
    return name


async def ask_replica(state: Any, replica: Replica, path: str) -> tuple[int, bytes]:
    """``POST path`` (no body) to ``replica``: its status and body."""
    if state.upstream is None:
        raise ServiceUnavailable("the gateway is not started", retry_after_s=state.retry_after_s)
    try:
        answer = await state.upstream.post(replica.base_url, path, replica.key_headers, b"")
        try:
            return answer.status_code, b"".join([p async for p in answer.iter_raw()])
        finally:
            await answer.close()
    except UpstreamError as exc:
        raise WorkerDied(f"replica {replica.replica_id} on {replica.device} did not answer "
                         f"{path}: {exc}", hint="retry the request") from None  # fmt: skip


async def replica_answer(
    request: Request, replicas: ReplicaSet, state: Any, path: str
) -> tuple[int, bytes, list[Replica]]:
    """``path`` asked of the least busy ready replica of the model the query means
    (:func:`ready_replicas`): its status and body, and the model's ready replicas."""
    _, chosen = ready_replicas(request, replicas, state)
    status, body = await ask_replica(state, min(chosen, key=lambda r: r.in_flight), path)
    return status, body, chosen


def relayed(answer: tuple[int, bytes, list[Replica]]) -> Response:
    """A replica's answer passed on as it is."""
    return Response(answer[1], status_code=answer[0], media_type="application/json")


def ready_replicas(request: Request, replicas: ReplicaSet, state: Any) -> tuple[str, list[Replica]]:
    """The model a query means (``?model=``, or :func:`only_model`) and its ready replicas
    (a 503 while it has none, a 404 for a model not served)."""
    model = only_model(request.query_params.get("model"), replicas, default_model(state))
    chosen = replicas.ready(model)
    if not chosen:
        if model in replicas.models():
            raise ServiceUnavailable(f"model {model!r} has no ready replica yet",
                                     retry_after_s=state.retry_after_s)  # fmt: skip
        raise ModelNotFound(f"model {model!r} is not served here; served: "
                            f"{', '.join(replicas.models()) or 'none'}")  # fmt: skip
    return model, chosen


def error_response(exc: BaseException) -> Response:
    """``exc`` in the OpenAI error shape (its catalog entry: status, type, code)."""
    status, body, headers = error_status_and_body(exc)
    return JSONResponse(body, status_code=status, headers=headers)
