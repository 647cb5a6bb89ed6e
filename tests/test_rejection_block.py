"""Block verification (``rejection_sample_method="block"``): the readable reference
(``rejection_reference.block_verify``) and the batch backend (``rejection_block.py``).

Exact enumeration on toy distributions (drafts drawn from q): the output is distributed exactly as
the target's, the expected kept length is at least the token-wise rule's (strictly more here), a
fixed draft can keep less, and one-hot drafts give exactly the token-wise distribution. Then the
batch backend against the reference from the same draws, chi-squared on sampled batches, greedy
rows unchanged, and the configuration's checks."""
from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from minivllm.sample.metadata import SamplingMetadata
from minivllm.sample.rejection_block import block_residual, joint_ratios_and_thresholds
from minivllm.sample.rejection_reference import accept_or_recover, block_verify
from minivllm.sample.rejection_sampler import PLACEHOLDER_TOKEN_ID, RejectionSampler
from minivllm.spec_decode.metadata import SpecDecodeMetadata


def test_worked_example_by_hand():
    """The docstring's example: token-wise keeps no draft, block keeps both."""
    a, b = 0, 1
    q = torch.tensor([[.8, .2], [.5, .5]], dtype=torch.float64)
    p = torch.tensor([[.4, .6], [.9, .1]], dtype=torch.float64)
    assert accept_or_recover([a, a], q, p, [0.7, 0.6]) == ([], b)
    assert block_verify([a, a], q, p, [0.7, 0.6]) == ([a, a], None)
    ratios, h = joint_ratios_and_thresholds([2], torch.tensor([a, a]), q, p)
    assert ratios == pytest.approx([.5, .9]) and h == pytest.approx([0.0, .9])


# ------------------------------------------------------------------------------------------------
# Exact enumeration: a target M_b and a drafter M_s over vocabulary V, one distribution per prefix.

def _toy(seed, V, k, one_hot=False, sharp=1.0):
    g = torch.Generator().manual_seed(seed)
    dist = lambda: torch.softmax(torch.randn(V, generator=g, dtype=torch.float64) * sharp, -1)  # noqa: E731
    prefixes = [pre for n in range(k + 1) for pre in itertools.product(range(V), repeat=n)]
    target = {pre: dist() for pre in prefixes}
    if one_hot:   # a deterministic drafter: one token per prefix
        drafter = {pre: torch.nn.functional.one_hot(torch.randint(V, (), generator=g), V).double()
                   for pre in prefixes}
    else:
        drafter = {pre: dist() for pre in prefixes}
    return target, drafter


def _rows(dists, draft):
    return torch.stack([dists[tuple(draft[:j])] for j in range(len(draft))])


def _tokenwise(draft, target, drafter):
    """P(tau = i) and the residual after tau, by the article's rule (min(1, p/q), stop at the
    first rejection)."""
    probs, alive = [], 1.0
    for j, x in enumerate(draft):
        r = min(1.0, (target[tuple(draft[:j])][x] / drafter[tuple(draft[:j])][x]).item())
        probs.append(alive * (1 - r))
        alive *= r
    probs.append(alive)
    residual = [(target[tuple(draft[:j])] - drafter[tuple(draft[:j])]).clamp_min(0)
                for j in range(len(draft))]
    return probs, residual


def _block(draft, target, drafter, one_hot):
    """P(tau = i) and the residual after tau, from the backend's thresholds and residuals: tau is
    the last i whose draw passes h_i."""
    k = len(draft)
    p, h = joint_ratios_and_thresholds([k], torch.tensor(draft), None if one_hot else
                                       _rows(drafter, draft), _rows(target, draft))
    probs = [math.prod(1 - h[j] for j in range(i, k)) * (h[i - 1] if i else 1.0) for i in range(k + 1)]
    residual = block_residual(_rows(target, draft), None if one_hot else _rows(drafter, draft),
                              torch.tensor(draft), torch.tensor([1.0] + p[:-1], dtype=torch.float64))
    return probs, residual


