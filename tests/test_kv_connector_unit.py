"""SharedStorageConnector on hand-made paged caches: the scheduler-side calls drive the worker-side
ones exactly as the engine does (lookup -> update_state_after_alloc -> build_connector_meta ->
context manager around a fake forward that writes K/V and calls the per-layer hooks)."""
from __future__ import annotations

import hashlib
import os
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from minivllm import trace
from minivllm.config import (CacheConfig, KVTransferConfig, ModelConfig, SchedulerConfig,
                             VllmConfig)
from minivllm.core.kv_cache_utils import KVCacheBlock, KVCacheBlocks
from minivllm.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from minivllm.distributed.kv_transfer import (KVConnectorBase_V1, KVConnectorFactory,
                                              KVConnectorOutput, KVConnectorRole,
                                              ensure_kv_transfer_initialized,
                                              validate_kv_transfer_config)
from minivllm.distributed.kv_transfer.shared_storage_connector import align_to_block_size
from minivllm.forward_context import set_forward_context
from minivllm.request import Request
from minivllm.sampling_params import SamplingParams
from minivllm.worker.kv_connector_model_runner_mixin import KVConnectorModelRunnerMixin
from minivllm.worker.model_runner import ModelRunner


class ConnectorHalf(KVConnectorModelRunnerMixin):
    """The model runner's KV-connector half alone, over a worker-role connector."""

    def __init__(self, connector):
        self.kv_connector = connector

H, D, NUM_BLOCKS, VOCAB = 2, 8, 40, 50
LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
_TABLE = torch.randn(len(LAYERS), 2, VOCAB, H, D, generator=torch.Generator().manual_seed(0))


def true_kv(layer: int, token_ids: list[int]) -> torch.Tensor:
    """What the "model" computes: [2, n, H, D], depends on layer, token and position."""
    pos = torch.arange(len(token_ids), dtype=torch.float32).view(1, -1, 1, 1)
    return _TABLE[layer][:, token_ids] + 0.01 * pos


def folder_name(token_ids: list[int]) -> str:
    return hashlib.md5(np.asarray(token_ids, dtype="<i8").tobytes()).hexdigest()


