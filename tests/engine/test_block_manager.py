"""Paged KV blocks: allocation, reference counts, prefix caching and LRU eviction."""

from __future__ import annotations

import random

from kunlun.engine.block_manager import NO_MATCH, BlockManager
from kunlun.engine.sampling_params import SamplingParams
from kunlun.engine.sequence import Sequence

BLOCK = 4


def seq_of(tokens: list[int]) -> Sequence:
    return Sequence("r", tokens, SamplingParams())


def admit(manager: BlockManager, seq: Sequence, *, compute: bool = True) -> int:
    """Admit ``seq`` for its whole length, as the scheduler does; return cached tokens."""
    match = manager.match_prefix(seq)
    num_new = seq.num_tokens - match.num_tokens
    assert manager.can_allocate(match, num_new)
    manager.allocate(seq, match, num_new)
    seq.num_computed = match.num_tokens
    if compute:
        seq.num_computed += num_new
        manager.cache_full_blocks(seq, num_new)
    return match.num_tokens


def check_invariants(manager: BlockManager, seqs: list[Sequence]) -> None:
    stats = manager.stats()
    assert stats.num_free_blocks + stats.num_used_blocks == stats.num_blocks
    held = {b for s in seqs for b in s.block_table}
    assert stats.num_used_blocks == len(held)
    for block_id in held:
        refs = sum(s.block_table.count(block_id) for s in seqs)
        assert manager._blocks[block_id].ref_count == refs


def test_allocate_and_deallocate_return_every_block() -> None:
    manager = BlockManager(8, BLOCK)
    a, b = seq_of(list(range(10))), seq_of(list(range(100, 105)))
    admit(manager, a)
    admit(manager, b)
    assert len(a.block_table) == 3 and len(b.block_table) == 2
    assert manager.stats().num_used_blocks == 5
    manager.deallocate(a)
    manager.deallocate(b)
    assert manager.stats().num_free_blocks == 8 and a.block_table == []


def test_prefix_hit_reuses_full_blocks_but_never_the_whole_sequence() -> None:
    manager = BlockManager(16, BLOCK)
    first = seq_of(list(range(12)))  # three full blocks
    assert admit(manager, first) == 0
    same = seq_of(list(range(12)))
    match = manager.match_prefix(same)
    assert match.num_tokens == 8  # the last block is recomputed to get logits
    longer = seq_of(list(range(12)) + [50, 51])
    assert admit(manager, longer) == 12
    assert longer.block_table[:3] == first.block_table
    check_invariants(manager, [first, longer])
    assert manager.stats().prefix_hit_tokens == 12


def test_a_different_block_breaks_the_chain() -> None:
    manager = BlockManager(16, BLOCK)
    admit(manager, seq_of(list(range(12))))
    other = seq_of([0, 1, 2, 3, 9, 9, 9, 9, 8, 9, 10, 11, 12])
    assert manager.match_prefix(other).num_tokens == 4  # block 3 equals, but after a change


def test_half_written_blocks_are_not_findable() -> None:
    manager = BlockManager(16, BLOCK)
    writer = seq_of(list(range(12)))
    admit(manager, writer, compute=False)  # allocated, KV not yet computed
    assert manager.match_prefix(seq_of(list(range(13)))).num_tokens == 0
    writer.num_computed = 6  # one chunk of 6 tokens computed: one full block
    manager.cache_full_blocks(writer, 6)
    assert manager.match_prefix(seq_of(list(range(13)))).num_tokens == 4


def test_freed_cached_blocks_stay_findable_until_needed() -> None:
    manager = BlockManager(4, BLOCK)
    a = seq_of(list(range(8)))
    admit(manager, a)
    manager.deallocate(a)
    assert manager.stats().num_free_blocks == 4 and manager.stats().num_cached_blocks == 2
    again = seq_of(list(range(9)))
    assert admit(manager, again) == 8
    manager.deallocate(again)
    # new content needs all four blocks: the cached ones are evicted
    filler = seq_of(list(range(200, 216)))
    admit(manager, filler)
    assert manager.match_prefix(seq_of(list(range(9)))) == NO_MATCH


def test_uncached_free_blocks_are_reused_before_cached_ones_and_lru_order() -> None:
    manager = BlockManager(6, BLOCK)
    old = seq_of(list(range(8)))  # 2 cached blocks, freed first
    new = seq_of(list(range(100, 108)))  # 2 cached blocks, freed later
    scratch = seq_of([7, 7])  # a partial block: never cached
    for s in (old, new, scratch):
        admit(manager, s)
    for s in (old, new, scratch):
        manager.deallocate(s)
    # 3 blocks: the never-used one and scratch's (no hash), then old's tail block (least
    # recently freed, and a sequence's tail goes before its head)
    taker = seq_of(list(range(300, 311)))
    admit(manager, taker, compute=False)
    assert manager.match_prefix(seq_of(list(range(100, 109)))).num_tokens == 8  # new survives
    assert manager.match_prefix(seq_of(list(range(9)))).num_tokens == 4  # old lost its tail


def test_can_allocate_counts_free_blocks_that_a_hit_reclaims() -> None:
    manager = BlockManager(3, BLOCK)
    a = seq_of(list(range(8)))
    admit(manager, a)
    manager.deallocate(a)
    b = seq_of(list(range(8)) + [1, 2, 3, 4])
    match = manager.match_prefix(b)
    assert match.num_tokens == 8
    assert manager.can_allocate(match, 4)  # 2 reclaimed + 1 new = 3 free
    assert not manager.can_allocate(match, 5)  # would need a fourth block


def test_can_append_and_append_grow_one_block_at_a_time() -> None:
    manager = BlockManager(3, BLOCK)
    s = seq_of([1, 2, 3])
    admit(manager, s)
    for token in range(4, 13):
        s.append_token(token)
        assert manager.can_append(s, 1)
        manager.append(s, 1)
        s.num_computed += 1
        manager.cache_full_blocks(s, 1)
    assert len(s.block_table) == 3
    s.append_token(13)
    assert not manager.can_append(s, 1)


def test_random_workload_keeps_reference_counts_consistent() -> None:
    rng = random.Random(0)
    manager = BlockManager(40, BLOCK)
    prefixes = [[rng.randrange(50) for _ in range(12)] for _ in range(3)]
    live: list[Sequence] = []
    for _ in range(300):
        if live and rng.random() < 0.4:
            manager.deallocate(live.pop(rng.randrange(len(live))))
        else:
            tokens = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randrange(1, 9))]
            s = seq_of(tokens)
            match = manager.match_prefix(s)
            if manager.can_allocate(match, s.num_tokens - match.num_tokens):
                admit(manager, s)
                live.append(s)
        check_invariants(manager, live)
    for s in live:
        manager.deallocate(s)
    assert manager.stats().num_free_blocks == 40
