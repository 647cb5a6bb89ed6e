"""The connector context manager in both orders (``KVTransferConfig.kv_connector_context``):
"article" (default: start_load_kv on enter, wait_for_save on exit, none without a forward) and
"vllm_today" (vLLM 0.32: start_load_kv before the forward only when the step has a synchronous
load, ``SchedulerOutput.has_sync_kv_loads``, otherwise after it; wait_for_save on every step)."""
from __future__ import annotations

import pytest

from conftest import runner_of, tiny_llm
from minivllm import SamplingParams
from minivllm.config import KVTransferConfig
from test_vllm_today_lookahead import AsyncLoadTestConnector  # noqa: F401  (registers it)

pytestmark = pytest.mark.usefixtures("one_thread")
PROMPTS = [{"prompt_token_ids": list(range(1, 12))}, {"prompt_token_ids": list(range(30, 40))}]
GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


def _traced(llm):
    """Log connector calls and forwards per step: one list per execute_model."""
    runner = runner_of(llm)
    conn, model, steps = runner.kv_connector, runner.model, []
    for name in ("start_load_kv", "wait_for_save"):
        orig = getattr(conn, name)
        setattr(conn, name, lambda *a, _o=orig, _n=name, **k: (steps[-1].append(_n), _o(*a, **k))[1])
    fwd = model.forward
    model.forward = lambda *a, **k: (steps[-1].append("forward"), fwd(*a, **k))[1]
    run = runner.execute_model

    def execute_model(so):
        steps.append(["sync_load"] if so.has_sync_kv_loads else [])
        return run(so)
    runner.execute_model = execute_model
    return steps


def _ktc(path, context=None, name="SharedStorageConnector"):
    extra = {"shared_storage_path": str(path)} if name == "SharedStorageConnector" else {}
    kw = {} if context is None else {"kv_connector_context": context}
    return KVTransferConfig(name, "kv_both", extra, **kw)


@pytest.mark.parametrize("context", [None, "article", "vllm_today"])
def test_order_around_the_forward(tmp_path, tiny_llama_dir, context):
    ref = [o.outputs[0].token_ids for o in tiny_llm(tiny_llama_dir).generate(
        PROMPTS, GREEDY, use_tqdm=False)]
    tiny_llm(tiny_llama_dir, kv_transfer_config=_ktc(tmp_path, context)).generate(
        PROMPTS, SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    d = tiny_llm(tiny_llama_dir, kv_transfer_config=_ktc(tmp_path, context))
    steps = _traced(d)
    out = d.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in out] == ref
    assert [o.num_cached_tokens for o in out] == [8, 8]
    first, later = steps[0], steps[1:]
    assert first == ["sync_load", "start_load_kv", "forward", "wait_for_save"]
    if context == "vllm_today":
        assert all(s == ["forward", "start_load_kv", "wait_for_save"] for s in later), later
    else:
        assert all(s == ["start_load_kv", "forward", "wait_for_save"] for s in later), later


@pytest.mark.parametrize("context", ["article", "vllm_today"])
def test_step_without_forward(tiny_llama_dir, context):
    """An async load leaves a step with nothing scheduled: only vLLM today saves there."""
    d = tiny_llm(tiny_llama_dir, kv_transfer_config=_ktc(None, context, "AsyncLoadTestConnector"),
                 num_gpu_blocks_override=64)
    d.llm_engine.engine_core.scheduler.connector.manager = d.llm_engine.engine_core.scheduler.kv_cache_manager
    steps = _traced(d)
    d.generate(PROMPTS[:1], GREEDY, use_tqdm=False)
    empty = [s for s in steps if "forward" not in s]
    assert empty
    want = ["start_load_kv", "wait_for_save"] if context == "vllm_today" else ["start_load_kv"]
    assert all(s == want for s in empty), empty


def test_bad_value_names_the_field():
    with pytest.raises(ValueError, match="kv_connector_context"):
        KVTransferConfig("SharedStorageConnector", "kv_both", {}, kv_connector_context="later")
