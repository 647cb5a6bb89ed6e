"""KVCacheManager: prefix hits, allocate_slots arithmetic, drafts, exhaustion, freeing
(minivllm/core/kv_cache_manager.py)."""
import random

import pytest

from minivllm.core import kv_cache_utils
from minivllm.core.kv_cache_manager import KVCacheManager
from minivllm.core.kv_cache_utils import get_request_block_hasher
from minivllm.request import Request
from minivllm.sampling_params import SamplingParams

BS = 4


def make_request(req_id, token_ids):
    return Request(req_id, token_ids, SamplingParams(max_tokens=64), eos_token_id=None,
                   block_hasher=get_request_block_hasher(BS))


def run_prefill(mgr, req, **kwargs):
    """What the scheduler does for a waiting request scheduled in full."""
    hit_blocks, num_hit = mgr.get_computed_blocks(req)
    new_blocks = mgr.allocate_slots(req, req.num_tokens - num_hit, num_hit, hit_blocks, **kwargs)
    assert new_blocks is not None
    mgr.record_prefix_cache_stats(req, num_hit)   # once admitted, as the scheduler does
    req.num_computed_tokens = req.num_tokens
    return num_hit, new_blocks


def free_ids(mgr):
    return [b.block_id for b in mgr.block_pool.free_block_queue.get_all_free_blocks()]


def test_prefix_hit_on_repeated_prompt_and_last_token_recomputed():
    mgr = KVCacheManager(num_gpu_blocks=16, block_size=BS, max_model_len=64)
    a = make_request("a", list(range(10)))
    assert run_prefill(mgr, a)[0] == 0
    assert mgr.get_block_ids("a") == ([1, 2, 3],)
    mgr.free(a)
    b = make_request("b", list(range(10)))
    blocks, num_hit = mgr.get_computed_blocks(b)
    assert num_hit == 8 and blocks.get_block_ids() == ([1, 2],)
    mgr.record_prefix_cache_stats(b, num_hit)
    # A prompt that is an exact multiple of the block size: the last block is recomputed.
    c = make_request("c", list(range(8)))
    blocks, num_hit = mgr.get_computed_blocks(c)
    assert num_hit == 8 - BS and blocks.get_block_ids() == ([1],)
    mgr.record_prefix_cache_stats(c, num_hit)
    stats = mgr.make_prefix_cache_stats()
    assert (stats.requests, stats.queries, stats.hits) == (3, 10 + 10 + 8, 0 + 8 + 4)
    assert mgr.prefix_cache_stats.queries == 0


def test_hit_stops_at_first_miss():
    mgr = KVCacheManager(num_gpu_blocks=16, block_size=BS, max_model_len=64)
    run_prefill(mgr, make_request("a", list(range(13))))
    other = list(range(13))
    other[5] = 99  # second block differs, so the third (same tokens) cannot be a prefix
    assert mgr.get_computed_blocks(make_request("b", other))[1] == 4


def test_use_eagle_drops_last_hit_block():
    mgr = KVCacheManager(num_gpu_blocks=16, block_size=BS, max_model_len=64, use_eagle=True)
    run_prefill(mgr, make_request("a", list(range(13))))
    assert mgr.get_computed_blocks(make_request("b", list(range(13))))[1] == 8  # 12 - one block


def test_hash_collision_is_not_a_hit(monkeypatch):
    monkeypatch.setattr(kv_cache_utils, "hash_block_tokens", lambda *args, **kwargs: b"\1" * 32)
    mgr = KVCacheManager(num_gpu_blocks=16, block_size=BS, max_model_len=64)
    run_prefill(mgr, make_request("a", list(range(9))))
    b = make_request("b", list(range(100, 109)))
    assert b.block_hashes == make_request("x", list(range(9))).block_hashes  # forced collision
    assert mgr.get_computed_blocks(b)[1] == 0
    assert mgr.get_computed_blocks(make_request("c", list(range(9))))[1] == 8  # genuine hit still works


def test_caching_off():
    mgr = KVCacheManager(num_gpu_blocks=16, block_size=BS, max_model_len=64, enable_caching=False)
    a = make_request("a", list(range(9)))
    run_prefill(mgr, a)
    assert mgr.block_pool.cached_block_hash_to_block == {}
    mgr.free(a)
    assert mgr.get_computed_blocks(make_request("b", list(range(9))))[1] == 0


