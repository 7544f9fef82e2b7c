"""Paged KV block allocation, reference counts and prefix caching."""

from __future__ import annotations

from kiln.runtime.native.block_manager import BlockManager, chain_hash
from kiln.runtime.sampling_params import SamplingParams
from kiln.runtime.sequence import Sequence

BLOCK = 4


def seq(token_ids: list[int]) -> Sequence:
    return Sequence("r", token_ids, SamplingParams(max_tokens=4))


def admit(bm: BlockManager, s: Sequence) -> bool:
    """Allocate the whole uncached remainder of `s` and mark it computed, as one prefill step would."""
    computed = bm.get_computed_blocks(s)
    if not bm.allocate(s, computed, s.num_tokens - len(computed) * BLOCK):
        return False
    s.num_computed_tokens = s.num_tokens
    bm.cache_full_blocks(s)
    return True


def test_allocate_then_free_returns_every_block():
    bm = BlockManager(num_blocks=8, block_size=BLOCK)
    s = seq(list(range(10)))
    assert admit(bm, s)
    assert len(s.block_table) == 3 and bm.num_free_blocks == 5
    bm.free(s)
    assert bm.num_free_blocks == 8 and s.block_table == [] and s.num_computed_tokens == 0


def test_request_with_the_same_prefix_reuses_full_blocks_and_counts_hits():
    bm = BlockManager(num_blocks=8, block_size=BLOCK)
    first = seq(list(range(10)))
    admit(bm, first)
    second = seq(list(range(8)) + [99, 98, 97])
    assert admit(bm, second)
    assert second.block_table[:2] == first.block_table[:2]
    assert second.block_table[2] != first.block_table[2]
    assert second.num_cached_tokens == 8
    assert (bm.prefix_cache_hit_blocks, bm.prefix_cache_hit_tokens) == (2, 8)
    assert [bm.blocks[b].ref_count for b in second.block_table] == [2, 2, 1]


def test_freed_blocks_stay_cached_until_handed_out_again():
    bm = BlockManager(num_blocks=4, block_size=BLOCK)
    first = seq(list(range(9)))
    admit(bm, first)
    bm.free(first)
    again = seq(list(range(9)))
    assert admit(bm, again)
    assert again.num_cached_tokens == 8 and bm.num_used_blocks == 3


def test_with_prefix_caching_off_a_repeated_prefix_is_no_hit_and_no_lookup():
    bm = BlockManager(num_blocks=4, block_size=BLOCK, prefix_caching=False)
    first = seq(list(range(9)))
    admit(bm, first)
    bm.free(first)
    again = seq(list(range(9)))
    assert admit(bm, again)
    assert again.num_cached_tokens == 0 and not bm.hash_to_block_id
    assert (bm.prefix_cache_queried_tokens, bm.prefix_cache_hit_tokens) == (0, 0)


def test_prefix_hit_leaves_the_last_token_to_compute():
    bm = BlockManager(num_blocks=8, block_size=BLOCK)
    admit(bm, seq(list(range(8))))
    same = seq(list(range(8)))
    assert admit(bm, same)
    assert same.num_cached_tokens == 4


def test_block_hash_chains_over_the_previous_blocks():
    bm = BlockManager(num_blocks=8, block_size=BLOCK)
    admit(bm, seq([1, 2, 3, 4, 5, 6, 7, 8, 9]))
    # its first block holds the tokens of the cached sequence's second block: their KV, computed after a different
    # prefix, must not be reused (a hash of the block's tokens alone would hit)
    shifted = seq([5, 6, 7, 8, 5, 6, 7, 8, 9])
    admit(bm, shifted)
    assert shifted.num_cached_tokens == 0
    assert chain_hash(b"a", [5, 6, 7, 8]) != chain_hash(b"b", [5, 6, 7, 8])


def test_shared_block_is_freed_when_its_last_reference_drops():
    bm = BlockManager(num_blocks=8, block_size=BLOCK)
    first, second = seq(list(range(9))), seq(list(range(9)))
    admit(bm, first)
    admit(bm, second)
    bm.free(first)
    assert bm.num_used_blocks == 3
    bm.free(second)
    assert bm.num_used_blocks == 0


def test_failed_allocation_changes_nothing():
    bm = BlockManager(num_blocks=3, block_size=BLOCK)
    big = seq(list(range(13)))
    assert not admit(bm, big)
    assert bm.num_free_blocks == 3 and big.block_table == [] and bm.prefix_cache_queried_tokens == 0


def test_append_slots_grows_a_block_table_one_block_at_a_time():
    bm = BlockManager(num_blocks=2, block_size=BLOCK)
    s = seq([1, 2, 3])
    assert bm.allocate(s, [], 3)
    s.num_computed_tokens = 3
    assert bm.append_slots(s, 1) and len(s.block_table) == 1
    s.num_computed_tokens = 4
    assert bm.append_slots(s, 4) and len(s.block_table) == 2
    s.num_computed_tokens = 8
    assert not bm.append_slots(s, 1) and len(s.block_table) == 2


