"""Case f: the KV-connector API, call by call, in the article's P/D example, against vLLM 0.32.

Both engines run the article's flow on one 200-token prompt (CPU blocks of 128 tokens in both, so
128 tokens move): a prefill instance (``max_tokens=1``) stores KV in a shared folder, then a fresh
decode instance loads it and generates 8 tokens. Every public method call on the connector, per
instance and per role, is logged with the shapes of its arguments and result
(vllm_side/f_calllog.py, the same code on both sides): vLLM's side subclasses ``ExampleConnector``
(vllm_side/f_connector_vllm.py, loaded through ``kv_connector_module_path``), minivllm's
``SharedStorageConnector``. Steps: a worker step begins at ``bind_connector_metadata``, a scheduler
step ends at ``build_connector_meta`` (so step k holds step k-1's ``request_finished`` and
``update_connector_output``).

Projected on the article's connector API, the sequences are equal except the named differences of
the delta file (rows 5, 6, 13, 33; "plainly wrong" 5), each asserted below.
"""
from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest

from minivllm import LLM, SamplingParams
from minivllm.config import KVTransferConfig
from minivllm.distributed.kv_transfer import KVConnectorFactory
from minivllm.distributed.kv_transfer.shared_storage_connector import SharedStorageConnector

from conftest import one_intra_op_thread  # tests/conftest.py

_spec = importlib.util.spec_from_file_location(
    "f_calllog", Path(__file__).parent / "vllm_side" / "f_calllog.py")
calllog = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(calllog)

BLOCK_SIZE = 128        # vLLM's CPU block size; minivllm is given the same
MAX_TOKENS = 8
SCHEDULER_API = ("get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta",
                 "update_connector_output", "request_finished")
WORKER_API = ("register_kv_caches", "bind_connector_metadata", "start_load_kv",
              "has_connector_metadata", "wait_for_layer_load", "save_kv_layer", "wait_for_save",
              "get_finished", "get_block_ids_with_load_errors", "clear_connector_metadata")
# Delta row 6: 0.32 collects finished transfers with get_transfer_results (its base calls the
# article's get_finished inside it, and the log records only the engine's own call).
RENAMED = {"get_transfer_results": "get_finished"}
# Delta row 33 ("connector base surface"): what vLLM 0.32's engine also calls on ExampleConnector.
VLLM_EXTRA = {
    "SCHEDULER": {"bind_kv_cache_manager", "get_finished_count",
                  "set_xfer_handshake_metadata_pp_aware", "has_pending_push_work", "on_new_request",
                  "get_kv_connector_stats", "take_events"},
    "WORKER": {"get_mem_pool_context", "set_host_xfer_buffer_ops", "get_handshake_metadata",
               "handle_preemptions", "get_kv_connector_stats", "get_kv_connector_kv_cache_events",
               "build_connector_worker_meta"},
}
# vLLM calls shutdown() on both roles as its engine exits; whether that call is logged before the
# process ends depends on the exit's timing, so it is allowed, never required.
AT_EXIT = {"shutdown"}
MINIVLLM_EXTRA = {"SCHEDULER": set(), "WORKER": {"get_stats"}}   # vLLM's get_kv_connector_stats

if "LoggingSharedStorageConnector" not in KVConnectorFactory._registry:
    KVConnectorFactory.register_connector("LoggingSharedStorageConnector",
                                          calllog.make_logging_class(SharedStorageConnector))


def prompt_ids(conformance_model) -> list[int]:
    from minivllm.model_executor.model_loader import load_tokenizer
    ids = load_tokenizer(conformance_model).encode(
        "The quick brown fox jumps over the lazy dog. " * 20)[:200]
    assert len(ids) == 200
    return ids


def run_minivllm(model: str, prompt: list[int], storage: str, tmp: Path) -> dict:
    out = {}
    for name, max_tokens in (("prefill", 1), ("decode", MAX_TOKENS)):
        log = tmp / f"{name}.jsonl"
        os.environ["MINIVLLM_CONF_CALLLOG"] = str(log)
        try:
            ktc = KVTransferConfig("LoggingSharedStorageConnector", "kv_both",
                                   {"shared_storage_path": storage})
            llm = LLM(model=model, dtype="float32", block_size=BLOCK_SIZE, max_model_len=1024,
                      kv_transfer_config=ktc)
            res = llm.generate([{"prompt_token_ids": prompt}],
                               SamplingParams(temperature=0, max_tokens=max_tokens,
                                              ignore_eos=True), use_tqdm=False)[0]
            del llm
        finally:
            del os.environ["MINIVLLM_CONF_CALLLOG"]
        out[name] = {"token_ids": list(res.outputs[0].token_ids),
                     "num_cached_tokens": res.num_cached_tokens, "calls": calllog.read_log(str(log))}
    return out


