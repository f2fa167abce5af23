"""What the node agent does differently for an external engine's server (llama.cpp, vLLM,
SGLang): how it is started and how it is seen to be ready. Everything else (watching,
restarting with backoff, probing, stopping) is the same as for Kunlun's own worker.

- :func:`start_argv`: the adapter's argv, its program found on PATH or beside this
  interpreter, behind the :mod:`kunlun.node.confine` prefix (dies with the daemon, rlimits,
  no_new_privs, the workers' niceness).
- :func:`ready_info`: a server writes no ready file; it is ready once its ``ready_path``
  answers 200 on its port.
"""

from __future__ import annotations

import asyncio
import time

import httpx

from kunlun.engine.launch import ReadyInfo
from kunlun.engines.adapter import EngineCommand, find_binary
from kunlun.node import confine
from kunlun.sandbox import WorkerSandbox
from kunlun.serving.worker import default_nice

ASK_AGAIN_S = 0.25
"""Pause after a loading server's refusal before the next readiness check."""


def start_argv(command: EngineCommand, sandbox: WorkerSandbox) -> list[str]:
    """The command line that starts ``command`` confined by ``sandbox``; a
    :class:`~kunlun.errors.ConfigError` when ``KUNLUN_WORKER_NICE`` is bad."""
    program, *rest = command.argv
    return confine.command(sandbox, default_nice(), [find_binary(program) or program, *rest])


async def ready_info(
    client: httpx.AsyncClient, command: EngineCommand, started_at: float
) -> ReadyInfo | None:
    """The ready record of a server that answers 200 on its ready path (as a worker's ready
    file would say it), or None after a short pause while it does not yet."""
    assert command.ready_path is not None
    url = f"http://{command.host}:{command.port}{command.ready_path}"
    try:
        answered = (await client.get(url, timeout=2.0)).status_code == 200
    except httpx.HTTPError:
        answered = False
    if not answered:
        await asyncio.sleep(ASK_AGAIN_S)
        return None
    return ReadyInfo(
        port=command.port,
        engine=command.engine,
        load_time_s=round(time.monotonic() - started_at, 3),
    )