def _output_distribution(rule, target, drafter, V, k, one_hot=False):
    """The exact distribution of the first k + 1 tokens (positions after the emitted ones filled
    by the target, as the next steps would), and the expected number of drafts kept."""
    out, kept = {}, 0.0
    for draft in itertools.product(range(V), repeat=k):
        p_draft = math.prod(drafter[draft[:j]][draft[j]].item() for j in range(k))
        if p_draft == 0:
            continue
        tau_probs, residual = rule(list(draft), target, drafter, one_hot) if rule is _block else \
            rule(list(draft), target, drafter)
        for tau, p_tau in enumerate(tau_probs):
            if p_tau == 0:
                continue
            kept += p_draft * p_tau * tau
            nxt = target[draft] if tau == k else residual[tau] / residual[tau].sum()
            for y in range(V):
                prefix = draft[:tau] + (y,)
                for rest in itertools.product(range(V), repeat=k - tau):
                    seq = prefix + rest
                    w = p_draft * p_tau * nxt[y].item() * math.prod(
                        target[seq[:j]][seq[j]].item() for j in range(tau + 1, k + 1))
                    out[seq] = out.get(seq, 0.0) + w
    return out, kept


def _target_distribution(target, V, k):
    return {seq: math.prod(target[seq[:j]][seq[j]].item() for j in range(k + 1))
            for seq in itertools.product(range(V), repeat=k + 1)}


@pytest.mark.parametrize("seed,V,k", [(0, 3, 2), (1, 2, 3), (2, 3, 3)])
def test_exact_output_is_the_target_and_keeps_at_least_as_many(seed, V, k):
    target, drafter = _toy(seed, V, k, sharp=2.0)
    want = _target_distribution(target, V, k)
    block, kept_block = _output_distribution(_block, target, drafter, V, k)
    token, kept_token = _output_distribution(_tokenwise, target, drafter, V, k)
    for seq, w in want.items():
        assert block.get(seq, 0.0) == pytest.approx(w, abs=1e-12)
        assert token.get(seq, 0.0) == pytest.approx(w, abs=1e-12)
    assert kept_block > kept_token + 1e-3, (kept_block, kept_token)   # strictly more here


def test_a_fixed_draft_can_keep_less():
    """The docstring's toy: for the draft a b, block keeps fewer drafts on average than token-wise
    (its gain is on average over drafts drawn from q, not for every draft)."""
    q = {(): torch.tensor([.8, .2], dtype=torch.float64), (0,): torch.tensor([.5, .5], dtype=torch.float64)}
    p = {(): torch.tensor([.4, .6], dtype=torch.float64), (0,): torch.tensor([.9, .1], dtype=torch.float64)}
    tok, _ = _tokenwise([0, 1], p, q)
    blk, _ = _block([0, 1], p, q, False)
    mean = lambda probs: sum(i * x for i, x in enumerate(probs))  # noqa: E731
    assert mean(blk) == pytest.approx(0.2) and mean(tok) == pytest.approx(0.6)


@pytest.mark.parametrize("seed,V,k", [(3, 3, 2), (4, 2, 3)])
def test_one_hot_drafts_give_the_token_wise_distribution(seed, V, k):
    target, drafter = _toy(seed, V, k, one_hot=True)
    for draft in itertools.product(range(V), repeat=k):
        if math.prod(drafter[draft[:j]][draft[j]].item() for j in range(k)) == 0:
            continue
        tau_b, res_b = _block(list(draft), target, drafter, True)
        tau_t, res_t = _tokenwise(list(draft), target, drafter)
        assert tau_b == pytest.approx(tau_t, abs=1e-12)
        for rb, rt in zip(res_b, res_t):
            assert torch.allclose(rb / rb.sum(), rt / rt.sum(), atol=1e-12)


# ------------------------------------------------------------------------------------------------
# The batch backend.

def _metadata(n, temperature=1.0, greedy_rows=()):
    t = torch.full((n,), temperature)
    t[list(greedy_rows)] = 0.0
    return SamplingMetadata(temperature=t, all_greedy=False, all_random=not greedy_rows,
                            top_p=None, top_k=None, generators={})