def test_allocate_slots_arithmetic_lookahead_and_max_model_len():
    mgr = KVCacheManager(num_gpu_blocks=16, block_size=BS, max_model_len=14)
    with pytest.raises(ValueError):
        mgr.allocate_slots(make_request("z", [1, 2]), 0)
    req = make_request("a", list(range(10)))
    new = mgr.allocate_slots(req, 10)
    assert new.get_block_ids() == ([1, 2, 3],)  # cdiv(10, 4)
    req.num_computed_tokens = 10
    req.append_output_token_ids(10)
    assert mgr.allocate_slots(req, 1).get_block_ids() == ([],)  # 11 tokens still fit in 3 blocks
    # 11 computed + 1 new + 3 lookahead = 15 -> capped at max_model_len 14 -> 4 blocks
    req.num_computed_tokens = 11
    req.append_output_token_ids(11)
    assert mgr.allocate_slots(req, 1, num_lookahead_tokens=3).get_block_ids() == ([4],)
    assert mgr.get_block_ids("a") == ([1, 2, 3, 4],)
    big = KVCacheManager(num_gpu_blocks=16, block_size=BS, max_model_len=64)
    r = make_request("r", list(range(5)))
    assert len(big.allocate_slots(r, 5, num_lookahead_tokens=4).blocks[0]) == 3  # cdiv(9, 4)


def test_allocate_slots_returns_only_new_blocks_after_prefix_hit():
    mgr = KVCacheManager(num_gpu_blocks=16, block_size=BS, max_model_len=64)
    a = make_request("a", list(range(10)))
    run_prefill(mgr, a)
    b = make_request("b", list(range(10)))
    num_hit, new = run_prefill(mgr, b)
    assert num_hit == 8
    assert new.get_block_ids() == ([4],)
    assert mgr.get_block_ids("b") == ([1, 2, 4],)
    assert [blk.ref_cnt for blk in mgr.get_blocks("b").blocks[0]] == [2, 2, 1]
    assert mgr.get_num_common_prefix_blocks("a", 2) == [2]
    assert mgr.get_num_common_prefix_blocks("a", 3) == [0]
    mgr.free(a)
    assert [blk.ref_cnt for blk in mgr.get_blocks("b").blocks[0]] == [1, 1, 1]
    # Only a's private block went back, to the head: it holds no full block, so no prefix to keep.
    assert free_ids(mgr)[0] == 3 and 3 not in free_ids(mgr)[1:]
    mgr.free(b)
    assert mgr.block_pool.get_num_free_blocks() == 15


def test_free_releases_in_reverse_so_tail_is_evicted_first():
    mgr = KVCacheManager(num_gpu_blocks=5, block_size=BS, max_model_len=64)
    a = make_request("a", list(range(12)))
    run_prefill(mgr, a)
    mgr.free(a)
    assert free_ids(mgr) == [4, 3, 2, 1]
    # A new unrelated request takes block 4 first; a's first two blocks stay cached.
    run_prefill(mgr, make_request("b", [50, 51, 52]))
    assert mgr.get_block_ids("b") == ([4],)
    assert mgr.get_computed_blocks(make_request("c", list(range(12))))[1] == 8


def test_hit_on_free_blocks_counts_against_free_pool_and_none_has_no_side_effects():
    mgr = KVCacheManager(num_gpu_blocks=5, block_size=BS, max_model_len=64)
    a = make_request("a", list(range(8)))
    run_prefill(mgr, a)
    mgr.free(a)  # blocks 1, 2 free but cached; 4 free in all
    filler = make_request("f", [90, 91, 92, 93, 94])
    run_prefill(mgr, filler)  # takes 3 and 4
    b = make_request("b", list(range(8)) + [7, 7, 7, 7, 7])  # 13 tokens -> 4 blocks, 2 of them hits
    hit_blocks, num_hit = mgr.get_computed_blocks(b)
    assert num_hit == 8 and mgr.block_pool.get_num_free_blocks() == 2
    before = (mgr.snapshot(), dict(mgr.num_cached_block))
    # needs 2 fresh blocks + 2 hit blocks leaving the free queue = 4 > 2 free
    assert mgr.allocate_slots(b, 5, num_hit, hit_blocks) is None
    assert (mgr.snapshot(), dict(mgr.num_cached_block)) == before
    assert "b" not in mgr.req_to_blocks
    mgr.free(filler)
    assert mgr.allocate_slots(b, 5, num_hit, hit_blocks).get_block_ids() == ([4, 3],)
    assert mgr.get_block_ids("b") == ([1, 2, 4, 3],)
    assert mgr.usage == 1.0


