"""Speculative decoding end to end: greedy output with drafts equals plain greedy output, for n-gram
(first/last match), draft model and self-draft; the draft model's KV cache; edges (lengths, stops,
mixed batches, seeds), metrics, step records, bad input; VLLM_REFERENCE 5.2's worked example."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from conftest import (generate_tokens, make_tiny_llama, plain_greedy_tokens, runner_of,
                      tiny_llm as tiny)
from minivllm import LLM, SamplingParams
from minivllm.worker.input_batch import InputBatch
from minivllm.worker.model_runner import ModelRunner

# Short and long, repetitive (so n-gram drafts) and not; some cross block boundaries (block_size 4).
PROMPTS = [[5, 17, 42], list(range(1, 30)), [9, 8, 7, 6] * 6, list(range(60, 100)), [7],
           [3, 1, 4, 1, 5, 9, 2, 6] * 3 + [3, 1, 4]]
METHODS = {   # name -> (k, separate draft checkpoint) -> speculative_config
    "ngram_first": lambda k, d: dict(num_speculative_tokens=k, prompt_lookup_min=2,
                                     prompt_lookup_max=4),
    "ngram_last": lambda k, d: dict(num_speculative_tokens=k, prompt_lookup_min=1,
                                    prompt_lookup_max=3, ngram_match="last"),
    "draft_model": lambda k, d: dict(method="draft_model", num_speculative_tokens=k, model=d),
    "self_draft": lambda k, d: dict(method="draft_model", num_speculative_tokens=k,
                                    draft_num_layers=1)}
ENGINE_VARIANTS = {"default": {}, "no_prefix_caching": dict(enable_prefix_caching=False),
                   "preemption": dict(num_gpu_blocks_override=22),   # 21 usable 4-token blocks
                   "chunked_prefill": dict(max_num_batched_tokens=7, max_num_seqs=3)}
SPEC = "vllm:spec_decode_num_"


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory) -> str:
    """A separate, smaller draft checkpoint with the tiny targets' vocabulary (256)."""
    return make_tiny_llama(tmp_path_factory.mktemp("tiny_draft"), seed=7, num_hidden_layers=1,
                           hidden_size=32, intermediate_size=64, num_attention_heads=2,
                           num_key_value_heads=1)


def prompts_of(ids_list):
    return [{"prompt_token_ids": p} for p in ids_list]


def greedy(max_tokens=24, **kw):
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def run(llm, prompts=PROMPTS, params=None):
    return generate_tokens(llm, prompts, params or greedy())


def metrics(llm) -> dict:
    return {m.name: getattr(m, "values", getattr(m, "value", None)) for m in llm.get_metrics()}


def check_spec_metrics(m: dict, k: int):
    drafts, drafted, accepted, per_pos = (m[SPEC + n] for n in (
        "drafts", "draft_tokens", "accepted_tokens", "accepted_tokens_per_pos"))
    assert len(per_pos) == k and sum(per_pos) == accepted
    assert 0 <= accepted <= drafted <= k * drafts and 0 < drafts <= drafted
    assert all(a >= b for a, b in zip(per_pos, per_pos[1:]))   # acceptance is a prefix


def assert_no_leak(llm):
    pool = llm.llm_engine.scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == llm.vllm_config.cache_config.num_gpu_blocks - 1


def reference(model, prompts=PROMPTS, max_tokens=24):
    return plain_greedy_tokens(model, prompts, max_tokens)


@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("method", list(METHODS))
def test_greedy_spec_equals_plain(method, k, tiny_llama_dir, tiny_gqa_dir, draft_dir):
    model = [tiny_llama_dir, tiny_gqa_dir][(k + len(method)) % 2]
    for variant, kw in ENGINE_VARIANTS.items():
        llm = tiny(model, METHODS[method](k, draft_dir), **kw)
        assert run(llm) == reference(model), (method, k, variant)
        check_spec_metrics(m := metrics(llm), k)
        if method.startswith("ngram"):
            assert m[SPEC + "accepted_tokens"] > 0   # repetitive text is drafted and accepted
        assert variant != "preemption" or m["vllm:num_preemptions"] > 0
        if variant == "default":   # again, now with prefix-cache hits
            outs = llm.generate(prompts_of(PROMPTS), greedy(), use_tqdm=False)
            assert [o.outputs[0].token_ids for o in outs] == reference(model)
            assert outs[1].num_cached_tokens > 0
        assert_no_leak(llm)


