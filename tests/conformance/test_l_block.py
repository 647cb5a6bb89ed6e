"""Case l: block verification's one-hot path. vLLM 0.32's own rejection kernel
(``v1/worker/gpu/spec_decode/rejection_sampler_utils.py``, ``use_block_verification=True``, run by
Triton's interpreter: ``vllm_side/l_block.py`` says how), on N copies of one request with one-hot
drafts, seeds 1..N, against minivllm's block rule on the same logits and drafts.

vLLM draws ``u`` and the recovered token from its own Philox stream per (seed, position), which
minivllm does not reproduce, so the comparison is in distribution: the (tokens emitted, last
token) pairs of vLLM's N requests must fit the exact distribution minivllm's block backend
computes (its thresholds ``h_i`` and residuals: chi-squared), and that distribution must be the
token-wise rule's (one-hot drafts gain nothing from block verification).
"""
from __future__ import annotations

import math

import numpy as np
import torch
from scipy.stats import chisquare

from minivllm.sample.rejection_block import block_residual, joint_ratios_and_thresholds

LOGITS = [[0.5, 1.0, -0.3, 0.2], [1.0, 0.1, 0.0, -1.0], [0.3, 0.3, 0.9, -0.2], [0.0, 0.2, 0.1, 0.0]]
DRAFTS = [1, 0, 2]
N = 500


def _exact() -> dict:
    """P(emitted tokens, last token) under minivllm's block rule: tau = the last i with u_i <= h_i."""
    k, probs = len(DRAFTS), torch.tensor(LOGITS, dtype=torch.float64).softmax(-1)
    p, h = joint_ratios_and_thresholds([k], torch.tensor(DRAFTS), None, probs[:k])
    residual = block_residual(probs[:k], None, torch.tensor(DRAFTS),
                              torch.tensor([1.0] + p[:-1], dtype=torch.float64))
    out = {}
    for tau in range(k + 1):
        p_tau = math.prod(1 - h[j] for j in range(tau, k)) * (h[tau - 1] if tau else 1.0)
        nxt = probs[k] if tau == k else residual[tau] / residual[tau].sum()
        for y in range(len(LOGITS[0])):
            out[(tau + 1, y)] = p_tau * nxt[y].item()
        # the token-wise rule: P(tau) = prod of the first tau p_target(x), then one rejection
        tokenwise = math.prod(probs[j, DRAFTS[j]].item() for j in range(tau)) * (
            1 - probs[tau, DRAFTS[tau]].item() if tau < k else 1.0)
        assert abs(p_tau - tokenwise) < 1e-12
    return out


def test_k_vllm_block_kernel_one_hot(vllm_side):
    got = vllm_side("l_block.py", {"logits": LOGITS, "drafts": DRAFTS, "draft_logits": None,
                                   "num_requests": N}, engine=False, timeout=900)["block"]
    exact = _exact()
    keys = sorted(exact)
    counts = np.array([sum(1 for g in got if tuple(g) == key) for key in keys], dtype=float)
    # Emitted tokens past the drafts kept are the drafts themselves: vLLM's rows must agree.
    assert sum(counts) == N, "vLLM emitted a (length, token) pair the rule cannot give"
    expected = np.array([exact[key] for key in keys]) * N
    keep = expected >= 5
    obs, exp = counts[keep], expected[keep]
    if (~keep).any() and expected[~keep].sum() > 0:   # the rare cells pooled into one
        obs, exp = np.append(obs, counts[~keep].sum()), np.append(exp, expected[~keep].sum())
    assert counts[expected == 0].sum() == 0
    assert chisquare(obs, exp * obs.sum() / exp.sum()).pvalue > 1e-3
