"""The model runner against Hugging Face transformers: greedy parity, varlen batches, logits."""

from __future__ import annotations

import random
import re
from pathlib import Path

import pytest
import torch

from kunlun.engine.model_runner import ModelRunner, StepSeq
from kunlun.errors import ConfigError, EngineError

DEMO_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n",
    "Once upon a time, in a small village,",
    "中国的首都是",
]
"""One prompt of each kind the test tells apart (through the chat template and chunked,
raw, through the chat template, raw and chunked; English, code, Chinese); the LLM-level
greedy tests of ``test_llm_engine.py`` compare eight more prompts with transformers."""


def greedy(
    runner: ModelRunner,
    prompt: list[int],
    max_new_tokens: int,
    *,
    chunk: int | None = None,
    seed: int = 0,
) -> list[int]:
    """Greedy decoding over ``runner.execute``: prefill (in two chunks when ``chunk``), then
    one token per step, on a shuffled block table so paging is exercised."""
    tokens = list(prompt)
    needed = -(-(len(prompt) + max_new_tokens) // runner.block_size)
    table = random.Random(seed).sample(range(runner.num_blocks), needed)
    computed = 0
    if chunk:
        runner.execute([StepSeq(tokens, 0, chunk, table)])
        computed = chunk
    out = runner.execute([StepSeq(tokens, computed, len(tokens) - computed, table)])
    computed = len(tokens)
    generated: list[int] = []
    while True:
        token = int(out.logits[0].argmax())
        generated.append(token)
        tokens.append(token)
        if len(generated) == max_new_tokens or token in runner.tokenizer.eos_token_ids:
            return generated
        out = runner.execute([StepSeq(tokens, computed, 1, table)])
        computed += 1


def hf_greedy(model: torch.nn.Module, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers' greedy ``generate`` (its own stopping rule: the config's EOS)."""
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            do_sample=False,
            max_new_tokens=max_new_tokens,
        )
    return out[0, len(prompt) :].tolist()


def hf_model(model_dir: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        model_dir, attn_implementation="sdpa", dtype=torch.float32
    ).eval()


@pytest.fixture(scope="module")
def demo_runner(demo_model_dir: Path) -> ModelRunner:
    return ModelRunner(demo_model_dir, block_size=16, num_blocks=128, max_model_len=2048)


@pytest.fixture(scope="module")
def demo_hf(demo_model_dir: Path) -> torch.nn.Module:
    return hf_model(demo_model_dir)


@pytest.mark.parametrize("index", range(len(DEMO_PROMPTS)))
def test_demo_greedy_matches_transformers(
    index: int, demo_runner: ModelRunner, demo_hf: torch.nn.Module
) -> None:
    tokenizer = demo_runner.tokenizer
    text = DEMO_PROMPTS[index]
    if index % 2 == 0:  # half raw text, half through the chat template
        text = tokenizer.apply_chat_template([{"role": "user", "content": text}])
    prompt = tokenizer.encode(text)
    chunk = len(prompt) // 2 if index % 3 == 0 else None
    ours = greedy(demo_runner, prompt, 32, chunk=chunk, seed=index)
    assert ours == hf_greedy(demo_hf, prompt, 32)


TINY_CASES = [
    ("LlamaForCausalLM", False, {}),
    ("LlamaForCausalLM", True, {"llama3_rope": True}),
    ("LlamaForCausalLM", False, {"attention_bias": True}),
    ("Qwen2ForCausalLM", False, {}),
    ("Qwen2ForCausalLM", True, {}),
    ("Qwen3ForCausalLM", True, {}),
    ("Qwen3ForCausalLM", False, {}),
]


@pytest.mark.parametrize(("arch", "tied", "options"), TINY_CASES)
def test_tiny_greedy_matches_transformers(
    arch: str, tied: bool, options: dict[str, bool], make_tiny_model
) -> None:
    model_dir = make_tiny_model(arch, tied, **options)
    runner = ModelRunner(model_dir, block_size=4, num_blocks=64)
    reference = hf_model(model_dir)
    rng = random.Random(7)
    for length, chunk in ((5, None), (23, 9), (1, None)):
        prompt = [rng.randrange(3, 49152) for _ in range(length)]
        ours = greedy(runner, prompt, 32, chunk=chunk, seed=length)
        assert ours == hf_greedy(reference, prompt, 32), (arch, tied, length)


def test_prompt_logits_match_transformers(make_tiny_model) -> None:
    model_dir = make_tiny_model("Qwen3ForCausalLM", False)
    runner = ModelRunner(model_dir, block_size=8, num_blocks=16)
    reference = hf_model(model_dir)
    prompt = list(range(100, 140))
    with torch.no_grad():
        expected = reference(torch.tensor([prompt])).logits[0]
    first = runner.execute([StepSeq(prompt, 0, 25, list(range(5)), want_prompt_logits=True)])
    second = runner.execute([StepSeq(prompt, 25, 15, list(range(5)), want_prompt_logits=True)])
    got = torch.cat([first.prompt_logits[0], second.prompt_logits[0]])
    assert got.dtype == torch.float32 and got.shape == expected.shape
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(second.logits[0], expected[-1], atol=1e-4, rtol=1e-4)


def test_demo_prompt_logits_match_transformers(
    demo_runner: ModelRunner, demo_hf: torch.nn.Module
) -> None:
    prompt = demo_runner.tokenizer.encode("Paged attention lets many sequences share memory.")
    with torch.no_grad():
        expected = demo_hf(torch.tensor([prompt])).logits[0]
    out = demo_runner.execute([StepSeq(prompt, 0, len(prompt), [3, 1], want_prompt_logits=True)])
    assert out.prompt_logits[0] is not None
    torch.testing.assert_close(out.prompt_logits[0], expected, atol=2e-3, rtol=1e-3)


def test_batched_varlen_step_matches_each_alone(make_tiny_model) -> None:
    """Decode and (chunked) prefill sequences in one step give the logits they give alone."""
    runner = ModelRunner(make_tiny_model("Qwen2ForCausalLM", False), block_size=4, num_blocks=96)
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 49152) for _ in range(n)] for n in (9, 30, 17, 2)]
    tables = [list(range(i * 12, (i + 1) * 12)) for i in range(4)]
    # per step: (num_computed, num_new) of each sequence; None = idle this step
    plan = [
        [(0, 9), (0, 12), (0, 17), (0, 2)],
        [(9, 1), (12, 18), (17, 1), (2, 1)],
        [(10, 1), (30, 1), (18, 1), None],
        [(11, 1), (31, 1), (19, 1), (3, 1)],
    ]
    tokens = [p + [rng.randrange(3, 49152) for _ in range(8)] for p in prompts]
    alone: dict[tuple[int, int], torch.Tensor] = {}
    for index in range(4):
        for step, work in enumerate(plan):
            if work[index] is not None:
                seq = StepSeq(tokens[index], *work[index], tables[index])
                alone[step, index] = runner.execute([seq]).logits[0]
    shifted = [[block + 48 for block in table] for table in tables]
    for step, work in enumerate(plan):
        active = [i for i in range(4) if work[i] is not None]
        batch = [StepSeq(tokens[i], *work[i], shifted[i]) for i in active]
        out = runner.execute(batch)
        for row, index in enumerate(active):
            torch.testing.assert_close(out.logits[row], alone[step, index], atol=1e-4, rtol=1e-4)


def test_bf16_runner_tracks_float32(demo_model_dir: Path, demo_runner: ModelRunner) -> None:
    runner = ModelRunner(demo_model_dir, dtype=torch.bfloat16, num_blocks=16, max_model_len=256)
    prompt = demo_runner.tokenizer.encode("The capital of France is")
    low = runner.execute([StepSeq(prompt, 0, len(prompt), [0])]).logits[0]
    high = demo_runner.execute([StepSeq(prompt, 0, len(prompt), [5])]).logits[0]
    assert low.dtype == torch.float32
    assert int(low.argmax()) == int(high.argmax())
    assert torch.nn.functional.cosine_similarity(low, high, dim=0) > 0.99


def test_kv_sizing(make_tiny_model) -> None:
    model_dir = make_tiny_model("LlamaForCausalLM", False)
    runner = ModelRunner(model_dir, block_size=16, max_model_len=128)
    # 3 layers x 2 kv heads x 16 head_dim x 2 (k, v) x 16 tokens x 4 bytes
    assert runner.kv_bytes_per_block() == 3 * 2 * 16 * 2 * 16 * 4
    assert runner.num_blocks == 4 * 128 // 16
    sized = ModelRunner(model_dir, kv_cache_memory_bytes=10 * runner.kv_bytes_per_block() + 5)
    assert sized.num_blocks == 10
    with pytest.raises(ConfigError, match="not both"):
        ModelRunner(model_dir, num_blocks=4, kv_cache_memory_bytes=1 << 20)
    with pytest.raises(ConfigError, match="max_model_len=9999"):
        ModelRunner(model_dir, max_model_len=9999)


def test_bad_steps_are_refused(make_tiny_model) -> None:
    runner = ModelRunner(make_tiny_model("LlamaForCausalLM", False), block_size=4, num_blocks=8)
    tokens = list(range(10, 20))
    with pytest.raises(EngineError, match=r"seqs\[0\]: block_table has 2 blocks, 3 needed"):
        runner.execute([StepSeq(tokens, 0, 10, [0, 1])])
    with pytest.raises(EngineError, match="block id 8"):
        runner.execute([StepSeq(tokens, 0, 4, [8])])
    with pytest.raises(EngineError, match="exceeds len"):
        runner.execute([StepSeq(tokens, 5, 6, [0, 1, 2])])
    with pytest.raises(EngineError, match="num_new=0"):
        runner.execute([StepSeq(tokens, 0, 0, [0])])
    with pytest.raises(EngineError, match="at least one"):
        runner.execute([])


def test_engine_source_names_no_vendor_device() -> None:
    root = Path(__file__).resolve().parents[2] / "src" / "kunlun" / "engine"
    offenders = [
        f"{path.relative_to(root)}:{number}"
        for path in sorted(root.rglob("*.py"))
        if path.name != "device.py"
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if re.search(r"torch\.cuda|[\"']cuda", line)
    ]
    assert offenders == []
