"""Paged KV-cache blocks: allocation, reference counts and prefix caching.

The KV cache is ``num_blocks`` blocks of ``block_size`` token slots. A sequence holds a
``block_table`` of block ids covering its positions. A block that is full of *computed*
tokens gets a content hash, chained with the hash of the block before it (so equal hashes
mean equal prefixes); a later sequence whose prompt starts with the same blocks reuses them
instead of recomputing (prefix caching). Blocks are reference counted: shared prefix blocks
have one reference per sequence. A freed block keeps its hash and stays findable until it is
needed for new content; free blocks are reused least-recently-freed first, blocks without a
hash before cached ones (LRU eviction of the cache).

The scheduler uses paired verbs: :meth:`match_prefix` + :meth:`can_allocate` /
:meth:`allocate` when a sequence is admitted, :meth:`can_append` / :meth:`append` for each
later step, :meth:`cache_full_blocks` after a step computed tokens, and :meth:`deallocate`
when the sequence finishes or is preempted. It gets :class:`PrefixMatch` and
:class:`BlockStats` back, never the blocks themselves.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass

from kunlun.engine.sequence import Sequence


@dataclass(frozen=True)
class PrefixMatch:
    """Cached blocks that cover the head of one sequence (an opaque admission ticket).

    ``num_tokens`` is a multiple of the block size and always smaller than the sequence's
    length: the last token is recomputed so that the step yields its logits.
    """

    block_ids: tuple[int, ...] = ()
    num_tokens: int = 0


NO_MATCH = PrefixMatch()


@dataclass(frozen=True)
class BlockStats:
    """A snapshot of the block pool."""

    num_blocks: int
    num_free_blocks: int
    """Blocks no sequence holds (cached or not): what new content can use."""
    num_used_blocks: int
    num_cached_blocks: int
    """Blocks that carry a prefix hash (held or free)."""
    prefix_hit_tokens: int
    """Total prompt tokens served from the prefix cache at admission."""
    prefix_query_tokens: int
    """Total tokens looked up in the prefix cache at admission."""


class _Block:
    __slots__ = ("block_id", "ref_count", "hash")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.hash: bytes | None = None


class BlockManager:
    """Owns the pool of KV blocks; sequences only see their ``block_table``."""

    def __init__(self, num_blocks: int, block_size: int, *, enable_prefix_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks={num_blocks} and block_size={block_size} must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._blocks = [_Block(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        """Free block ids, next to be reused first."""
        self._hash_to_block: dict[bytes, int] = {}
        self._hit_tokens = 0
        self._query_tokens = 0

    # ---- admission ----
    def match_prefix(self, seq: Sequence) -> PrefixMatch:
        """The longest run of cached full blocks equal to the head of ``seq`` (read-only)."""
        if not self.enable_prefix_caching:
            return NO_MATCH
        self._update_hashes(seq)
        max_blocks = (seq.num_tokens - 1) // self.block_size
        block_ids: list[int] = []
        for block_hash in seq.block_hashes[:max_blocks]:
            block_id = self._hash_to_block.get(block_hash)
            if block_id is None:
                break
            block_ids.append(block_id)
        return PrefixMatch(tuple(block_ids), len(block_ids) * self.block_size)

    def can_allocate(self, match: PrefixMatch, num_new_tokens: int) -> bool:
        """Whether ``allocate(seq, match, num_new_tokens)`` would find enough blocks."""
        num_held = len(match.block_ids)
        needed = self._blocks_for(match.num_tokens + num_new_tokens) - num_held
        reclaimed = sum(1 for b in match.block_ids if self._blocks[b].ref_count == 0)
        return needed + reclaimed <= len(self._free)

    def allocate(self, seq: Sequence, match: PrefixMatch, num_new_tokens: int) -> None:
        """Give ``seq`` (holding no blocks) the matched blocks plus fresh ones so that its
        table covers ``match.num_tokens + num_new_tokens`` positions.

        The caller must have checked :meth:`can_allocate` with the same arguments, and sets
        ``seq.num_computed = match.num_tokens``.
        """
        if seq.block_table:
            raise RuntimeError(f"{seq!r} already holds blocks")
        for block_id in match.block_ids:
            block = self._blocks[block_id]
            if block.ref_count == 0:
                del self._free[block_id]
            block.ref_count += 1
        seq.block_table = list(match.block_ids)
        self._grow(seq, match.num_tokens + num_new_tokens)
        self._hit_tokens += match.num_tokens
        self._query_tokens += seq.num_tokens

    # ---- later steps ----
    def can_append(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Whether ``seq`` can get blocks for ``num_new_tokens`` more computed positions."""
        needed = self._blocks_for(seq.num_computed + num_new_tokens) - len(seq.block_table)
        return needed <= len(self._free)

    def append(self, seq: Sequence, num_new_tokens: int) -> None:
        """Extend ``seq.block_table`` to cover ``seq.num_computed + num_new_tokens``."""
        self._grow(seq, seq.num_computed + num_new_tokens)

    def cache_full_blocks(self, seq: Sequence, num_new_tokens: int) -> None:
        """Publish the blocks that the last ``num_new_tokens`` computed tokens completed.

        Call after ``seq.num_computed`` has advanced; a block becomes findable only once all
        its positions hold computed KV, so no reader sees a half-written block.
        """
        if not self.enable_prefix_caching:
            return
        first = (seq.num_computed - num_new_tokens) // self.block_size
        last = seq.num_computed // self.block_size
        if last <= first:
            return
        self._update_hashes(seq)
        for i in range(first, last):
            block = self._blocks[seq.block_table[i]]
            block_hash = seq.block_hashes[i]
            if block.hash is None and block_hash not in self._hash_to_block:
                block.hash = block_hash
                self._hash_to_block[block_hash] = block.block_id

    def deallocate(self, seq: Sequence) -> None:
        """Drop ``seq``'s references; blocks nobody holds become free (cached ones stay
        findable until reused). Tail blocks are freed first so they are evicted first."""
        for block_id in reversed(seq.block_table):
            block = self._blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block_id] = None
                if block.hash is None:
                    self._free.move_to_end(block_id, last=False)
        seq.block_table = []

    # ---- queries ----
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` positions."""
        return self._blocks_for(num_tokens)

    def stats(self) -> BlockStats:
        return BlockStats(
            num_blocks=self.num_blocks,
            num_free_blocks=len(self._free),
            num_used_blocks=self.num_blocks - len(self._free),
            num_cached_blocks=len(self._hash_to_block),
            prefix_hit_tokens=self._hit_tokens,
            prefix_query_tokens=self._query_tokens,
        )

    def reset_prefix_cache(self) -> None:
        """Forget every prefix hash (e.g. after the KV contents were lost)."""
        for block in self._blocks:
            block.hash = None
        self._hash_to_block.clear()

    # ---- internals ----
    def _blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _grow(self, seq: Sequence, num_tokens: int) -> None:
        needed = self._blocks_for(num_tokens) - len(seq.block_table)
        if needed > len(self._free):
            raise RuntimeError(f"out of KV blocks: need {needed}, {len(self._free)} free")
        for _ in range(needed):
            block_id, _ = self._free.popitem(last=False)
            block = self._blocks[block_id]
            if block.hash is not None:  # evict the cached content it held
                if self._hash_to_block.get(block.hash) == block_id:
                    del self._hash_to_block[block.hash]
                block.hash = None
            block.ref_count = 1
            seq.block_table.append(block_id)

    def _update_hashes(self, seq: Sequence) -> None:
        """Extend ``seq.block_hashes`` to every full block of its tokens."""
        hashes = seq.block_hashes
        size = self.block_size
        while (len(hashes) + 1) * size <= seq.num_tokens:
            start = len(hashes) * size
            digest = hashlib.blake2b(hashes[-1] if hashes else b"", digest_size=16)
            digest.update(array("q", seq.token_ids[start : start + size]).tobytes())
            hashes.append(digest.digest())
