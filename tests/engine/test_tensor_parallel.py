"""Tensor parallelism on this CPU: two ranks over gloo against one rank, token for token.

Greedy outputs of TP=2 must equal TP=1's. The all-reduces sum partial products in another
order, so the last bits differ: outputs must agree up to the first position where TP=1's own
two best logits are within 1e-4 of each other (a near tie, where either token is a correct
greedy choice), the rule the engine's equality tests use against transformers.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kunlun.engine.engine_config import EngineConfig
from kunlun.engine.llm import LLM
from kunlun.engine.llm_engine import LLMEngine
from kunlun.engine.sampling_params import SamplingParams
from kunlun.engine.tp_layout import head_split, head_split_problem
from kunlun.errors import ConfigError, EngineError

NEAR_TIE = 1e-4
GREEDY = SamplingParams(temperature=0, max_tokens=24, logprobs=2)
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village at the edge of a great forest, there lived",
    "List three primary colors:",
]


def engine(model_dir: Path, tp: int, **settings: object) -> LLMEngine:
    """One torch thread per rank: the test compares tokens, and the suite runs beside other
    test files on two cores, where each extra thread only waits for a core."""
    return LLMEngine(
        EngineConfig(
            model_dir,
            tensor_parallel_size=tp,
            distributed_backend="gloo" if tp > 1 else None,
            num_threads=tp,
            max_model_len=512,
            **settings,  # type: ignore[arg-type]
        )
    )


def greedy(model_dir: Path, tp: int) -> list[tuple[list[int], int]]:
    """Each prompt's greedy tokens and the first near-tie position (len when none)."""
    runner = engine(model_dir, tp)
    try:
        outs = LLM(engine=runner).generate(PROMPTS, GREEDY)
    finally:
        runner.close()
    result = []
    for out in outs:
        completion = out.outputs[0]
        near_tie = len(completion.token_ids)
        for step, top in enumerate(completion.logprobs or []):
            best = sorted(top.values(), reverse=True)[:2]
            if len(best) == 2 and best[0] - best[1] < NEAR_TIE:
                near_tie = step
                break
        result.append((completion.token_ids, near_tie))
    return result


def assert_same_greedy(model_dir: Path) -> None:
    one, two = greedy(model_dir, 1), greedy(model_dir, 2)
    exact = 0
    for (reference, near_tie), (tokens, _) in zip(one, two, strict=True):
        limit = min(near_tie, len(tokens))
        assert tokens[:limit] == reference[:limit]
        exact += near_tie == len(reference)
    assert exact >= len(PROMPTS) - 1  # meaningful only when most prompts have no near tie


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"])
def test_tp2_greedy_equals_tp1_on_tiny_models(make_tiny_model, arch: str) -> None:
    assert_same_greedy(make_tiny_model(arch, tie_word_embeddings=arch == "Qwen3ForCausalLM"))


def test_tp2_replicates_a_single_kv_head(make_tiny_model) -> None:
    model_dir = make_tiny_model("LlamaForCausalLM", heads=(4, 1))
    assert head_split(4, 1, 2, 1).kv.start == 0  # both ranks hold KV head 0
    assert_same_greedy(model_dir)


def test_tp2_greedy_equals_tp1_on_the_demo_model(demo_model_dir: Path) -> None:
    # SmolLM2-135M has 9 query / 3 KV heads: rank 0 takes 2 KV heads (6 queries), rank 1 one
    assert_same_greedy(demo_model_dir)


def test_each_rank_holds_only_its_slices(make_tiny_model) -> None:
    model_dir = make_tiny_model("Qwen2ForCausalLM")
    one, two = engine(model_dir, 1), engine(model_dir, 2)
    try:
        full = dict(one.runner.model.named_parameters())
        mine = dict(two.runner.model.named_parameters())
        qkv = "model.layers.0.self_attn.qkv_proj.weight"
        assert mine[qkv].shape[0] * 2 == full[qkv].shape[0]
        assert (
            mine[qkv.replace("weight", "bias")].shape[0] * 2
            == full[qkv.replace("weight", "bias")].shape[0]
        )
        down = "model.layers.0.mlp.down_proj.weight"
        assert mine[down].shape[1] * 2 == full[down].shape[1]
        assert (
            mine["model.embed_tokens.weight"].shape[0] * 2
            == full["model.embed_tokens.weight"].shape[0]
        )
        # the KV cache of a rank holds its KV heads only
        assert two.runner.kv_cache.shape[-2] * 2 == one.runner.kv_cache.shape[-2]
    finally:
        two.close()


def test_heads_that_do_not_split_are_refused_before_any_rank_starts(make_tiny_model) -> None:
    model_dir = make_tiny_model("LlamaForCausalLM", heads=(3, 1))
    with pytest.raises(ConfigError) as info:
        engine(model_dir, 2)
    message = str(info.value)
    assert "tensor_parallel_size=2" in message and "3 query heads" in message
    assert str(model_dir) in message


def test_split_rule() -> None:
    assert head_split_problem(9, 3, 2) is None  # uneven at KV-head granularity: 6 + 3
    assert [head_split(9, 3, 2, r).q.size for r in (0, 1)] == [6, 3]
    assert head_split_problem(8, 2, 4) is None  # each KV head on two ranks, 2 queries each
    assert head_split(8, 2, 4, 3).q.start == 6 and head_split(8, 2, 4, 3).kv.start == 1
    assert "not a multiple" in (head_split_problem(6, 3, 4) or "")
    assert "3 query heads" in (head_split_problem(3, 1, 2) or "")


def test_tp_needs_a_backend(make_tiny_model) -> None:
    config = EngineConfig(make_tiny_model("LlamaForCausalLM"), tensor_parallel_size=2)
    with pytest.raises(ConfigError, match="distributed_backend"):
        config.validate()


@pytest.fixture
def tp_engine(make_tiny_model) -> Iterator[LLMEngine]:
    runner = engine(make_tiny_model("LlamaForCausalLM"), 2)
    yield runner
    runner.close()


def test_a_killed_rank_fails_the_requests_and_reports_the_group_lost(
    tp_engine: LLMEngine,
) -> None:
    group = tp_engine.rank_group
    assert group is not None
    lost: list[str] = []
    group.on_lost = lost.append
    (pid,) = group.pids
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 60
    while not lost:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert "rank 1 of 2" in lost[0] and "signal 9" in lost[0]
    (out,) = LLM(engine=tp_engine).generate(["Hello"], SamplingParams(max_tokens=4))
    assert isinstance(out.error, EngineError) and "rank 1 of 2" in str(out.error)
