"""Paged KV block allocation with reference counts and prefix caching by chained hashes of full blocks."""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict

from kiln.runtime.sequence import Sequence


def chain_hash(prev_hash: bytes, token_ids: list[int]) -> bytes:
    """Hash of a full block: sha256 of the previous block's hash followed by this block's token ids."""
    return hashlib.sha256(prev_hash + array("q", token_ids).tobytes()).digest()


class Block:
    __slots__ = ("block_id", "ref_count", "block_hash")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.block_hash: bytes | None = None


class BlockManager:
    """Hands out fixed-size KV blocks to sequences.

    Free blocks sit in LRU order: a freed block that still holds a full, hashed block of tokens keeps its hash until
    it is handed out again, so a later request with the same prefix can take it back (a prefix-cache hit). Blocks
    are shared by reference count; a block is free when no sequence refers to it. With ``prefix_caching`` False no
    block is looked up or published, so there is never a hit and the prefix-cache counters stay at zero (vLLM's
    ``--no-enable-prefix-caching``).
    """

    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = True) -> None:
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_block_ids: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.hash_to_block_id: dict[bytes, int] = {}
        self.prefix_cache_queried_tokens = 0
        self.prefix_cache_hit_tokens = 0
        self.prefix_cache_hit_blocks = 0

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    @property
    def num_used_blocks(self) -> int:
        return len(self.blocks) - len(self.free_block_ids)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def block_hash(self, seq: Sequence, index: int) -> bytes:
        """Chained hash of the sequence's full block `index`, memoised on the sequence."""
        while len(seq.block_hashes) <= index:
            i = len(seq.block_hashes)
            prev = seq.block_hashes[-1] if seq.block_hashes else seq.cache_salt
            seq.block_hashes.append(chain_hash(prev, seq.token_ids[i * self.block_size:(i + 1) * self.block_size]))
        return seq.block_hashes[index]

    def get_computed_blocks(self, seq: Sequence) -> list[int]:
        """Block ids already holding this sequence's leading full blocks. At least one token is always left to
        compute, since the last prompt token must run through the model to give logits. No blocks for a request whose
        prompt log probabilities are still to compute: every prompt position must run through the model."""
        if not self.prefix_caching or (seq.prompt_logprobs is not None
                                       and len(seq.prompt_logprobs) < seq.num_prompt_tokens):
            return []
        hits = []
        for i in range((seq.num_tokens - 1) // self.block_size):
            block_id = self.hash_to_block_id.get(self.block_hash(seq, i))
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def allocate(self, seq: Sequence, computed_blocks: list[int], num_new_tokens: int) -> bool:
        """Give a waiting sequence the cached `computed_blocks` plus fresh blocks for `num_new_tokens` more tokens.
        Returns False, changing nothing, when too few blocks are free."""
        assert not seq.block_table, f"{seq} already holds blocks"
        num_cached_tokens = len(computed_blocks) * self.block_size
        num_fresh = self.blocks_needed(num_cached_tokens + num_new_tokens) - len(computed_blocks)
        num_revived = sum(1 for b in computed_blocks if self.blocks[b].ref_count == 0)
        if num_fresh + num_revived > self.num_free_blocks:
            return False
        for block_id in computed_blocks:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free_block_ids[block_id]
            block.ref_count += 1
        seq.block_table = list(computed_blocks) + [self._take_free_block() for _ in range(num_fresh)]
        seq.num_computed_tokens = num_cached_tokens
        # a prompt's first lookup, as vLLM counts them: a sequence readmitted (preempted, or recomputed for LongRoPE)
        # finding its own blocks again is no hit on the cache, and one whose prompt log probabilities bypass the
        # cache looked nothing up; nor did any with prefix caching off
        first = self.prefix_caching and seq.num_preemptions == 0 and seq.num_completion_tokens == 0
        if first and seq.prompt_logprobs is None:
            seq.num_cached_tokens = num_cached_tokens
            self.prefix_cache_queried_tokens += seq.num_tokens
            self.prefix_cache_hit_tokens += num_cached_tokens
            self.prefix_cache_hit_blocks += len(computed_blocks)
        return True

    def append_slots(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Grow a running sequence's block table to hold `num_new_tokens` more tokens. Returns False, changing
        nothing, when too few blocks are free."""
        num_fresh = self.blocks_needed(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        if num_fresh > self.num_free_blocks:
            return False
        seq.block_table.extend(self._take_free_block() for _ in range(num_fresh))
        return True

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Publish the hashes of blocks that became full of computed tokens, so later requests can reuse them (none
        with prefix caching off)."""
        if not self.prefix_caching:
            return
        for i in reversed(range(seq.num_computed_tokens // self.block_size)):
            block = self.blocks[seq.block_table[i]]
            if block.block_hash is not None:
                break
            block.block_hash = self.block_hash(seq, i)
            self.hash_to_block_id.setdefault(block.block_hash, block.block_id)

    def free(self, seq: Sequence) -> None:
        """Drop the sequence's references; it no longer has any KV in the cache. Tail blocks are freed first so
        that shared prefixes stay cached longest; blocks holding no reusable hash are handed out first."""
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_block_ids[block_id] = None
                if block.block_hash is None:
                    self.free_block_ids.move_to_end(block_id, last=False)
        seq.block_table = []
        seq.num_computed_tokens = 0

    def _take_free_block(self) -> int:
        block_id, _ = self.free_block_ids.popitem(last=False)
        block = self.blocks[block_id]
        if block.block_hash is not None:
            if self.hash_to_block_id.get(block.block_hash) == block_id:
                del self.hash_to_block_id[block.block_hash]
            block.block_hash = None
        block.ref_count = 1
        return block_id
