"""Logprobs and penalties through the engine on a tiny model: vLLM's shapes, the numbers equal to
log_softmax of the logits that logprobs_mode names (the model's own, from transformers), prompt
logprobs, and greedy output plus logprobs identical with and without speculation (n-gram, also
asynchronously scheduled, the draft model, EAGLE, Medusa)."""
import pytest
import torch

from conftest import tiny_llm
from minivllm import SamplingParams
from minivllm.sample.ops import drafts as draft_rows

PROMPT = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7, 8, 5, 6]
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
         "prompt_lookup_min": 2}


@pytest.fixture(scope="module")
def engines(tiny_llama_dir, tmp_path_factory):
    from learned_heads import make_eagle_head, make_medusa_head
    eagle = make_eagle_head(tmp_path_factory.mktemp("eagle_head"), tiny_llama_dir)
    medusa = make_medusa_head(tmp_path_factory.mktemp("medusa_head"), tiny_llama_dir)
    return {"plain": tiny_llm(tiny_llama_dir), "ngram": tiny_llm(tiny_llama_dir, NGRAM),
            "ngram_async": tiny_llm(tiny_llama_dir, NGRAM, async_scheduling=True),
            "draft_model": tiny_llm(tiny_llama_dir, dict(method="draft_model", model=tiny_llama_dir,
                                                         num_speculative_tokens=3)),
            "eagle": tiny_llm(tiny_llama_dir, dict(method="eagle", model=eagle,
                                                   num_speculative_tokens=3)),
            "medusa": tiny_llm(tiny_llama_dir, dict(method="medusa", model=medusa,
                                                    num_speculative_tokens=3))}


def _hf_logits(model_dir, token_ids):
    from transformers import LlamaForCausalLM
    model = LlamaForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    with torch.no_grad():
        return model(torch.tensor([token_ids])).logits[0]


def _run(llm, **kw):
    p = SamplingParams(**{"temperature": 0.0, "max_tokens": 12, "ignore_eos": True, **kw})
    return llm.generate([{"prompt_token_ids": PROMPT}], p, use_tqdm=False)[0]


def test_logprobs_shape_and_values_equal_log_softmax(engines, tiny_llama_dir):
    out = _run(engines["plain"], logprobs=3, prompt_logprobs=2)
    comp = out.outputs[0]
    assert len(comp.logprobs) == len(comp.token_ids) == 12
    logits = _hf_logits(tiny_llama_dir, PROMPT + comp.token_ids).log_softmax(-1)
    for j, (tok, pos) in enumerate(zip(comp.token_ids, comp.logprobs)):
        row = logits[len(PROMPT) - 1 + j]
        assert tok in pos and 3 <= len(pos) <= 4
        ranks = sorted(lp.rank for t, lp in pos.items() if t != tok or lp.rank <= 3)
        assert ranks[:3] == [1, 2, 3]
        for t, lp in pos.items():
            assert lp.logprob <= 0 and abs(lp.logprob - row[t].item()) < 1e-4
        top = sorted(pos.values(), key=lambda lp: lp.rank)
        assert all(a.logprob >= b.logprob for a, b in zip(top, top[1:]))
    assert comp.cumulative_logprob == pytest.approx(
        sum(p[t].logprob for t, p in zip(comp.token_ids, comp.logprobs)), abs=1e-4)
    # Prompt logprobs: None first, then the logprob of each prompt token given the ones before.
    pl = out.prompt_logprobs
    assert len(pl) == len(PROMPT) and pl[0] is None
    for i in range(1, len(PROMPT)):
        assert PROMPT[i] in pl[i]
        assert abs(pl[i][PROMPT[i]].logprob - logits[i - 1, PROMPT[i]].item()) < 1e-4


def test_sampled_token_outside_top_k_is_included(engines):
    comp = _run(engines["plain"], logprobs=0, logit_bias={40: 8.0}).outputs[0]
    assert all(list(pos) == [tok] for tok, pos in zip(comp.token_ids, comp.logprobs))
    assert comp.token_ids[0] == 40 and comp.logprobs[0][40].rank > 1   # raw: ranked without bias


@pytest.mark.parametrize("mode", ["raw_logits", "processed_logprobs", "processed_logits"])
def test_logprobs_mode_names_the_numbers(tiny_llama_dir, mode):
    llm = tiny_llm(tiny_llama_dir, logprobs_mode=mode)
    bias = {40: 3.0}
    comp = _run(llm, logprobs=-1, logit_bias=bias, max_tokens=1).outputs[0]
    logits = _hf_logits(tiny_llama_dir, PROMPT)[-1]
    if mode.startswith("processed"):
        logits[40] += 3.0
    want = logits if mode.endswith("logits") else logits.log_softmax(-1)
    got = torch.tensor([comp.logprobs[0][t].logprob for t in range(logits.shape[0])])
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


