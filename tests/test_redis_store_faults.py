"""RedisStoreConnector faults against a real redis-server: unreachable at start, killed or
restarted mid-run, evicted chunks, truncated or corrupt values, another model's or dtype's
values, two producers storing the same prefix at once. Output always equals a single instance's."""
from __future__ import annotations

import threading
import warnings

import pytest
import redis
import torch

from minivllm import LLM
from minivllm.distributed.kv_transfer import redis_store
from minivllm.distributed.kv_transfer.redis_server import RedisServer
from test_redis_store_connector import GREEDY, PREFILL, ktc, llm, prompts, tokens, worker_stats


@pytest.fixture(scope="module")
def model(tiny_llama_dir):
    return tiny_llama_dir


@pytest.fixture(scope="module")
def reference(model):
    return tokens(llm(model).generate(prompts(), GREEDY, use_tqdm=False))


def consumer(model, url, load_async=True, **extra):
    return llm(model, ktc(url, "kv_consumer", load_async=load_async, retry_s=0.2, timeout_s=2.0, **extra),
               enable_prefix_caching=False)


def test_unreachable_at_start(model, tmp_path, reference):
    url = f"unix://{tmp_path}/nobody.sock"
    with pytest.raises(ConnectionError, match="unreachable"):
        LLM(model=str(tmp_path / "not-even-a-model"), kv_transfer_config=ktc(url, "kv_both"))
    with pytest.warns(RuntimeWarning, match="unreachable|failed"):
        d = llm(model, ktc(url, "kv_both", on_unavailable="recompute", retry_s=0.2))
        got = d.generate(prompts(), GREEDY, use_tqdm=False)
    assert tokens(got) == reference
    assert worker_stats(d)["num_loaded_tokens"] == 0


@pytest.mark.parametrize("load_async", [False, True])
def test_killed_or_restarted_between_lookup_and_load(model, reference, load_async):
    """The lookup finds every chunk; the server then dies (or comes back empty): the loads fail,
    the requests recompute from their first missing block, nothing hangs, output is identical."""
    for restart in (False, True):
        srv = RedisServer().start()
        try:
            llm(model, ktc(srv.url, "kv_producer")).generate(prompts(), PREFILL, use_tqdm=False)
            d = consumer(model, srv.url, load_async)
            conn = d.llm_engine.scheduler.connector
            lookup = conn.get_num_new_matched_tokens

            def lookup_then_fail(request, n, srv=srv):
                result = lookup(request, n)
                if result[0] and srv.proc.poll() is None:
                    srv.stop(keep_dir=restart)
                    if restart:      # same socket, empty store
                        srv.start()
                return result
            conn.get_num_new_matched_tokens = lookup_then_fail
            with warnings.catch_warnings(record=True) as w:
                warnings.simplefilter("always")
                got = d.generate(prompts(), GREEDY, use_tqdm=False)
            assert tokens(got) == reference
            assert worker_stats(d)["num_load_errors"] >= 1
            assert any("recomputed" in str(x.message) for x in w)
        finally:
            srv.stop()


def test_store_dropped_when_server_dies(model, reference):
    srv = RedisServer().start()
    p = llm(model, ktc(srv.url, "kv_producer", retry_s=0.2, timeout_s=2.0))
    srv.stop()
    with pytest.warns(RuntimeWarning, match="failed"):
        got = p.generate(prompts(), GREEDY, use_tqdm=False)
    assert tokens(got) == reference
    assert worker_stats(p)["num_stored_tokens"] == 0


def test_evicted_chunks_are_misses(model, reference):
    """maxmemory + allkeys-lru evicts values and metas independently: a meta whose values are gone
    is a load error (recomputed) and is removed; output stays identical."""
    with RedisServer(maxmemory="2mb") as srv:
        p = llm(model, ktc(srv.url, "kv_producer"))
        p.generate(prompts(), PREFILL, use_tqdm=False)
        client = redis.Redis.from_url(srv.url)
        ours = len(client.keys("mv:*"))
        for i in range(200):         # other tenants' values, until LRU has evicted some of ours
            client.set(f"other:{i}", b"x" * 50_000)
            if len(client.keys("mv:*")) < ours:
                break
        assert 0 < len(client.keys("mv:*")) < ours
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got = consumer(model, srv.url).generate(prompts(), GREEDY, use_tqdm=False)
        assert tokens(got) == reference


