"""``LLM(..., async_scheduling=True)``, vLLM 0.32's asynchronous scheduling (DESIGN §5.4): outputs
identical to the default for n-gram, EAGLE and the draft model, greedy and seeded;
``request.spec_token_ids`` holds -1 placeholders (step records) while the worker feeds its own
drafts; the engine never calls ``take_draft_token_ids``; -1 drafts are rejected by both rejection
backends and count in the metrics."""
from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from conftest import generate_tokens, make_tiny_llama, tiny_llm as tiny
from learned_heads import make_eagle_head
from minivllm import SamplingParams
from minivllm.core.sched.async_scheduler import AsyncScheduler
from minivllm.sample.metadata import SamplingMetadata
from minivllm.sample.rejection_sampler import PLACEHOLDER_TOKEN_ID, RejectionSampler
from minivllm.spec_decode.metadata import SpecDecodeMetadata
from minivllm.worker.vllm_today.async_scheduling import num_real_drafts, substitute_drafts

PROMPTS = [[5, 17, 42], list(range(1, 30)), [9, 8, 7, 6] * 6, [7],
           [3, 1, 4, 1, 5, 9, 2, 6] * 3 + [3, 1, 4]]
NGRAM = dict(num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=3)

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> str:
    return make_tiny_llama(tmp_path_factory.mktemp("async_target"), seed=3, num_hidden_layers=2,
                           num_key_value_heads=2)


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory) -> str:
    return make_tiny_llama(tmp_path_factory.mktemp("async_draft"), seed=7, num_hidden_layers=1,
                           hidden_size=32, intermediate_size=64, num_attention_heads=2,
                           num_key_value_heads=1)


@pytest.fixture(scope="module")
def eagle_head(tmp_path_factory, target) -> str:
    return make_eagle_head(tmp_path_factory.mktemp("async_heads") / "eagle", target, "eagle", seed=1)


def greedy(max_tokens=20):
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def seeded(max_tokens=20):
    # Every request has its own seed, so its random stream does not depend on the batch.
    return [SamplingParams(temperature=0.9, top_p=0.95, max_tokens=max_tokens, ignore_eos=True,
                           seed=100 + i) for i in range(len(PROMPTS))]


def traced_run(llm, params):
    llm.llm_engine.tracer.enabled = True
    return generate_tokens(llm, PROMPTS, params), llm.llm_engine.tracer


def stats(llm):
    return llm.llm_engine.engine_core.scheduler.spec_decoding_stats


def no_take(llm):
    """Make any take_draft_token_ids call fail: async mode must not use it."""
    def fail():
        raise AssertionError("take_draft_token_ids called under async_scheduling")
    llm.llm_engine.engine_core.worker.take_draft_token_ids = fail


# ------------------------------------------------------------------------------------------------
# End to end: identical outputs.

@pytest.mark.parametrize("kind,variant", [
    ("ngram", {}), ("ngram", dict(max_num_batched_tokens=7, max_num_seqs=3)),
    ("ngram", dict(num_gpu_blocks_override=24)), ("eagle", {}),
    ("eagle", dict(max_num_batched_tokens=7, max_num_seqs=3)), ("eagle_probabilistic", {}),
    ("draft_model", {})])
def test_outputs_identical_to_sync(kind, variant, target, eagle_head, draft_dir):
    spec = NGRAM if kind == "ngram" else dict(method="eagle", model=eagle_head,
                                              num_speculative_tokens=3)
    if kind == "draft_model":
        spec = dict(method="draft_model", model=draft_dir, num_speculative_tokens=3)
    if kind == "eagle_probabilistic":
        spec = dict(spec, draft_sample_method="probabilistic")
    # Seeded outputs are identical where the token budget and the KV blocks do not bind: under
    # pressure the placeholders (k each) take more of both, so a step verifies other drafts and
    # the random draws differ (the distribution does not). Greedy outputs are identical always.
    for params in (greedy(), seeded()) if not variant else (greedy(),):
        sync = tiny(target, spec, **variant)
        ref, _ = traced_run(sync, params)
        llm = tiny(target, spec, async_scheduling=True, **variant)
        no_take(llm)
        out, tr = traced_run(llm, params)
        assert out == ref, (kind, variant)
        assert isinstance(llm.llm_engine.engine_core.scheduler, AsyncScheduler)
        a, s = stats(llm), stats(sync)
        if not variant:
            # Same drafts accepted. (Under a tight budget or few blocks the placeholders take more
            # of both, so batches and draft timing differ: the outputs still do not.)
            assert a.num_accepted_tokens == s.num_accepted_tokens
            assert a.num_accepted_tokens_per_pos == s.num_accepted_tokens_per_pos
        # Every scheduled placeholder counts as drafted, as in vLLM.
        scheduled = sum(len(d) for ev in tr.events("schedule")
                        for d in ev["scheduled_spec_decode_tokens"].values())
        assert a.num_draft_tokens == scheduled >= s.num_draft_tokens
        assert all(t == -1 for ev in tr.events("schedule")
                   for d in ev["scheduled_spec_decode_tokens"].values() for t in d)


