"""Free queue, block pool and hashing (minivllm/core/kv_cache_utils.py, minivllm/core/block_pool.py)."""
import pytest

from minivllm.core import kv_cache_utils
from minivllm.core.block_pool import BlockPool
from minivllm.core.kv_cache_utils import (NONE_HASH, FreeKVCacheBlockQueue, KVCacheBlock, KVCacheBlocks,
                                          get_request_block_hasher, hash_block_tokens)
from minivllm.request import Request
from minivllm.sampling_params import SamplingParams

BS = 4


def make_request(req_id, token_ids, block_size=BS):
    return Request(req_id, token_ids, SamplingParams(max_tokens=8), eos_token_id=None,
                   block_hasher=get_request_block_hasher(block_size))


def ids(blocks):
    return [b.block_id for b in blocks]


# ---- FreeKVCacheBlockQueue ---------------------------------------------------------------------------
def test_free_queue_order_and_popleft():
    blocks = [KVCacheBlock(i) for i in range(5)]
    q = FreeKVCacheBlockQueue(blocks)
    assert q.num_free_blocks == 5
    assert ids(q.get_all_free_blocks()) == [0, 1, 2, 3, 4]
    assert q.popleft().block_id == 0
    assert ids(q.popleft_n(2)) == [1, 2]
    assert q.num_free_blocks == 2
    q.append(blocks[0])
    q.append_n([blocks[2], blocks[1]])
    assert ids(q.get_all_free_blocks()) == [3, 4, 0, 2, 1]
    assert q.num_free_blocks == 5
    assert q.popleft_n(0) == []


def test_free_queue_remove_is_constant_time_unlink():
    blocks = [KVCacheBlock(i) for i in range(4)]
    q = FreeKVCacheBlockQueue(blocks)
    q.remove(blocks[2])  # middle
    assert blocks[2].prev_free_block is None and blocks[2].next_free_block is None
    assert blocks[1].next_free_block is blocks[3] and blocks[3].prev_free_block is blocks[1]
    q.remove(blocks[0])  # front
    q.remove(blocks[3])  # back
    assert ids(q.get_all_free_blocks()) == [1]
    assert q.num_free_blocks == 1
    with pytest.raises(RuntimeError):
        q.remove(blocks[2])  # already unlinked


def test_free_queue_empty():
    q = FreeKVCacheBlockQueue([])
    assert q.get_all_free_blocks() == []
    with pytest.raises(ValueError, match="No free blocks available"):
        q.popleft()
    b = KVCacheBlock(7)
    q.append(b)
    assert q.popleft() is b
    with pytest.raises(ValueError, match="No free blocks available"):
        q.popleft()


def test_block_hash_set_once_and_repr_does_not_recurse():
    b = KVCacheBlock(3)
    b.block_hash = b"x" * 32
    with pytest.raises(ValueError):
        b.block_hash = b"y" * 32
    b.reset_hash()
    assert b.block_hash is None
    b.block_hash = b"y" * 32
    q = FreeKVCacheBlockQueue([KVCacheBlock(i) for i in range(1000)])
    assert "block_id=0" in repr(q.get_all_free_blocks()[0])


# ---- hashing -----------------------------------------------------------------------------------------
def test_hash_block_tokens_chain():
    h0 = hash_block_tokens(None, [1, 2, 3, 4])
    assert isinstance(h0, bytes) and len(h0) == 32
    assert h0 == hash_block_tokens(NONE_HASH, (1, 2, 3, 4))
    assert h0 != hash_block_tokens(None, [1, 2, 3, 5])
    assert hash_block_tokens(h0, [5, 6, 7, 8]) != hash_block_tokens(None, [5, 6, 7, 8])
    assert hash_block_tokens(None, [1, 2, 3, 4], ("salt",)) != h0
    # int64, not int8: token 256 must not alias token 0
    assert hash_block_tokens(None, [256]) != hash_block_tokens(None, [0])


def test_request_block_hasher_hashes_only_new_full_blocks():
    req = make_request("r", list(range(10)))  # 2 full blocks + 2 tokens
    h0 = hash_block_tokens(None, [0, 1, 2, 3])
    h1 = hash_block_tokens(h0, [4, 5, 6, 7])
    assert req.block_hashes == [h0, h1]
    req.append_output_token_ids(10)
    assert len(req.block_hashes) == 2
    req.append_output_token_ids([11, 12])
    assert req.block_hashes == [h0, h1, hash_block_tokens(h1, [8, 9, 10, 11])]
    req.spec_token_ids = [1, 2, 3, 4, 5]  # drafts are never hashed
    req.append_output_token_ids(13)
    assert len(req.block_hashes) == 3


def test_kv_cache_blocks_helpers():
    a, b, c = KVCacheBlock(1), KVCacheBlock(2), KVCacheBlock(3)
    b.block_hash = b"h" * 32
    x = KVCacheBlocks(([a, b],))
    y = KVCacheBlocks(([c],))
    assert (x + y).get_block_ids() == ([1, 2, 3],)
    assert x.get_block_ids() == ([1, 2],)  # + made a new list
    assert x.get_unhashed_block_ids() == [1]
    empty = x.new_empty()
    assert empty.get_block_ids() == ([],)
    assert empty.get_block_ids(allow_none=True) is None


