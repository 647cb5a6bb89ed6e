"""EAGLE and EAGLE-3 (issue 9 sections 1 and 4): greedy output identical with and without the
drafter; drafts equal a dense recomputation of the head; vLLM's prepare_inputs example; draft KV
in the target's slots and never outside the request's blocks; max_model_len edge; chunked prefill,
prefix caching, preemption, mixed batches; the triton backend; loading vLLM weight names; bad heads.
"""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from conftest import generate_tokens, make_tiny_llama, plain_greedy_tokens, tiny_llm as tiny
from learned_heads import dense_eagle_drafts, load_tensors, make_eagle_head
from minivllm import SamplingParams
from minivllm.spec_decode.eagle import EagleProposer, prepare_inputs

PROMPTS = [[5, 17, 42], list(range(1, 30)), [9, 8, 7, 6] * 6, [7], list(range(60, 75))]
VARIANTS = {"default": {}, "no_prefix_caching": dict(enable_prefix_caching=False),
            "chunked_prefill": dict(max_num_batched_tokens=7, max_num_seqs=3),
            "preemption": dict(num_gpu_blocks_override=24)}


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> str:
    """8 layers so that EAGLE-3's default taps (2, 4, 5) are distinct; grouped-query attention."""
    return make_tiny_llama(tmp_path_factory.mktemp("eagle_target"), seed=3, num_hidden_layers=8,
                           num_key_value_heads=2)


@pytest.fixture(scope="module")
def heads(tmp_path_factory, target) -> dict:
    d = tmp_path_factory.mktemp("heads")
    return {"eagle": make_eagle_head(d / "eagle", target, "eagle", seed=1),
            "eagle3": make_eagle_head(d / "eagle3", target, "eagle3", seed=2, draft_vocab_size=128,
                                      midlayer=True)}


def greedy(max_tokens=20):
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def run(llm, prompts=PROMPTS, params=None):
    return generate_tokens(llm, prompts, params or greedy())


def spec(method, head, k=3):
    return {"method": method, "model": head, "num_speculative_tokens": k}


def metrics(llm) -> dict:
    return {m.name: getattr(m, "values", getattr(m, "value", None)) for m in llm.get_metrics()}


def plain(model, prompts=PROMPTS, max_tokens=20, **kw):
    return plain_greedy_tokens(model, prompts, max_tokens, **kw)


def test_prepare_inputs_worked_example():
    """vLLM's tests/v1/spec_decode/test_eagle.py example: query lens [4, 7, 5], rejected [1, 3, 2]."""
    cu, idx = prepare_inputs(np.array([0, 4, 11, 16]), np.array([1, 3, 2]))
    assert cu.tolist() == [0, 3, 7, 10]
    assert idx.tolist() == [0, 1, 2, 4, 5, 6, 7, 11, 12, 13]
    assert EagleProposer.prepare_inputs is prepare_inputs   # vLLM's name, on the proposer too


@pytest.mark.parametrize("method,k,variants", [
    ("eagle", 1, ["default", "preemption"]), ("eagle", 3, ["chunked_prefill", "no_prefix_caching"]),
    ("eagle3", 2, ["default", "chunked_prefill"]), ("eagle3", 4, ["preemption", "no_prefix_caching"])])
