"""The engine end to end on real models, against transformers' ``generate``.

Greedy outputs must equal transformers' token for token. When requests run batched (or are
preempted and recomputed) the arithmetic differs in the last bits, so there the outputs must
agree up to the first position where transformers' own two best logits are within 1e-4 of
each other (a near tie, where either token is a correct greedy choice).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import pytest
import torch
from tests.conftest import machine_cache
from transformers import AutoModelForCausalLM

from kunlun.engine.engine_config import EngineConfig
from kunlun.engine.llm import LLM
from kunlun.engine.llm_engine import LLMEngine
from kunlun.engine.model_runner import ModelRunner, StepOutput, StepSeq
from kunlun.engine.sampling_params import SamplingParams
from kunlun.errors import EngineError, PromptTooLong, RequestError

NEAR_TIE = 1e-4
GREEDY = SamplingParams(temperature=0, max_tokens=32)
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village at the edge of a great forest, there lived",
    "List three primary colors:",
    "Q: What is the boiling point of water at sea level?\nA:",
    "The quick brown fox",
    "In 1969, the first humans landed on the Moon. The mission was called Apollo 11, and the "
    "astronauts were Neil Armstrong, Buzz Aldrin and Michael Collins. Armstrong's first words",
    "import numpy as np\n\n# compute the mean of a list\ndef mean(values):",
]


# ---- references from transformers ----
@dataclass
class Reference:
    """transformers greedy output of one prompt and the first near-tie position in it."""

    token_ids: list[int]
    near_tie: int

    @classmethod
    def generate(
        cls, model, prompt_ids: list[int], max_new_tokens: int, eos: set[int]
    ) -> Reference:
        out = model.generate(
            torch.tensor([prompt_ids]),
            attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            eos_token_id=sorted(eos) or None,
            pad_token_id=sorted(eos)[0] if eos else 0,
        )
        token_ids = out.sequences[0, len(prompt_ids) :].tolist()
        near_tie = len(token_ids)
        for step, logits in enumerate(out.logits):
            top = torch.topk(logits[0].float(), 2).values
            if (top[0] - top[1]).item() < NEAR_TIE:
                near_tie = step
                break
        return cls(token_ids, near_tie)

    @property
    def has_near_tie(self) -> bool:
        return self.near_tie < len(self.token_ids)

    def check(self, token_ids: list[int]) -> None:
        """Equal up to the first near tie (or everywhere when there is none)."""
        if not self.has_near_tie:
            assert token_ids == self.token_ids[: len(token_ids)]
            return
        limit = min(self.near_tie, len(token_ids))
        assert token_ids[:limit] == self.token_ids[:limit]


def hf_model(model_dir: Path):
    return AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="sdpa"
    ).eval()


@pytest.fixture(scope="module")
def demo_llm(demo_model_dir: Path) -> LLM:
    return LLM(demo_model_dir, max_model_len=1024)


@pytest.fixture(scope="module")
def demo_hf(demo_model_dir: Path):
    return hf_model(demo_model_dir)


@pytest.fixture(scope="module")
def demo_references(demo_llm: LLM, demo_model_dir: Path) -> list[Reference]:
    """transformers' greedy decodes of :data:`PROMPTS`, made once per machine: kept under the
    test-model cache, keyed by the weights file, the transformers and torch versions and
    the prompts (a change to any makes them again). transformers' generate takes about
    half a minute of a busy core for them; the engine's side is computed by every run."""
    import transformers

    weights = demo_model_dir / "model.safetensors"
    stat = weights.stat()
    eos = demo_llm.tokenizer.eos_token_ids
    key = json.dumps([str(weights), stat.st_size, stat.st_mtime_ns, transformers.__version__,
                      torch.__version__, PROMPTS, GREEDY.max_tokens, NEAR_TIE, sorted(eos)])  # fmt: skip
    path = machine_cache() / "references" / f"{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"
    if path.exists():
        return [Reference(**item) for item in json.loads(path.read_text())]
    model = hf_model(demo_model_dir)
    made = [
        Reference.generate(model, demo_llm.tokenizer.encode(p), GREEDY.max_tokens, eos)
        for p in PROMPTS
    ]
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(f".{os.getpid()}.part")  # two workers may race: the same text
    partial.write_text(json.dumps([asdict(r) for r in made]))
    partial.replace(path)
    return made


