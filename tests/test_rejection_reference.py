"""The rejection sampler's torch reference (the article's left-to-right loop) against the Triton
kernels (interpreted on CPU), on random batches: greedy, random and mixed rows, with and without
draft probabilities, with -1 placeholder drafts and requests without drafts."""
import pytest
import torch

from minivllm.sample import rejection_kernels as K
from minivllm.sample import rejection_torch as R
from minivllm.sample.metadata import SamplingMetadata
from minivllm.sample.rejection_sampler import PLACEHOLDER_TOKEN_ID, RejectionSampler
from minivllm.sampling_params import SamplingParams
from minivllm.spec_decode.metadata import SpecDecodeMetadata


def test_accept_left_to_right_by_hand():
    # Request 0: accept, accept, reject -> recovered 30; request 1: no drafts -> bonus;
    # request 2: both accepted -> bonus after them; request 3 is not one of `rows`.
    cu = torch.tensor([3, 3, 5, 6], dtype=torch.int32)
    drafts = torch.tensor([1, 2, 3, 4, 5, 6], dtype=torch.int32)
    accepted = torch.tensor([True, True, False, True, True, False])
    recovered = torch.tensor([10, 20, 30, 40, 50, 60], dtype=torch.int32)
    bonus = torch.tensor([[7], [8], [9], [11]])
    out = torch.full((4, 4), PLACEHOLDER_TOKEN_ID, dtype=torch.int32)
    rows = torch.tensor([True, True, True, False])
    R.accept_left_to_right(out, rows, cu, drafts, accepted, recovered, bonus)
    assert out.tolist() == [[1, 2, 30, -1], [8, -1, -1, -1], [4, 5, 9, -1], [-1, -1, -1, -1]]


def _random_case(gen, trial):
    batch = int(torch.randint(1, 9, (1,), generator=gen))
    vocab = int(torch.randint(2, 50, (1,), generator=gen))
    low = -1 if trial % 3 == 0 else 0            # some -1 placeholders (async scheduling)
    drafts = [torch.randint(low, vocab, (int(torch.randint(0, 6, (1,), generator=gen)),),
                            generator=gen).tolist() for _ in range(batch)]
    n = max(sum(map(len, drafts)), 1)
    if not any(drafts):
        drafts[0] = [0]
    logits = torch.randn(n, vocab, generator=gen) * 2
    # Make drafts likely on odd trials so that rows run past their first position.
    flat = torch.tensor(sum(drafts, [])).clamp(min=0)
    logits[torch.arange(n), flat] += 4.0 * (trial % 2)
    draft_probs = torch.softmax(torch.randn(n, vocab, generator=gen), dim=-1)
    kind = trial % 4
    temps = [0.0 if kind == 0 else (1.0 if kind == 1 else float(t) * 0.5)
             for t in torch.randint(0, 4, (batch,), generator=gen)]
    params = [SamplingParams(temperature=t, seed=(i if trial % 5 == 0 else None))
              for i, t in enumerate(temps)]
    bonus = torch.randint(0, vocab, (batch, 1), generator=gen)
    return drafts, logits, draft_probs, params, bonus


@pytest.mark.parametrize("trial", range(24))
def test_reference_equals_triton_end_to_end(trial):
    gen = torch.Generator().manual_seed(100 + trial)
    drafts, logits, draft_probs, params, bonus = _random_case(gen, trial)
    for probs in (draft_probs, None):
        outs = []
        for backend in ("torch", "triton"):
            torch.manual_seed(trial)   # the same uniform draws and recovery noise for both
            outs.append(RejectionSampler(backend)(SpecDecodeMetadata.make_dummy(drafts), probs, logits,
                                                  bonus, SamplingMetadata.from_params(params)))
        assert torch.equal(outs[0], outs[1]), (drafts, outs)


@pytest.mark.parametrize("seed", range(6))
def test_reference_kernels_equal_triton_kernels(seed):
    """The two write-out functions on the same inputs (uniform draws, recovered tokens given)."""
    gen = torch.Generator().manual_seed(seed)
    num_draft = torch.randint(0, 6, (int(torch.randint(1, 10, (1,), generator=gen)),),
                              generator=gen).tolist()
    num_draft[0] = max(num_draft[0], 1)
    batch, n, msl = len(num_draft), sum(num_draft), max(max(num_draft), 1)
    vocab = 17
    cu = torch.tensor(num_draft, dtype=torch.int32).cumsum(0).to(torch.int32)
    target_probs = torch.softmax(torch.randn(n, vocab, generator=gen) * 2, dim=-1)
    draft = torch.randint(-1, vocab, (n,), generator=gen, dtype=torch.int32)
    target_argmax = torch.where(torch.rand(n, generator=gen) < 0.7, draft.long().clamp(min=0),
                                target_probs.argmax(-1))
    recovered = torch.randint(0, vocab, (n,), generator=gen, dtype=torch.int32)
    uniform = torch.rand(n, dtype=torch.float64, generator=gen)
    bonus = torch.randint(0, vocab, (batch, 1), generator=gen)
    is_greedy = torch.rand(batch, generator=gen) < 0.5
    flat = draft.tolist()
    md = SpecDecodeMetadata.make_dummy([flat[end - k:end] for k, end in zip(num_draft, cu.tolist())])
    for dp in (torch.softmax(torch.randn(n, vocab, generator=gen), -1), target_probs, None):
        outs = []
        for backend, write_random in (
                (R.TorchRejectionBackend, R.rejection_random_sample_torch),
                (K.TritonRejectionBackend,
                 lambda *args: K.rejection_random_sample_launch(*args, msl).run())):
            out = torch.full((batch, msl + 1), PLACEHOLDER_TOKEN_ID, dtype=torch.int32)
            backend.rejection_greedy_sample(output_token_ids=out, metadata=md,
                                            target_argmax=target_argmax, bonus_token_ids=bonus,
                                            is_greedy=is_greedy)
            write_random(out, cu, draft, dp, target_probs, bonus, recovered, uniform, is_greedy)
            outs.append(out)
        assert torch.equal(outs[0], outs[1])