def _check_slots(drafter):
    """Wrap the drafter's forward: every position it writes lies inside its row's blocks."""
    inner, writes = drafter._forward, []

    def checked(batch, rows, query_lens, seq_lens, req_idx, positions, *rest):
        num_blocks = batch.block_table.num_blocks_per_row[req_idx]
        assert (positions // drafter.block_size < num_blocks).all()
        writes.append(len(positions))
        return inner(batch, rows, query_lens, seq_lens, req_idx, positions, *rest)
    drafter._forward = checked
    return writes


@pytest.mark.parametrize("lookahead", ["reserved", "none"])
@pytest.mark.parametrize("draft", ["separate", "target"])
@torch.no_grad()
def test_drafts_are_the_draft_models_greedy_continuation(tiny_gqa_dir, draft_dir, draft, lookahead):
    """Every proposal is the draft model's greedy continuation of the request's context (Hugging
    Face, from scratch): the draft KV cache (kept across steps, repaired after rejections, rebuilt
    after preemption, filled chunk by chunk) is never stale, and never written outside the row's
    blocks, even with no lookahead slots (vLLM's rule for fresh requests, here for all)."""
    from transformers import AutoModelForCausalLM
    path = draft_dir if draft == "separate" else tiny_gqa_dir
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                              attn_implementation="eager").eval()
    spec = dict(method="draft_model", model=path, num_speculative_tokens=3)
    for kw in (dict(num_gpu_blocks_override=22), dict(max_num_batched_tokens=7, max_num_seqs=3)):
        llm = tiny(tiny_gqa_dir, spec, **kw)
        if lookahead == "none":
            llm.llm_engine.scheduler.num_lookahead_tokens = 0
        writes = _check_slots(runner_of(llm).drafter)
        llm.llm_engine.tracer.enabled = True
        assert run(llm, PROMPTS, greedy(12)) == reference(tiny_gqa_dir, PROMPTS, 12)
        context, checked = {}, 0
        for step in llm.llm_engine.tracer.steps:
            for req_id in step.first("schedule")["new_req_ids"]:
                context[req_id] = list(PROMPTS[int(req_id)])
            for req_id, toks in step.first("sampled")["sampled"].items():
                context[req_id] += toks
            for req_id, drafts in step.first("spec_propose")["drafts"].items():
                ids = torch.tensor([context[req_id]])   # an explicit mask: token 0 is not padding
                out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                  max_new_tokens=len(drafts), min_new_tokens=len(drafts),
                                  pad_token_id=0)
                assert out[0, ids.shape[1]:].tolist() == drafts, (req_id, step.step)
                checked += 1
        check_spec_metrics(m := metrics(llm), 3)
        assert writes and checked > 10
        assert m["vllm:num_preemptions"] > 0 or "max_num_batched_tokens" in kw
        # A draft equal to the target is always right; the separate one gets rejections.
        assert (m[SPEC + "accepted_tokens"] == m[SPEC + "draft_tokens"]) == (draft == "target")
        assert_no_leak(llm)