def _norm(x):
    """Shapes with the engine-specific names taken out: metadata classes, tensor layouts (row 13)
    and attention-metadata classes are compared by their own tests below."""
    if isinstance(x, dict):
        if len(x) == 1 and next(iter(x)).endswith("ConnectorMetadata"):
            return {"metadata": next(iter(x.values()))}
        if "tensor" in x:
            return "tensor"
        return {k: _norm(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_norm(v) for v in x]
    if isinstance(x, str) and x.endswith("AttentionMetadata"):
        return "attn_metadata"
    return x


def steps(calls: list[dict], role: str) -> list[list[tuple]]:
    """One role's article-API calls as (method, argument shapes, result shape), split into engine
    steps; the first group is set-up (``register_kv_caches``)."""
    api = SCHEDULER_API if role == "SCHEDULER" else WORKER_API
    groups: list[list[tuple]] = [[]]
    for c in calls:
        if c["role"] != role:
            continue
        m = RENAMED.get(c["method"], c["method"])
        if m not in api:
            continue
        if role == "WORKER" and m == "bind_connector_metadata":
            groups.append([])
        result = _norm(c["result"]) if m in SCHEDULER_API else None
        groups[-1].append((m, json.dumps(_norm(c["args"])), json.dumps(result)))
        if role == "SCHEDULER" and m == "build_connector_meta":
            groups.append([])
    return [g for g in groups if g]


@pytest.fixture(scope="module")
def both(vllm_side, conformance_model, tmp_path_factory):
    prompt = prompt_ids(conformance_model)
    tmp = tmp_path_factory.mktemp("f_connector")
    job = ("f_pd.py", {"model": conformance_model, "prompt_token_ids": prompt,
                       "max_tokens": MAX_TOKENS, "storage": str(tmp / "vllm_storage")})
    vllm_side.start(*job)   # runs while minivllm does the same
    with one_intra_op_thread():
        mini = run_minivllm(conformance_model, prompt, str(tmp / "mini_storage"), tmp)
    return mini, vllm_side(*job)


def _methods(group):
    return [c[0] for c in group]


def _expected_minivllm(vllm_groups: list[list[tuple]], role: str) -> list[list[tuple]]:
    """vLLM 0.32's sequence with the named differences undone: what minivllm must produce."""
    groups = [list(g) for g in vllm_groups]
    last = groups[-1]
    if role == "WORKER":
        # "Plainly wrong" 5 + delta row 6: after the last request finishes, 0.32 runs one more,
        # empty step (has_finished_requests keeps the engine stepping) whose kv_connector_no_forward
        # still calls start_load_kv and wait_for_save. minivllm stops stepping.
        assert _methods(last) == ["bind_connector_metadata", "start_load_kv", "wait_for_save",
                                  "get_finished", "get_block_ids_with_load_errors",
                                  "clear_connector_metadata"], last
        groups.pop()
        for g in groups:
            # Delta row 6: without a synchronous load in the step (has_sync_kv_loads false), 0.32
            # calls start_load_kv *after* the forward; the article and minivllm call it on enter.
            ms = _methods(g)
            if ms[0] == "bind_connector_metadata" and "start_load_kv" in ms:
                g.insert(1, g.pop(ms.index("start_load_kv")))
    else:
        # The same empty step, scheduler side: its build_connector_meta has nothing scheduled and
        # one finished id, and its update_connector_output follows it.
        assert _methods(last) == ["update_connector_output"], last
        groups.pop()
        assert _methods(groups[-1])[-1] == "build_connector_meta"
        assert '"num_scheduled_tokens": [], "finished_req_ids": 1' in groups[-1][-1][1]
        groups[-1].pop()
        for g in groups:
            # Delta row 25: 0.32's update_from_output calls request_finished inside its per-request
            # loop and update_connector_output (_update_from_kv_xfer_finished) after it; minivllm
            # handles finished transfers before the loop.
            ms = _methods(g)
            if "request_finished" in ms and "update_connector_output" in ms:
                i, j = ms.index("request_finished"), ms.index("update_connector_output")
                if i < j:
                    g[i], g[j] = g[j], g[i]
    return groups


@pytest.mark.parametrize("instance", ["prefill", "decode"])
def test_pd_outputs_equal(both, instance):
    """Same tokens and the same KV hit: P samples one token, D loads 128 of 200 prompt tokens."""
    mini, vllm = both
    assert mini[instance]["token_ids"] == vllm[instance]["token_ids"]
    assert mini[instance]["num_cached_tokens"] == vllm[instance]["num_cached_tokens"]
    assert vllm["decode"]["num_cached_tokens"] == BLOCK_SIZE


@pytest.mark.parametrize("role", ["SCHEDULER", "WORKER"])
@pytest.mark.parametrize("instance", ["prefill", "decode"])
def test_connector_calls_per_step_equal(both, instance, role):
    """Every article-API call, its argument shapes and (scheduler side) result shapes, step by
    step: minivllm's sequence equals vLLM 0.32's once the named differences are undone."""
    mini, vllm = both
    got = steps(mini[instance]["calls"], role)
    want = _expected_minivllm(steps(vllm[instance]["calls"], role), role)
    assert len(got) == len(want), (len(got), len(want))
    for i, (g, w) in enumerate(zip(got, want)):
        assert g == w, f"{instance} {role} step {i}: minivllm {g} != vLLM 0.32 (normalised) {w}"


@pytest.mark.parametrize("instance", ["prefill", "decode"])
def test_connector_surface_beyond_the_article(both, instance):
    """Delta row 33: the methods each engine calls outside the article's API. vLLM 0.32 calls 15
    more (handshakes, push work, KV events, worker metadata, preemption hooks...); minivllm only
    its stats hook (0.32's get_kv_connector_stats)."""
    mini, vllm = both
    for role in ("SCHEDULER", "WORKER"):
        api = set(SCHEDULER_API if role == "SCHEDULER" else WORKER_API) | {"__init__"}
        called = lambda d: {c["method"] for c in d[instance]["calls"]  # noqa: E731
                            if c["role"] == role} - api - set(RENAMED) - AT_EXIT
        assert called(vllm) == VLLM_EXTRA[role], role
        assert called(mini) == MINIVLLM_EXTRA[role], role


@pytest.mark.parametrize("instance", ["prefill", "decode"])
def test_worker_connector_creation_and_kv_layout(both, instance):
    """Delta row 5: 0.32 creates the worker connector in initialize_from_config (it needs the
    KVCacheConfig, so after KV profiling); the article and minivllm in init_device ->
    init_worker_distributed_environment. Delta row 13: the cache each layer registers and saves
    is minivllm's [2, num_blocks, block_size, kv_heads, head_dim] against the CPU backend's
    [num_blocks, kv_heads, block_size, 2 * head_dim] (K and V side by side)."""
    mini, vllm = both
    init = {name: next(c for c in d[instance]["calls"]
                       if c["role"] == "WORKER" and c["method"] == "__init__")
            for name, d in (("mini", mini), ("vllm", vllm))}
    assert "initialize_from_config" in init["vllm"]["stack"]
    assert "init_device" not in init["vllm"]["stack"]
    assert {"init_device", "init_worker_distributed_environment"} <= set(init["mini"]["stack"])
    assert "initialize_from_config" not in init["mini"]["stack"]
    # ... and 0.32 passes it the KVCacheConfig (required since 0.32, row 33); minivllm passes None.
    assert init["vllm"]["args"] == ["KVCacheConfig"] and init["mini"]["args"] == [None]
    shape = {name: next(c for c in d[instance]["calls"] if c["method"] == "register_kv_caches")
             ["args"][0] for name, d in (("mini", mini), ("vllm", vllm))}
    assert shape["mini"]["dict"] == shape["vllm"]["dict"] == 30     # one cache per layer
    m, v = shape["mini"]["value"]["tensor"], shape["vllm"]["value"]["tensor"]
    assert m[0] == 2 and m[2:] == [BLOCK_SIZE, 3, 64]
    assert v[1:] == [3, BLOCK_SIZE, 2 * 64]
