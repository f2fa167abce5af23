"""Load generators for ``kunlun-cli bench`` and the platform figures read alongside.

Every request is a streamed ``POST /v1/completions`` whose prompt is a list of token ids
(exactly ``input_len`` of them, drawn at random per request from ids 1000..1999 so the
prefix cache does not shortcut them) with ``max_tokens = output_len``, ``ignore_eos`` and
``temperature`` 0, so every request does the same work. ``stream_options.include_usage``
asks for the token counts. They go over kept-alive connections of the gateway's own HTTP
client (:class:`~kunlun.http_client.UpstreamPool`), and of each event only the text's presence
is looked at, the usage and errors parsed: on a machine the benchmark shares with the server,
its CPU per streamed token is taken from what it measures. Two ways to send them:

- :func:`closed_loop`: ``concurrency`` clients, each sending its next request as soon as
  the previous one ends;
- :func:`poisson`: requests sent at exponentially distributed intervals with mean
  ``1 / rate`` (an open loop: arrivals do not wait for answers).

:class:`PlatformProbe` reads the daemon's ``/metrics`` (when the endpoint is a Kunlun
daemon) over one connection for the whole benchmark: the resident memory of its process
tree, sampled once a second while a run goes on (one gauge picked out of the page, not the
whole page parsed), and the start-up times of the model's replicas.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import ssl
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx

from kunlun.bench.stats import RequestRecord
from kunlun.errors import ConfigError, Location
from kunlun.http_client import UpstreamError, UpstreamPool, UpstreamResponse
from kunlun.telemetry.view import PLATFORM_MEMORY as MEMORY_GAUGE
from kunlun.telemetry.view import parse

TOKEN_ID_RANGE = (1000, 2000)
"""Prompt token ids are drawn from here: inside the vocabulary of any current LLM and of the
tiny test models (2,048 ids), above the low ids where byte and special tokens often sit."""
MEMORY_SAMPLE_S = 1.0
"""How often the daemon's memory is read during a run: each read has the daemon render its
``/metrics`` page, so a low rate keeps the benchmark from loading what it measures."""


@dataclass(frozen=True)
class Target:
    """Where and what to benchmark."""

    base_url: str
    """The server's root, e.g. ``http://127.0.0.1:8470`` (a trailing ``/v1`` is dropped)."""
    model: str
    api_key: str | None = None
    timeout_s: float = 600.0

    @classmethod
    def parse(cls, endpoint: str, model: str, api_key: str | None, timeout_s: float) -> Target:
        url = endpoint.strip().rstrip("/")
        if not url.startswith(("http://", "https://")):
            raise ConfigError(
                f"endpoint {endpoint!r} is not an http(s) URL", location=Location("--endpoint")
            )
        return cls(url.removesuffix("/v1"), model, api_key, timeout_s)

    def client(self, max_connections: int | None = None) -> httpx.AsyncClient:
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=None)
        return httpx.AsyncClient(
            base_url=self.base_url, headers=headers, limits=limits, timeout=self.timeout_s
        )

    @contextlib.asynccontextmanager
    async def pool(self) -> AsyncIterator[UpstreamPool]:
        """Kept-alive connections for the load (the gateway's own client: its CPU per
        streamed token is a fraction of a general-purpose one's, and on a machine the
        benchmark shares with the server that CPU is taken from what it measures)."""
        tls = ssl.create_default_context() if self.base_url.startswith("https://") else None
        pool = UpstreamPool(connect_timeout_s=self.timeout_s, max_idle_per_host=1024,
                            first_byte_timeout_s=self.timeout_s, read_timeout_s=self.timeout_s,
                            ssl_context=tls)  # fmt: skip
        try:
            yield pool
        finally:
            await pool.close()


def make_prompts(count: int, input_len: int, seed: int) -> list[list[int]]:
    """``count`` prompts of ``input_len`` random token ids each (reproducible by ``seed``)."""
    rng = random.Random(seed)
    return [[rng.randrange(*TOKEN_ID_RANGE) for _ in range(input_len)] for _ in range(count)]


