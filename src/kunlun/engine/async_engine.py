"""Serve the engine to asyncio code: the step loop runs in a background thread.

Every torch computation of an engine served here runs on that one thread: given a factory
instead of a built engine, the thread builds it (loading, casting, quantizing weights) before
its first step, and :meth:`AsyncLLMEngine.ready` waits for that. This matters on CPUs: torch's
OpenMP runtime keeps one worker pool per thread that has run a parallel operation; a second
pool (weights loaded on the main thread, steps on this one) makes more pool threads than
cores, and the runtime then parks its workers after every operation instead of spinning.
Measured on the 2-vCPU benchmark machine, a decode-sized matrix product took about 2.5x as
long on the second thread (docs/benchmarks.md, "One thread runs the model").

Streaming: each completion's first delta goes out at once and alone, even to a consumer that
reads late (its first token is an event of its own); after it, deltas that are already
waiting when the consumer reads are merged into one (a consumer that fell behind catches up in
one event instead of one per token: no token waits for this), and with ``stream_interval`` N > 1
a completion's tokens are held until N are there (or it finishes), for fewer, larger events.

A stream may also be written by the engine thread itself (:meth:`AsyncLLMEngine.attach_sink`):
its deltas then go to the stream's :data:`Sink` right after the step, not through the event
loop, until the sink declines one; that delta and every later one go the usual way, so the
stream keeps its order. A server uses it to write a plain stream's events to its client's
connection without waking its event loop per token (``docs/benchmarks.md``, "The engine
thread writing each event").

The event loop never waits on the model. :meth:`AsyncLLMEngine.add_request` validates the
request in the caller (bad input raises there, at once), hands it to the engine thread and
returns an async iterator of :class:`RequestOutputDelta`. The engine thread takes new
requests and aborts between steps, runs a step, and passes each delta back with
``loop.call_soon_threadsafe`` into the request's own :class:`asyncio.Queue`. A consumer that
stops listening (its task cancelled, the client gone) aborts its request; :meth:`abort`
returns once the request's blocks are free. A request that fails raises its
:class:`EngineError` from the iterator.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import torch

from kunlun.engine.launch import Pooling
from kunlun.engine.llm_engine import LLMEngine
from kunlun.engine.outputs import EngineStats, RequestOutputDelta
from kunlun.engine.pooling import Pooler, PoolingJob
from kunlun.engine.request import Prompt, Request
from kunlun.engine.sampling_params import SamplingParams
from kunlun.errors import EngineError, RequestError

logger = logging.getLogger(__name__)


Sink = Callable[[RequestOutputDelta], bool]
"""Called on the engine thread with a delta of its stream: True when it took the delta (wrote
it), False to have it and every later delta of the stream go through the event loop. It
must not block, and it is called with the engine's lock held."""


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[RequestOutputDelta | BaseException]
    sink: Sink | None = None
    handed: int = 0
    """Deltas handed to the event loop (counted by the engine thread, under the lock)."""
    taken: int = 0
    """Deltas the consumer has been given (counted by the event loop)."""


