"""KV events (minivllm/distributed/kv_events.py, core/kv_events_block_pool.py): what an engine
publishes is its prefix cache, step by step, through a preemption and an eviction; the wire carries
it (with a replay for a subscriber that missed batches); off by default, nothing is loaded."""
from __future__ import annotations

import subprocess
import sys
import time

import pytest

pytest.importorskip("msgspec")

from minivllm.config import KVEventsConfig  # noqa: E402
from minivllm.distributed.kv_events import (AllBlocksCleared, BlockRemoved,  # noqa: E402
                                            BlockStored, KVEventBatch, KVEventSubscriber,
                                            ZmqEventPublisher)
from conftest import tiny_llm  # noqa: E402

ENDPOINT = "tcp://127.0.0.1:0"
PROMPTS = [[1 + (7 * i + j) % 50 for j in range(10 + 6 * i)] for i in range(5)]


def _apply(held: set, events: list) -> None:
    for e in events:
        if isinstance(e, BlockStored):
            held.update(e.block_hashes)
        elif isinstance(e, BlockRemoved):
            held.difference_update(e.block_hashes)
        elif isinstance(e, AllBlocksCleared):
            held.clear()


def _drain(sub: KVEventSubscriber, want_seq: int) -> list:
    got, deadline = [], time.monotonic() + 10
    while sub.next_seq < want_seq and time.monotonic() < deadline:
        got += sub.poll(0.2)
    return got


def test_events_are_the_prefix_cache_through_a_preemption_and_an_eviction(tiny_gqa_dir):
    """19 usable blocks of 4 tokens cannot hold five requests at once: requests are preempted and
    cached blocks evicted. After every step, the hashes the events say are held equal the pool's
    ``cached_block_hash_to_block``; every stored block's tokens are its prompt's."""
    from minivllm import SamplingParams
    llm = tiny_llm(tiny_gqa_dir, num_gpu_blocks_override=20,
                   kv_events_config={"enable_kv_cache_events": True, "endpoint": ENDPOINT})
    engine = llm.llm_engine
    publisher = engine.engine_core.scheduler.kv_event_publisher
    sub = KVEventSubscriber(publisher.endpoint)
    time.sleep(0.3)                      # a PUB socket drops what it sends before SUB joins
    pool = engine.engine_core.scheduler.kv_cache_manager.block_pool
    held, kinds = set(), set()
    try:
        for i, p in enumerate(PROMPTS * 2):        # the second round hits what is left cached
            engine.add_request(f"r{i}", {"prompt_token_ids": p},
                               SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
        while engine.has_unfinished_requests():
            engine.step()
            for _, batch in _drain(sub, publisher_seq(publisher)):
                assert isinstance(batch, KVEventBatch)
                _apply(held, batch.events)
                kinds.update(type(e).__name__ for e in batch.events)
                for e in batch.events:
                    if isinstance(e, BlockStored):
                        assert len(e.token_ids) == len(e.block_hashes) * e.block_size == \
                            4 * len(e.block_hashes)
            assert held == set(pool.cached_block_hash_to_block)
        assert engine.engine_core.scheduler.num_preemptions_total > 0
        assert {"BlockStored", "BlockRemoved"} <= kinds
        assert pool.reset_prefix_cache()
        engine.add_request("last", {"prompt_token_ids": PROMPTS[0]},
                           SamplingParams(temperature=0, max_tokens=1))
        while engine.has_unfinished_requests():
            engine.step()
        events = [e for _, b in _drain(sub, publisher_seq(publisher)) for e in b.events]
        assert isinstance(events[0], AllBlocksCleared)
        _apply(held, events)
        assert held == set(pool.cached_block_hash_to_block)
    finally:
        sub.close()
        publisher.shutdown()


def publisher_seq(publisher: ZmqEventPublisher) -> int:
    """How many batches the publisher has sent (its thread sends them in order)."""
    deadline = time.monotonic() + 5
    while not publisher._queue.empty() and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.05)
    return publisher._buffer[-1][0] + 1 if publisher._buffer else 0


def test_a_subscriber_that_missed_batches_gets_them_replayed():
    pub = ZmqEventPublisher(endpoint=ENDPOINT, replay_endpoint=ENDPOINT)
    try:
        for i in range(3):              # sent before anyone listens: lost on the PUB socket
            pub.publish(KVEventBatch(ts=float(i), events=[AllBlocksCleared()]))
        time.sleep(0.3)
        sub = KVEventSubscriber(pub.endpoint, pub.replay_endpoint)
        time.sleep(0.3)
        pub.publish(KVEventBatch(ts=3.0, events=[BlockRemoved(block_hashes=[b"x"], medium="GPU")]))
        got = []
        deadline = time.monotonic() + 10
        while len(got) < 4 and time.monotonic() < deadline:
            got += sub.poll(0.2)
        assert [seq for seq, _ in got] == [0, 1, 2, 3] and sub.missed == 0
        assert got[-1][1].events[0].block_hashes == [b"x"]
        sub.close()
    finally:
        pub.shutdown()


def test_off_by_default_and_a_bad_config_is_refused():
    assert KVEventsConfig().publisher == "null"
    assert KVEventsConfig(enable_kv_cache_events=True).publisher == "zmq"
    with pytest.raises(ValueError, match="unknown field"):
        KVEventsConfig.from_any({"enable_kv_cache_event": True})
    with pytest.raises(ValueError, match="publisher"):
        KVEventsConfig(publisher="kafka")
    code = ("import minivllm, sys; from minivllm import LLM; "
            "print([m for m in ('msgspec', 'minivllm.distributed.kv_events', "
            "'minivllm.core.kv_events_block_pool') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
