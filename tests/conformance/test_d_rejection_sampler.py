"""Case d: the rejection sampler alone. vLLM's (``v1/sample/rejection_sampler.py``, with the CPU
build's C++ kernels) against minivllm's torch reference and its Triton kernels (interpreted on
the CPU), given the same target logits, draft ids and draft probabilities.

vLLM 0.32's CPU override of ``expand_kernel`` is broken for float inputs (temperatures come back as
uninitialised memory: ``test_d_vllm_cpu_expand_kernel_bug``), so the vLLM side computes that one
kernel in torch; everything else is vLLM's own code.

The uniform draws are made identical: every random row has a seed, so both sides draw
``u`` (float64, per request slice) and the recovery noise ``q`` (float32 Exp(1), one row per request)
from ``torch.Generator().manual_seed(seed)`` in the same order, and the unseeded global stream
never reaches an output. The token ids must then be identical, row for row.

Two call shapes (delta row 11):
- ``rejection_sample(...)`` with the bonus ids given: minivllm's ``RejectionSampler.forward``;
- vLLM 0.32's ``RejectionSampler.forward(metadata, draft_probs, logits[num_tokens + batch, V],
  sampling_metadata)``, which samples the bonus itself first. Its CPU ``Sampler`` draws the bonus
  by a fused Gumbel-argmax with SplitMix64 noise seeded by one ``torch.randint`` from the request's
  generator (``v1/sample/ops/topk_topp_sampler.py`` ``forward_cpu``), a stream minivllm's exponential
  race cannot reproduce. So minivllm is given the bonus ids vLLM drew, and its generators are
  advanced by that one ``randint`` first; then the outputs must again be identical.
"""
from __future__ import annotations

import pytest
import torch

from minivllm.sample.metadata import SamplingMetadata
from minivllm.sample.rejection_sampler import RejectionSampler
from minivllm.sampling_params import SamplingParams
from minivllm.spec_decode.metadata import SpecDecodeMetadata

VOCAB = 24
KINDS = ("greedy", "random", "random_probs", "mixed", "mixed_probs")


def make_case(kind: str, gen: torch.Generator, placeholders: bool = False) -> dict:
    batch = int(torch.randint(1, 6, (1,), generator=gen))
    probs_given = kind.endswith("_probs")
    temps = []
    for i in range(batch):
        greedy = kind == "greedy" or (kind.startswith("mixed") and i % 2 == 0)
        temps.append(0.0 if greedy else [0.5, 1.0, 1.7][i % 3])
    drafts, target, draft_probs = [], [], []
    for i in range(batch):
        n = int(torch.randint(0, 5, (1,), generator=gen))
        row = []
        for _ in range(n):
            logits = torch.randn(VOCAB, generator=gen) * 3
            q = torch.softmax(torch.randn(VOCAB, generator=gen), -1)
            r = float(torch.rand(1, generator=gen))
            # Mostly plausible drafts (the target's argmax), some others; with ``placeholders``
            # some -1 (vLLM's drafts for fresh decodes and async scheduling: always rejected).
            tok = int(logits.argmax()) if r < 0.6 else -1 if placeholders and r < 0.7 else \
                int(torch.randint(0, VOCAB, (1,), generator=gen))
            if probs_given and tok >= 0 and r > 0.95:
                q[tok] = 0.0                      # p_draft = 0: never accepted
                q = q / q.sum()
            row.append(tok)
            target.append(logits.tolist())
            draft_probs.append(q.tolist())
        drafts.append(row)
    if not target:       # a step with no drafts at all never reaches the rejection sampler
        return make_case(kind, gen, placeholders)
    bonus_logits = (torch.randn(batch, VOCAB, generator=gen) * 3)
    return dict(drafts=drafts, target_logits=target, bonus_logits=bonus_logits.tolist(),
                bonus_token_ids=bonus_logits.argmax(-1).tolist(),
                draft_probs=draft_probs if probs_given else None, temperature=temps,
                seeds=[None if t == 0 else 1000 + 7 * i for i, t in enumerate(temps)])


def make_cases(placeholders: bool = False) -> list[dict]:
    gen = torch.Generator().manual_seed(1 if placeholders else 0)
    cases = [make_case(kind, gen, placeholders) for _ in range(12) for kind in KINDS]
    if not placeholders:
        return cases
    # Every row fully drafted with -1 (the async-scheduling placeholder row), greedy and random.
    cases.append(dict(drafts=[[-1, -1, -1], [-1, -1]], target_logits=[[0.0] * VOCAB] * 5,
                      bonus_logits=[[1.0] + [0.0] * (VOCAB - 1)] * 2, bonus_token_ids=[0, 0],
                      draft_probs=None, temperature=[0.0, 1.0], seeds=[None, 5]))
    return cases


