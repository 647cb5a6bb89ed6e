"""The article's rule written plainly (sample/rejection_reference.py: accept while p_target >=
p_draft or u < p_target / p_draft, else a draw from the normalised residual, else the bonus)
against ``RejectionSampler`` (the batch version with vLLM's draws and the exponential race): the
same distribution of outcomes, chi-squared on (drafts accepted, token emitted after them)."""
import numpy as np
import pytest
import torch
from scipy.stats import chi2_contingency, chisquare

from minivllm.sample.metadata import SamplingMetadata
from minivllm.sample.rejection_reference import accept_or_recover, rejection_sample_one
from minivllm.sample.rejection_sampler import PLACEHOLDER_TOKEN_ID, RejectionSampler
from minivllm.spec_decode.metadata import SpecDecodeMetadata

VOCAB, K, N = 6, 2, 20_000


def _expected(probs: torch.Tensor) -> np.ndarray:
    probs = probs.double().numpy()
    return N * probs / probs.sum()


def _outcome_counts(outputs: list[list[int]]) -> np.ndarray:
    """[K + 1, VOCAB]: how many requests accepted i drafts and then emitted token t."""
    counts = np.zeros((K + 1, VOCAB), dtype=np.int64)
    for out in outputs:
        counts[len(out) - 1, out[-1]] += 1
    return counts


@pytest.mark.parametrize("one_hot", [False, True])
def test_reference_and_race_agree_in_distribution(one_hot):
    gen = torch.Generator().manual_seed(7)
    p = torch.softmax(torch.randn(K + 1, VOCAB, generator=gen), -1)        # target, per position
    q = torch.softmax(1.5 * torch.randn(K, VOCAB, generator=gen), -1)      # drafter, per position
    if one_hot:
        drafts = torch.tensor([[2, 4]]).expand(N, K)
        draft_probs = None
    else:
        drafts = torch.stack([torch.multinomial(q[j], N, replacement=True, generator=gen)
                              for j in range(K)], dim=1)
    # The race: a batch of N requests, the bonus sampled from the last target row.
    bonus = torch.multinomial(p[K], N, replacement=True, generator=gen).view(N, 1)
    md = SpecDecodeMetadata.make_dummy(drafts.tolist())
    sm = SamplingMetadata(temperature=torch.ones(N), all_greedy=False, all_random=True,
                          top_p=None, top_k=None, generators={})
    draft_probs = None if one_hot else q.repeat(N, 1)
    torch.manual_seed(0)
    raced = RejectionSampler("torch")(md, draft_probs, p[:K].log().repeat(N, 1), bonus, sm)
    raced = [[t for t in row if t != PLACEHOLDER_TOKEN_ID] for row in raced.tolist()]
    # The reference, one request at a time.
    ref_gen = torch.Generator().manual_seed(1)
    plain = [rejection_sample_one(drafts[i].tolist(), None if one_hot else q, p, ref_gen)
             for i in range(N)]
    a, b = _outcome_counts(plain), _outcome_counts(raced)
    keep = (a + b).sum(0) > 0
    table = np.stack([a[:, keep].reshape(-1), b[:, keep].reshape(-1)])
    table = table[:, table.sum(0) > 0]
    assert chi2_contingency(table).pvalue > 1e-3
    # Power: the reference's first token follows the target, not the drafter.
    first = np.bincount([out[0] for out in plain], minlength=VOCAB)
    assert chisquare(first, _expected(p[0])).pvalue > 1e-3
    if not one_hot:
        assert chisquare(first, _expected(q[0])).pvalue < 1e-12


def test_reference_rule_by_hand():
    p = torch.tensor([[0.1, 0.9], [0.5, 0.5], [1.0, 0.0]])
    # p_target(1) = 0.9 < 1 = p_draft(1) (one-hot), so acceptance needs u < 0.9; a rejection
    # draws from max(p - onehot(1), 0) = [0.1, 0] -> token 0.
    outs = {tuple(rejection_sample_one([1, 0], None, p, torch.Generator().manual_seed(s)))
            for s in range(200)}
    assert outs <= {(0,), (1, 1), (1, 0, 0)} and (0,) in outs and (1, 0, 0) in outs


def _batch(backend, drafts, draft_probs, p, bonus, temperature, seed=0):
    md = SpecDecodeMetadata.make_dummy(drafts)
    n = len(drafts)
    greedy = temperature == 0
    sm = SamplingMetadata(temperature=None if greedy else torch.full((n,), temperature),
                          all_greedy=greedy, all_random=not greedy, top_p=None, top_k=None,
                          generators={})
    torch.manual_seed(seed)
    return RejectionSampler(backend)(md, draft_probs, p[:K].log().repeat(n, 1), bonus, sm).tolist()