class AsyncLLMEngine:
    """An :class:`LLMEngine` driven by a background thread, for asyncio servers."""

    def __init__(
        self,
        engine: LLMEngine | Callable[[], LLMEngine],
        stream_interval: int = 1,
        step_delay_s: float = 0.0,
    ) -> None:
        """``engine`` is a built engine, or a factory the engine thread calls to build it
        (see the module: a server should pass a factory); ``stream_interval``: tokens a
        completion's delta holds before it is handed out, after the first (see the module);
        ``step_delay_s``: an injected fault (a workload's ``faults.step_delay_ms``), the
        engine thread's wait after each step and its deltas."""
        if stream_interval < 1:
            raise ValueError(f"stream_interval must be >= 1, got {stream_interval}")
        if step_delay_s < 0:
            raise ValueError(f"step_delay_s must be >= 0, got {step_delay_s}")
        self.stream_interval = stream_interval
        self.step_delay_s = step_delay_s
        self._built: concurrent.futures.Future[LLMEngine] = concurrent.futures.Future()
        self._factory: Callable[[], LLMEngine] | None = None
        if isinstance(engine, LLMEngine):
            self._built.set_result(engine)
        else:
            self._factory = engine
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._new: list[Request] = []
        self._aborts: list[tuple[str, concurrent.futures.Future[None] | None]] = []
        self._flushes: list[concurrent.futures.Future[int]] = []
        self._streams: dict[str, _Stream] = {}
        self._new_pooling: list[PoolingJob] = []
        self._pooler: Pooler | None = None  # built with the engine, on its thread
        self._stats: EngineStats | None = None if self._factory else self.engine.stats()
        self._stopping = False
        self._thread: threading.Thread | None = None

    # ---- lifecycle ----
    def start(self) -> None:
        """Start the engine thread (done on the first request if not called)."""
        with self._lock:
            if self._thread is None:
                self._stopping = False
                self._thread = threading.Thread(target=self._run, name="kunlun-engine", daemon=True)
                self._thread.start()

    def shutdown(self, timeout: float | None = 10.0) -> None:
        """Stop the engine thread after its current step; unfinished streams get an error."""
        with self._lock:
            thread, self._thread = self._thread, None
            self._stopping = True
        self._wake.set()
        if thread is not None:
            thread.join(timeout)
        self._fail_all(EngineError("the engine was shut down"))
        if self._built.done() and self._built.exception() is None:
            self.engine.close()

    @property
    def engine(self) -> LLMEngine:
        """The engine (a :class:`RuntimeError` while the engine thread is still building it,
        or when building failed)."""
        if not self._built.done():
            raise RuntimeError("the engine is still being built: await ready() first")
        if (failure := self._built.exception()) is not None:
            raise RuntimeError(f"the engine could not be built: {failure}")
        return self._built.result()

    async def ready(self) -> LLMEngine:
        """Start the engine thread and wait until the engine is built; raises what building
        raised (the thread then ends)."""
        self.start()
        return await asyncio.wrap_future(self._built)

    async def __aenter__(self) -> AsyncLLMEngine:
        await self.ready()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await asyncio.to_thread(self.shutdown)

    # ---- requests ----
    def add_request(
        self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None
    ) -> AsyncIterator[RequestOutputDelta]:
        """Queue a request; iterate the result for its deltas (the last has ``final`` set).

        Must be called from a running event loop. Raises :class:`RequestError` at once for
        bad input or a request id already in use.
        """
        return self.add(self.engine.make_request(prompt, params, request_id))  # once ready()

    def add(self, request: Request) -> AsyncIterator[RequestOutputDelta]:
        """Queue a request built by :meth:`LLMEngine.make_request` (which may run in another
        thread: a guided request's grammar is compiled there); as :meth:`add_request`."""
        loop = asyncio.get_running_loop()
        stream = _Stream(loop, asyncio.Queue())
        with self._lock:
            if request.request_id in self._streams:
                raise RequestError(f"request_id {request.request_id!r} is already in use")
            self._streams[request.request_id] = stream
            self._new.append(request)
        self.start()
        self._wake.set()
        return self._iterate(request.request_id, stream)

    def attach_sink(self, request_id: str, sink: Sink) -> bool:
        """From the event loop that consumes ``request_id``'s stream: the engine thread hands
        the stream's next deltas to ``sink`` (:data:`Sink`). Only where every delta handed to
        the event loop so far has been taken (a sink would otherwise write ahead of them) and
        deltas are not held for ``stream_interval``: False, nothing attached, otherwise."""
        if self.stream_interval > 1:
            return False
        with self._lock:
            stream = self._streams.get(request_id)
            if stream is None or stream.handed != stream.taken:
                return False
            stream.sink = sink
            return True

    async def embed(self, inputs: list[list[int]], method: Pooling) -> list[torch.Tensor]:
        """The unit-norm float32 vectors of ``inputs`` (token ids, checked with
        :func:`kunlun.engine.pooling.check_input`), run by the engine thread's pooling path;
        raises :class:`EngineError` when the model fails on them."""
        job = PoolingJob(inputs, method)
        with self._lock:
            self._new_pooling.append(job)
        self.start()
        self._wake.set()
        return await asyncio.wrap_future(job.done)

    async def abort(self, request_id: str) -> None:
        """Abort a request; returns once its blocks are free (a no-op for unknown ids)."""
        done: concurrent.futures.Future[None] = concurrent.futures.Future()
        with self._lock:
            self._aborts.append((request_id, done))
        self.start()
        self._wake.set()
        await asyncio.wrap_future(done)

    async def flush_prefix_cache(self) -> int:
        """Forget the prefix cache between two steps, unless requests are unfinished then;
        returns how many were (0: flushed). See :meth:`LLMEngine.flush_prefix_cache`."""
        done: concurrent.futures.Future[int] = concurrent.futures.Future()
        with self._lock:
            self._flushes.append(done)
        self.start()
        self._wake.set()
        return await asyncio.wrap_future(done)

    def fail_all(self, error: BaseException) -> None:
        """End every open stream with ``error`` (safe from any thread): the engine cannot
        go on, e.g. a rank of its tensor-parallel group died."""
        self._fail_all(error)

    def stats(self) -> EngineStats:
        """The engine's statistics as of its last step (safe from any thread; once built)."""
        if self._stats is None:
            raise RuntimeError("the engine is still being built: await ready() first")
        return self._stats

    # ---- consumer side ----
    async def _iterate(self, request_id: str, stream: _Stream) -> AsyncIterator[RequestOutputDelta]:
        done = False
        held: dict[int, RequestOutputDelta] = {}  # per completion index: not handed out yet
        merged: dict[int, int] = {}  # per completion index: the deltas held in it
        started: set[int] = set()
        try:
            while not done:
                items = [await stream.queue.get()]
                first = items[0]
                if isinstance(first, BaseException) or first.index in started:
                    while not stream.queue.empty():  # already here: merged, nothing waits
                        items.append(stream.queue.get_nowait())
                failure: BaseException | None = None
                for item in items:
                    if isinstance(item, BaseException):
                        failure = item
                        break
                    if item.final is not None and item.error is not None:
                        failure = item.error  # what came before it is still handed out
                        break
                    before = held.get(item.index)
                    held[item.index] = item if before is None else _merged(before, item)
                    merged[item.index] = merged.get(item.index, 0) + 1
                done = failure is not None or any(d.final is not None for d in held.values())
                # the delta that finishes the request goes last
                for index, delta in sorted(held.items(), key=lambda kv: kv[1].final is not None):
                    due = (done or index not in started or delta.finish_reason is not None
                           or len(delta.token_ids) >= self.stream_interval)  # fmt: skip
                    if due:
                        del held[index]
                        stream.taken += merged.pop(index)
                        started.add(index)
                        yield delta
                if failure is not None:
                    raise failure
        finally:
            with self._lock:
                self._streams.pop(request_id, None)
                if not done:  # the consumer left early: stop generating for nobody
                    self._aborts.append((request_id, None))
            if not done:
                self._wake.set()

    # ---- engine thread ----
    def _run(self) -> None:
        if not self._build():
            return
        while True:
            self._wake.clear()
            with self._lock:
                if self._stopping:
                    return
                new, self._new = self._new, []
                aborts, self._aborts = self._aborts, []
                pooling, self._new_pooling = self._new_pooling, []
                flushes, self._flushes = self._flushes, []
            for done in flushes:  # before new requests: they would hold it off
                busy = self.engine.flush_prefix_cache()
                self._stats = self.engine.stats()  # before the caller reads it
                if not done.done():
                    done.set_result(busy)
            try:
                self._pool(pooling)
                self._step(new, aborts)
            except Exception as exc:  # a bug outside the model step: fail all, keep serving
                logger.exception("engine loop failed")
                self._recover(EngineError(f"engine loop failed: {type(exc).__name__}: {exc}"))
                _resolve(aborts)
            if not self.engine.has_unfinished() and not self._pooling_pending():
                self._wake.wait()

    def _build(self) -> bool:
        """Build the engine from the factory on this thread, once; False when that failed
        (the error goes to :meth:`ready`)."""
        if self._built.done():
            return self._built.exception() is None
        assert self._factory is not None
        try:
            engine = self._factory()
        except BaseException as exc:  # noqa: BLE001 - handed to ready(), which raises it
            self._built.set_exception(exc)
            with self._lock:
                self._thread = None
            return False
        self._stats = engine.stats()
        self._built.set_result(engine)
        return True

    def _step(
        self, new: list[Request], aborts: list[tuple[str, concurrent.futures.Future[None] | None]]
    ) -> None:
        deltas: list[RequestOutputDelta] = []
        for request in new:
            self.engine.add(request)
        for request_id, _ in aborts:
            deltas += self.engine.abort_request(request_id)
        self._stats = self.engine.stats()
        _resolve(aborts)
        stepped = self.engine.has_unfinished()
        if stepped:
            deltas += self.engine.step()
            self._stats = self.engine.stats()
        self._deliver(deltas)
        if stepped and self.step_delay_s:
            time.sleep(self.step_delay_s)

    def _pool(self, jobs: list[PoolingJob]) -> None:
        """One pooling step over the waiting embeddings inputs (:mod:`kunlun.engine.pooling`)."""
        if self._pooler is None:
            self._pooler = Pooler(self.engine)
        self._pooler.add(jobs)
        if self._pooler.pending:
            self._pooler.step()
            self._stats = self.engine.stats()

    def _pooling_pending(self) -> bool:
        return self._pooler is not None and self._pooler.pending

    def _deliver(self, items: list[RequestOutputDelta]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[_Stream, RequestOutputDelta]]] = {}
        with self._lock:
            for item in items:
                stream = self._streams.get(item.request_id)
                if stream is None:
                    continue
                if stream.sink is not None:
                    if _sunk(stream.sink, item):
                        continue
                    stream.sink = None  # this delta and the later ones: the event loop's
                stream.handed += 1
                by_loop.setdefault(stream.loop, []).append((stream, item))
        for loop, pairs in by_loop.items():
            with contextlib.suppress(RuntimeError):  # a closed loop: nobody is listening
                loop.call_soon_threadsafe(_put_all, pairs)

    def _recover(self, error: EngineError) -> None:
        self.engine.abort_all()
        self._stats = self.engine.stats()
        self._fail_all(error)

    def _fail_all(self, error: BaseException) -> None:
        with self._lock:
            streams, self._streams = self._streams, {}
            jobs, self._new_pooling = self._new_pooling, []
        for job in jobs:
            job.done.set_exception(error)
        if self._pooler is not None:
            self._pooler.fail_all(error)
        for stream in streams.values():
            with contextlib.suppress(RuntimeError):
                stream.loop.call_soon_threadsafe(stream.queue.put_nowait, error)


