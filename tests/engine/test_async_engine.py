"""The asyncio front: streaming, abort, cancellation, errors, and a free event loop."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from kunlun.engine.async_engine import AsyncLLMEngine
from kunlun.engine.llm import LLM
from kunlun.engine.llm_engine import LLMEngine
from kunlun.engine.outputs import RequestOutputDelta
from kunlun.engine.sampling_params import SamplingParams
from kunlun.errors import PromptTooLong, RequestError

GREEDY = SamplingParams(temperature=0, max_tokens=16)


@pytest.fixture(scope="module")
def engine(demo_model_dir: Path) -> LLMEngine:
    return LLMEngine.from_model(demo_model_dir, max_model_len=512)


def run(coroutine):  # noqa: ANN001, ANN201
    return asyncio.run(coroutine)


async def collect(stream) -> list[RequestOutputDelta]:  # noqa: ANN001
    return [delta async for delta in stream]


async def wait_until(condition, timeout: float = 30.0) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


def test_deltas_add_up_to_the_final_output(engine: LLMEngine) -> None:
    async def main() -> list[RequestOutputDelta]:
        async with AsyncLLMEngine(engine) as server:
            return await collect(server.add_request("The capital of France is", GREEDY))

    deltas = run(main())
    final = deltas[-1].final
    assert final is not None and all(d.final is None for d in deltas[:-1])
    completion = final.outputs[0]
    # streamed: one delta per token, unless the consumer fell behind and deltas merged
    assert 1 < len(deltas) <= len(completion.token_ids)
    assert "".join(d.text for d in deltas) == completion.text
    assert [t for d in deltas for t in d.token_ids] == completion.token_ids
    assert deltas[-1].finish_reason == completion.finish_reason in ("stop", "length")
    assert deltas[0].num_prompt_tokens == len(final.prompt_token_ids)


def test_concurrent_streams_each_get_their_own_solo_output(engine: LLMEngine) -> None:
    prompts = ["Once upon a time", "def add(a, b):", "List three colors:"]
    short = SamplingParams(temperature=0, max_tokens=8)
    solo = [LLM(engine=engine).generate([p], short)[0].outputs[0].token_ids for p in prompts]

    async def main() -> list[list[RequestOutputDelta]]:
        async with AsyncLLMEngine(engine) as server:
            return await asyncio.gather(*(collect(server.add_request(p, short)) for p in prompts))

    for deltas, expected in zip(run(main()), solo, strict=True):
        assert deltas[-1].final is not None
        # near ties aside (see test_llm_engine), batched greedy equals solo greedy
        assert deltas[-1].final.outputs[0].token_ids[:6] == expected[:6]


def test_streamed_chinese_never_contains_a_replacement_character(engine: LLMEngine) -> None:
    async def main() -> list[RequestOutputDelta]:
        async with AsyncLLMEngine(engine) as server:
            params = SamplingParams(temperature=0, max_tokens=24)
            return await collect(server.add_request("长江是中国最长的河流，", params))

    deltas = run(main())
    text = "".join(d.text for d in deltas)
    assert any("\u4e00" <= ch <= "\u9fff" for ch in text)  # the model did write Chinese
    assert all("\ufffd" not in d.text for d in deltas)


def test_abort_frees_blocks_before_returning(engine: LLMEngine) -> None:
    async def main() -> tuple[list[RequestOutputDelta], int]:
        async with AsyncLLMEngine(engine) as server:
            params = SamplingParams(max_tokens=200, ignore_eos=True)
            stream = server.add_request("Tell me a story.", params, "story")
            received, used = [], -1
            async for delta in stream:
                received.append(delta)
                if len(received) == 3:
                    await server.abort("story")
                    used = server.stats().num_blocks_used
                if delta.final is not None:
                    break
            return received, used

    received, used_after_abort = run(main())
    assert used_after_abort == 0
    assert received[-1].finish_reason == "abort" and received[-1].final is not None
    assert len(received[-1].final.outputs[0].token_ids) < 200


def test_a_cancelled_consumer_aborts_its_request(engine: LLMEngine) -> None:
    async def main() -> tuple[int, int]:
        async with AsyncLLMEngine(engine) as server:
            started = asyncio.Event()

            async def client() -> None:
                async for _ in server.add_request(
                    "Write a long essay.", SamplingParams(max_tokens=300, ignore_eos=True)
                ):
                    started.set()

            task = asyncio.create_task(client())
            await started.wait()
            busy = server.stats().num_blocks_used
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await wait_until(lambda: server.stats().num_unfinished_requests == 0)
            return busy, server.stats().num_blocks_used

    busy, after = run(main())
    assert busy > 0 and after == 0


def test_bad_requests_raise_at_once_and_others_finish(engine: LLMEngine) -> None:
    async def main() -> list[RequestOutputDelta]:
        async with AsyncLLMEngine(engine) as server:
            good = server.add_request("Hello", GREEDY, request_id="good")
            with pytest.raises(PromptTooLong):
                server.add_request(list(range(5, 600)), GREEDY)
            with pytest.raises(RequestError, match="temperature=-1"):
                server.add_request("Hello", SamplingParams(temperature=-1))
            with pytest.raises(RequestError, match="already in use"):
                server.add_request("Hello", GREEDY, request_id="good")
            return await collect(good)

    deltas = run(main())
    assert deltas[-1].final is not None and deltas[-1].final.error is None


def test_the_event_loop_stays_free_while_the_engine_works(engine: LLMEngine) -> None:
    async def main() -> tuple[float, int, float]:
        async with AsyncLLMEngine(engine) as server:
            stream = server.add_request(
                "Once upon a time", SamplingParams(max_tokens=24, ignore_eos=True)
            )
            consumer = asyncio.create_task(collect(stream))
            worst, ticks = 0.0, 0
            start = time.perf_counter()
            while not consumer.done():
                before = time.perf_counter()
                await asyncio.sleep(0.002)
                worst = max(worst, time.perf_counter() - before)
                ticks += 1
            total = time.perf_counter() - start
            await consumer
            return worst, ticks, total

    worst, ticks, total = run(main())
    assert ticks > 24  # the loop kept ticking during generation
    # Never stalled for a large part of the generation (24 steps); relative, so a loaded
    # machine, which slows both alike, passes too.
    assert worst < total / 3


def test_stats_are_a_snapshot_readable_from_the_loop(engine: LLMEngine) -> None:
    async def main():  # noqa: ANN202
        async with AsyncLLMEngine(engine) as server:
            await collect(server.add_request("Hi", GREEDY))
            return server.stats()

    stats = run(main())
    assert stats.num_blocks_total == engine.block_manager.num_blocks
    assert stats.num_blocks_used == 0 and stats.num_unfinished_requests == 0
    assert stats.num_generated_tokens > 0


def test_a_factory_builds_the_engine_on_the_thread_that_steps_it(demo_model_dir: Path) -> None:
    # torch keeps one OpenMP pool per thread that computed: the server's engine is loaded
    # and stepped on one thread, so only one pool exists (the module's docstring)
    import threading

    threads: dict[str, set[int]] = {"build": set(), "step": set()}

    def factory() -> LLMEngine:
        threads["build"].add(threading.get_ident())
        built = LLMEngine.from_model(demo_model_dir, max_model_len=256)
        step = built.step

        def traced_step():  # noqa: ANN202
            threads["step"].add(threading.get_ident())
            return step()

        built.step = traced_step  # type: ignore[method-assign]
        return built

    async def main() -> list[RequestOutputDelta]:
        server = AsyncLLMEngine(factory)
        with pytest.raises(RuntimeError, match="still being built"):
            server.stats()
        async with server:
            assert server.stats().num_blocks_total > 0
            return await collect(server.add_request("Hello", GREEDY))

    deltas = run(main())
    assert deltas[-1].final is not None
    assert threads["step"] == threads["build"] != {threading.get_ident()}


def test_a_factory_that_fails_raises_from_ready() -> None:
    def factory() -> LLMEngine:
        raise RequestError("no such model")

    async def main() -> None:
        server = AsyncLLMEngine(factory)
        with pytest.raises(RequestError, match="no such model"):
            await server.ready()
        with pytest.raises(RuntimeError, match="could not be built: no such model"):
            server.engine  # noqa: B018
        await asyncio.to_thread(server.shutdown)

    run(main())


def test_deltas_that_wait_are_merged_and_an_interval_holds_tokens(engine: LLMEngine) -> None:
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)

    async def late_consumer() -> list[RequestOutputDelta]:
        async with AsyncLLMEngine(engine) as server:
            stream = server.add_request("Once upon a time", params, request_id="late")
            queue = server._streams["late"].queue
            await wait_until(lambda: queue.qsize() >= 4)  # the engine ran ahead of us
            deltas = [await anext(stream)]
            return deltas + [d async for d in stream]

    late = run(late_consumer())
    # the first token is an event of its own however late the first read; what waited
    # behind it comes as one
    assert len(late[0].token_ids) == 1 and len(late[1].token_ids) >= 3
    final = late[-1].final
    assert final is not None and late[-1].finish_reason == "length"
    assert [t for d in late for t in d.token_ids] == final.outputs[0].token_ids
    assert "".join(d.text for d in late) == final.outputs[0].text

    async def with_interval() -> list[RequestOutputDelta]:
        async with AsyncLLMEngine(engine, stream_interval=5) as server:
            return await collect(server.add_request("Once upon a time", params))

    held = run(with_interval())
    sizes = [len(d.token_ids) for d in held]
    assert sizes[0] == 1 and all(size >= 5 for size in sizes[1:-1]) and sum(sizes) == 24
    assert [t for d in held for t in d.token_ids] == final.outputs[0].token_ids  # greedy
    with pytest.raises(ValueError, match="stream_interval"):
        AsyncLLMEngine(engine, stream_interval=0)


def test_a_step_delay_fault_waits_after_every_step(engine: LLMEngine) -> None:
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)

    async def slowed() -> tuple[list[RequestOutputDelta], float]:
        async with AsyncLLMEngine(engine, step_delay_s=0.1) as server:
            started = time.monotonic()
            deltas = await collect(server.add_request("Once upon a time", params))
            return deltas, time.monotonic() - started

    deltas, took = run(slowed())
    assert sum(len(d.token_ids) for d in deltas) == 5
    assert took >= 0.4  # a wait after each of the first four steps: a floor, never a ceiling
    with pytest.raises(ValueError, match="step_delay_s"):
        AsyncLLMEngine(engine, step_delay_s=-1)


def test_a_sink_takes_deltas_on_the_engine_thread_until_it_declines_one(engine: LLMEngine) -> None:
    """``attach_sink``: the engine thread hands the stream's deltas to the sink right after
    its steps; the first one the sink declines, and every later one, come through the
    iterator, so the stream's tokens stay whole and in order. Attaching waits for the
    consumer to have every delta already handed to it, and an interval refuses it."""
    import threading

    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    reference = run(collect_with(engine, params))
    sunk: list[RequestOutputDelta] = []
    threads: set[int] = set()

    def sink(delta: RequestOutputDelta) -> bool:
        threads.add(threading.get_ident())
        if len(sunk) == 10:
            return False  # declined: this one and the rest go through the iterator
        sunk.append(delta)
        return True

    async def main() -> tuple[list[RequestOutputDelta], list[bool]]:
        # paced (a slow device's steps), so tokens are left to sink once it is attached
        async with AsyncLLMEngine(engine, step_delay_s=0.02) as server:
            stream = server.add_request("Once upon a time", params, request_id="sunk")
            first = await anext(stream)
            queue = server._streams["sunk"].queue
            await wait_until(lambda: queue.qsize() >= 1)  # handed to the loop, not yet taken
            attached = [server.attach_sink("sunk", sink)]
            rest = [first, await anext(stream)]  # now everything handed has been taken
            attached.append(server.attach_sink("sunk", sink))
            return rest + [d async for d in stream], attached

    through_loop, attached = run(main())
    assert attached == [False, True]
    assert len(sunk) == 10 and threading.get_ident() not in threads and len(threads) == 1
    final = through_loop[-1].final
    assert final is not None
    # the iterator's deltas before the sink's, then the sink's, then the iterator's again
    order = through_loop[:2] + sunk + through_loop[2:]
    assert [t for d in order for t in d.token_ids] == final.outputs[0].token_ids
    assert "".join(d.text for d in order) == final.outputs[0].text == reference

    async def with_interval() -> bool:
        async with AsyncLLMEngine(engine, stream_interval=2) as server:
            stream = server.add_request("Once upon a time", params, request_id="held")
            await anext(stream)
            attached = server.attach_sink("held", sink)
            await collect(stream)
            return attached

    assert run(with_interval()) is False


async def collect_with(engine: LLMEngine, params: SamplingParams) -> str:
    async with AsyncLLMEngine(engine) as server:
        return "".join([d.text async for d in server.add_request("Once upon a time", params)])