def test_reused_free_block_forgets_its_old_hash():
    bm = BlockManager(num_blocks=2, block_size=BLOCK)
    first = seq(list(range(5)))
    admit(bm, first)
    bm.free(first)
    admit(bm, seq([7] * 8))
    assert bm.get_computed_blocks(seq(list(range(5)))) == []


def test_a_block_is_reused_only_when_every_one_of_its_tokens_matches():
    cached = list(range(100, 113))  # three full blocks and one token
    for position in range(12):  # a prompt differing from the cached one at `position` only
        bm = BlockManager(num_blocks=16, block_size=BLOCK)
        first = seq(cached)
        admit(bm, first)
        other = cached.copy()
        other[position] = 7
        assert bm.get_computed_blocks(seq(other)) == first.block_table[:position // BLOCK], position


def test_prefix_hits_stop_at_the_first_block_no_longer_cached():
    bm = BlockManager(num_blocks=8, block_size=BLOCK)
    first = seq(list(range(13)))
    admit(bm, first)
    del bm.hash_to_block_id[bm.block_hash(first, 0)]  # block 0 handed out again; blocks 1 and 2 still cached
    assert bm.get_computed_blocks(seq(list(range(13)))) == []  # block 1's KV was computed after block 0's


def test_freeing_hands_out_blocks_without_a_reusable_hash_first():
    bm = BlockManager(num_blocks=3, block_size=BLOCK)
    first = seq(list(range(6)))  # one full (hashed) block and a partial one
    admit(bm, first)
    full_block = first.block_table[0]
    bm.free(first)
    other = seq([50, 51])  # one block
    admit(bm, other)
    bm.free(other)  # its block goes before the never-used one too, though freed last
    admit(bm, seq([60, 61, 62, 63, 64]))  # two blocks: both without a hash
    assert bm.get_computed_blocks(seq(list(range(6)))) == [full_block]  # the cached block was not handed out


def test_a_request_for_prompt_log_probabilities_computes_its_whole_prompt():
    bm = BlockManager(num_blocks=8, block_size=BLOCK)
    admit(bm, seq(list(range(9))))
    wants = Sequence("p", list(range(9)), SamplingParams(max_tokens=4, prompt_logprobs=1))
    assert bm.get_computed_blocks(wants) == []  # every prompt position must run through the model
    wants.prompt_logprobs.extend([None] * 8)  # all of them computed: a preempted request may reuse its blocks
    assert len(bm.get_computed_blocks(wants)) == 2
    one = Sequence("one", [7], SamplingParams(max_tokens=4, prompt_logprobs=1))  # its prompt's one position
    assert admit(bm, one) and bm.prefix_cache_queried_tokens == 9  # the first prompt's lookup only, as vLLM counts


def test_sharing_blocks_in_use_needs_free_blocks_for_the_fresh_ones_only():
    bm = BlockManager(num_blocks=4, block_size=BLOCK)
    first = seq(list(range(9)))  # two full blocks and one token: 3 of the 4 blocks
    admit(bm, first)
    cached = first.block_table[:2]
    second = seq(list(range(8)) + [50])  # the same two blocks, in use by `first`, and one fresh block
    assert admit(bm, second) and bm.num_free_blocks == 0
    bm.free(second)
    longer = seq(list(range(8)) + list(range(50, 58)))  # the two cached blocks and two fresh ones
    assert not admit(bm, longer)  # one block is free
    bm.free(first)
    assert admit(bm, longer) and len(longer.block_table) == 4 and longer.block_table[:2] == cached


def test_a_reused_block_forgets_its_hash_at_any_block_id():
    bm = BlockManager(num_blocks=300, block_size=BLOCK)  # ids past 256, which Python does not intern
    filler = seq(list(range(1000, 1000 + 280 * BLOCK)))  # holds blocks 0..279
    assert bm.allocate(filler, [], filler.num_tokens)
    cached = seq(list(range(5)))  # its full block gets an id of 280 or more
    admit(bm, cached)
    assert cached.block_table[0] >= 280
    bm.free(cached)
    bm.free(filler)
    assert bm.allocate(seq([7] * (300 * BLOCK)), [], 300 * BLOCK)  # every block handed out again
    assert bm.get_computed_blocks(seq(list(range(5)))) == []


def test_sequences_of_different_cache_salts_share_no_blocks():
    bm = BlockManager(num_blocks=8, block_size=BLOCK)
    first = seq(list(range(9)))
    first.cache_salt = b"longrope-long"  # its KV rotated by other tables (layers/rotary.py)
    admit(bm, first)
    assert bm.get_computed_blocks(seq(list(range(9)))) == []
    again = seq(list(range(9)))
    again.cache_salt = b"longrope-long"
    assert bm.get_computed_blocks(again) == first.block_table[:2]