@pytest.mark.parametrize("damage", ["truncate", "corrupt", "delete"])
def test_damaged_values_never_load(model, reference, damage):
    with RedisServer() as srv:
        llm(model, ktc(srv.url, "kv_producer")).generate(prompts(), PREFILL, use_tqdm=False)
        client = redis.Redis.from_url(srv.url)
        values = sorted(k for k in client.keys("*") if not k.endswith(b":meta"))
        for key in values[::3]:
            raw = client.get(key)
            if damage == "truncate":
                client.set(key, raw[:len(raw) // 2])
            elif damage == "corrupt":
                client.set(key, raw[:100] + bytes([raw[100] ^ 0xFF]) + raw[101:])
            else:
                client.delete(key)
        d = consumer(model, srv.url)
        with pytest.warns(RuntimeWarning, match="truncated|expected|checksum|missing"):
            got = d.generate(prompts(), GREEDY, use_tqdm=False)
        assert tokens(got) == reference
        assert worker_stats(d)["num_load_errors"] >= 1
        # A damaged chunk's meta is gone, so the next producer stores it again.
        assert len(client.keys("*:meta")) < 1 + 2 + 4 + 4   # chunks of 9, 17, 40, 70 tokens


def test_another_models_or_dtypes_values_never_load(model, reference):
    """Values of a bfloat16 instance, copied under the float32 instance's keys: the meta value
    (fingerprint, dtype, shape) tells them apart, so nothing loads."""
    with RedisServer() as srv:
        p16 = llm(model, ktc(srv.url, "kv_producer"), dtype="bfloat16")
        p16.generate(prompts(), PREFILL, use_tqdm=False)
        d = consumer(model, srv.url, load_async=False)
        fp16, fp32 = p16.llm_engine.scheduler.connector._fp, d.llm_engine.scheduler.connector._fp
        assert fp16 != fp32
        client = redis.Redis.from_url(srv.url)
        for key in client.keys("*"):
            client.set(key.replace(fp16.encode(), fp32.encode()), client.get(key))
        got = d.generate(prompts(), GREEDY, use_tqdm=False)
        assert tokens(got) == reference
        assert worker_stats(d)["num_loaded_tokens"] == 0


def test_two_producers_one_complete_copy_never_torn():
    """Two writers store the same chunks at once with different bytes; a reader running alongside
    sees either a miss or one writer's complete copy, never a mix; one copy remains."""
    layout = {"num_layers": 3, "num_kv_heads": 2, "head_dim": 4, "dtype": "float32"}
    with RedisServer() as srv:
        chunks = redis_store.chunk_prefix(list(range(64)), 64, 8)
        copies = {w: [torch.full((2, 8, 8), float(w))] * 3 for w in (1, 2)}
        seen, won = [], {1: 0, 2: 0}
        start = threading.Barrier(3)

        def write(w):
            client = redis.Redis.from_url(srv.url)
            start.wait(timeout=10)
            for c in chunks:
                won[w] += redis_store.put_chunk(client, "fp", c, copies[w])

        def read():
            client = redis.Redis.from_url(srv.url)
            start.wait(timeout=10)
            for _ in range(200):
                for c in chunks:
                    try:
                        layers = redis_store.get_chunk(client, "fp", c, layout)
                        seen.append({v for t in layers for v in t.unique().tolist()})
                    except redis_store.KVStoreError:
                        pass
        threads = [threading.Thread(target=write, args=(w,)) for w in (1, 2)] + [threading.Thread(target=read)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert won[1] + won[2] == len(chunks)
        assert all(s in ({1.0}, {2.0}) for s in seen), seen[:5]
        client = redis.Redis.from_url(srv.url)
        assert len(client.keys("*")) == len(chunks) * (1 + 3)     # the losers' values are gone
