"""The scheduler with a real block manager; the model's part is played by a counter.

Each simulated step "samples" token 7 for every sequence that completed its known tokens,
and a sequence finishes after ``max_tokens`` outputs, as the engine would decide.
"""

from __future__ import annotations

from kunlun.engine.block_manager import BlockManager
from kunlun.engine.sampling_params import SamplingParams
from kunlun.engine.scheduler import Scheduler, SchedulerOutput, StepLimits
from kunlun.engine.sequence import Sequence, SequenceStatus

BLOCK = 4


def make(num_blocks: int = 64, max_seqs: int = 8, budget: int = 64) -> Scheduler:
    return Scheduler(StepLimits(max_seqs, budget), BlockManager(num_blocks, BLOCK))


def seq_of(
    request_id: str,
    length: int,
    *,
    max_tokens: int = 4,
    priority: int = 0,
    start: int = 0,
    arrival: float | None = None,
) -> Sequence:
    params = SamplingParams(max_tokens=max_tokens, priority=priority)
    return Sequence(request_id, list(range(start, start + length)), params, arrival_time=arrival)


def step(scheduler: Scheduler) -> SchedulerOutput:
    out = scheduler.schedule()
    sampled = [
        7 if s.num_computed + n == s.num_tokens else None
        for s, n in zip(out.seqs, out.num_new_tokens, strict=True)
    ]
    scheduler.postprocess(out, sampled)
    for seq in out.seqs:
        if seq.status is SequenceStatus.RUNNING and seq.num_output_tokens >= seq.params.max_tokens:
            scheduler.finish(seq, "length")
    return out


def run_to_end(scheduler: Scheduler, limit: int = 1000) -> list[SchedulerOutput]:
    outs = []
    while scheduler.has_unfinished():
        outs.append(step(scheduler))
        assert len(outs) < limit, "the scheduler made no progress"
    return outs


def test_long_prompt_is_prefilled_in_chunks_within_the_budget() -> None:
    scheduler = make(budget=32)
    seq = seq_of("a", 100)
    scheduler.add([seq])
    chunks = [step(scheduler).num_new_tokens for _ in range(4)]
    assert chunks == [[32], [32], [32], [4]]
    assert seq.num_output_tokens == 1  # the last chunk yields the first token
    assert step(scheduler).num_new_tokens == [1]


def test_decodes_go_first_and_a_new_prompt_takes_the_rest_of_the_budget() -> None:
    scheduler = make(budget=16)
    a = seq_of("a", 10, max_tokens=10)
    scheduler.add([a])
    step(scheduler)
    b = seq_of("b", 40, start=100)
    scheduler.add([b])
    out = step(scheduler)
    assert out.seqs == [a, b] and out.num_new_tokens == [1, 15]
    assert out.num_batched_tokens == 16


def test_max_num_seqs_caps_the_running_set() -> None:
    scheduler = make(max_seqs=2)
    for i in range(5):
        scheduler.add([seq_of(str(i), 5, start=10 * i)])
    for out in run_to_end(scheduler):
        assert len(out) <= 2
    assert scheduler.block_manager.stats().num_used_blocks == 0


def test_priority_classes_then_fifo() -> None:
    scheduler = make(max_seqs=1)
    low = seq_of("low", 4, priority=5, arrival=1.0)
    first = seq_of("first", 4, priority=0, arrival=2.0, start=10)
    second = seq_of("second", 4, priority=0, arrival=3.0, start=20)
    for s in (low, second, first):
        scheduler.add([s])
    order = []
    for out in run_to_end(scheduler):
        for s in out.seqs:
            if s.request_id not in order:
                order.append(s.request_id)
    assert order == ["first", "second", "low"]


def test_running_out_of_blocks_preempts_the_newest_and_everything_finishes() -> None:
    # 8 blocks of 4 = 32 slots; four sequences of 6 prompt + 8 output tokens need 4 blocks each
    scheduler = make(num_blocks=8, budget=64)
    seqs = [seq_of(str(i), 6, max_tokens=8, start=10 * i, arrival=float(i)) for i in range(4)]
    for s in seqs:
        scheduler.add([s])
    run_to_end(scheduler)
    assert scheduler.num_preemptions > 0
    assert seqs[0].num_preemptions == 0  # the oldest is never the victim
    assert all(s.num_output_tokens == 8 for s in seqs)
    assert scheduler.block_manager.stats().num_free_blocks == 8


def test_a_preempted_sequence_waits_ahead_of_later_arrivals() -> None:
    scheduler = make(num_blocks=4, max_seqs=2)
    a = seq_of("a", 4, max_tokens=8, arrival=1.0)
    b = seq_of("b", 4, max_tokens=8, arrival=2.0, start=10)
    scheduler.add([a])
    scheduler.add([b])
    while b.num_preemptions == 0:
        step(scheduler)
    late = seq_of("late", 4, arrival=3.0, start=20)
    scheduler.add([late])
    assert scheduler.waiting[0] is b
    assert b.num_computed == 0 and b.block_table == []


def test_prefix_hit_at_admission_sets_num_computed() -> None:
    scheduler = make()
    first = seq_of("a", 20, max_tokens=1)
    scheduler.add([first])
    run_to_end(scheduler)
    again = seq_of("b", 20, max_tokens=1)
    scheduler.add([again])
    out = scheduler.schedule()
    assert again.num_computed == 16 and again.num_cached_tokens == 16
    assert out.num_new_tokens == [4]


def test_siblings_wait_for_the_prompt_then_share_its_blocks() -> None:
    scheduler = make()
    params = SamplingParams(n=3, max_tokens=3)
    seqs = [Sequence("r", list(range(18)), params, index=i, arrival_time=0.0) for i in range(3)]
    scheduler.add(seqs)
    out = step(scheduler)
    assert out.seqs == [seqs[0]]
    out = step(scheduler)
    assert set(out.seqs) == set(seqs)
    assert seqs[1].num_cached_tokens == 16
    assert seqs[1].block_table[:4] == seqs[0].block_table[:4]
    run_to_end(scheduler)
    assert scheduler.block_manager.stats().num_used_blocks == 0


def test_abort_frees_blocks_of_running_waiting_and_held_siblings() -> None:
    scheduler = make(max_seqs=1)
    running = seq_of("x", 10)
    scheduler.add([running])
    params = SamplingParams(n=2)
    scheduler.add([Sequence("y", [1, 2, 3], params, index=i) for i in range(2)])
    step(scheduler)
    assert scheduler.block_manager.stats().num_used_blocks > 0
    aborted = scheduler.abort("x") + scheduler.abort("y")
    assert len(aborted) == 3 and all(s.finish_reason == "abort" for s in aborted)
    assert not scheduler.has_unfinished()
    assert scheduler.block_manager.stats().num_used_blocks == 0
