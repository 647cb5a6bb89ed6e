"""Case e, vLLM side: run e_workload through vLLM 0.32's own Scheduler, no model, and print JSON.

Built the way vLLM's unit tests build it (tests/v1/core/utils.py ``create_scheduler``): a
VllmConfig, a one-group KVCacheConfig with a FullAttentionSpec, a StructuredOutputManager, and
n-gram speculative decoding so drafts can be injected. Usage: python e_scheduler.py IN.json OUT.json
with IN holding {"model": MODEL_DIR} (only its config.json is read; no weights, no engine). OUT
holds the records twice: with 0.32's default ``scheduler_reserve_full_isl=True`` and with it off.
"""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import e_workload as W  # noqa: E402

import torch  # noqa: E402
from vllm.config import (CacheConfig, ModelConfig, SchedulerConfig, SpeculativeConfig,  # noqa: E402
                         VllmConfig)
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheConfig,  # noqa: E402
                                        KVCacheGroupSpec)
from vllm.v1.outputs import DraftTokenIds, ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402


def build(model_dir: str, reserve_full_isl: bool) -> Scheduler:
    sched = SchedulerConfig(max_num_seqs=W.MAX_NUM_SEQS,
                            max_num_batched_tokens=W.MAX_NUM_BATCHED_TOKENS,
                            max_model_len=W.MAX_MODEL_LEN, enable_chunked_prefill=True,
                            async_scheduling=False, is_encoder_decoder=False,
                            scheduler_reserve_full_isl=reserve_full_isl)
    model = ModelConfig(model=model_dir, dtype="float32", seed=0, max_model_len=W.MAX_MODEL_LEN)
    cache = CacheConfig(block_size=W.BLOCK_SIZE, enable_prefix_caching=True)
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=W.NUM_SPEC_TOKENS,
                             prompt_lookup_min=2, prompt_lookup_max=4)
    cfg = VllmConfig(scheduler_config=sched, model_config=model, cache_config=cache,
                     speculative_config=spec)
    kv = KVCacheConfig(num_blocks=W.NUM_BLOCKS, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(["layer"], FullAttentionSpec(block_size=W.BLOCK_SIZE, num_kv_heads=1,
                                                      head_size=1, dtype=torch.float32))])
    cfg.cache_config.num_gpu_blocks = W.NUM_BLOCKS
    return Scheduler(vllm_config=cfg, kv_cache_config=kv, block_size=W.BLOCK_SIZE,
                     structured_output_manager=StructuredOutputManager(cfg), log_stats=True)


class VllmAdapter(W.SchedulerAdapter):
    def __init__(self, model_dir: str, reserve_full_isl: bool) -> None:
        self.s = build(model_dir, reserve_full_isl)
        init_none_hash(sha256)
        self.hasher = get_request_block_hasher(W.BLOCK_SIZE, sha256)
        self._now: set[str] = set()
        self.reqs: dict[str, Request] = {}

    def add_request(self, rid, prompt, max_tokens):
        r = Request(rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True,
                                                temperature=0.0), None, block_hasher=self.hasher)
        self.reqs[rid] = r
        self.s.add_request(r)

    def runner_output(self, ids, sampled):
        return ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                 sampled_token_ids=[sampled[r] for r in ids])

    def update_draft_token_ids(self, drafts):
        ids = list(drafts)
        self.s.update_draft_token_ids(DraftTokenIds(ids, [drafts[r] for r in ids]))


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        payload = json.load(f)
    with open(sys.argv[2], "w") as f:
        # Both admission rules in one process: 0.32's default (the whole prompt must fit before a
        # request is admitted) and the article's (the first chunk must fit).
        json.dump({name: W.run(VllmAdapter(payload["model"], flag)) for name, flag in
                   (("reserve_full_isl", True), ("first_chunk", False))}, f)
