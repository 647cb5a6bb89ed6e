"""Sampler: greedy argmax, temperature, top-k / top-p (vLLM's order), the exponential race, seeds."""
import math

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from minivllm.sample.metadata import SamplingMetadata
from minivllm.sample.sampler import Sampler, apply_top_k_top_p, compute_probs
from minivllm.sampling_params import SamplingParams

NEG_INF = float("-inf")


def _meta(params, generators=None):
    return SamplingMetadata.from_params(params, generators)


def test_from_params_tensors():
    sm = _meta([SamplingParams(temperature=0.0)] * 2)
    assert sm.all_greedy and not sm.all_random
    assert sm.temperature is None and sm.top_k is None and sm.top_p is None and sm.generators == {}
    sm = _meta([SamplingParams(temperature=0.0, seed=1), SamplingParams(temperature=0.7, top_k=5, seed=2),
                SamplingParams(temperature=1.0, top_p=0.9)])
    assert not sm.all_greedy and not sm.all_random
    assert sm.temperature.dtype == torch.float32 and sm.temperature.tolist() == pytest.approx([0, 0.7, 1])
    assert sm.top_k.dtype == torch.int64 and sm.top_k.tolist() == [0, 5, 0]
    assert sm.top_p.dtype == torch.float32 and sm.top_p.tolist() == pytest.approx([1, 1, 0.9])
    assert list(sm.generators) == [1]  # greedy rows need no generator
    gens = {0: torch.Generator()}
    assert _meta([SamplingParams(seed=3)], gens).generators is gens


def test_greedy_rows_take_the_first_argmax():
    logits = torch.tensor([[0.0, 3.0, 3.0, 1.0], [5.0, 5.0, 0.0, 0.0], [0.0, 0.0, 0.0, 9.0]])
    out = Sampler()(logits, _meta([SamplingParams(temperature=0.0)] * 3))
    assert out.dtype == torch.int64 and out.tolist() == [1, 0, 3]
    # Mixed batch: greedy rows are unaffected by the random ones.
    params = [SamplingParams(temperature=t) for t in (0.0, 1.0, 0.0)]
    for _ in range(5):
        out = Sampler()(logits, _meta(params))
        assert out[0] == 1 and out[2] == 3


def test_top_k_keeps_ties_and_top_p_keeps_the_nucleus():
    logits = torch.tensor([[1.0, 2.0, 2.0, 0.0], [4.0, 3.0, 2.0, 1.0]])
    masked = apply_top_k_top_p(logits, torch.tensor([1, 0]), None)
    assert masked[0].tolist() == [NEG_INF, 2.0, 2.0, NEG_INF]  # both tied maxima stay
    assert torch.equal(masked[1], logits[1])  # 0 = off
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    masked = apply_top_k_top_p(probs.log(), None, torch.tensor([0.7]))
    assert torch.isfinite(masked[0]).tolist() == [True, True, False, False]
    masked = apply_top_k_top_p(probs.log(), None, torch.tensor([0.01]))
    assert torch.isfinite(masked[0]).tolist() == [True, False, False, False]  # at least one token


def test_top_k_is_applied_before_top_p():
    # After top-2 the renormalised probs are 0.53, 0.47, so top-p 0.5 keeps token 0 only; top-p first
    # would have kept tokens 0 and 1.
    logits = torch.tensor([[0.40, 0.35, 0.25]]).log()
    masked = apply_top_k_top_p(logits, torch.tensor([2]), torch.tensor([0.5]))
    assert torch.isfinite(masked[0]).tolist() == [True, False, False]
    sm = _meta([SamplingParams(temperature=1.0, top_k=2, top_p=0.5)])
    assert compute_probs(logits, sm)[0].tolist() == [1.0, 0.0, 0.0]


def test_sampled_distribution_with_temperature_and_top_k():
    gen = torch.Generator().manual_seed(0)
    vocab, n = 12, 60_000
    logits = torch.randn(vocab, generator=gen)
    params = [SamplingParams(temperature=0.7, top_k=6)]
    sm = SamplingMetadata(temperature=torch.full((n,), 0.7), all_greedy=False, all_random=True,
                          top_p=None, top_k=torch.full((n,), 6), generators={})
    expected = compute_probs(logits.unsqueeze(0), _meta(params))[0].double().numpy()
    assert (expected > 0).sum() == 6
    torch.manual_seed(0)
    out = Sampler()(logits.expand(n, vocab), sm)
    counts = np.bincount(out.numpy(), minlength=vocab)
    assert counts[expected == 0].sum() == 0
    keep = expected > 0
    assert chisquare(counts[keep], n * expected[keep] / expected[keep].sum()).pvalue > 1e-3
    # Power: the untempered distribution over the same six tokens is rejected.
    plain = torch.softmax(logits.double(), -1).numpy()[keep]
    assert chisquare(counts[keep], n * plain / plain.sum()).pvalue < 1e-6


def test_low_temperature_is_greedy():
    gen = torch.Generator().manual_seed(1)
    logits = torch.stack([torch.randperm(20, generator=gen).float() for _ in range(50)])
    out = Sampler()(logits, _meta([SamplingParams(temperature=1e-3)] * 50))
    assert torch.equal(out, logits.argmax(dim=-1))


def test_seeded_rows_reproducible_and_independent_of_batch():
    gen = torch.Generator().manual_seed(2)
    vocab = 50
    mine = torch.randn(vocab, generator=gen) * 0.1  # flat: the draw decides

    def sample(batch, row, seed, rng_seed):
        logits = torch.randn(batch, vocab, generator=gen)
        logits[row] = mine
        params = [SamplingParams(temperature=1.0)] * batch
        params[row] = SamplingParams(temperature=1.0, seed=seed)
        torch.manual_seed(rng_seed)
        return Sampler()(logits, _meta(params))[row].item()

    for seed in range(5):
        first = sample(1, 0, seed, rng_seed=0)
        assert sample(4, 2, seed, rng_seed=1) == first
        assert sample(7, 6, seed, rng_seed=2) == first
    assert len({sample(3, 1, seed, rng_seed=0) for seed in range(10)}) > 1


def test_persistent_generator_continues_its_stream():
    # The runner keeps one generator per request: successive steps give fresh, reproducible draws.
    logits = torch.zeros(1, 1000)

    def run_steps():
        gens = {0: torch.Generator().manual_seed(42)}
        sm = _meta([SamplingParams(temperature=1.0, seed=42)], gens)
        return [Sampler()(logits, sm).item() for _ in range(4)]

    steps = run_steps()
    assert steps == run_steps() and len(set(steps)) > 1


def test_exponential_race_never_picks_masked_tokens():
    logits = torch.tensor([[0.0, NEG_INF, 1.0, NEG_INF]]).expand(5000, 4)
    sm = SamplingMetadata(temperature=torch.ones(5000), all_greedy=False, all_random=True,
                          top_p=None, top_k=None, generators={})
    out = Sampler()(logits, sm)
    assert set(out.tolist()) == {0, 2}
    assert abs((out == 2).float().mean().item() - math.e / (1 + math.e)) < 0.03
