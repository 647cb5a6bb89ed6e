"""Medusa (issue 9 sections 1 and 4): greedy output identical with and without the heads; drafts
equal a dense recomputation (head j over the target state at the last accepted token); vLLM's
config renaming; truncated vocabulary; shared target lm_head; no lookahead slots; bad heads."""
from __future__ import annotations

import json
import os

import pytest
import torch

from conftest import generate_tokens, make_tiny_llama, plain_greedy_tokens, tiny_llm as tiny
from learned_heads import dense_medusa_drafts, load_tensors, make_medusa_head
from minivllm import SamplingParams
from minivllm.spec_decode.medusa import last_accepted_rows

PROMPTS = [[5, 17, 42], list(range(1, 30)), [9, 8, 7, 6] * 6, [7]]


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> str:
    return make_tiny_llama(tmp_path_factory.mktemp("medusa_target"), seed=6, vocab_size=64)


def greedy(max_tokens=16):
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def run(llm, prompts=PROMPTS, params=None):
    return generate_tokens(llm, prompts, params or greedy())


def spec(head, k=3):
    return {"method": "medusa", "model": head, "num_speculative_tokens": k}


def plain(model, prompts=PROMPTS, max_tokens=16):
    return plain_greedy_tokens(model, prompts, max_tokens)


def test_last_accepted_rows():
    # 3 requests: no drafts (1 row), 2 drafts with 1 accepted (+1 bonus), partial prefill (nothing).
    assert last_accepted_rows([0, 2, 0], [[4], [7, 8], []]) == [0, 2, -1]


@pytest.mark.parametrize("case", ["own_heads", "shared_lm_head", "truncated_vocab"])
def test_drafts_equal_dense_recomputation(case, target, tmp_path):
    """Every proposal equals the heads recomputed over the Hugging Face target state of the last
    context token; output equals plain decoding, with chunked prefill and a mixed batch."""
    kw = {"own_heads": dict(num_layers=2, bias=True), "shared_lm_head": dict(own_lm_heads=False),
          "truncated_vocab": dict(truncated_vocab_size=16, fasterdecoding_names=False)}[case]
    head = make_medusa_head(tmp_path / case, target, num_heads=4, **kw)
    k = 3
    llm = tiny(target, spec(head, k), max_num_batched_tokens=9, max_num_seqs=3)
    (tracer := llm.llm_engine.tracer).enabled = True
    assert run(llm) == plain(target)
    tokens, checked = {}, 0
    token_map = set(load_tensors(head)["token_map"].tolist()) if "truncated" in case else None
    for rec in tracer.steps:
        for req_id in rec.first("schedule")["new_req_ids"]:
            tokens[req_id] = list(PROMPTS[len(tokens)])
        for req_id, toks in rec.first("sampled")["sampled"].items():
            tokens[req_id].extend(toks)
        for req_id, drafts in rec.first("spec_propose")["drafts"].items():
            assert drafts == dense_medusa_drafts(head, target, tokens[req_id], k)[:len(drafts)]
            assert token_map is None or set(drafts) <= token_map
            checked += 1
    assert checked >= 10
    runner = llm.llm_engine.engine_core.worker.model_runner
    medusa = runner.drafter.model
    assert len(medusa.blocks) == k   # only the first k of the 4 heads are built
    if case == "shared_lm_head":
        assert medusa.lm_heads is None and medusa.target_lm_head is runner.model.lm_head
    # Medusa writes no KV and reserves no lookahead slots (vLLM).
    assert llm.llm_engine.engine_core.scheduler.num_lookahead_tokens == 0
    assert not runner.drafter.has_kv_cache and not runner.drafter.attn_layers()


@pytest.mark.parametrize("k", [1, 2])
def test_greedy_equals_plain_with_preemption_and_prefix_caching(k, target, tmp_path):
    head = make_medusa_head(tmp_path / "h", target, num_heads=2, seed=k)
    llm = tiny(target, spec(head, k), num_gpu_blocks_override=22)
    assert run(llm) == plain(target)
    m = {x.name: getattr(x, "values", getattr(x, "value", None)) for x in llm.get_metrics()}
    assert m["vllm:num_preemptions"] > 0 and m["vllm:spec_decode_num_draft_tokens"] > 0
    assert run(llm) == plain(target)   # prefix-cache hits now


def test_config_renaming(target, tmp_path):
    """vLLM's MedusaConfig: medusa_num_heads / medusa_num_layers are num_heads / num_hidden_layers."""
    from minivllm.model_executor.models.medusa import medusa_config_from_dict
    cfg = medusa_config_from_dict({"medusa_num_heads": 5, "medusa_num_layers": 2, "hidden_size": 8})
    assert cfg == {"num_heads": 5, "num_hidden_layers": 2, "hidden_size": 8}
    assert medusa_config_from_dict({"num_heads": 2})["num_hidden_layers"] == 1
    head = make_medusa_head(tmp_path / "h", target, num_heads=3, num_layers=2)
    with open(os.path.join(head, "config.json")) as f:
        assert "medusa_num_layers" in json.load(f)
    llm = tiny(target, spec(head, 3))
    medusa = llm.llm_engine.engine_core.worker.model_runner.drafter.model
    assert [len(b.layers) for b in medusa.blocks] == [2, 2, 2]
    w = load_tensors(head)
    assert torch.equal(medusa.blocks[1].layers[1].weight, w["blocks.1.layers.1.weight"])
    assert torch.equal(medusa.lm_heads[2].weight, w["lm_heads.2.weight"])


def test_bad_heads(target, tmp_path, monkeypatch):
    from safetensors.torch import save_file
    monkeypatch.setattr("minivllm.entrypoints.llm.LLMEngine", None)   # must never be reached
    head = make_medusa_head(tmp_path / "h", target, num_heads=2)
    with pytest.raises(ValueError, match="num_speculative_tokens=3 is larger than the Medusa "
                                         "head's num_heads=2"):
        tiny(target, spec(head, 3))
    other = make_tiny_llama(tmp_path / "other", hidden_size=32, intermediate_size=64)
    with pytest.raises(ValueError, match="hidden_size"):
        tiny(target, spec(make_medusa_head(tmp_path / "h32", other), 2))
    w = load_tensors(head)
    del w["blocks.1.layers.0.weight"]
    save_file(w, os.path.join(head, "model.safetensors"))
    with pytest.raises(ValueError, match=r"blocks\.1\.layers\.0\.weight"):
        tiny(target, spec(head, 2))
    trunc = make_medusa_head(tmp_path / "t", target, truncated_vocab_size=16)
    w = load_tensors(trunc)
    del w["token_map"]
    save_file(w, os.path.join(trunc, "model.safetensors"))
    with pytest.raises(ValueError, match="token_map"):
        tiny(target, spec(trunc, 2))