def test_draft_cache_sizing_and_self_draft_shares_weights(tiny_gqa_dir, draft_dir):
    runner = runner_of(tiny(tiny_gqa_dir, dict(method="draft_model", draft_num_layers=2),
                            num_gpu_blocks_override=9))
    draft, target = runner.drafter.model, runner.model
    for name in ("lm_head.weight", "model.layers.1.mlp.gate_up_proj.weight", "model.norm.weight"):
        assert draft.get_parameter(name).data_ptr() == target.get_parameter(name).data_ptr()
    # Target 3 + draft 2 layers, each 2 (K, V) x 2 kv heads x head_dim 16 x 4 bytes x 4 slots.
    assert runner.kv_cache_bytes_per_block() == (3 + 2) * 2 * 2 * 16 * 4 * 4
    for layer in draft.attn_layers().values():
        assert layer.kv_cache.shape == (2, 9, 4, 2, 16)
        assert layer.kv_cache.data_ptr() not in {t.data_ptr() for t in runner.kv_caches}
    sep = runner_of(tiny(tiny_gqa_dir, dict(method="draft_model", model=draft_dir))).drafter
    assert sep.kv_cache_bytes_per_token() == 1 * 2 * 1 * 16 * 4   # 1 layer, 1 kv head


def test_lengths_are_exact(tiny_llama_dir):
    """Drafts never push a request past max_tokens or max_model_len."""
    prompts = [[9, 8, 7, 6] * 3, [3, 1, 4, 1, 5, 9, 2, 6] * 2]
    ref = reference(tiny_llama_dir, prompts, 10)
    for spec in (METHODS["ngram_last"](5, None), METHODS["self_draft"](5, None)):
        llm = tiny(tiny_llama_dir, spec)
        for max_tokens in (1, 2, 3, 7):
            assert run(llm, prompts, greedy(max_tokens)) == [r[:max_tokens] for r in ref]
        short = tiny(tiny_llama_dir, spec, max_model_len=21)
        outs = [o.outputs[0] for o in short.generate(prompts_of(prompts), greedy(100),
                                                     use_tqdm=False)]
        assert [o.token_ids for o in outs] == [ref[0][:21 - 12], ref[1][:21 - 16]]
        assert all(o.finish_reason == "length" for o in outs)
        assert_no_leak(short)


def _accepted_run_tokens(llm, prompt, params):
    """Traced run: (output ids, indices of accepted drafts with more tokens after them)."""
    tracer = llm.llm_engine.tracer
    tracer.enabled, tracer.steps = True, []
    out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    req_id = tracer.events("schedule")[0]["new_req_ids"][0]
    index, inside = 0, []
    for ev in tracer.events("sampled"):
        toks = ev["sampled"].get(req_id, [])
        inside += [index + j for j in range(len(toks) - 1)]
        index += len(toks)
    return out, inside


def test_stops_inside_accepted_run(tiny_llama_dir, tmp_path):
    """A stop token id or the EOS met at an accepted draft with more tokens after it in its step
    ends the output where plain decoding does (a draft equal to the target accepts every draft)."""
    prompt = [3, 1, 4, 1, 5, 9, 2, 6] * 3
    spec = dict(method="draft_model", model=tiny_llama_dir, num_speculative_tokens=5)
    llm = tiny(tiny_llama_dir, spec)
    out, inside = _accepted_run_tokens(llm, prompts_of([prompt])[0], greedy(40))
    assert out == reference(tiny_llama_dir, [prompt], 40)[0]
    i = max(i for i in inside if out[i] not in out[:i])   # the token's first occurrence
    got = llm.generate(prompts_of([prompt]), greedy(40, stop_token_ids=[out[i]]),
                       use_tqdm=False)[0].outputs[0]
    assert (got.token_ids, got.finish_reason, got.stop_reason) == (out[:i + 1], "stop", out[i])
    assert_no_leak(llm)
    # The model's EOS: the same checkpoint with eos_token_id set to that token.
    eos_dir = tmp_path / "eos"
    # (without generation_config.json, whose EOS would stop requests too)
    shutil.copytree(tiny_llama_dir, eos_dir, ignore=shutil.ignore_patterns("generation_config*"))
    cfg = json.loads((eos_dir / "config.json").read_text())
    (eos_dir / "config.json").write_text(json.dumps(dict(cfg, eos_token_id=out[i])))
    for s in (dict(spec, model=str(eos_dir)), METHODS["ngram_last"](5, None), None):
        eos_llm = tiny(str(eos_dir), s)
        got = eos_llm.generate(prompts_of([prompt]), SamplingParams(temperature=0, max_tokens=40),
                               use_tqdm=False)[0].outputs[0]
        assert got.token_ids == out[:i + 1] and got.finish_reason == "stop"
        assert_no_leak(eos_llm)