def test_reference_backend_is_the_article_rule_in_the_batch():
    """``RejectionSampler("reference")`` (the ``--plain`` path) reaches ``accept_or_recover`` in at
    most 4 calls from ``forward`` and samples what the race samples."""
    import inspect
    from minivllm.sample import rejection_sampler
    from minivllm.sample.rejection_reference import ReferenceRejectionBackend
    assert RejectionSampler("reference").backend_cls is ReferenceRejectionBackend
    chain = [(rejection_sampler.RejectionSampler.forward, "rejection_sample("),
             (rejection_sampler.rejection_sample, "backend.rejection_random_sample("),
             (ReferenceRejectionBackend.rejection_random_sample, "accept_or_recover(")]
    assert all(call in inspect.getsource(f) for f, call in chain)
    gen = torch.Generator().manual_seed(3)
    p = torch.softmax(torch.randn(K + 1, VOCAB, generator=gen), -1)
    q = torch.softmax(1.5 * torch.randn(K, VOCAB, generator=gen), -1)
    drafts = torch.stack([torch.multinomial(q[j], N, replacement=True, generator=gen)
                          for j in range(K)], dim=1).tolist()
    bonus = torch.multinomial(p[K], N, replacement=True, generator=gen).view(N, 1)
    counts = []
    for backend in ("reference", "torch"):
        rows = _batch(backend, drafts, q.repeat(N, 1), p, bonus, 1.0)
        counts.append(_outcome_counts([[t for t in r if t != PLACEHOLDER_TOKEN_ID] for r in rows]))
    table = np.stack([c.reshape(-1) for c in counts])
    assert chi2_contingency(table[:, table.sum(0) > 0]).pvalue > 1e-3
    # Greedy rows and -1 placeholders take the same path in every backend: equal ids.
    drafts = [[1, 2], [-1, 3], [4, -1]]
    bonus = torch.tensor([[5], [5], [5]])
    assert _batch("reference", drafts, None, p, bonus, 0) == _batch("torch", drafts, None, p, bonus, 0)
    placeholder_rows = _batch("reference", drafts, None, p, bonus, 1.0)
    # -1 is always rejected: no bonus ever follows it
    assert placeholder_rows[1][1:] == [PLACEHOLDER_TOKEN_ID] * 2
    assert placeholder_rows[2][2] == PLACEHOLDER_TOKEN_ID


def test_reference_backend_is_chosen_by_the_environment(monkeypatch):
    monkeypatch.setenv("MINIVLLM_REJECTION_SAMPLER", "reference")
    assert RejectionSampler().backend == "reference"
    monkeypatch.setenv("MINIVLLM_REJECTION_SAMPLER", "nope")
    with pytest.raises(ValueError, match="MINIVLLM_REJECTION_SAMPLER"):
        RejectionSampler()
    monkeypatch.delenv("MINIVLLM_REJECTION_SAMPLER")
    assert RejectionSampler().backend in ("torch", "triton")


def test_reference_rule_rejects_a_draft_its_drafter_gave_probability_zero():
    """vLLM's kernel accepts iff ``draft_prob > 0 and target_prob / draft_prob >= uniform``: a
    draft with ``p_draft(x) = 0`` is rejected even where ``p_target(x) >= p_draft(x)``."""
    target = torch.tensor([[0.5, 0.3, 0.2]])
    draft = torch.tensor([[0.0, 0.6, 0.4]])               # token 0 drafted with probability 0
    accepted, recovered = accept_or_recover([0], draft, target, [0.0])
    assert accepted == [] and recovered == 0              # residual max(p_t - p_d, 0) = [0.5, 0, 0]


def test_reference_rule_equality_accepts():
    """``p_target(x) == p_draft(x)`` accepts whatever the uniform; the ratio equal to the uniform
    accepts too (``>=``, as vLLM's kernel)."""
    target = torch.tensor([[0.25, 0.5, 0.25]])
    draft = torch.tensor([[0.25, 0.5, 0.25]])
    assert accept_or_recover([1], draft, target, [0.999999]) == ([1], None)
    half = torch.tensor([[0.5, 0.25, 0.25]])             # p_target(1) / p_draft(1) = 0.5
    assert accept_or_recover([1], draft, half, [0.5]) == ([1], None)
    assert accept_or_recover([1], draft, half, [0.5000001])[0] == []
    one_hot = accept_or_recover([2], None, target, [0.25])   # p_draft = 1: accepted iff p_t >= u
    assert one_hot == ([2], None)