class Instance:
    """One engine instance: a scheduler-role and a worker-role connector, paged caches, a block
    allocator. ``step`` runs one engine step for new requests (and chunk continuations)."""

    def __init__(self, path, role="kv_both", bs=4, first_block=1, head_dim=D, **extra):
        hf = SimpleNamespace(model_type="llama", num_hidden_layers=len(LAYERS), num_attention_heads=4,
                             num_key_value_heads=H, hidden_size=4 * head_dim, head_dim=head_dim)
        ktc = KVTransferConfig("SharedStorageConnector", role,
                               {"shared_storage_path": str(path), **extra})
        self.cfg = VllmConfig(ModelConfig(model="fake"), CacheConfig(block_size=bs), SchedulerConfig(),
                              kv_transfer_config=ktc, hf_config=hf)
        self.bs = bs
        self.sched = KVConnectorFactory.create_connector(self.cfg, KVConnectorRole.SCHEDULER)
        self.worker = ensure_kv_transfer_initialized(self.cfg)
        self.caches = {n: torch.zeros(2, NUM_BLOCKS, bs, H, head_dim) for n in LAYERS}
        self.worker.register_kv_caches(self.caches)
        self.next_block = first_block
        self.blocks: dict[str, list[int]] = {}
        self.computed: dict[str, int] = {}

    def alloc(self, n: int) -> list[int]:
        ids = list(range(self.next_block, self.next_block + n))
        self.next_block += n
        return ids

    def slots(self, req_id: str, start: int, end: int) -> torch.Tensor:
        pos = torch.arange(start, end)
        return torch.tensor(self.blocks[req_id])[pos // self.bs] * self.bs + pos % self.bs

    def cache_rows(self, layer: int, req_id: str, start: int, end: int) -> torch.Tensor:
        kv = self.caches[LAYERS[layer]]
        return kv.view(2, -1, H, kv.shape[-1])[:, self.slots(req_id, start, end)]

    def step(self, reqs: list[Request], chunk: int = 10**9, local_hit: int = 0, hook=None):
        new, sched = [], {}
        for r in reqs:
            rid = r.request_id
            if rid not in self.blocks:
                n_ext, load_async = self.sched.get_num_new_matched_tokens(r, local_hit)
                assert load_async is False
                self.blocks[rid] = self.alloc(-(-r.num_tokens // self.bs))
                blocks = KVCacheBlocks(([KVCacheBlock(i) for i in self.blocks[rid]],))
                self.sched.update_state_after_alloc(r, blocks, n_ext)
                self.computed[rid] = local_hit + n_ext
                sched[rid] = min(r.num_tokens - self.computed[rid], chunk)
                new.append(NewRequestData(rid, r.prompt_token_ids, r.sampling_params,
                                          (list(self.blocks[rid]),), self.computed[rid]))
            else:
                sched[rid] = min(r.num_tokens - self.computed[rid], chunk)
        cached = CachedRequestData()
        for r in reqs:
            if r.request_id not in [n.req_id for n in new]:
                cached.req_ids.append(r.request_id)
                cached.new_block_ids.append(([],))
                cached.num_computed_tokens.append(self.computed[r.request_id])
                cached.num_output_tokens.append(0)
        so = SchedulerOutput(new, cached, sched, sum(sched.values()), {}, [0], set())
        so.kv_connector_metadata = self.sched.build_connector_meta(so)
        with set_forward_context(None, {}, self.worker):
            with ConnectorHalf(self.worker).maybe_get_kv_connector_output(so) as out:
                if hook:
                    hook("after_start_load_kv")
                for i, name in enumerate(LAYERS):
                    self.worker.wait_for_layer_load(name)
                    for r in reqs:   # the "forward" writes this step's K/V
                        rid, c = r.request_id, self.computed[r.request_id]
                        kv = true_kv(i, r.all_token_ids[:c + sched[rid]])[:, c:]
                        flat = self.caches[name].view(2, -1, H, self.caches[name].shape[-1])
                        flat[:, self.slots(rid, c, c + sched[rid])] = kv
                    self.worker.save_kv_layer(name, self.caches[name], None)
                    if hook:
                        hook(f"after_layer_{i}")
        for rid, n in sched.items():
            self.computed[rid] += n
        return so, out


def req(rid: str, ids: list[int]) -> Request:
    return Request(rid, ids, SamplingParams(temperature=0), eos_token_id=None)


def prompt(n: int, seed: int = 0) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def layer_file(path, ids, layer=0):
    return os.path.join(path, folder_name(ids), f"{LAYERS[layer]}.safetensors")


def test_align_to_block_size():
    assert [align_to_block_size(n, 16) for n in (0, 1, 15, 16, 17, 32, 33, 40)] == [0, 0, 0, 0, 16, 16, 32, 32]


@pytest.mark.parametrize("layerwise", [False, True])
@pytest.mark.parametrize("n_prompt", [3, 4, 5, 8, 9, 12, 15])
def test_store_then_load_round_trip(tmp_path, n_prompt, layerwise):
    ids, n = prompt(n_prompt), align_to_block_size(n_prompt, 4)
    p = Instance(tmp_path, layerwise=layerwise)
    so, _ = p.step([req("p0", ids)])
    stores = [r for r in so.kv_connector_metadata.requests if r.is_store]
    assert [(r.req_id, len(r.token_ids)) for r in stores] == ([("p0", n)] if n else [])
    # Layout on disk: one folder named by the MD5 of the int64 token ids, one file per layer.
    expected = {folder_name(ids[:n])} if n else set()
    assert set(os.listdir(tmp_path)) == expected, "no temporary folders left behind"
    if n:
        assert sorted(os.listdir(tmp_path / folder_name(ids[:n]))) == sorted(
            [f"{name}.safetensors" for name in LAYERS] + ["meta.json"])
        for i in range(len(LAYERS)):
            stored = load_file(layer_file(tmp_path, ids[:n], i))["kv_cache"]
            assert stored.shape == (2, n, H * D)
            torch.testing.assert_close(stored, true_kv(i, ids[:n]).reshape(2, n, H * D))

    dec = Instance(tmp_path, layerwise=layerwise, first_block=17)   # other block ids than P
    seen = {}
    hook = lambda where: seen.setdefault(where, dec.caches[LAYERS[1]].abs().sum().item())  # noqa: E731
    so, out = dec.step([req("d0", ids)], hook=hook)
    assert dec.computed["d0"] == n_prompt and so.num_scheduled_tokens["d0"] == n_prompt - n
    assert not [r for r in so.kv_connector_metadata.requests if r.is_store]   # found: no re-store
    assert out.invalid_block_ids == set() and out.is_empty()
    for i in range(len(LAYERS)):
        torch.testing.assert_close(dec.cache_rows(i, "d0", 0, n_prompt), true_kv(i, ids))
    if n:   # layerwise: layer 1 is still empty after start_load_kv and after layer 0
        assert (seen["after_start_load_kv"] == 0) == layerwise
        assert (seen["after_layer_0"] == 0) == layerwise
    stats = dec.worker.get_stats()
    assert stats["num_loaded_tokens"] == n and stats["num_loaded_bytes"] == len(LAYERS) * 2 * n * H * D * 4
    assert p.worker.get_stats()["num_stored_tokens"] == n


def test_decode_prompt_with_generated_token_finds_stored_prefix(tmp_path):
    """vLLM's edge case: L_d = L_p + 1 with L_p a multiple of bs. P stores align(8) = 4 tokens; D
    first looks for 8 (never written), then falls back to 4."""
    ids = prompt(8)
    Instance(tmp_path, role="kv_producer").step([req("p", ids)])
    dec = Instance(tmp_path, role="kv_consumer", first_block=20)
    r = req("d", ids + [7])
    assert dec.sched.get_num_new_matched_tokens(r, 0) == (4, False)
    so, out = dec.step([r])
    assert [(x.start, len(x.token_ids)) for x in so.kv_connector_metadata.requests] == [(0, 4)]
    for i in range(len(LAYERS)):
        torch.testing.assert_close(dec.cache_rows(i, "d", 0, 9), true_kv(i, ids + [7]))


def test_local_prefix_hit_is_not_overwritten_and_match_is_clamped(tmp_path):
    ids = prompt(13)                                                   # n = 12
    Instance(tmp_path).step([req("p", ids)])
    dec = Instance(tmp_path, first_block=20)
    r = req("d", ids)
    assert dec.sched.get_num_new_matched_tokens(r, 4) == (8, False)
    assert dec.sched.get_num_new_matched_tokens(r, 12) == (0, False)
    assert dec.sched.get_num_new_matched_tokens(r, 16) == (0, False)   # vLLM would say -4
    dec.blocks["d"] = [20, 21, 22, 23]
    dec.caches[LAYERS[0]][:, 20] = 123.0    # the locally cached block: must stay untouched
    del dec.blocks["d"]
    so, _ = dec.step([r], local_hit=4)
    (load,) = so.kv_connector_metadata.requests
    assert (load.start, load.block_ids) == (4, [21, 22])
    assert (dec.caches[LAYERS[0]][:, 20] == 123.0).all()
    torch.testing.assert_close(dec.cache_rows(1, "d", 4, 13), true_kv(1, ids)[:, 4:])


def test_roles_producer_never_loads_consumer_never_stores(tmp_path):
    ids = prompt(9)
    so, _ = Instance(tmp_path, role="kv_consumer").step([req("c", ids)])
    assert so.kv_connector_metadata.requests == [] and os.listdir(tmp_path) == []
    Instance(tmp_path, role="kv_producer").step([req("p", ids)])
    assert Instance(tmp_path, role="kv_producer").sched.get_num_new_matched_tokens(req("q", ids), 0) == (0, False)


def test_block_size_of_decode_may_differ(tmp_path):
    ids = prompt(17)                                        # P bs 4 stores 16 tokens
    Instance(tmp_path, bs=4).step([req("p", ids)])
    for bs in (2, 8, 16):
        dec = Instance(tmp_path, bs=bs, role="kv_consumer")
        so, out = dec.step([req("d", ids)])
        assert dec.computed["d"] == 17 and so.num_scheduled_tokens["d"] == 1 and not out.invalid_block_ids
        torch.testing.assert_close(dec.cache_rows(1, "d", 0, 17), true_kv(1, ids))


def test_chunked_prefill_stores_when_prefix_is_complete(tmp_path):
    ids = prompt(14)                                            # n = 12, chunks of 5
    p = Instance(tmp_path)
    r = req("p", ids)
    kinds = []
    for _ in range(3):
        so, _ = p.step([r], chunk=5)
        kinds.append([(m.is_store, len(m.token_ids)) for m in so.kv_connector_metadata.requests])
    assert kinds == [[], [], [(True, 12)]]
    stored = load_file(layer_file(tmp_path, ids[:12], 1))["kv_cache"]
    torch.testing.assert_close(stored, true_kv(1, ids[:12]).reshape(2, 12, H * D))


def test_same_prompt_twice_in_one_step_is_stored_once(tmp_path):
    ids = prompt(9)
    so, _ = Instance(tmp_path).step([req("a", ids), req("b", ids)])
    assert [m.req_id for m in so.kv_connector_metadata.requests if m.is_store] == ["a"]
    assert os.listdir(tmp_path) == [folder_name(ids[:8])]


def test_trace_records_each_call_per_role(tmp_path):
    ids = prompt(9)
    p, tracer = Instance(tmp_path), trace.Tracer(enabled=True)
    with tracer.step(0):
        p.step([req("p", ids)])
    events = tracer.events("connector")
    sched = [e["method"] for e in events if e["role"] == "scheduler"]
    worker = [e["method"] for e in events if e["role"] == "worker"]
    assert sched == ["get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta"]
    assert worker == (["bind_connector_metadata", "start_load_kv"]
                      + ["wait_for_layer_load", "save_kv_layer"] * len(LAYERS)
                      + ["wait_for_save", "get_finished", "get_block_ids_with_load_errors",
                         "clear_connector_metadata"])
    saves = [e for e in events if e["method"] == "save_kv_layer"]
    assert [e["bytes"] for e in saves] == [2 * 8 * H * D * 4] * len(LAYERS)
    build = next(e for e in events if e["method"] == "build_connector_meta")
    assert build["result"][0]["is_store"] is True and build["result"][0]["tokens"] == [0, 8]


def test_request_finished_and_no_forward_step(tmp_path):
    p = Instance(tmp_path)
    ids = prompt(14)
    p.step([req("p", ids)], chunk=5)                      # store pending until the prefix is done
    assert p.sched.request_finished(req("p", ids), [1, 2, 3, 4]) == (False, None)
    assert "p" not in p.sched._pending_stores
    so = SchedulerOutput([], CachedRequestData(), {}, 0, {}, [0], {"p"})
    so.kv_connector_metadata = p.sched.build_connector_meta(so)
    out = ConnectorHalf(p.worker).kv_connector_no_forward(so)
    assert isinstance(out, KVConnectorOutput) and out.is_empty()
    assert not p.worker.has_connector_metadata()
    with ModelRunner.maybe_get_kv_connector_output(None, so) as nothing:   # no connector
        assert nothing is None


def test_config_validation_names_the_field(tmp_path):
    def ktc(**extra):
        return KVTransferConfig("SharedStorageConnector", "kv_both", extra)
    with pytest.raises(ValueError, match="kv_connector"):
        validate_kv_transfer_config(KVTransferConfig("NoSuchConnector", "kv_both"))
    with pytest.raises(ValueError, match="shared_storage_path"):
        validate_kv_transfer_config(ktc())
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    with pytest.raises(ValueError, match="shared_storage_path"):
        validate_kv_transfer_config(ktc(shared_storage_path=str(blocker / "sub")))
    with pytest.raises(ValueError, match="layer_wise"):
        validate_kv_transfer_config(ktc(shared_storage_path=str(tmp_path), layer_wise=True))
    with pytest.raises(ValueError, match="layerwise"):
        validate_kv_transfer_config(ktc(shared_storage_path=str(tmp_path), layerwise="yes"))
    with pytest.raises(ValueError, match="kv_role"):
        validate_kv_transfer_config({"kv_connector": "SharedStorageConnector", "kv_role": "both"})
    ok = validate_kv_transfer_config({"kv_connector": "SharedStorageConnector", "kv_role": "kv_both",
                                      "kv_connector_extra_config": {"shared_storage_path": str(tmp_path / "new")}})
    assert isinstance(ok, KVTransferConfig) and (tmp_path / "new").is_dir()
    assert validate_kv_transfer_config(None) is None


def test_register_custom_connector(tmp_path):
    class NullConnector(KVConnectorBase_V1):
        pass
    KVConnectorFactory.register_connector("NullConnectorForTest", NullConnector)
    with pytest.raises(ValueError):
        KVConnectorFactory.register_connector("NullConnectorForTest", NullConnector)
    cfg = Instance(tmp_path).cfg
    cfg.kv_transfer_config = KVTransferConfig("NullConnectorForTest", "kv_both")
    conn = KVConnectorFactory.create_connector(cfg, KVConnectorRole.WORKER)
    assert isinstance(conn, NullConnector) and conn.role is KVConnectorRole.WORKER
    assert conn.request_finished(None, []) == (False, None) and conn.get_finished(set()) == (None, None)
    with pytest.raises(NotImplementedError):
        conn.get_num_new_matched_tokens(None, 0)
    cfg.kv_transfer_config = None
    assert ensure_kv_transfer_initialized(cfg) is None