# ---- greedy equality ----
def test_greedy_alone_is_token_identical_to_transformers(
    demo_llm: LLM, demo_references: list[Reference]
) -> None:
    for prompt, reference in zip(PROMPTS, demo_references, strict=True):
        (out,) = demo_llm.generate([prompt], GREEDY)
        reference.check(out.outputs[0].token_ids)
        if not reference.has_near_tie:
            assert out.outputs[0].token_ids == reference.token_ids  # same length too
    # the comparison is meaningful only if most prompts have no near tie at all
    assert sum(not r.has_near_tie for r in demo_references) >= 6


def test_greedy_batched_with_mixed_lengths_matches_transformers(
    demo_llm: LLM, demo_references: list[Reference]
) -> None:
    outs = demo_llm.generate(PROMPTS, GREEDY)
    for out, reference in zip(outs, demo_references, strict=True):
        reference.check(out.outputs[0].token_ids)
        assert out.outputs[0].text == demo_llm.tokenizer.decode(out.outputs[0].token_ids)


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"])
@pytest.mark.parametrize("tied", [False, True])
def test_tiny_models_match_transformers(make_tiny_model, arch: str, tied: bool) -> None:
    model_dir = make_tiny_model(arch, tied)
    llm = LLM(model_dir, max_model_len=256, max_num_batched_tokens=48)  # chunked prefill too
    model = hf_model(model_dir)
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 49152, (n,), generator=generator).tolist() for n in (5, 17, 70)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    references = [Reference.generate(model, p, 12, set()) for p in prompts]
    for prompt, reference in zip(prompts, references, strict=True):
        reference.check(llm.generate([prompt], params)[0].outputs[0].token_ids)
    for out, reference in zip(llm.generate(prompts, params), references, strict=True):
        reference.check(out.outputs[0].token_ids)


# ---- preemption and prefix caching ----
def test_sixteen_requests_in_room_for_three_finish_with_their_solo_output(make_tiny_model) -> None:
    """KV room for three 256-token sequences, sixteen requests of 100-220 + 24 tokens: the
    scheduler must preempt and recompute, and every request still gets its solo output.
    (A tiny random Qwen2 model keeps this fast; the demo model is covered above.)"""
    model_dir = make_tiny_model("Qwen2ForCausalLM", False)
    max_model_len, block_size = 256, 16
    num_blocks = 3 * max_model_len // block_size
    llm = LLM(model_dir, max_model_len=max_model_len, num_blocks=num_blocks, max_num_seqs=16)
    generator = torch.Generator().manual_seed(3)
    lengths = torch.randint(100, 221, (16,), generator=generator).tolist()
    prompts = [torch.randint(3, 49152, (n,), generator=generator).tolist() for n in lengths]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    model = hf_model(model_dir)
    references = [Reference.generate(model, p, 24, set()) for p in prompts]
    assert sum(not r.has_near_tie for r in references) >= 12
    outs = llm.generate(prompts, params)
    for out, reference in zip(outs, references, strict=True):
        assert len(out.outputs[0].token_ids) == 24
        reference.check(out.outputs[0].token_ids)
    stats = llm.engine.stats()
    assert stats.num_preemptions > 0
    assert stats.num_blocks_free == stats.num_blocks_total == num_blocks
    assert stats.num_blocks_used == 0 and stats.num_running == stats.num_waiting == 0