# ---- BlockPool ---------------------------------------------------------------------------------------
def test_null_block_never_handed_out_or_freed():
    pool = BlockPool(5, enable_caching=True)
    assert pool.null_block.block_id == 0 and pool.null_block.is_null
    assert pool.get_num_free_blocks() == 4
    got = pool.get_new_blocks(4)
    assert ids(got) == [1, 2, 3, 4]
    assert all(b.ref_cnt == 1 for b in got)
    assert pool.get_usage() == 1.0
    with pytest.raises(ValueError):
        pool.get_new_blocks(1)
    pool.free_blocks(got)
    pool.free_blocks([pool.null_block])
    assert 0 not in ids(pool.free_block_queue.get_all_free_blocks())
    assert pool.get_num_free_blocks() == 4
    assert pool.get_usage() == 0.0


def test_get_new_blocks_too_many_raises_without_side_effects():
    pool = BlockPool(4, enable_caching=True)
    with pytest.raises(ValueError):
        pool.get_new_blocks(4)  # only 3 usable
    assert pool.get_num_free_blocks() == 3


def test_cache_evict_lazily_and_lru_order():
    pool = BlockPool(6, enable_caching=True)
    req = make_request("a", list(range(8)))
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(req, blocks, 0, 2, BS)
    h0, h1 = req.block_hashes
    assert pool.get_cached_block(h0, [0, 1, 2, 3]) is blocks[0]
    assert pool.get_cached_block(h1, [4, 5, 6, 7]) is blocks[1]
    # freed in reverse (as KVCacheManager.free does): tail block goes to the front of eviction
    pool.free_blocks(reversed(blocks))
    snap = pool.snapshot()
    assert snap["free_block_ids"] == [3, 4, 5, 2, 1]
    assert snap["cached_block_ids"] == [1, 2]  # hashes kept after free
    assert snap["ref_cnts"] == [0] * 6
    # still hits while free; touch pulls it out of the free queue
    hit = pool.get_cached_block(h0, [0, 1, 2, 3])
    pool.touch([hit])
    assert hit.ref_cnt == 1 and pool.get_num_free_blocks() == 4
    pool.free_blocks([hit])
    assert ids(pool.free_block_queue.get_all_free_blocks()) == [3, 4, 5, 2, 1]
    # allocating 4 blocks evicts 3, 4, 5 (never cached) then 2 (the tail block): 1 survives
    got = pool.get_new_blocks(4)
    assert ids(got) == [3, 4, 5, 2]
    assert got[3].block_hash is None
    assert pool.get_cached_block(h1, [4, 5, 6, 7]) is None
    assert pool.get_cached_block(h0, [0, 1, 2, 3]) is blocks[0]


def test_get_cached_block_verifies_token_ids():
    pool = BlockPool(4, enable_caching=True)
    req = make_request("a", [1, 2, 3, 4])
    blocks = pool.get_new_blocks(1)
    pool.cache_full_blocks(req, blocks, 0, 1, BS)
    assert pool.get_cached_block(req.block_hashes[0], [1, 2, 3, 4]) is blocks[0]
    assert pool.get_cached_block(req.block_hashes[0], [1, 2, 3, 5]) is None


def test_same_hash_several_blocks_no_dedup():
    pool = BlockPool(4, enable_caching=True)
    r1, r2 = make_request("a", [1, 2, 3, 4]), make_request("b", [1, 2, 3, 4])
    b1, b2 = pool.get_new_blocks(1), pool.get_new_blocks(1)
    pool.cache_full_blocks(r1, b1, 0, 1, BS)
    pool.cache_full_blocks(r2, b2, 0, 1, BS)
    assert set(pool.cached_block_hash_to_block[r1.block_hashes[0]]) == {1, 2}
    pool.free_blocks(b1 + b2)
    pool.get_new_blocks(2)  # 3 (never cached), then 1
    assert set(pool.cached_block_hash_to_block[r1.block_hashes[0]]) == {2}
    pool.get_new_blocks(1)
    assert pool.cached_block_hash_to_block == {}


def test_reset_prefix_cache_only_when_idle():
    pool = BlockPool(4, enable_caching=True)
    req = make_request("a", [1, 2, 3, 4])
    blocks = pool.get_new_blocks(1)
    pool.cache_full_blocks(req, blocks, 0, 1, BS)
    assert not pool.reset_prefix_cache()
    pool.free_blocks(blocks)
    assert pool.reset_prefix_cache()
    assert pool.cached_block_hash_to_block == {} and blocks[0].block_hash is None


def test_cache_full_blocks_needs_hashes():
    pool = BlockPool(4, enable_caching=True)
    req = Request("x", [1, 2, 3, 4], SamplingParams(), eos_token_id=None)  # no hasher
    with pytest.raises(RuntimeError, match="block hashes"):
        pool.cache_full_blocks(req, pool.get_new_blocks(1), 0, 1, BS)


def test_hasher_monkeypatch_reaches_module_lookup(monkeypatch):
    monkeypatch.setattr(kv_cache_utils, "hash_block_tokens", lambda *a, **k: b"\0" * 32)
    assert make_request("a", list(range(8))).block_hashes == [b"\0" * 32] * 2