def minivllm_output(case: dict, backend: str, bonus_ids: list[int],
                    advance_generators: bool = False) -> list[list[int]]:
    params = [SamplingParams(temperature=t, seed=s)
              for t, s in zip(case["temperature"], case["seeds"])]
    sm = SamplingMetadata.from_params(params)        # fresh torch.Generator(seed) per random row
    if advance_generators:                           # what vLLM's CPU bonus sampler drew first
        for g in sm.generators.values():
            torch.randint(0, 2**31, (1,), generator=g, dtype=torch.long)
    md = SpecDecodeMetadata.make_dummy(case["drafts"])
    target = torch.tensor(case["target_logits"], dtype=torch.float32).view(-1, VOCAB)
    probs = None if case["draft_probs"] is None else torch.tensor(case["draft_probs"])
    bonus = torch.tensor(bonus_ids, dtype=torch.int32).view(-1, 1)
    out = RejectionSampler(backend)(md, probs, target, bonus, sm)
    return out.tolist()


@pytest.fixture(scope="module")
def cases_and_vllm(vllm_side):
    """Plain cases, then the cases with -1 placeholder drafts; one vLLM-side run for all."""
    plain, placeholder = make_cases(), make_cases(placeholders=True)
    res = vllm_side("d_rejection.py", {"cases": plain + placeholder}, engine=False,
                    timeout=600)
    cases = res["cases"]
    return plain, cases[:len(plain)], placeholder, cases[len(plain):], res["expand_kernel"]


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_d_rejection_sample_identical(cases_and_vllm, backend):
    cases, theirs, _, _, _ = cases_and_vllm
    for i, (case, res) in enumerate(zip(cases, theirs)):
        ours = minivllm_output(case, backend, case["bonus_token_ids"])
        assert ours == res["rejection_sample"], (i, case["drafts"], case["temperature"], ours,
                                                 res["rejection_sample"])
    # The batches exercise acceptances, rejections and bonus tokens, not one path only.
    emitted = [len([t for t in row if t >= 0]) for r in theirs for row in r["rejection_sample"]]
    assert min(emitted) == 1 and max(emitted) >= 4


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_d_vllm_forward_call_shape(cases_and_vllm, backend):
    cases, theirs, _, _, _ = cases_and_vllm
    for i, (case, res) in enumerate(zip(cases, theirs)):
        ours = minivllm_output(case, backend, res["forward_bonus"], advance_generators=True)
        assert ours == res["forward"], (i, case["drafts"], case["temperature"], ours,
                                        res["forward"])


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_d_placeholder_drafts(cases_and_vllm, backend):
    """vLLM 0.32 schedules -1 placeholder drafts (fresh decodes after a full remote KV load, async
    scheduling: delta rows 3 and 22) and its sampler always rejects them (``draft id < 0``)."""
    _, _, cases, theirs, _ = cases_and_vllm
    for i, (case, res) in enumerate(zip(cases, theirs)):
        ours = minivllm_output(case, backend, case["bonus_token_ids"])
        assert ours == res["rejection_sample"], (i, case["drafts"], case["temperature"], ours,
                                                 res["rejection_sample"])


def test_d_vllm_cpu_expand_kernel_bug(cases_and_vllm):
    """Not a minivllm difference: vLLM 0.32's CPU build (``vllm/utils/cpu_triton_utils.py``
    ``_expand_kernel_impl``) hands the C++ op ``_ensure_int64(output)``, a temporary int64 copy of
    a float32 output, so ``expand_batch_to_tokens(temperature, ...)`` returns uninitialised memory
    and ``apply_sampling_constraints`` divides the target logits by garbage whenever a spec-decode
    batch is not all greedy. When this test fails, vLLM has fixed it: drop ``_expand_torch`` from
    ``vllm_side/d_rejection.py`` and this test."""
    expand = cases_and_vllm[4]
    assert expand["int64"] == [3, 3, 1, 9, 9], expand       # int64 (top-k) is right (0 -> 1)
    assert expand["float32"] == [-7.0] * 5, (
        "vLLM's CPU expand_kernel now writes float outputs: " + str(expand))