def _sunk(sink: Sink, item: RequestOutputDelta) -> bool:
    """Whether ``sink`` took ``item``; a sink that fails declines it (said once in the log:
    the event loop writes the rest of that stream)."""
    try:
        return sink(item)
    except Exception:
        logger.exception("a stream's writer on the engine thread failed; the event loop goes on")
        return False


def _resolve(aborts: list[tuple[str, concurrent.futures.Future[None] | None]]) -> None:
    for _, done in aborts:
        if done is not None and not done.done():
            done.set_result(None)


def _merged(first: RequestOutputDelta, then: RequestOutputDelta) -> RequestOutputDelta:
    """One delta holding ``first`` then ``then`` (same request, same completion)."""
    logprobs = None
    if first.logprobs is not None or then.logprobs is not None:
        logprobs = (first.logprobs or []) + (then.logprobs or [])
    return RequestOutputDelta(
        request_id=first.request_id,
        index=first.index,
        text=first.text + then.text,
        token_ids=first.token_ids + then.token_ids,
        logprobs=logprobs,
        finish_reason=then.finish_reason,
        num_prompt_tokens=first.num_prompt_tokens,
        num_cached_tokens=first.num_cached_tokens,
        error=then.error,
        final=then.final,
    )


def _put_all(pairs: list[tuple[_Stream, RequestOutputDelta]]) -> None:
    for stream, item in pairs:
        stream.queue.put_nowait(item)
