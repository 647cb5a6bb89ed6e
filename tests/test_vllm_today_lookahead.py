"""Lookahead slots and ``update_state_after_alloc``'s blocks as in vLLM 0.32 (scheduler.py):
drafters that write KV (EAGLE, EAGLE-3, draft model) get k lookahead slots on a request's first
step, withheld only while an asynchronous KV load is pending; ``update_state_after_alloc`` always
receives all of the request's blocks (``kv_cache_manager.get_blocks``)."""
from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from conftest import tiny_llm
from minivllm import SamplingParams
from minivllm.config import KVTransferConfig
from minivllm.distributed.kv_transfer import KVConnectorBase_V1, KVConnectorFactory, KVConnectorMetadata

pytestmark = pytest.mark.usefixtures("one_thread")
BS, K = 4, 3
SELF_DRAFT = {"method": "draft_model", "num_speculative_tokens": K, "draft_num_layers": 1}
CALLS: list[tuple[str, list[int], int, list[int]]] = []   # (req, blocks given, n_ext, blocks held)


@dataclass
class _Meta(KVConnectorMetadata):
    load_req_ids: list[str] = field(default_factory=list)


class AsyncLoadTestConnector(KVConnectorBase_V1):
    """Claims every prompt's whole blocks below the last token as an asynchronous load; the worker
    reports each load finished one step later (it writes nothing: outputs are not checked)."""

    def __init__(self, vllm_config, role, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        self._asked: set[str] = set()
        self._to_load: list[str] = []
        self._loading: set[str] = set()
        self.manager = None   # the test binds the scheduler's KV cache manager

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        if request.request_id in self._asked:
            return 0, False
        self._asked.add(request.request_id)
        n = (request.num_tokens - 1) // BS * BS - num_computed_tokens
        return max(n, 0), n > 0

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        CALLS.append((request.request_id, blocks.get_block_ids()[0], num_external_tokens,
                      self.manager.get_block_ids(request.request_id)[0]))
        if num_external_tokens:
            self._to_load.append(request.request_id)

    def build_connector_meta(self, scheduler_output):
        meta, self._to_load = _Meta(self._to_load), []
        return meta

    def start_load_kv(self, forward_context, **kwargs):
        self._loading |= set(self._get_connector_metadata().load_req_ids)

    def wait_for_layer_load(self, layer_name):
        pass

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs):
        pass

    def wait_for_save(self):
        pass

    def get_finished(self, finished_req_ids):
        done, self._loading = self._loading, set(self._get_connector_metadata().load_req_ids)
        return None, done or None


KVConnectorFactory.register_connector("AsyncLoadTestConnector", AsyncLoadTestConnector)


def _blocks(n_tokens):
    return -(-n_tokens // BS)


def test_sync_connector_gives_draft_model_its_lookahead_slots(tmp_path, tiny_llama_dir):
    """SharedStorageConnector (synchronous), nothing stored: the first step of a 10-token prompt
    reserves 10 + k slots, the blocks update_state_after_alloc sees are all the request holds."""
    kv = KVTransferConfig("SharedStorageConnector", "kv_both", {"shared_storage_path": str(tmp_path)})
    llm = tiny_llm(tiny_llama_dir, SELF_DRAFT, kv_transfer_config=kv, num_gpu_blocks_override=64)
    sched = llm.llm_engine.engine_core.scheduler
    seen = []
    orig = sched.connector.update_state_after_alloc
    sched.connector.update_state_after_alloc = lambda r, b, n: (seen.append(b.get_block_ids()[0]),
                                                                orig(r, b, n))
    llm.llm_engine.add_request("a", {"prompt_token_ids": list(range(1, 11))},
                               SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    so = sched.schedule()
    held = sched.kv_cache_manager.get_block_ids("a")[0]
    assert so.num_scheduled_tokens == {"a": 10}
    assert len(held) == _blocks(10 + K)
    assert seen == [held]


def test_async_load_withholds_lookahead_then_passes_all_blocks(tiny_llama_dir):
    CALLS.clear()
    kv = KVTransferConfig("AsyncLoadTestConnector", "kv_both")
    llm = tiny_llm(tiny_llama_dir, SELF_DRAFT, kv_transfer_config=kv, num_gpu_blocks_override=64)
    sched = llm.llm_engine.engine_core.scheduler
    sched.connector.manager = sched.kv_cache_manager
    out = llm.generate([{"prompt_token_ids": list(range(1, 11))}],
                       SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3
    # First call: the async load of 8 tokens, no lookahead (2 blocks). Second call, once loaded:
    # 2 more tokens to compute plus k lookahead slots, and all of the request's blocks.
    assert [(c[2], len(c[1])) for c in CALLS] == [(8, _blocks(8)), (0, _blocks(10 + K))]
    assert all(given == held for _, given, _, held in CALLS)