def test_batch_backend_keeps_what_the_reference_keeps_from_the_same_draws():
    """Same uniforms -> the same kept drafts, and a bonus exactly when the reference has none to
    recover (the recovered token itself is drawn differently: the race against multinomial)."""
    from minivllm.sample.rejection_block import BlockRejectionBackend
    gen = torch.Generator().manual_seed(5)
    V = 12
    for trial in range(40):
        one_hot = trial % 2 == 0
        counts = torch.randint(0, 5, (6,), generator=gen).tolist()
        drafts = [torch.randint(V, (n,), generator=gen).tolist() for n in counts]
        if trial % 5 == 0 and counts[0] > 1:
            drafts[0][1] = PLACEHOLDER_TOKEN_ID
        flat = torch.tensor(sum(drafts, []), dtype=torch.int32)
        num = len(flat)
        target = torch.softmax(torch.randn(num, V, generator=gen) * 2, -1)
        q = None if one_hot else torch.softmax(torch.randn(num, V, generator=gen) * 2, -1)
        u = torch.rand(num, generator=gen, dtype=torch.float64)
        out = torch.full((6, 5), PLACEHOLDER_TOKEN_ID, dtype=torch.int32)
        bonus = torch.full((6, 1), 99)
        BlockRejectionBackend.rejection_random_sample(
            output_token_ids=out, metadata=SpecDecodeMetadata.make_dummy(drafts), draft_probs=q,
            target_probs=target, bonus_token_ids=bonus, uniform_probs=u,
            is_greedy=torch.zeros(6, dtype=torch.bool), generators={})
        start = 0
        for i, n in enumerate(counts):
            kept, recovered = block_verify(drafts[i], None if q is None else q[start:start + n],
                                           target[start:start + n], u[start:start + n].tolist())
            row = [t for t in out[i].tolist() if t != PLACEHOLDER_TOKEN_ID]
            assert row[:len(kept)] == kept and len(row) == len(kept) + 1
            assert (row[-1] == 99) == (recovered is None)
            start += n


def test_batch_backend_follows_the_target_over_two_positions():
    """Chi-squared on sampled batches: drafts from q, the pair of emitted tokens (the second
    filled from the target where only one was emitted) against p1(x) p2(y | x); and more tokens
    kept per verify than the token-wise rule on the same inputs."""
    gen = torch.Generator().manual_seed(7)
    vocab, n = 6, 30_000
    p1, q1 = torch.softmax(torch.randn(vocab, generator=gen) * 2, -1), torch.softmax(torch.randn(vocab, generator=gen) * 2, -1)
    p2, q2 = torch.softmax(torch.randn(vocab, vocab, generator=gen) * 2, -1), torch.softmax(torch.randn(vocab, vocab, generator=gen) * 2, -1)
    x1 = torch.multinomial(q1, n, replacement=True, generator=gen)
    x2 = torch.multinomial(q2[x1], 1, generator=gen).squeeze(1)
    md = SpecDecodeMetadata.make_dummy(torch.stack([x1, x2], 1).tolist())
    logits = torch.stack([p1.log().expand(n, vocab), p2[x1].log()], 1).reshape(2 * n, vocab)
    q = torch.stack([q1.expand(n, vocab), q2[x1]], 1).reshape(2 * n, vocab)
    bonus = torch.zeros(n, 1, dtype=torch.long)
    kept = {}
    for backend in ("block", "torch"):
        torch.manual_seed(3)
        out = RejectionSampler(backend)(md, q, logits, bonus, _metadata(n))
        kept[backend] = (out != PLACEHOLDER_TOKEN_ID).sum(1).double().mean().item() - 1
        y1, y2 = out[:, 0].long(), out[:, 1].long()
        missing = y2 == PLACEHOLDER_TOKEN_ID
        y2[missing] = torch.multinomial(p2[y1[missing]], 1, generator=gen).squeeze(1)
        counts = np.bincount((y1 * vocab + y2).numpy(), minlength=vocab * vocab)
        expected = (p1.double().unsqueeze(1) * p2.double()).reshape(-1).numpy()
        assert chisquare(counts, n * expected / expected.sum()).pvalue > 1e-3
    assert kept["block"] > kept["torch"] + 0.01, kept