def test_mixed_batch_with_and_without_drafts(tiny_gqa_dir):
    """Requests that get no drafts (no n-gram match, or max_tokens=1) share steps with requests
    that do; the step records agree with the metrics and with each other."""
    prompts = [[9, 8, 7, 6] * 5, [201, 13, 77, 150, 2, 99, 45], [3, 1, 4, 1, 5, 9, 2, 6] * 3, [42]]
    params = [greedy(), greedy(), greedy(1), greedy(9)]
    llm = tiny(tiny_gqa_dir, METHODS["ngram_first"](3, None))
    (tracer := llm.llm_engine.tracer).enabled = True
    got = run(llm, prompts, params)
    assert got == [r[:p.max_tokens] for r, p in zip(reference(tiny_gqa_dir, prompts), params)]
    schedules, verify = tracer.events("schedule"), tracer.events("spec_verify")
    assert any(0 < len(s["scheduled_spec_decode_tokens"]) < len(s["num_scheduled_tokens"])
               for s in schedules)
    check_spec_metrics(m := metrics(llm), 3)
    assert len(verify) == m[SPEC + "drafts"]
    assert sum(p["kind"] == "accepted" for e in verify for p in e["positions"]) == \
        m[SPEC + "accepted_tokens"] > 0
    # Every scheduled draft list is a prefix of what was proposed the step before.
    by_step = {ev["step"]: ev["drafts"] for ev in tracer.events("spec_propose")}
    for s in schedules:
        for req_id, drafts in s["scheduled_spec_decode_tokens"].items():
            assert by_step[s["step"] - 1][req_id][:len(drafts)] == drafts
    assert_no_leak(llm)


@pytest.mark.parametrize("method", ["ngram_last", "self_draft"])
def test_seeded_sampling_with_spec_is_reproducible(tiny_llama_dir, method):
    params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=16, seed=11, ignore_eos=True)
    spec = METHODS[method](3, None)
    first = run(tiny(tiny_llama_dir, spec), PROMPTS[2:4], params)
    llm = tiny(tiny_llama_dir, spec)
    assert run(llm, PROMPTS[2:4], params) == first
    assert run(llm, PROMPTS[2:4], params) == first
    assert metrics(llm)[SPEC + "drafts"] > 0


def test_calc_spec_decode_metadata_worked_example():
    """VLLM_REFERENCE 5.2: cu_num_scheduled_tokens 4,104,107,207,209; drafts 3,0,2,0,1."""
    runner = ModelRunner.__new__(ModelRunner)
    runner.device = torch.device("cpu")
    runner.input_batch = batch = InputBatch(5, 512, 32, 16)
    drafts = [[11, 12, 13], [], [21, 22], [], [31]]
    for row, (n, d) in enumerate(zip([50, 100, 7, 100, 300], drafts)):
        batch.num_tokens_no_spec[row] = n
        batch.token_ids_cpu[row, n:n + len(d)] = d
        batch.num_tokens[row] = n + len(d)
    md = runner._calc_spec_decode_metadata(np.array([3, 0, 2, 0, 1]),
                                           np.array([4, 104, 107, 207, 209]))
    assert md.num_draft_tokens == [3, 0, 2, 0, 1] and md.max_spec_len == 3
    assert md.cu_num_sampled_tokens.tolist() == [4, 5, 8, 9, 11]
    assert md.logits_indices.tolist() == [0, 1, 2, 3, 103, 104, 105, 106, 206, 207, 208]
    assert md.bonus_logits_indices.tolist() == [3, 4, 7, 8, 10]
    assert md.cu_num_draft_tokens.tolist() == [3, 3, 5, 5, 6]
    assert md.target_logits_indices.tolist() == [0, 1, 2, 5, 6, 9]
    assert md.logits_indices[md.target_logits_indices + 1].tolist() == [1, 2, 3, 105, 106, 208]
    assert md.draft_token_ids.tolist() == [11, 12, 13, 21, 22, 31]