def test_drafts_never_enter_the_prefix_cache():
    mgr = KVCacheManager(num_gpu_blocks=16, block_size=BS, max_model_len=64)
    req = make_request("a", list(range(7)))
    run_prefill(mgr, req)
    req.append_output_token_ids(7)  # 8 real tokens, the 8th not yet computed
    req.spec_token_ids = [20, 21, 22, 23, 24, 25]
    num_new_tokens = req.num_tokens_with_spec - req.num_computed_tokens  # 1 + 6 drafts
    new = mgr.allocate_slots(req, num_new_tokens)
    assert mgr.get_block_ids("a") == ([1, 2, 3, 4],)  # 14 slots
    assert new.get_block_ids() == ([3, 4],)
    assert new.get_unhashed_block_ids() == [3, 4]
    assert mgr.get_blocks("a").get_unhashed_block_ids() == [3, 4]
    assert mgr.num_cached_block["a"] == 2
    assert len(mgr.block_pool.cached_block_hash_to_block) == 2


def test_delay_cache_blocks_then_cache_blocks():
    mgr = KVCacheManager(num_gpu_blocks=16, block_size=BS, max_model_len=64)
    req = make_request("a", list(range(9)))
    mgr.allocate_slots(req, 9, delay_cache_blocks=True)
    assert mgr.block_pool.cached_block_hash_to_block == {}
    mgr.cache_blocks(req, 8)
    assert mgr.num_cached_block["a"] == 2
    assert mgr.snapshot(["a"])["cached_block_ids"] == [1, 2]
    mgr.cache_blocks(req, 8)  # idempotent


def test_snapshot_and_reset_prefix_cache():
    mgr = KVCacheManager(num_gpu_blocks=6, block_size=BS, max_model_len=64)
    a = make_request("a", list(range(6)))
    run_prefill(mgr, a)
    snap = mgr.snapshot(["a", "missing"])
    assert snap["block_tables"] == {"a": [1, 2], "missing": []}
    assert snap["free_block_ids"] == [3, 4, 5] and snap["num_free_blocks"] == 3
    assert snap["cached_block_ids"] == [1] and snap["ref_cnts"] == [0, 1, 1, 0, 0, 0]
    assert snap["num_gpu_blocks"] == 6
    assert mgr.snapshot()["block_tables"] == {"a": [1, 2]}
    assert not mgr.reset_prefix_cache()
    mgr.free(a)
    assert mgr.reset_prefix_cache()
    assert mgr.get_computed_blocks(make_request("b", list(range(6))))[1] == 0


def test_random_workload_leaks_nothing():
    rng = random.Random(0)
    mgr = KVCacheManager(num_gpu_blocks=12, block_size=BS, max_model_len=40)
    prefixes = [[rng.randrange(50) for _ in range(8)] for _ in range(3)]
    running = []
    for step in range(300):
        if len(running) < 4 and rng.random() < 0.5:
            prompt = rng.choice(prefixes)[:rng.randrange(1, 9)] + [rng.randrange(50)
                                                                    for _ in range(rng.randrange(1, 6))]
            req = make_request(f"r{step}", prompt)
            hit_blocks, num_hit = mgr.get_computed_blocks(req)
            if mgr.allocate_slots(req, req.num_tokens - num_hit, num_hit, hit_blocks) is not None:
                req.num_computed_tokens = req.num_tokens
                running.append(req)
        for req in list(running):
            req.append_output_token_ids(rng.randrange(50))
            req.spec_token_ids = [rng.randrange(50) for _ in range(rng.randrange(3))]
            n_new = req.num_tokens_with_spec - req.num_computed_tokens
            if req.num_tokens >= 30 or mgr.allocate_slots(req, n_new, num_lookahead_tokens=1) is None:
                mgr.free(req)  # finished or preempted
                running.remove(req)
                continue
            req.num_computed_tokens = req.num_tokens  # all drafts rejected
        # invariant: ref counts equal the number of holders; free + held == usable
        holders = {}
        for blocks in mgr.req_to_blocks.values():
            for blk in blocks:
                holders[blk.block_id] = holders.get(blk.block_id, 0) + 1
        snap = mgr.block_pool.snapshot()
        assert all(snap["ref_cnts"][bid] == n for bid, n in holders.items())
        assert snap["num_free_blocks"] + len(holders) == 11
        assert 0 not in holders and 0 not in snap["free_block_ids"]
    for req in running:
        mgr.free(req)
    assert mgr.block_pool.get_num_free_blocks() == 11
    assert mgr.req_to_blocks == {} and mgr.num_cached_block == {}