def test_a_shared_256_token_prefix_comes_from_the_cache(demo_llm: LLM) -> None:
    generator = torch.Generator().manual_seed(2)
    prefix = torch.randint(100, 40000, (256,), generator=generator).tolist()
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    demo_llm.generate([prefix + [11, 12, 13]], params)
    (second,) = demo_llm.generate([prefix + [21, 22, 23, 24]], params)
    assert second.num_cached_tokens >= 240
    uncached = LLMEngine(
        EngineConfig(demo_llm.engine.config.model_dir, enable_prefix_caching=False),
        runner=demo_llm.engine.runner,
    )
    (fresh,) = LLM(engine=uncached).generate([prefix + [21, 22, 23, 24]], params)
    assert fresh.num_cached_tokens == 0
    assert fresh.outputs[0].token_ids == second.outputs[0].token_ids


# ---- sampling features end to end ----
def test_logprobs_and_prompt_logprobs_match_the_model(demo_llm: LLM, demo_hf) -> None:
    prompt = PROMPTS[2]
    ids = demo_llm.tokenizer.encode(prompt)
    chunked = LLMEngine(
        EngineConfig(demo_llm.engine.config.model_dir, max_num_batched_tokens=7),
        runner=demo_llm.engine.runner,
    )
    params = SamplingParams(temperature=0, max_tokens=3, logprobs=2, prompt_logprobs=1)
    (out,) = LLM(engine=chunked).generate([prompt], params)
    with torch.no_grad():
        full = ids + out.outputs[0].token_ids
        expected = torch.log_softmax(demo_hf(torch.tensor([full])).logits[0].float(), dim=-1)
    assert out.prompt_logprobs is not None and out.prompt_logprobs[0] is None
    assert len(out.prompt_logprobs) == len(ids)
    for position in range(1, len(ids)):
        entry = out.prompt_logprobs[position]
        assert entry is not None and ids[position] in entry and len(entry) <= 2
        want = expected[position - 1, ids[position]].item()
        assert entry[ids[position]] == pytest.approx(want, abs=1e-3)
    completion = out.outputs[0]
    assert completion.logprobs is not None and len(completion.logprobs) == 3
    total = 0.0
    for step, (token_id, entry) in enumerate(
        zip(completion.token_ids, completion.logprobs, strict=True)
    ):
        want = expected[len(ids) - 1 + step, token_id].item()
        assert entry[token_id] == pytest.approx(want, abs=1e-3)
        assert token_id == max(entry, key=entry.get)  # greedy picks the top logprob
        total += entry[token_id]
    assert completion.cumulative_logprob == pytest.approx(total)


def test_n_completions_share_the_prompt_and_seeds_reproduce(demo_llm: LLM) -> None:
    params = SamplingParams(
        n=3, temperature=1.0, seed=123, max_tokens=6, ignore_eos=True, prompt_logprobs=0
    )
    prompt = PROMPTS[4]
    (first,) = demo_llm.generate([prompt], params)
    assert first.prompt_logprobs is not None
    assert len(first.prompt_logprobs) == len(first.prompt_token_ids)
    (again,) = demo_llm.generate([prompt], params)
    assert [o.index for o in first.outputs] == [0, 1, 2]
    assert [o.token_ids for o in first.outputs] == [o.token_ids for o in again.outputs]
    assert len({tuple(o.token_ids) for o in first.outputs}) > 1
    assert all(o.finish_reason == "length" and len(o.token_ids) == 6 for o in first.outputs)
    assert demo_llm.engine.stats().num_blocks_used == 0


