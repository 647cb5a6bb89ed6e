"""The scheduler, KV cache manager and block pool where vLLM 0.32's own unit tests found minivllm
disagreeing (tests/conformance/vllm_tests/ runs those tests); each case here is minivllm's own check
of one of them, without a model: a Scheduler on a hand-made config, and hand-made model outputs.
"""
from __future__ import annotations

from typing import Optional

import pytest

from minivllm.config import (CacheConfig, KVTransferConfig, ModelConfig, SchedulerConfig,
                             SpeculativeConfig, VllmConfig)
from minivllm.core.block_pool import BlockPool
from minivllm.core.kv_cache_utils import KVCacheBlock, generate_block_hash_extra_keys
from minivllm.core.sched.scheduler import Scheduler
from minivllm.distributed.kv_transfer import KVConnectorFactory, KVConnectorOutput
from minivllm.distributed.kv_transfer.base import KVConnectorBase_V1, KVConnectorMetadata
from minivllm.request import Request, RequestStatus
from minivllm.sampling_params import SamplingParams
from minivllm.worker.model_runner import ModelRunnerOutput

BS = 16


class ParkingConnector(KVConnectorBase_V1):
    """A scheduler-side connector for the queue test: requests named ``remote*`` have 32 external
    tokens loaded asynchronously; ``defer*`` is asked again later, once."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.deferred: set[str] = set()

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        if request.request_id.startswith("defer") and request.request_id not in self.deferred:
            self.deferred.add(request.request_id)   # ask again later, once
            return None, False
        if request.request_id.startswith("remote"):
            return 32, True
        return 0, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        pass

    def build_connector_meta(self, scheduler_output):
        return KVConnectorMetadata()

    def request_finished(self, request, block_ids):
        return False, None


if "TestParkingConnector" not in KVConnectorFactory._registry:
    KVConnectorFactory.register_connector("TestParkingConnector", ParkingConnector)


def make_scheduler(num_blocks: int = 100, max_num_batched_tokens: int = 1024, k: int = 0,
                   long_prefill_token_threshold: int = 0, connector: Optional[str] = None,
                   enable_prefix_caching: bool = True) -> Scheduler:
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=k, prompt_lookup_min=1,
                             prompt_lookup_max=3) if k else None
    ktc = KVTransferConfig(connector, "kv_both") if connector else None
    cfg = VllmConfig(ModelConfig(model="fake", max_model_len=4096),
                     CacheConfig(block_size=BS, enable_prefix_caching=enable_prefix_caching),
                     SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=max_num_batched_tokens,
                                     long_prefill_token_threshold=long_prefill_token_threshold),
                     speculative_config=spec, kv_transfer_config=ktc)
    return Scheduler(cfg, num_gpu_blocks=num_blocks)


def add(sched: Scheduler, req_id: str, num_tokens: int, first: int = 0) -> Request:
    req = sched.make_request(req_id, list(range(first, first + num_tokens)),
                             SamplingParams(max_tokens=8, ignore_eos=True), eos_token_id=None)
    sched.add_request(req)
    return req


def output(so, sampled: dict[str, list[int]], kv_out=None) -> ModelRunnerOutput:
    ids = list(so.num_scheduled_tokens)
    return ModelRunnerOutput(ids, {r: i for i, r in enumerate(ids)},
                             [sampled.get(r, []) for r in ids], kv_connector_output=kv_out)


def test_drafts_with_an_empty_output_accept_nothing_and_roll_nothing_back():
    """vLLM: drafts count only when the step produced tokens (a failed load gives none)."""
    sched = make_scheduler(k=3)
    req = add(sched, "a", 10)
    so = sched.schedule()
    sched.update_from_output(so, output(so, {"a": [7]}))
    sched.update_draft_token_ids({"a": [1, 2, 3]})
    so = sched.schedule()
    assert so.scheduled_spec_decode_tokens == {"a": [1, 2, 3]}
    assert req.num_computed_tokens == 14
    sched.update_from_output(so, output(so, {}))        # no tokens came back
    assert req.num_computed_tokens == 14                 # not 13: nothing verified, nothing rolled back
    assert sched.spec_decoding_stats.num_drafts == 0
    assert sched.spec_decoding_stats.num_draft_tokens == 0


def test_no_drafts_kept_for_a_request_still_prefilling():
    """vLLM 0.32's update_draft_token_ids ignores drafts for a prefill chunk (is_prefill_chunk)."""
    sched = make_scheduler(k=3, max_num_batched_tokens=30)
    req = add(sched, "a", 50)
    so = sched.schedule()
    assert so.num_scheduled_tokens == {"a": 30}
    sched.update_from_output(so, output(so, {}))
    sched.update_draft_token_ids({"a": [1, 2, 3]})
    assert req.spec_token_ids == []
    so = sched.schedule()
    assert so.num_scheduled_tokens == {"a": 20} and so.scheduled_spec_decode_tokens == {}
    assert not req.is_prefill_chunk


def test_a_parked_request_is_promoted_behind_one_that_does_not_fit():
    """A request waiting for remote KV sits in ``kv_holding_waiting``, scanned first: once its load
    lands it runs, whatever stands in ``waiting``. Here the request ahead of it in arrival order
    was deferred by the connector, then needs the very blocks the parked one holds: scanning
    ``waiting`` alone, that request stops the scan every step and nothing ever runs."""
    sched = make_scheduler(num_blocks=5, connector="TestParkingConnector")   # 4 usable blocks
    big = add(sched, "defer_once", 40, first=1000)
    remote = add(sched, "remote", 40)
    so = sched.schedule()
    assert remote.status == RequestStatus.WAITING_FOR_REMOTE_KVS and so.num_scheduled_tokens == {}
    assert list(sched.kv_holding_waiting) == [remote] and list(sched.waiting) == [big]
    sched.update_from_output(so, output(so, {}, KVConnectorOutput(finished_recving={"remote"})))
    so = sched.schedule()                                    # "defer_once" needs 3 blocks, 1 free
    assert remote.status == RequestStatus.RUNNING
    assert so.num_scheduled_tokens == {"remote": 8}          # 40 - 32 loaded
    assert list(sched.waiting) == [big] and not sched.kv_holding_waiting
    assert sched.has_unfinished_requests()


