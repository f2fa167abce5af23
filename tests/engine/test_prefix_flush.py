"""Flushing the prefix cache through the asyncio front: refused while a request runs, done
between steps when the engine is idle, and the next identical prompt then misses once."""

from __future__ import annotations

import asyncio
from pathlib import Path

from kunlun.engine.async_engine import AsyncLLMEngine
from kunlun.engine.llm_engine import LLMEngine
from kunlun.engine.sampling_params import SamplingParams

PROMPT = "A prompt long enough to fill several KV blocks of sixteen tokens each. " * 3


def test_flush_is_refused_while_busy_and_forgets_the_cache_when_idle(
    demo_model_dir: Path,
) -> None:
    engine = LLMEngine.from_model(demo_model_dir, max_model_len=512)

    async def cached(server: AsyncLLMEngine) -> int:
        stream = server.add_request(PROMPT, SamplingParams(temperature=0, max_tokens=1))
        return [d async for d in stream][-1].num_cached_tokens

    async def main() -> tuple[int, int, int, int, int, int]:
        async with AsyncLLMEngine(engine) as server:
            await cached(server)
            hit = await cached(server)
            long = SamplingParams(max_tokens=200, ignore_eos=True)
            stream = server.add_request("Tell me a story.", long, "story")
            await anext(stream)
            busy = await server.flush_prefix_cache()
            await server.abort("story")
            await stream.aclose()  # type: ignore[attr-defined]
            idle = await server.flush_prefix_cache()
            blocks = server.stats().num_cached_blocks
            return hit, busy, idle, blocks, await cached(server), await cached(server)

    hit, busy, idle, blocks, after, again = asyncio.run(main())
    assert hit > 0
    assert busy == 1  # one request running: not flushed
    assert idle == 0 and blocks == 0
    assert after == 0 and again > 0