def test_stop_strings_end_the_text_before_them(demo_llm: LLM) -> None:
    (free,) = demo_llm.generate([PROMPTS[1]], SamplingParams(temperature=0, max_tokens=16))
    text = free.outputs[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    (stopped,) = demo_llm.generate([PROMPTS[1]], SamplingParams(temperature=0, stop=[stop]))
    completion = stopped.outputs[0]
    assert completion.finish_reason == "stop" and completion.stop_reason == stop
    assert completion.text == text[: text.index(stop)]


def test_chat_uses_the_template(demo_llm: LLM) -> None:
    messages = [{"role": "user", "content": "Say hello."}]
    (chat,) = demo_llm.chat(messages, SamplingParams(temperature=0, max_tokens=8))
    rendered = demo_llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    ids = demo_llm.tokenizer.encode(rendered, add_special_tokens=False)
    assert chat.prompt_token_ids == ids
    (plain,) = demo_llm.generate([ids], SamplingParams(temperature=0, max_tokens=8))
    assert chat.outputs[0].token_ids == plain.outputs[0].token_ids


# ---- bad input and failures ----
def test_bad_requests_fail_alone_while_others_finish(demo_llm: LLM) -> None:
    engine = demo_llm.engine
    good = [engine.add_request(p, SamplingParams(temperature=0, max_tokens=4)) for p in PROMPTS[:2]]
    with pytest.raises(PromptTooLong) as too_long:
        engine.add_request(list(range(5, 1030)))
    assert "1025 tokens" in too_long.value.message and "1024" in too_long.value.message
    with pytest.raises(RequestError, match="top_p=2"):
        engine.add_request("hi", SamplingParams(top_p=2))
    with pytest.raises(RequestError, match="max_tokens=2000"):
        engine.add_request("hi", SamplingParams(max_tokens=2000))
    with pytest.raises(RequestError, match="49152"):
        engine.add_request([1, 49152])
    with pytest.raises(RequestError, match="already in use"):
        engine.add_request("hi", request_id=good[0])
    finished = {}
    while engine.has_unfinished():
        for delta in engine.step():
            if delta.final is not None:
                finished[delta.request_id] = delta.final
    assert set(finished) == set(good)
    assert all(len(o.outputs[0].token_ids) == 4 for o in finished.values())
    with pytest.raises(PromptTooLong):
        demo_llm.generate(["fine", list(range(5, 2000))])
    assert not engine.has_unfinished()  # nothing of the failed batch was queued


def test_abort_frees_blocks_at_once(demo_llm: LLM) -> None:
    engine = demo_llm.engine
    request_id = engine.add_request(PROMPTS[6], SamplingParams(max_tokens=50))
    engine.step()
    engine.step()
    assert engine.stats().num_blocks_used > 0
    (delta,) = engine.abort_request(request_id)
    assert delta.finish_reason == "abort" and delta.final is not None
    assert delta.final.outputs[0].finish_reason == "abort"
    assert engine.stats().num_blocks_used == 0 and not engine.has_unfinished()
    assert engine.abort_request(request_id) == []


POISON = 31337


class PoisonedRunner:
    """The real runner, except that computing the token POISON raises (a model failure)."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner

    def __getattr__(self, name: str):
        return getattr(self.runner, name)

    def execute(self, seqs: list[StepSeq]) -> StepOutput:
        for seq in seqs:
            if POISON in seq.token_ids[seq.num_computed : seq.num_computed + seq.num_new]:
                raise RuntimeError("kernel exploded")
        return self.runner.execute(seqs)


def test_a_model_failure_fails_only_the_affected_request(
    demo_llm: LLM, demo_references: list[Reference]
) -> None:
    runner = PoisonedRunner(demo_llm.engine.runner)
    engine = LLMEngine(EngineConfig(demo_llm.engine.config.model_dir), runner=runner)  # type: ignore[arg-type]
    llm = LLM(engine=engine)
    params = SamplingParams(temperature=0, max_tokens=6)
    poisoned = demo_llm.tokenizer.encode(PROMPTS[3]) + [POISON]
    outs = llm.generate([PROMPTS[0], poisoned, PROMPTS[1], PROMPTS[2]], params)
    bad = outs[1]
    assert isinstance(bad.error, EngineError) and "kernel exploded" in bad.error.message
    assert bad.outputs[0].finish_reason == "abort"
    for out, reference in zip([outs[0], *outs[2:]], demo_references[:3], strict=True):
        assert out.error is None and len(out.outputs[0].token_ids) == 6
        reference.check(out.outputs[0].token_ids)
    stats = engine.stats()
    assert stats.num_failed_steps >= 1 and stats.num_blocks_used == 0
    (after,) = llm.generate([PROMPTS[0]], params)  # still serving
    demo_references[0].check(after.outputs[0].token_ids)