def test_prefix_cache_stats_count_a_request_once_when_admitted():
    """A request looked up step after step while it finds no room counts once, when admitted."""
    sched = make_scheduler(num_blocks=4)                     # 3 usable blocks of 16 tokens
    first = add(sched, "a", 40)
    so = sched.schedule()
    add(sched, "b", 40, first=1000)
    for _ in range(3):                                      # "b" is looked up, does not fit
        sched.update_from_output(so, output(so, {"a": [5]}))
        so = sched.schedule()
        assert "b" not in so.num_scheduled_tokens
    stats = sched.kv_cache_manager.make_prefix_cache_stats()
    assert (stats.requests, stats.queries) == (1, first.num_prompt_tokens)


def test_freed_blocks_without_a_hash_go_to_the_head_of_the_free_queue():
    pool = BlockPool(6, enable_caching=True)
    blocks = pool.get_new_blocks(3)                          # ids 1, 2, 3
    blocks[0].block_hash = b"h" * 32                        # a full, cached block
    pool.free_blocks(reversed(blocks))
    free = [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]
    assert free == [3, 2, 4, 5, 1]                          # unhashed first, cached one last
    assert pool.get_num_free_blocks() == 5


def test_long_prefill_threshold_is_lifted_for_a_lone_request():
    sched = make_scheduler(long_prefill_token_threshold=400)
    add(sched, "a", 1500)
    assert sched.schedule().num_scheduled_tokens == {"a": 1024}
    sched = make_scheduler(long_prefill_token_threshold=400)
    add(sched, "a", 1500)
    add(sched, "b", 1500, first=5000)
    assert sched.schedule().num_scheduled_tokens == {"a": 400, "b": 400}


def test_cache_salt_extra_key_is_tagged():
    req = Request("a", list(range(20)), SamplingParams(), eos_token_id=None)
    req.cache_salt = "salt"
    assert generate_block_hash_extra_keys(req, 0) == (("cache_salt", "salt"),)
    assert generate_block_hash_extra_keys(req, BS) is None


def test_kv_cache_block_has_slots():
    block = KVCacheBlock(1)
    assert not hasattr(block, "__dict__")
    with pytest.raises(AttributeError):
        block.some_new_attribute = 1


def test_zmq_pull_reads_remote_block_ids_one_list_per_group():
    """What a vLLM prefill instance sends: ``remote_block_ids`` as one list per KV-cache group
    (``([3, 4, 5],)``, ``[[3, 4, 5]]`` after JSON). The decode side pulls those three blocks; two
    groups cannot land in minivllm's one-group cache, so that prompt is recomputed."""
    from types import SimpleNamespace

    from minivllm.distributed.kv_transfer.zmq_pull_connector import remote_block_ids
    assert remote_block_ids({"remote_block_ids": ([3, 4, 5],)}) == [3, 4, 5]
    assert remote_block_ids({"remote_block_ids": [[3, 4, 5]]}) == [3, 4, 5]
    assert remote_block_ids({"remote_block_ids": [3, 4, 5]}) == [3, 4, 5]
    assert remote_block_ids({"remote_block_ids": [[3], [4]]}) is None
    hf = SimpleNamespace(model_type="llama", num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=1, hidden_size=8, head_dim=4)
    cfg = VllmConfig(ModelConfig(model="fake", max_model_len=4096), CacheConfig(block_size=BS),
                     SchedulerConfig(), hf_config=hf,
                     kv_transfer_config=KVTransferConfig("ZmqPullConnector", "kv_consumer"))
    sched = Scheduler(cfg, num_gpu_blocks=20)
    params = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "p",
              "remote_request_id": "r", "remote_host": "127.0.0.1", "remote_port": 1}
    for req_id, ids in [("one", [[3, 4, 5]]), ("two", [[3, 4, 5], [6, 7, 8]])]:
        req = sched.make_request(req_id, list(range(40)), SamplingParams(
            max_tokens=2, extra_args={"kv_transfer_params": {**params, "remote_block_ids": ids}}),
            eos_token_id=None)
        sched.add_request(req)
    with pytest.warns(RuntimeWarning, match="2 KV-cache groups"):
        so = sched.schedule()
    (meta,) = so.kv_connector_metadata.reqs_to_recv
    assert meta.req_id == "one" and meta.remote_block_ids == [3, 4, 5]
    assert so.num_scheduled_tokens == {"two": 40}             # recomputed


class HitConnector(ParkingConnector):
    """Every request has 32 external tokens, loaded in this step's forward."""

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        return 32, False


if "TestHitConnector" not in KVConnectorFactory._registry:
    KVConnectorFactory.register_connector("TestHitConnector", HitConnector)


def test_a_request_that_reads_no_cache_takes_no_external_hit():
    """vLLM: ``skip_reading_prefix_cache`` zeroes the connector's hit as well as the local one."""
    sched = make_scheduler(connector="TestHitConnector")
    plain, scoring = add(sched, "plain", 64), add(sched, "scoring", 64, first=1000)
    scoring.skip_reading_prefix_cache = True
    so = sched.schedule()
    assert so.num_scheduled_tokens == {"plain": 32, "scoring": 64}
    assert plain.num_external_computed_tokens == 32 and scoring.num_external_computed_tokens == 0
