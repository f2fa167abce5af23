"""The engine's pooling path (:mod:`kunlun.engine.pooling`) against transformers' own hidden
states on the same tiny random Llama: mean and last pooling, several inputs in one step,
inputs over the step's token budget, and no KV block kept afterwards."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from tests.engine.conftest import TinyFactory

from kunlun.engine.async_engine import AsyncLLMEngine
from kunlun.engine.llm_engine import LLMEngine

INPUTS = [[1, 400, 401, 402, 9000], [1, 77], [5], list(range(3, 40))]


def reference(model_dir: Path, ids: list[int], method: str) -> torch.Tensor:
    """transformers' final-norm hidden states of ``ids``, pooled and normalised."""
    import transformers

    model = transformers.AutoModel.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        hidden = model(torch.tensor([ids])).last_hidden_state[0]
    return F.normalize(hidden.mean(0) if method == "mean" else hidden[-1], dim=0)


@pytest.fixture(scope="module")
def llama(make_tiny_model: TinyFactory) -> Path:
    return make_tiny_model("LlamaForCausalLM")


@pytest.mark.parametrize("method", ["mean", "last"])
def test_vectors_match_transformers_hidden_states(llama: Path, method: str) -> None:
    engine = LLMEngine.from_model(llama, max_num_batched_tokens=48, num_blocks=8, block_size=8)

    async def run() -> list[torch.Tensor]:
        async with AsyncLLMEngine(engine) as served:
            jobs = [served.embed(INPUTS[:2], method), served.embed(INPUTS[2:], method)]
            first, second = await asyncio.gather(*jobs)  # concurrent requests
            return first + second

    vectors = asyncio.run(run())
    for ids, vector in zip(INPUTS, vectors, strict=True):
        assert vector.dtype == torch.float32
        assert abs(vector.norm().item() - 1) < 1e-5
        assert F.cosine_similarity(vector, reference(llama, ids, method), dim=0) > 0.999
    # every block is back, and none was published to the prefix cache
    stats = engine.stats()
    assert stats.num_blocks_free == stats.num_blocks_total and stats.num_cached_blocks == 0


def test_an_input_longer_than_the_step_budget_runs_alone(llama: Path) -> None:
    engine = LLMEngine.from_model(llama, max_num_batched_tokens=16, num_blocks=16, block_size=8)
    long = list(range(10, 90))

    async def run() -> list[torch.Tensor]:
        async with AsyncLLMEngine(engine) as served:
            return await served.embed([long, [1, 2]], "mean")

    vectors = asyncio.run(run())
    assert F.cosine_similarity(vectors[0], reference(llama, long, "mean"), dim=0) > 0.999
    assert F.cosine_similarity(vectors[1], reference(llama, [1, 2], "mean"), dim=0) > 0.999


def test_two_ranks_pool_like_one_and_still_generate(llama: Path) -> None:
    """Under tensor parallelism every rank runs the pooling step without the LM head (its
    gather included): the vectors match, and a generation after it still runs."""
    from kunlun.engine.engine_config import EngineConfig
    from kunlun.engine.sampling_params import SamplingParams

    engine = LLMEngine(EngineConfig(llama, tensor_parallel_size=2, distributed_backend="gloo",
                                    num_threads=1, max_model_len=128))  # fmt: skip

    async def run() -> tuple[list[torch.Tensor], int]:
        async with AsyncLLMEngine(engine) as served:
            vectors = await served.embed(INPUTS, "mean")
            stream = served.add_request([1, 400, 401], SamplingParams(max_tokens=3))
            tokens = [t async for delta in stream for t in delta.token_ids]
            return vectors, len(tokens)

    vectors, generated = asyncio.run(run())
    assert generated == 3
    for ids, vector in zip(INPUTS, vectors, strict=True):
        assert F.cosine_similarity(vector, reference(llama, ids, "mean"), dim=0) > 0.999


def test_a_request_of_many_inputs_shares_each_step_with_the_ones_behind_it(llama: Path) -> None:
    """Issue 32, bug 6: 2,048 inputs in one request held every later request (the replica's
    health probe among them) until all were pooled, and the replica left routing. Inputs are
    now taken one per request in turn, so a one-input request behind it is done in the next
    step, whatever the size of the first."""
    from kunlun.engine.pooling import Pooler, PoolingJob

    engine = LLMEngine.from_model(llama, max_num_batched_tokens=32, num_blocks=16, block_size=8)
    big = PoolingJob([[1, 400 + i % 50, 7] for i in range(64)], "mean")
    probe = PoolingJob([[1, 2, 3]], "mean")
    pooler = Pooler(engine)
    pooler.add([big, probe])
    pooler.step()  # 32 tokens: ten of the big request's inputs and the probe's one
    assert probe.done.done() and not big.done.done()
    assert abs(probe.done.result()[0].norm().item() - 1) < 1e-5
    steps = 1
    while pooler.pending:
        pooler.step()
        steps += 1
    assert len(big.done.result()) == 64 and steps >= 64 * 3 // 32