# Mild penalties: 230 repeats for a while (the n-gram drafts it, and they are accepted), then the
# penalty turns it away in the middle of a step's drafts.
PENALISED = [dict(frequency_penalty=0.1, max_tokens=24), dict(frequency_penalty=0.5), dict(presence_penalty=1.5, repetition_penalty=1.2),
             dict(logit_bias={7: 2.0}), dict(allowed_token_ids=[5, 6, 7, 9, 10, 230]),
             dict(frequency_penalty=0.4, min_tokens=5)]


# Every field with n-gram; one penalty and one mask with the other methods (time).
CASES = ([("ngram", kw) for kw in PENALISED]
         + [(m, PENALISED[i]) for m in ("ngram_async", "draft_model", "eagle", "medusa")
            for i in (0, 3)])


@pytest.mark.parametrize("method,kw", CASES, ids=lambda x: x if isinstance(x, str) else ",".join(x))
def test_greedy_with_speculation_equals_plain(engines, method, kw):
    plain, spec = _run(engines["plain"], logprobs=2, **kw), _run(engines[method], logprobs=2, **kw)
    a, b = plain.outputs[0], spec.outputs[0]
    assert a.token_ids == b.token_ids
    for x, y in zip(a.logprobs, b.logprobs):
        assert list(x) == list(y)
        assert all(abs(x[t].logprob - y[t].logprob) < 1e-4 and x[t].rank == y[t].rank for t in x)


def test_penalties_change_the_output_and_drafts_were_accepted(engines):
    base = _run(engines["plain"]).outputs[0].token_ids
    assert _run(engines["plain"], frequency_penalty=0.5).outputs[0].token_ids != base
    before = {m.name: m for m in engines["ngram"].get_metrics()}
    _run(engines["ngram"], frequency_penalty=0.1, max_tokens=24)
    after = {m.name: m for m in engines["ngram"].get_metrics()}
    name = "vllm:spec_decode_num_accepted_tokens"
    assert after[name].value > before[name].value


def test_drafts_left_uncounted_break_the_identity(engines, monkeypatch):
    """The same comparison with the rule broken on purpose (penalties ignore earlier drafts)."""
    kw = dict(frequency_penalty=0.1, max_tokens=24)
    plain = _run(engines["plain"], **kw).outputs[0].token_ids
    monkeypatch.setattr(draft_rows, "combine_outputs_with_spec_tokens",
                        lambda outs, ds: [list(o) for o, d in zip(outs, ds) for _ in d])
    assert _run(engines["ngram"], **kw).outputs[0].token_ids != plain


def test_engine_checks_against_the_model(engines):
    with pytest.raises(ValueError, match="logit_bias"):
        _run(engines["plain"], logit_bias={999: 1.0})
    with pytest.raises(ValueError, match="logprobs"):
        _run(engines["plain"], logprobs=21)
    with pytest.raises(ValueError, match="bad_words"):
        _run(engines["plain"], bad_words=["x"])     # no tokenizer on this engine


def test_prompt_logprobs_over_prefill_chunks_and_a_cached_prefix(engines, tiny_llama_dir):
    """Chunks of 4 tokens give the same prompt logprobs as one pass; a second request with the
    same prompt still gets them all (the prefix cache is not read for it, as in vLLM)."""
    whole = _run(engines["plain"], prompt_logprobs=1, max_tokens=2).prompt_logprobs
    chunked = tiny_llm(tiny_llama_dir, max_num_batched_tokens=4, max_num_seqs=1)
    for _ in range(2):
        out = _run(chunked, prompt_logprobs=1, max_tokens=2)
        assert out.num_cached_tokens == 0 and len(out.prompt_logprobs) == len(PROMPT)
        for a, b in zip(whole[1:], out.prompt_logprobs[1:]):
            assert list(a) == list(b)
            assert all(abs(a[t].logprob - b[t].logprob) < 1e-4 for t in a)


@pytest.mark.parametrize("mode", ["processed_logprobs", "raw_logits"])
def test_logprobs_modes_under_speculation_equal_plain(tiny_llama_dir, engines, mode):
    """The accepted and bonus tokens' numbers come from the target's (processed) logits."""
    kw = dict(frequency_penalty=0.1, logit_bias={230: 0.5}, max_tokens=24, logprobs=3,
              prompt_logprobs=1)
    plain = _run(tiny_llm(tiny_llama_dir, logprobs_mode=mode), **kw)
    spec = _run(tiny_llm(tiny_llama_dir, NGRAM, logprobs_mode=mode), **kw)
    a, b = plain.outputs[0], spec.outputs[0]
    assert a.token_ids == b.token_ids
    for x, y in zip(a.logprobs + plain.prompt_logprobs[1:], b.logprobs + spec.prompt_logprobs[1:]):
        assert list(x) == list(y) and all(abs(x[t].logprob - y[t].logprob) < 1e-4 for t in x)
