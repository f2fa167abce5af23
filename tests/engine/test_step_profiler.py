"""The step profiler on a real engine (tiny random Llama): a Chrome trace whose events match
the steps the engine ran, sampling by interval, and no change to the output."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kunlun.engine.llm_engine import LLMEngine
from kunlun.engine.sampling_params import SamplingParams
from kunlun.engine.step_profiler import StepProfiler

PHASES = ["schedule", "prepare", "forward", "sample", "postprocess", "detokenize"]
PROMPTS = [list(range(100, 120)), list(range(200, 212)), list(range(300, 305))]
GREEDY = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(tiny_model_dir) -> LLMEngine:  # noqa: ANN001
    # a 16-token step budget: the 20-token prompt is prefilled in two chunks, mixed with decodes;
    # no prefix cache, so every run computes the same tokens
    return LLMEngine.from_model(
        tiny_model_dir("LlamaForCausalLM"),
        max_model_len=256,
        num_blocks=64,
        max_num_batched_tokens=16,
        enable_prefix_caching=False,
    )


def run(engine: LLMEngine) -> tuple[list[list[int]], int]:
    """Generate for every prompt; (output tokens per prompt, steps that ran a batch)."""
    steps_before = engine.stats().num_steps
    ids = [engine.add_request(p, GREEDY) for p in PROMPTS]
    tokens: dict[str, list[int]] = {i: [] for i in ids}
    while engine.has_unfinished():
        for delta in engine.step():
            tokens[delta.request_id] += delta.token_ids
    return [tokens[i] for i in ids], engine.stats().num_steps - steps_before


def test_every_step_is_traced_with_its_phases(engine: LLMEngine, tmp_path: Path) -> None:
    reference, _ = run(engine)
    profiler = StepProfiler(tmp_path / "trace.json", interval_ms=0, name="tiny")
    engine.set_profiler(profiler)
    try:
        outputs, num_steps = run(engine)
    finally:
        engine.set_profiler(None)
        profiler.close()
    assert outputs == reference  # profiling does not change what is generated
    events = json.loads((tmp_path / "trace.json").read_text())
    steps = [e for e in events if e["name"] == "step"]
    assert len(steps) == num_steps == profiler.num_traced
    counters = [e for e in events if e["ph"] == "C"]
    assert len(counters) == num_steps
    phases = [e for e in events if e["name"] in PHASES]
    assert len(phases) == len(PHASES) * num_steps
    total_tokens = 0
    for i, step in enumerate(steps):
        mine = phases[i * len(PHASES) : (i + 1) * len(PHASES)]
        assert [e["name"] for e in mine] == PHASES
        assert all(e["ph"] == "X" and e["dur"] >= 0 for e in mine)
        assert mine[0]["ts"] == step["ts"]  # phases tile the step, in order, no gap
        for before, after in zip(mine, mine[1:], strict=False):
            assert after["ts"] == pytest.approx(before["ts"] + before["dur"], abs=1e-3)
        end = mine[-1]["ts"] + mine[-1]["dur"]
        assert end == pytest.approx(step["ts"] + step["dur"], abs=1e-3)
        args = step["args"]
        assert args["num_prefill"] + args["num_decode"] == args["batch_size"]
        assert counters[i]["args"] == {"seqs": args["batch_size"], "tokens": args["num_tokens"]}
        assert args["num_tokens"] <= 16
        total_tokens += args["num_tokens"]
    # every prompt token and every generated token but the last of each request is computed
    assert total_tokens == sum(len(p) for p in PROMPTS) + 3 * (GREEDY.max_tokens - 1)
    assert steps[0]["args"] == {
        "step": 1,
        "batch_size": 1,
        "num_tokens": 16,
        "num_prefill": 1,
        "num_decode": 0,
    }
    assert events[0]["ph"] == "M" and "tiny" in events[0]["args"]["name"]


def test_interval_samples_steps(engine: LLMEngine, tmp_path: Path) -> None:
    profiler = StepProfiler(tmp_path / "sampled.json", interval_ms=60_000)
    engine.set_profiler(profiler)
    try:
        _, num_steps = run(engine)
    finally:
        engine.set_profiler(None)
        profiler.close()
    assert num_steps > 3 and profiler.num_traced == 1  # one step per minute at most
    events = json.loads((tmp_path / "sampled.json").read_text())
    assert sum(e["name"] == "step" for e in events) == 1


def test_a_trace_cut_short_lacks_only_the_bracket(engine: LLMEngine, tmp_path: Path) -> None:
    profiler = StepProfiler(tmp_path / "cut.json", interval_ms=0)
    engine.set_profiler(profiler)
    try:
        run(engine)
        profiler.flush()  # what a crashed worker leaves: the events, not the closing bracket
        text = (tmp_path / "cut.json").read_text()
    finally:
        engine.set_profiler(None)
        profiler.close()
    assert text.startswith("[") and not text.rstrip().endswith("]")
    assert any(e["name"] == "step" for e in json.loads(text + "]"))


def test_bad_interval() -> None:
    with pytest.raises(ValueError, match="interval_ms=-1"):
        StepProfiler("unused.json", interval_ms=-1)
