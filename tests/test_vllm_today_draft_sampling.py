"""``speculative_config["draft_sample_method"] = "probabilistic"`` (vLLM 0.32): EAGLE samples its
drafts from its own distribution q at the request's temperature, and the rejection sampler gets q
as ``draft_probs``; the article's accept rule ``min(1, p/q)`` plus recovery from ``max(p - q, 0)``
then makes every output token follow the target p exactly.

Test: at temperature 0.8, each of N seeded requests (prompt fixed) emits its 2nd token from the
verification of one draft (accepted or recovered); the counts must fit the exact marginal
``sum_x1 p(x1) p(x2 | x1)`` of the target (chi-squared). The same test rejects a wrong q."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from conftest import make_tiny_llama, runner_of, tiny_llm
from learned_heads import make_eagle_head
from minivllm import SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")
PROMPT, TEMP, N, V = [3, 9, 4, 1], 0.8, 3000, 16


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("draft_sampling")
    tgt = make_tiny_llama(d / "target", seed=11, vocab_size=V, initializer_range=0.05)
    return tgt, make_eagle_head(d / "head", tgt, "eagle", seed=3, std=0.3)


def _exact_marginal(tgt):
    from transformers import LlamaForCausalLM
    m = LlamaForCausalLM.from_pretrained(tgt).eval()
    with torch.no_grad():
        p1 = torch.softmax(m(torch.tensor([PROMPT])).logits[0, -1] / TEMP, -1).double()
        ctx = torch.tensor([PROMPT + [x] for x in range(V)])
        p2 = torch.softmax(m(ctx).logits[:, -1] / TEMP, -1).double()
    return (p1[:, None] * p2).sum(0).numpy()


def _second_tokens(llm):
    params = [SamplingParams(temperature=TEMP, max_tokens=3, seed=i, ignore_eos=True)
              for i in range(N)]
    outs = llm.generate([{"prompt_token_ids": PROMPT}] * N, params, use_tqdm=False)
    return np.bincount([o.outputs[0].token_ids[1] for o in outs], minlength=V)


def _pvalue(counts, probs):
    exp = probs / probs.sum() * counts.sum()
    keep = exp >= 5
    obs = np.append(counts[keep], counts[~keep].sum())
    exp = np.append(exp[keep], exp[~keep].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    return chisquare(obs, exp).pvalue


def _llm(tgt, head):
    spec = {"method": "eagle", "model": head, "num_speculative_tokens": 1,
            "draft_sample_method": "probabilistic"}
    return tiny_llm(tgt, spec, max_num_seqs=256, max_num_batched_tokens=2048)


def test_output_follows_target_with_probabilistic_drafts(models):
    tgt, head = models
    llm = _llm(tgt, head)
    runner, drafts = runner_of(llm), []
    propose = runner.propose_draft_token_ids
    runner.propose_draft_token_ids = lambda *a: (d := propose(*a), drafts.extend(d.values()))[0]
    counts = _second_tokens(llm)
    # Sampled, not argmax: the same context gets different first drafts under different seeds.
    assert len({tuple(d) for d in drafts}) > 3
    m = {x.name: getattr(x, "values", getattr(x, "value", None)) for x in llm.get_metrics()}
    # Drafts were made and verified for (nearly) every request, some accepted, some not.
    assert m["vllm:spec_decode_num_draft_tokens"] >= N * 0.9
    assert 0 < m["vllm:spec_decode_num_accepted_tokens"] < m["vllm:spec_decode_num_draft_tokens"]
    pvalue = _pvalue(counts, _exact_marginal(tgt))
    print(f"probabilistic drafts: chi-squared p = {pvalue:.3g}")
    assert pvalue > 1e-3


def test_a_wrong_q_is_rejected(models):
    """Drafts still sampled from q, but the rejection sampler is told q is uniform."""
    tgt, head = models
    llm = _llm(tgt, head)
    runner = runner_of(llm)
    right = runner._scheduled_draft_probs
    runner._scheduled_draft_probs = lambda md: (None if (q := right(md)) is None
                                                else torch.full_like(q, 1.0 / q.shape[-1]))
    pvalue = _pvalue(_second_tokens(llm), _exact_marginal(tgt))
    print(f"wrong q: chi-squared p = {pvalue:.3g}")
    assert pvalue < 1e-3


def test_bad_draft_sample_method():
    from minivllm.config import SpeculativeConfig
    with pytest.raises(ValueError, match="draft_sample_method"):
        SpeculativeConfig(method="eagle", draft_sample_method="beam")
    with pytest.raises(ValueError, match="draft_sample_method"):
        SpeculativeConfig(method="ngram", draft_sample_method="probabilistic")