def test_greedy_rows_are_unchanged():
    gen = torch.Generator().manual_seed(8)
    n, V = 8, 20
    drafts = torch.randint(V, (n, 3), generator=gen).tolist()
    logits = torch.randn(3 * n, V, generator=gen)
    for i in range(0, 3 * n, 4):   # make some drafts the argmax, so that some are kept
        logits[i, drafts[i // 3][i % 3]] = 10.0
    md, bonus = SpecDecodeMetadata.make_dummy(drafts), torch.arange(n).view(n, 1)
    greedy = SamplingMetadata(temperature=torch.zeros(n), all_greedy=True, all_random=False,
                              top_p=None, top_k=None, generators={})
    assert torch.equal(RejectionSampler("block")(md, None, logits, bonus, greedy),
                       RejectionSampler("torch")(md, None, logits, bonus, greedy))
    mixed = _metadata(n, greedy_rows=(0, 2, 5))
    a = RejectionSampler("block")(md, None, logits, bonus, mixed)
    b = RejectionSampler("torch")(md, None, logits, bonus, mixed)
    assert torch.equal(a[[0, 2, 5]], b[[0, 2, 5]])


def test_configuration_checks():
    from minivllm.config import SpeculativeConfig
    assert SpeculativeConfig().rejection_sample_method == "standard"
    assert SpeculativeConfig(rejection_sample_method="block").rejection_sample_method == "block"
    with pytest.raises(ValueError, match="'synthetic'.*not built in minivllm"):
        SpeculativeConfig(rejection_sample_method="synthetic")
    with pytest.raises(ValueError, match="rejection_sample_method must be one of"):
        SpeculativeConfig(rejection_sample_method="tree")
    with pytest.raises(ValueError, match="only valid with rejection_sample_method='synthetic'"):
        SpeculativeConfig(synthetic_acceptance_length=2.0)


@pytest.mark.usefixtures("one_thread")
def test_engine_runs_block_verification(tiny_llama_dir):
    """The engine picks the block backend from the configuration; greedy output is unchanged, and
    sampled requests run through it."""
    from conftest import runner_of, tiny_llm
    from minivllm import SamplingParams
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2,
            "prompt_lookup_max": 3, "rejection_sample_method": "block"}
    prompt = {"prompt_token_ids": [1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2]}
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    plain = tiny_llm(tiny_llama_dir).generate([prompt], greedy, use_tqdm=False)
    llm = tiny_llm(tiny_llama_dir, spec)
    assert runner_of(llm).rejection_sampler.backend == "block"
    assert llm.generate([prompt], greedy, use_tqdm=False)[0].outputs[0].token_ids == \
        plain[0].outputs[0].token_ids
    outs = llm.generate([prompt] * 3, SamplingParams(temperature=0.8, max_tokens=10, seed=1,
                                                     ignore_eos=True), use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 10 for o in outs)


def test_real_model_rows_follow_the_target(smollm2_dir):
    """Monte Carlo on SmolLM2's own rows: the target at temperature 0.8 and top-k 6 after a prompt
    and after each of its 6 candidates, drafts from a self-draft (the first 6 layers) at the same
    settings. Block verification's pair of tokens fits p1(x) p2(y | x) (chi-squared), as the
    token-wise rule's does."""
    from transformers import AutoTokenizer, LlamaForCausalLM
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    model = LlamaForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    ids = tok.apply_chat_template([{"role": "user", "content": "Name a colour."}],
                                  add_generation_prompt=True, tokenize=False)
    ids = tok(ids, add_special_tokens=False)["input_ids"]

    def rows(contexts):   # target and self-draft distributions after each context, top-6 at 0.8
        with torch.no_grad():
            out = model(torch.tensor(contexts), output_hidden_states=True)
            shallow = model.lm_head(model.model.norm(out.hidden_states[6][:, -1]))
        def constrain(logits):
            logits = logits / 0.8
            kth = logits.topk(6, dim=-1).values[:, -1:]
            return logits.masked_fill(logits < kth, -math.inf).softmax(-1).double()
        return constrain(out.logits[:, -1]), constrain(shallow)
    p1, q1 = rows([ids])
    support = sorted(set((p1[0] > 0).nonzero().view(-1).tolist()) | set((q1[0] > 0).nonzero().view(-1).tolist()))
    p2_rows, q2_rows = rows([ids + [x] for x in support])
    vocab_ids = sorted(set(support) | set((p2_rows > 0).nonzero()[:, 1].tolist())
                       | set((q2_rows > 0).nonzero()[:, 1].tolist()))
    V = len(vocab_ids)   # the tokens any of these rows can give, renumbered 0..V-1
    col = torch.tensor(vocab_ids)
    p1, q1 = p1[:, col].float(), q1[:, col].float()
    p2, q2 = torch.zeros(V, V), torch.full((V, V), 1.0 / V)
    for r, x in enumerate(support):
        p2[vocab_ids.index(x)] = p2_rows[r, col].float()
        q2[vocab_ids.index(x)] = q2_rows[r, col].float()
    gen, n = torch.Generator().manual_seed(11), 30_000
    x1 = torch.multinomial(q1[0], n, replacement=True, generator=gen)
    x2 = torch.multinomial(q2[x1], 1, generator=gen).squeeze(1)
    md = SpecDecodeMetadata.make_dummy(torch.stack([x1, x2], 1).tolist())
    logits = torch.stack([p1[0].log().expand(n, V), p2[x1].log()], 1).reshape(2 * n, V)
    q = torch.stack([q1[0].expand(n, V), q2[x1]], 1).reshape(2 * n, V)
    torch.manual_seed(4)
    out = RejectionSampler("block")(md, q, logits, torch.zeros(n, 1, dtype=torch.long), _metadata(n))
    y1, y2 = out[:, 0].long(), out[:, 1].long()
    missing = y2 == PLACEHOLDER_TOKEN_ID
    y2[missing] = torch.multinomial(p2[y1[missing]], 1, generator=gen).squeeze(1)
    expected = (p1[0].double().unsqueeze(1) * p2.double()).reshape(-1).numpy()
    expected /= expected.sum()
    counts = np.bincount((y1 * V + y2).numpy(), minlength=V * V)
    keep = expected * n >= 5   # chi-squared needs 5 expected per cell: the rare cells pooled
    obs = np.append(counts[keep], counts[~keep].sum())
    exp = np.append(expected[keep], expected[~keep].sum()) * n
    assert counts[expected == 0].sum() == 0
    assert chisquare(obs, exp).pvalue > 1e-3


def test_record_follows_the_block_rule():
    """The verify record reads what was kept from the output, so its accepted/recovered/bonus
    kinds hold under block verification (whose test is u <= h, not p_target / p_draft >= u)."""
    gen = torch.Generator().manual_seed(9)
    n, V = 40, 6
    drafts = torch.randint(V, (n, 3), generator=gen).tolist()
    logits = torch.randn(3 * n, V, generator=gen)
    q = torch.softmax(torch.randn(3 * n, V, generator=gen) * 2, -1)
    sampler = RejectionSampler("block")
    sampler.record = True
    out = sampler(SpecDecodeMetadata.make_dummy(drafts), q, logits, torch.zeros(n, 1, dtype=torch.long),
                  _metadata(n))
    for row, rec in zip(out.tolist(), sampler.last_record):
        emitted = [t for t in row if t != PLACEHOLDER_TOKEN_ID]
        assert [p["kind"] for p in rec] == ["accepted"] * (len(emitted) - 1) + [
            "bonus" if len(emitted) == 4 else "recovered"]
        assert [p["output_token_id"] for p in rec] == emitted