async def send(
    pool: UpstreamPool, target: Target, prompt: list[int], output_len: int
) -> RequestRecord:
    """Stream one completion and time it (see the module docstring for the request)."""
    body = {
        "model": target.model,
        "prompt": prompt,
        "max_tokens": output_len,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    headers = [(b"content-type", b"application/json")]
    if target.api_key:
        headers.append((b"authorization", f"Bearer {target.api_key}".encode()))
    record = RequestRecord(start=time.perf_counter())
    response: UpstreamResponse | None = None
    try:
        response = await pool.post(target.base_url, "/v1/completions", headers,
                                   json.dumps(body).encode())  # fmt: skip
        if response.status_code != 200:
            text = b"".join([piece async for piece in response.iter_raw()])
            record.error = f"HTTP {response.status_code}: {text.decode(errors='replace')[:200]}"
        else:
            async for event, arrival in _events(response):
                _take(record, event, arrival)
    except (UpstreamError, ValueError) as exc:
        record.error = f"{type(exc).__name__}: {exc}"
    finally:
        if response is not None:
            await response.close()  # whole: the connection goes back to the pool
    record.end = time.perf_counter()
    return record


async def _events(response: UpstreamResponse) -> AsyncIterator[tuple[bytes, float]]:
    """The JSON texts of an SSE stream's events up to ``[DONE]``, each with the time of the
    network read that completed it (events that arrived in one read share that time); the
    body is read to its end, so that its connection can be used again."""
    pending, done = b"", False
    async for data in response.iter_raw():
        arrival = time.perf_counter()
        if done:
            continue
        lines = (pending + data).split(b"\n")
        pending = lines.pop()
        for line in lines:
            if not line.startswith(b"data:"):
                continue
            text = line[5:].strip()
            if text == b"[DONE]":
                done = True
                break
            yield text, arrival


_EMPTY_TEXT = (b'"text":""', b'"text": ""')
"""How a chunk whose choice added no text reads, compact or spaced (text inside a JSON string
is escaped, so neither can occur inside one)."""
_PARSED = (b'"error"', b'"usage":{', b'"usage": {')
"""What only a parsed event tells: an error, the token counts."""


def _take(record: RequestRecord, event: bytes, now: float) -> None:
    """Note one event: a chunk with text (its arrival), the usage, an error. Only an event
    that may carry the usage or an error is parsed: the benchmark's own CPU per token is CPU
    taken from the server it measures when both share a machine."""
    if any(marker in event for marker in _PARSED) or b'"text"' not in event:
        _take_parsed(record, json.loads(event), now)
    elif not any(empty in event for empty in _EMPTY_TEXT):
        record.chunk_times.append(now)


def _take_parsed(record: RequestRecord, payload: dict[str, Any], now: float) -> None:
    if "error" in payload:
        record.error = str(payload["error"].get("message", payload["error"]))
        return
    if any(choice.get("text") for choice in payload.get("choices") or []):
        record.chunk_times.append(now)
    usage = payload.get("usage")
    if usage:
        record.num_output_tokens = usage.get("completion_tokens")
        record.num_prompt_tokens = usage.get("prompt_tokens")


async def closed_loop(
    target: Target, prompts: list[list[int]], concurrency: int, output_len: int
) -> list[RequestRecord]:
    """Send ``prompts`` from ``concurrency`` clients, each waiting for its previous answer."""
    pending = iter(prompts)
    records: list[RequestRecord] = []
    async with target.pool() as pool:

        async def one_client() -> None:
            for prompt in pending:
                records.append(await send(pool, target, prompt, output_len))

        await asyncio.gather(*(one_client() for _ in range(concurrency)))
    return records


async def poisson(
    target: Target, prompts: list[list[int]], rate: float, output_len: int, seed: int
) -> list[RequestRecord]:
    """Send ``prompts`` at Poisson arrivals of ``rate`` per second, not waiting for answers."""
    rng = random.Random(seed)
    async with target.pool() as pool:
        tasks = []
        for prompt in prompts:
            tasks.append(asyncio.ensure_future(send(pool, target, prompt, output_len)))
            await asyncio.sleep(rng.expovariate(rate))
        return list(await asyncio.gather(*tasks))


class PlatformProbe:
    """Reads the daemon's ``/metrics`` over one client (:meth:`close` it); every figure is
    None when the endpoint has none."""

    def __init__(self, target: Target) -> None:
        self.target = target
        self.available = False
        self._client: httpx.AsyncClient | None = None

    async def close(self) -> None:
        if self._client is not None:
            await self._client.aclose()

    async def page(self) -> str | None:
        """The ``/metrics`` text, or None (no Kunlun ``/metrics`` there)."""
        if self._client is None:
            self._client = self.target.client(max_connections=1)
        try:
            response = await self._client.get("/metrics", timeout=10)
        except httpx.HTTPError:
            return None
        if response.status_code != 200 or "kunlun_" not in response.text:
            return None
        self.available = True
        return response.text

    async def read(self) -> dict[str, Any] | None:
        """The parsed snapshot as a dict, or None (no Kunlun ``/metrics`` there)."""
        text = await self.page()
        return None if text is None else parse(text).to_dict()

    async def memory(self) -> float | None:
        """Resident memory of the daemon's process tree, in bytes (its one gauge's line)."""
        text = await self.page()
        if text is None:
            return None
        at = text.find("\n" + MEMORY_GAUGE + " ")
        if at < 0:
            return None
        end = text.find("\n", at + 1)
        return float(text[at + len(MEMORY_GAUGE) + 2 : end if end >= 0 else None])

    async def startup(self) -> list[dict[str, Any]]:
        """Start-up phases (seconds) of every replica serving the target's model."""
        snapshot = await self.read()
        if snapshot is None:
            return []
        keys = ("compile", "load", "warmup_ttft", "total")
        return [
            {
                "replica": r["replica"],
                "device": r.get("device"),
                **{f"{k}_s": r.get(f"startup_{k}_s") for k in keys},
            }
            for r in snapshot["replicas"]
            if r.get("model") == self.target.model
        ]

    @contextlib.asynccontextmanager
    async def peak_memory(self) -> AsyncIterator[dict[str, float | None]]:
        """Sample memory while the body runs; the yielded dict gets ``peak_bytes``."""
        result: dict[str, float | None] = {"peak_bytes": None}
        if not self.available:
            yield result
            return

        async def sample() -> None:
            while True:
                value = await self.memory()
                if value is not None:
                    result["peak_bytes"] = max(value, result["peak_bytes"] or 0.0)
                await asyncio.sleep(MEMORY_SAMPLE_S)

        sampler = asyncio.ensure_future(sample())
        try:
            yield result
        finally:
            sampler.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sampler
            last = await self.memory()  # once more after the run, in case it was short
            if last is not None:
                result["peak_bytes"] = max(last, result["peak_bytes"] or 0.0)