def test_bad_speculative_config(tiny_gqa_dir, tmp_path):
    for spec, match in [
            (dict(method="medusa2"), "method"), (dict(num_speculative_tokens=0), "tokens"),
            (dict(prompt_lookup_min=0, prompt_lookup_max=3), "prompt_lookup_min"),
            (dict(prompt_lookup_min=4, prompt_lookup_max=2), "prompt_lookup_min"),
            (dict(method="draft_model", draft_num_layers=0), "draft_num_layers"),
            (dict(method="draft_model", draft_num_layers=3), r"\[1, 2\]"),   # a 3-layer target
            (dict(method="draft_model"), "model"), (dict(typo=1), "unknown keys"),
            (dict(method="draft_model", model=str(tmp_path / "no")), r"speculative_config\.model")]:
        with pytest.raises(ValueError, match=match):
            tiny(tiny_gqa_dir, spec)
    other_vocab = make_tiny_llama(tmp_path / "v512", vocab_size=512, num_hidden_layers=1)
    with pytest.raises(ValueError, match=r"speculative_config\.model.*vocab_size=512"):
        tiny(tiny_gqa_dir, dict(method="draft_model", model=other_vocab))
    not_llama = tmp_path / "gpt2"
    shutil.copytree(other_vocab, not_llama)
    (not_llama / "config.json").write_text(json.dumps({"model_type": "gpt2", "vocab_size": 256}))
    with pytest.raises(ValueError, match=r"speculative_config\.model.*Llama"):
        tiny(tiny_gqa_dir, dict(method="draft_model", model=str(not_llama)))


def test_smollm2_greedy_spec_equals_plain(smollm2_dir):
    plain = LLM(model=smollm2_dir)
    tok = plain.get_tokenizer()
    code = "def add(a, b):\n    return a + b\n\ndef mul(a, b):\n    return a * b\n"
    prompts = [tok.apply_chat_template([{"role": "user", "content": "Repeat this code exactly:\n"
                                         + code}], tokenize=False, add_generation_prompt=True)]
    params = SamplingParams(temperature=0, max_tokens=24)
    expected = [o.outputs[0] for o in plain.generate(prompts, params, use_tqdm=False)]
    for spec in (dict(method="ngram", num_speculative_tokens=3, prompt_lookup_min=2,
                      prompt_lookup_max=4),
                 # Not trained for early exit, a shallow self-draft is mostly rejected: fine here.
                 dict(method="draft_model", num_speculative_tokens=3, draft_num_layers=6)):
        llm = LLM(model=smollm2_dir, speculative_config=spec)
        got = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
        assert [(g.token_ids, g.text) for g in got] == [(e.token_ids, e.text) for e in expected]
        check_spec_metrics(m := metrics(llm), 3)
        assert_no_leak(llm)
        if spec["method"] != "ngram":
            continue
        # The model copies the code, so n-gram drafts are accepted; a stop string first met at an
        # accepted draft with more tokens after it in its step ends the output where plain does.
        assert m[SPEC + "accepted_tokens"] > 0
        out, inside = _accepted_run_tokens(llm, prompts[0], params)
        texts = [tok.decode(out[i:i + 1]).strip() for i in range(len(out))]
        i = next(i for i in inside if texts[i] and texts[i] not in tok.decode(out[:i]))
        with_stop = SamplingParams(temperature=0, max_tokens=24, stop=[texts[i]])
        a = llm.generate(prompts, with_stop, use_tqdm=False)[0].outputs[0]
        b = plain.generate(prompts, with_stop, use_tqdm=False)[0].outputs[0]
        assert (a.token_ids, a.text, a.finish_reason) == (b.token_ids, b.text, b.finish_reason)
        assert a.token_ids == out[:i + 1] and a.finish_reason == "stop"