def test_spec_token_ids_hold_placeholders(target, eagle_head):
    """From step records: sync holds the proposer's drafts, async holds [-1] * k while the worker
    writes the previous step's proposals over them."""
    spec = dict(method="eagle", model=eagle_head, num_speculative_tokens=3)
    _, sync_tr = traced_run(tiny(target, spec), greedy(12))
    _, tr = traced_run(tiny(target, spec, async_scheduling=True), greedy(12))
    sync_held = [d for ev in sync_tr.events("spec_token_ids") for d in ev["spec_token_ids"].values()]
    held = [d for ev in tr.events("spec_token_ids") for d in ev["spec_token_ids"].values()]
    assert any(sync_held) and all(t >= 0 for d in sync_held for t in d)
    assert held and all(d == [-1, -1, -1] for d in held)
    # The worker fed, in place of step N's placeholders, what it proposed at step N - 1.
    subs = tr.events("spec_substitute")
    assert subs and any(num_real_drafts(ev["drafts"]) for ev in subs)
    for ev in subs:
        # The last step before this one in which the request sampled (and so was drafted for).
        last = max(e["step"] for e in tr.events("sampled")
                   if e["step"] < ev["step"] and e["sampled"].get(ev["req_id"]))
        want = [p["drafts"].get(ev["req_id"], []) for p in tr.events("spec_propose")
                if p["step"] == last][0]
        assert ev["drafts"] == substitute_drafts([-1] * len(ev["drafts"]), want)
    # Sync: the same tokens are scheduled as drafts that the scheduler held.
    assert sync_tr.events("spec_substitute") == []


def test_no_spec_decode_and_bad_draft_update(target):
    llm = tiny(target, async_scheduling=True)
    assert generate_tokens(llm, PROMPTS, greedy(8)) == generate_tokens(tiny(target), PROMPTS, greedy(8))
    sched = tiny(target, NGRAM, async_scheduling=True).llm_engine.engine_core.scheduler
    with pytest.raises(RuntimeError, match="stay in the worker"):
        sched.update_draft_token_ids({"0": [1, 2]})


def test_substitute_drafts():
    assert substitute_drafts([-1, -1, -1], [4, 5]) == [4, 5, -1]
    assert substitute_drafts([-1, -1], [4, 5, 6]) == [4, 5]   # the budget cut the placeholders
    assert substitute_drafts([-1, -1], []) == [-1, -1]
    assert num_real_drafts([4, -1, 7]) == 1 and num_real_drafts([]) == 0


# ------------------------------------------------------------------------------------------------
# The rejection sampler with -1 drafts.

def _md(drafts):
    return SpecDecodeMetadata.make_dummy(drafts)


def _sm(temperature, batch, seeds=None):
    return SamplingMetadata.from_params([
        SamplingParams(temperature=temperature, seed=None if seeds is None else seeds[i])
        for i in range(batch)])


@pytest.mark.parametrize("with_draft_probs", [False, True])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_placeholder_drafts_always_rejected(temperature, with_draft_probs):
    vocab = 12
    gen = torch.Generator().manual_seed(0)
    drafts = [[-1, -1, -1], [3, -1], [-1], [5, 6, -1], []]
    n = sum(len(d) for d in drafts)
    # Each real draft is the target's sure choice, so it is accepted on greedy and random rows alike.
    logits = torch.randn(n, vocab, generator=gen)
    flat = [t for d in drafts for t in d]
    for j, t in enumerate(flat):
        if t >= 0:
            logits[j, t] = 50.0
    draft_probs = None
    if with_draft_probs:
        draft_probs = torch.rand(n, vocab, generator=gen)
        draft_probs /= draft_probs.sum(-1, keepdim=True)
    bonus = torch.tensor([[1], [2], [3], [4], [7]])
    outs = []
    for backend in ("torch", "triton"):
        sampler = RejectionSampler(backend)
        sampler.record = True
        sm = _sm(temperature, len(drafts), seeds=list(range(len(drafts))))
        out = sampler(_md(drafts), draft_probs, logits, bonus, sm)
        outs.append(out)
        rows = out.tolist()
        assert rows[4][0] == 7                           # no drafts: the bonus
        assert rows[1][0] == 3 and rows[3][:2] == [5, 6]  # real drafts before the placeholder pass
        for i, d in enumerate(drafts):
            j = num_real_drafts(d)
            if j < len(d):   # the first -1: rejected, replaced by a real token, nothing after it
                assert 0 <= rows[i][j] < vocab and rows[i][j + 1:] == [-1] * (len(rows[i]) - j - 1)
                rec = sampler.last_record[i][j]
                assert rec["draft_token_id"] == -1 and not rec["accepted"] and rec["p_draft"] == 0.0
        if temperature == 0.0:
            start = 0
            for i, d in enumerate(drafts):
                j = num_real_drafts(d)
                if j < len(d):
                    assert rows[i][j] == int(logits[start + j].argmax())
                start += len(d)
    assert torch.equal(outs[0], outs[1])   # the Triton kernels agree with the torch reference


@pytest.mark.parametrize("with_draft_probs", [False, True])
def test_placeholder_recovered_token_follows_target(with_draft_probs):
    """A -1 draft's output is distributed as p_target itself (no draft to subtract): chi-squared."""
    vocab, batch = 8, 40_000
    gen = torch.Generator().manual_seed(3)
    row = torch.randn(vocab, generator=gen) * 1.5
    logits = row.expand(batch, vocab).contiguous()
    draft_probs = torch.full((batch, vocab), 1.0 / vocab) if with_draft_probs else None
    sm = SamplingMetadata(temperature=torch.ones(batch), all_greedy=False, all_random=True,
                          top_p=None, top_k=None, generators={})
    torch.manual_seed(11)
    out = RejectionSampler("torch")(_md([[PLACEHOLDER_TOKEN_ID]] * batch), draft_probs, logits,
                                    torch.zeros(batch, 1, dtype=torch.int32), sm)
    counts = torch.bincount(out[:, 0].long(), minlength=vocab).double()
    p = row.double().softmax(-1)
    expected = p / p.sum() * counts.sum()
    assert (out[:, 1] == -1).all()
    assert chisquare(counts.numpy(), expected.numpy()).pvalue > 1e-4
