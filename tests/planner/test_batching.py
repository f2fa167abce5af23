"""The planner's ``max_num_seqs`` sizing (:mod:`kunlun.planner.batching`): monotonic in the
KV memory, bounded by what the KV holds at the average context (so by ``max_model_len``),
stopped at the roofline knee where the device declares one, overridden by ``max_num_seqs``
(``batch_size``, its old name, still read),
and explained by ``plan --explain``; and the step budget (``max_num_batched_tokens``):
monotonic in the declared compute, never below one decode per sequence plus a prompt chunk,
never above ``max_num_seqs * max_model_len``, overridden by the spec, handed to the engine."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from tests.planner.conftest import model, node
from tests.planner.test_plan_cli import cli, mixed

from kunlun.engine.launch import EMBEDDED_ENGINE
from kunlun.errors import ConfigError
from kunlun.planner.batching import (
    DEFAULT_STEP_TOKENS,
    GRAPH_SIZES_UP_TO,
    MAX_STEP_TOKENS,
    MIN_PREFILL_CHUNK,
    SATURATION,
    graph_batch_sizes,
    graph_capture,
    saturation_batch,
    size_batch,
    size_step_tokens,
)
from kunlun.planner.capacity import capacity_of
from kunlun.planner.estimate import BLOCK_SIZE, MAX_AUTO_BATCH, MIB, average_context, tokens_per_s
from kunlun.planner.launch import engine_launch
from kunlun.workload.placement import place
from kunlun.workload.spec import WorkloadSpec, current_names, parse_spec

CAPS = {p.device_type: capacity_of(p) for p in node("mixed").profiles}
LENGTHS = (128, 512, 1024, 2048, 8192)


@pytest.mark.parametrize("device", sorted(CAPS))
@pytest.mark.parametrize("name", ["Qwen2-0.5B", "Llama-3-8B"])
def test_more_kv_memory_never_means_fewer_sequences(device: str, name: str) -> None:
    info, cap = model(name), CAPS[device]
    for max_model_len in LENGTHS:
        sizes = [size_batch(info, cap, "fp16", "none", 1, max_model_len, kv).max_num_seqs
                 for kv in (1, 64, 256, 1024, 4096, 16384, 65536)]  # fmt: skip
        assert sizes == sorted(sizes), (max_model_len, sizes)
        assert 1 <= sizes[0] and sizes[-1] <= MAX_AUTO_BATCH


@pytest.mark.parametrize("device", sorted(CAPS))
def test_the_kv_holds_every_sequence_at_the_average_context(device: str) -> None:
    info, cap = model("Qwen2-0.5B"), CAPS[device]
    for kv_mb in (16, 256, 2048):
        kv_tokens = kv_mb * MIB // info.kv_bytes_per_token("fp16")
        sizes = []
        for max_model_len in LENGTHS:
            seqs = size_batch(info, cap, "fp16", "none", 1, max_model_len, kv_mb).max_num_seqs
            assert seqs == 1 or seqs * average_context(max_model_len) <= kv_tokens
            sizes.append(seqs)
        assert sizes == sorted(sizes, reverse=True)  # longer contexts, never more sequences


def test_the_batch_stops_where_the_decode_estimate_saturates() -> None:
    info = model("Qwen2-0.5B")
    # a device with little compute for its bandwidth (5 TFLOPS fp16, 320 GB/s)
    slow = dataclasses.replace(CAPS["nvidia"], compute={"fp16": 5.0})
    knee = saturation_batch(info, slow, "fp16", "none", 1, average_context(2048))
    assert knee is not None and 1 < knee < MAX_AUTO_BATCH
    rate = [tokens_per_s(info, slow, "fp16", "none", 1, b, 2048) for b in (knee - 1, knee, 512)]
    assert rate[0] is not None and rate[1] is not None and rate[2] is not None
    assert rate[0] < SATURATION * rate[2] <= rate[1] <= rate[2]
    plenty = size_batch(info, slow, "fp16", "none", 1, 2048, 1 << 20)
    assert plenty.max_num_seqs == knee and f"of its limit at {knee} sequences" in plenty.reason
    # without a bandwidth figure (a CPU's default) the estimate ignores the batch: memory decides
    bare = dataclasses.replace(slow, bandwidth_gbps=None)
    assert saturation_batch(info, bare, "fp16", "none", 1, 1024) is None
    assert size_batch(info, bare, "fp16", "none", 1, 2048, 1 << 20).max_num_seqs == MAX_AUTO_BATCH


def test_the_spec_overrides_and_the_plan_uses_the_sized_batch() -> None:
    info = model("Qwen2-0.5B")
    sized = place(WorkloadSpec(model="Qwen2-0.5B", device="nvidia:0", max_model_len=2048),
                  node("mixed"), info).plans[0]  # fmt: skip
    knee = saturation_batch(info, CAPS["nvidia"], sized.dtype, "none", 1, average_context(2048))
    assert sized.max_num_seqs == min(knee or MAX_AUTO_BATCH, MAX_AUTO_BATCH)
    assert any(n.startswith(f"max_num_seqs {sized.max_num_seqs}: the KV") for n in sized.notes)
    fixed = place(WorkloadSpec(model="Qwen2-0.5B", device="nvidia:0", max_model_len=2048,
                               max_num_seqs=3), node("mixed"), info).plans[0]  # fmt: skip
    assert fixed.max_num_seqs == 3 and "max_num_seqs 3: the spec's" in fixed.notes


def test_batch_size_is_read_as_max_num_seqs_and_both_names_at_once_are_refused() -> None:
    old = parse_spec({"model": "Qwen2-0.5B", "batch_size": 3}, "old.yaml")
    assert old.max_num_seqs == 3
    written = old.model_dump(exclude_unset=True)
    assert written == {"model": "Qwen2-0.5B", "max_num_seqs": 3}  # stored under the new name
    with pytest.raises(ConfigError) as both:
        parse_spec({**written, "batch_size": 5}, "old.yaml")
    assert "max_num_seqs and batch_size (its old name) are both given (3 and 5)" in str(both.value)
    assert str(both.value).startswith("old.yaml")
    stored = {"model": "Qwen2-0.5B", "batch_size": None}  # a workload stored before the rename
    assert parse_spec({**stored, "max_num_seqs": 4}).max_num_seqs == 4
    assert current_names({**stored, "batch_size": 2}) == {"model": "Qwen2-0.5B", "max_num_seqs": 2}
    both_given = {"max_num_seqs": 3, "batch_size": 5}  # kept for the spec to refuse, by name
    assert current_names(both_given) == both_given
    with pytest.raises(ConfigError, match=r"batch_size: Input should be greater than or equal"):
        parse_spec({"model": "Qwen2-0.5B", "batch_size": 0})  # named as given
    with pytest.raises(ConfigError, match=r"did you mean 'max_num_seqs'"):
        parse_spec({"model": "Qwen2-0.5B", "batch_sise": 2})


def test_plan_explain_shows_the_sizing_and_max_num_seqs_overrides(tmp_path: Path) -> None:
    args = ("--model", "Qwen2-0.5B", "--device", "nvidia:0", "--max-model-len", "2048", *mixed())
    explained = cli(*args, "--explain", home=tmp_path)
    assert explained.returncode == 0, explained.stderr
    assert "max_num_seqs" in explained.stdout and "of its limit at" in explained.stdout
    forced = cli(*args, "--max-num-seqs", "5", "--json", home=tmp_path)
    assert forced.returncode == 0, forced.stderr
    assert json.loads(forced.stdout)["plan"]["max_num_seqs"] == 5
    old = cli(*args, "--batch-size", "6", "--json", home=tmp_path)  # the flag's old name
    assert old.returncode == 0, old.stderr
    assert json.loads(old.stdout)["plan"]["max_num_seqs"] == 6


def test_more_declared_compute_never_means_a_smaller_step() -> None:
    info = model("Llama-3-8B")
    for seqs, max_model_len in ((1, 64), (8, 512), (45, 8192), (64, 2048)):
        sizes = []
        for tflops in (0.5, 5.0, 50.0, 400.0, 1000.0, 4000.0):
            cap = dataclasses.replace(CAPS["nvidia"], compute={"fp16": tflops})
            sizes.append(size_step_tokens(info, cap, "fp16", "none", 1, max_model_len, seqs).tokens)
        assert sizes == sorted(sizes), (seqs, max_model_len, sizes)
        ceiling = min(MAX_STEP_TOKENS, seqs * max_model_len)
        floor = min(seqs + MIN_PREFILL_CHUNK, ceiling)
        assert all(floor <= s <= ceiling for s in sizes), (seqs, max_model_len, sizes)
    # mid-range compute: whole KV blocks of 50 ms of it
    cap = dataclasses.replace(CAPS["nvidia"], compute={"fp16": 400.0})
    step = size_step_tokens(info, cap, "fp16", "none", 1, 8192, 8)
    assert step.tokens % BLOCK_SIZE == 0 and "50 ms of the declared compute" in step.reason


def test_a_device_without_a_compute_figure_gets_the_measured_default() -> None:
    info = model("Qwen2-0.5B")
    bare = dataclasses.replace(CAPS["nvidia"], compute={})
    assert size_step_tokens(info, bare, "fp16", "none", 1, 8192, 8).tokens == DEFAULT_STEP_TOKENS
    # the floor wins over the default for a wide batch, max_model_len over both
    wide = size_step_tokens(info, bare, "fp16", "none", 1, 8192, 256)
    assert wide.tokens == 256 + MIN_PREFILL_CHUNK and "raised to" in wide.reason
    short = size_step_tokens(info, bare, "fp16", "none", 1, 16, 2)
    assert short.tokens == 32 and "capped at 32" in short.reason


def test_the_plan_hands_its_step_budget_to_the_engine_and_the_spec_overrides_it() -> None:
    info = model("Qwen2-0.5B")
    spec = WorkloadSpec(model="Qwen2-0.5B", device="nvidia:0", max_model_len=2048)
    sized = place(spec, node("mixed"), info).plans[0]
    expected = size_step_tokens(info, CAPS["nvidia"], sized.dtype, "none", 1, 2048,
                                sized.max_num_seqs)  # fmt: skip
    assert sized.max_num_batched_tokens == expected.tokens
    assert expected.reason in sized.notes and "max_num_batched_tokens" in sized.summary()
    launch = engine_launch(sized, None, "/models/q", "q", None, 2)
    assert launch.max_num_batched_tokens == sized.max_num_batched_tokens
    assert launch.engine_config().max_num_batched_tokens == sized.max_num_batched_tokens
    fixed = place(spec.model_copy(update={"max_num_batched_tokens": 96}), node("mixed"),
                  info).plans[0]  # fmt: skip
    assert fixed.max_num_batched_tokens == 96
    assert "max_num_batched_tokens 96: the spec's" in fixed.notes


def test_plan_explain_shows_the_step_budget_and_the_flag_overrides(tmp_path: Path) -> None:
    args = ("--model", "Qwen2-0.5B", "--device", "nvidia:0", "--max-model-len", "2048", *mixed())
    explained = cli(*args, "--explain", home=tmp_path)
    assert explained.returncode == 0, explained.stderr
    assert "max_num_batched_tokens" in explained.stdout and "chunked-prefill" in explained.stdout
    plain = cli(*args, home=tmp_path)
    assert plain.returncode == 0 and "max_num_batched_tokens: " in plain.stdout, plain.stderr
    forced = cli(*args, "--max-num-batched-tokens", "200", "--json", home=tmp_path)
    assert forced.returncode == 0, forced.stderr
    assert json.loads(forced.stdout)["plan"]["max_num_batched_tokens"] == 200
    bad = cli(*args, "--max-num-batched-tokens", "0", home=tmp_path)
    assert bad.returncode != 0 and "max_num_batched_tokens" in bad.stderr


def test_nvidia_plans_capture_decode_graphs_for_the_batch_sizes_max_num_seqs_allows() -> None:
    """On a device whose plugin declares graph capture (NVIDIA: torch.cuda.CUDAGraph), the
    plan lists the decode batch sizes to capture, up to its ``max_num_seqs``, says so in its
    notes and hands them to the engine; the declaration's ``cuda_graphs: false``, more than one
    rank or another engine turn it off with a note; a device family without graph capture
    (Ascend here) has none and says nothing."""
    info = model("Qwen2-0.5B")
    spec = WorkloadSpec(model="Qwen2-0.5B", device="nvidia:0", max_model_len=2048, max_num_seqs=40)
    plan = place(spec, node("mixed"), info).plans[0]
    assert plan.graph_batch_sizes == [1, 2, 4, 8, 16, 32, 40]
    said = "decode steps captured as graphs (torch.cuda.CUDAGraph) for batch sizes 1, 2, 4, 8"
    assert any(n.startswith(said) for n in plan.notes)
    assert plan.engine_options["graph_capture"] is True
    assert not any("graph_capture" in n and "not use" in n for n in plan.notes)
    launch = engine_launch(plan, None, "/models/q", "q", None, 2)
    assert launch.engine_config().graph_batch_sizes == (1, 2, 4, 8, 16, 32, 40)
    assert graph_batch_sizes(3) == [1, 2, 3] and graph_batch_sizes(16) == [1, 2, 4, 8, 16]
    assert graph_batch_sizes(2000)[-1] == GRAPH_SIZES_UP_TO
    off = dataclasses.replace(CAPS["nvidia"], custom_attributes={"cuda_graphs": False})
    assert graph_capture(off, 1, EMBEDDED_ENGINE, 40) == (
        [],
        "graph capture (torch.cuda.CUDAGraph) off: the declaration's cuda_graphs is false",
    )
    sizes, why = graph_capture(CAPS["nvidia"], 2, EMBEDDED_ENGINE, 40)
    assert sizes == [] and why is not None and "one rank, not 2" in why
    sizes, why = graph_capture(CAPS["nvidia"], 1, "vllm", 40)
    assert sizes == [] and why is not None and "vllm decides its own" in why
    plan.set_engine("vllm")  # auto chose an external engine: the embedded engine's graphs go
    assert plan.graph_batch_sizes == [] and not any(n.startswith(said) for n in plan.notes)
    assert "graph capture is the embedded engine's; vllm decides its own" in plan.notes
    npu = place(WorkloadSpec(model="Qwen2-0.5B", device="ascend:0"), node("mixed"), info).plans[0]
    assert npu.graph_batch_sizes == [] and not any("graph" in n for n in npu.notes)