def test_greedy_equals_plain(method, k, variants, target, heads):
    for variant in variants:
        kw = VARIANTS[variant]
        llm = tiny(target, spec(method, heads[method], k), **kw)
        assert run(llm) == plain(target), (method, k, variant)
        m = metrics(llm)
        assert m["vllm:spec_decode_num_draft_tokens"] > 0
        assert variant != "preemption" or m["vllm:num_preemptions"] > 0
        if variant == "default":   # again: prefix-cache hits, last matched block recomputed
            outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], greedy(),
                                use_tqdm=False)
            assert [o.outputs[0].token_ids for o in outs] == plain(target)
            hits = [o.num_cached_tokens for o in outs]
            assert hits[1] == 24   # 29-token prompt: 7 full blocks, the 7th is recomputed (EAGLE)


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_drafts_equal_dense_recomputation_and_kv_stays_in_blocks(method, target, heads):
    """Every proposal equals the head recomputed densely over the whole context (Hugging Face target
    states, no paging): the draft KV written in earlier steps is right. Each draft pass writes only
    into slots of the request's own blocks, the first pass into exactly the target's slots."""
    k = 3
    llm = tiny(target, spec(method, heads[method], k), max_num_batched_tokens=9, max_num_seqs=2)
    (tracer := llm.llm_engine.tracer).enabled = True
    prompts = [PROMPTS[0], PROMPTS[1]]   # the long one prefills in chunks while the short decodes
    assert run(llm, prompts, greedy(12)) == plain(target, prompts, 12)
    tokens = {}
    checked = mixed = 0
    for rec in tracer.steps:
        sched = rec.first("schedule")
        for req_id in sched["new_req_ids"]:
            tokens[req_id] = list(prompts[len(tokens)])
        blocks = rec.first("kv_cache")["block_tables"]
        tgt = rec.first("slot_mapping")
        lens = [sched["num_scheduled_tokens"][r] for r in tgt["req_ids"]]
        cu_t = np.concatenate([[0], np.cumsum(lens)])
        passes = rec.of("spec_draft_pass")
        any_sampled = any(rec.first("sampled")["sampled"].values())
        assert [p["pass_idx"] for p in passes] == list(range(k if any_sampled else 1))
        for p in passes:
            for j, req_id in enumerate(p["req_ids"]):
                lo, hi = p["query_start_loc"][j], p["query_start_loc"][j + 1]
                pos, slots = p["positions"][lo:hi], p["slot_mapping"][lo:hi]
                assert all(s == -1 or s // 4 in set(blocks[req_id]) for s in slots), req_id
                if p["pass_idx"] == 0:   # the target's positions and slots, rejected ones dropped
                    r = tgt["req_ids"].index(req_id)
                    t_lo = cu_t[r]
                    assert pos == tgt["positions"][t_lo:t_lo + len(pos)]
                    assert slots == tgt["slot_mapping"][t_lo:t_lo + len(pos)]
                else:
                    assert len(pos) == 1
        sampled = rec.first("sampled")["sampled"]
        # One batch: a partial prefill chunk (nothing sampled) next to a verify step.
        mixed += any(not s for s in sampled.values()) and bool(rec.of("spec_verify"))
        for req_id, toks in sampled.items():
            tokens[req_id].extend(toks)
        for req_id, drafts in rec.first("spec_propose")["drafts"].items():
            want = dense_eagle_drafts(heads[method], target, tokens[req_id], len(drafts), method)
            assert drafts == want, (rec.step, req_id)
            checked += 1
    assert checked >= 8 and mixed > 0


@pytest.mark.parametrize("k", [1, 3, 10])
def test_max_model_len_edge(k, target, heads):
    """Generation runs into max_model_len: passes past it are clamped, their writes skipped
    (slot -1), and the output still equals plain decoding."""
    prompts = [list(range(1, 20)), [3, 4, 5]]
    llm = tiny(target, spec("eagle", heads["eagle"], k), max_model_len=28)
    (tracer := llm.llm_engine.tracer).enabled = True
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(100), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == plain(target, prompts, 100, max_model_len=28)
    assert all(o.outputs[0].finish_reason == "length" for o in outs)
    assert len(outs[0].outputs[0].token_ids) == 28 - 19
    passes = tracer.events("spec_draft_pass")
    assert all(pos < 28 for p in passes for pos in p["positions"])
    if k == 10:
        assert any(-1 in p["slot_mapping"] for p in passes)


def test_triton_backend(tmp_path):
    """One EAGLE case through the Triton kernels (interpreted on CPU: kept small)."""
    tgt = make_tiny_llama(tmp_path / "t", seed=4, num_hidden_layers=1)
    head = make_eagle_head(tmp_path / "h", tgt, "eagle")
    llm = tiny(tgt, spec("eagle", head, 2), attention_backend="triton", max_num_batched_tokens=6)
    prompts = [[5, 6, 7, 8, 9, 10, 11], [3]]
    assert run(llm, prompts, greedy(4)) == plain(tgt, prompts, 4)
    assert metrics(llm)["vllm:spec_decode_num_draft_tokens"] > 0


def test_perfect_head_on_a_bigram_target(tmp_path):
    """A target whose attention and MLP outputs are zero is a bigram model (next = f(token)); an
    EAGLE head with fc = [I | 0] and a zero layer predicts f exactly, so every draft is accepted
    (exercises accepted runs of every length and the lookahead slots)."""
    from safetensors.torch import load_file, save_file
    tgt = make_tiny_llama(tmp_path / "bigram", seed=5, vocab_size=32)
    w = load_file(os.path.join(tgt, "model.safetensors"))
    for name in w:
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            w[name].zero_()
    save_file(w, os.path.join(tgt, "model.safetensors"))
    head = make_eagle_head(tmp_path / "head", tgt, "eagle")
    hw = load_tensors(head)
    h = hw["fc.weight"].shape[0]
    hw["fc.weight"] = torch.cat((torch.eye(h), torch.zeros(h, h)), 1)
    hw["layers.0.self_attn.o_proj.weight"].zero_()
    hw["layers.0.mlp.down_proj.weight"].zero_()
    save_file(hw, os.path.join(head, "model.safetensors"))
    prompts = [[1, 2, 3], [7] * 6, list(range(10, 20))]
    llm = tiny(tgt, spec("eagle", head, 3))
    assert run(llm, prompts, greedy(16)) == plain(tgt, prompts, 16)
    m = metrics(llm)
    assert m["vllm:spec_decode_num_accepted_tokens"] == m["vllm:spec_decode_num_draft_tokens"] > 0


def test_loading_vllm_weight_names(target, heads, tmp_path):
    """fc / layers.0.* (EAGLE-3 as midlayer.*) / norm / lm_head / d2t land in the right modules;
    embed_tokens and (EAGLE-1) lm_head are the target's own tensors; t2d is skipped."""
    for method in ("eagle", "eagle3"):
        llm = tiny(target, spec(method, heads[method], 2))
        runner = llm.llm_engine.engine_core.worker.model_runner
        draft, tgt = runner.drafter.model, runner.model
        w = load_tensors(heads[method])
        w = {k.replace("midlayer.", "layers.0."): v for k, v in w.items()}
        assert torch.equal(draft.model.fc.weight, w["fc.weight"])
        layer = draft.model.layers[0]
        # Stacked at load (vLLM's stacked_params_mapping): k after q in qkv_proj, up after gate.
        qkv, q, kv = layer.self_attn.qkv_proj, layer.self_attn.q_size, layer.self_attn.kv_size
        assert torch.equal(qkv.weight[q:q + kv], w["layers.0.self_attn.k_proj.weight"])
        inter = layer.mlp.down_proj.in_features
        assert torch.equal(layer.mlp.gate_up_proj.weight[inter:], w["layers.0.mlp.up_proj.weight"])
        assert draft.model.embed_tokens is tgt.model.embed_tokens
        if method == "eagle":
            assert draft.lm_head is tgt.lm_head
            assert isinstance(layer.input_layernorm, torch.nn.Identity)
        else:
            assert torch.equal(layer.hidden_norm.weight, w["layers.0.hidden_norm.weight"])
            assert torch.equal(draft.model.norm.weight, w["norm.weight"])
            assert torch.equal(draft.lm_head.weight, w["lm_head.weight"])
            assert torch.equal(draft.draft_id_to_target_id, w["d2t"])
            assert tgt.model.aux_hidden_state_layers == (2, 4, 5)
        sched = llm.llm_engine.engine_core.scheduler   # k lookahead slots; recompute last hit
        assert sched.num_lookahead_tokens == 2 and sched.kv_cache_manager.use_eagle
        names = set(draft.attn_layers())
        assert names.isdisjoint(tgt.attn_layers()) and names == {"model.layers.8.self_attn.attn"}
    # A head with its own (different) embed_tokens keeps it.
    own = make_eagle_head(tmp_path / "own", target, "eagle", embed_tokens=True)
    runner = tiny(target, spec("eagle", own, 2)).llm_engine.engine_core.worker.model_runner
    assert runner.drafter.model.model.embed_tokens is not runner.model.model.embed_tokens
    assert torch.equal(runner.drafter.model.model.embed_tokens.weight,
                       load_tensors(own)["embed_tokens.weight"])


def test_full_vocabulary_eagle3_head_without_lm_head_shares_the_targets(target, tmp_path):
    """vLLM's EagleProposer.load_model: an EAGLE-3 head over the full vocabulary that brings no
    lm_head (and no d2t) uses the target's; greedy output is the target's own."""
    from safetensors.torch import save_file
    head = make_eagle_head(tmp_path / "e3", target, "eagle3", seed=4)
    tensors = {k: v for k, v in load_tensors(head).items()
               if k not in ("lm_head.weight", "d2t", "t2d")}
    save_file(tensors, os.path.join(head, "model.safetensors"), metadata={"format": "pt"})
    llm = tiny(target, spec("eagle3", head, 2))
    runner = llm.llm_engine.engine_core.worker.model_runner
    assert runner.drafter.model.lm_head is runner.model.lm_head
    assert runner.drafter.model.model.embed_tokens is runner.model.model.embed_tokens
    assert run(llm, PROMPTS[:2], greedy(8)) == plain(target, PROMPTS[:2], 8)


def test_bad_heads_raise_before_any_work(target, heads, tmp_path, monkeypatch):
    from safetensors.torch import save_file
    cases = []
    wrong_h = make_tiny_llama(tmp_path / "wide", hidden_size=32, intermediate_size=64)
    cases.append((spec("eagle", make_eagle_head(tmp_path / "h32", wrong_h)), "hidden_size"))
    wrong_v = make_tiny_llama(tmp_path / "v128", vocab_size=128)
    cases.append((spec("eagle", make_eagle_head(tmp_path / "v", wrong_v)), "vocab_size"))
    cases.append((spec("eagle", str(tmp_path / "nowhere")), "does not exist"))
    w = load_tensors(heads["eagle"])
    del w["layers.0.mlp.up_proj.weight"]
    broken = tmp_path / "missing"
    os.makedirs(broken)
    save_file(w, broken / "model.safetensors")
    with open(os.path.join(heads["eagle"], "config.json")) as f:
        (broken / "config.json").write_text(f.read())
    cases.append((spec("eagle", str(broken)), "layers.0.mlp.up_proj.weight"))
    cases.append((spec("eagle3", heads["eagle"]), "hidden_norm"))   # an EAGLE-1 head as EAGLE-3
    cases.append((spec("eagle", heads["eagle3"]), "unexpected tensor"))
    short = make_tiny_llama(tmp_path / "short", num_hidden_layers=2)
    cases.append((spec("eagle3", make_eagle_head(tmp_path / "e3", short, "eagle3")),
                  "eagle_aux_hidden_state_layer_ids"))
    cases.append((spec("eagle", None), "speculative_config.model is required"))
    def no_engine(*a, **k):
        raise AssertionError("the engine was built despite a bad head")
    monkeypatch.setattr("minivllm.entrypoints.llm.LLMEngine", no_engine)
    for cfg, message in cases:
        model = short if "aux" in message else target
        with pytest.raises(ValueError, match=message.replace(".", r"\.")):
            tiny(model, cfg)


def test_shipped_head_lookup(monkeypatch, tmp_path):
    """Without "model" on the default model the shipped head is used; a missing one names the
    training command."""
    import minivllm.spec_decode.heads as heads_mod
    from minivllm.config import SpeculativeConfig
    from minivllm.model_executor.model_loader import DEFAULT_MODEL
    monkeypatch.setattr(heads_mod, "HEADS_DIR", str(tmp_path))
    cfg = SpeculativeConfig(method="eagle3", num_speculative_tokens=3)
    with pytest.raises(ValueError, match=r"python -m minivllm\.train eagle3 --out"):
        heads_mod.resolve_head_dir(cfg, DEFAULT_MODEL)
    d = tmp_path / heads_mod.DEFAULT_MODEL_HEADS / "eagle3"
    os.makedirs(d)
    (d / "config.json").write_text(json.dumps({}))
    (d / "model.safetensors").write_bytes(b"")
    assert heads_mod.resolve_head_dir(cfg, DEFAULT_MODEL) == str(d)


def test_seeded_sampling_is_reproducible(target, heads):
    """Random sampling through the rejection sampler (draft_probs=None: greedy drafts count as
    one-hot proposals): a seeded request gives the same tokens twice."""
    params = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=12, seed=7, ignore_eos=True)
    llm = tiny(target, spec("eagle3", heads["eagle3"], 3))
    first, second = run(llm, PROMPTS[:2], params), run(llm, PROMPTS[:2], params)
    assert first == second and all(len(t) == 12 for t in first)
