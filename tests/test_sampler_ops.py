"""The sampler's logits operations against direct torch computations of vLLM 0.32's formulas, their
order in ``Sampler``, and the rejection sampler applying them at every draft position with the
earlier drafts counted as outputs (torch reference and Triton, interpreted on a CPU)."""
import pytest
import torch

from minivllm.sample.ops import drafts as draft_rows
from minivllm.sample import sampler as S
from minivllm.sample.ops import processors
from minivllm.sample.metadata import SamplingMetadata
from minivllm.sample.ops.bad_words import apply_bad_words
from minivllm.sample.ops.builtin import apply_min_p
from minivllm.sample.ops.penalties import apply_all_penalties
from minivllm.sample.rejection_sampler import RejectionSampler
from minivllm.sample.sampler import Sampler, apply_logits_processors
from minivllm.sampling_params import SamplingParams
from minivllm.spec_decode.metadata import SpecDecodeMetadata

NEG_INF = float("-inf")


def _vllm_penalties(logits, prompt, output, presence, frequency, repetition):
    """vLLM's apply_penalties, written out one row and one token at a time."""
    out = logits.clone()
    for i in range(out.shape[0]):
        for v in range(out.shape[1]):
            count = output[i].count(v)
            if v in prompt[i] or count:
                out[i, v] = out[i, v] / repetition[i] if out[i, v] > 0 else out[i, v] * repetition[i]
            out[i, v] -= frequency[i] * count + presence[i] * (count > 0)
    return out


def test_penalties_equal_vllm_formula():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 11, generator=gen) * 3
    prompt, output = [[1, 2, 2], [], [4]], [[2, 3, 3, 3], [0, 10], [-1, 5]]
    pres, freq, rep = [0.5, -1.0, 2.0], [0.3, 2.0, -0.7], [1.5, 0.8, 1.0]
    got = apply_all_penalties(logits.clone(), prompt, torch.tensor(pres), torch.tensor(freq),
                              torch.tensor(rep), output)
    want = _vllm_penalties(logits, prompt, [[t for t in o if t >= 0] for o in output], pres, freq, rep)
    torch.testing.assert_close(got, want)
    # Presence and frequency count the output only; repetition the prompt too.
    assert got[0, 1] == logits[0, 1] / 1.5 if logits[0, 1] > 0 else logits[0, 1] * 1.5


def test_bad_words_single_and_multi_token():
    logits = torch.zeros(3, 8)
    words = {0: [[3], [1, 2, 5]], 1: [[1, 2, 5]], 2: [[6, 7]]}
    apply_bad_words(logits, words, [[4, 1, 2], [1, 2, 9], []])
    assert logits[0].tolist() == [0, 0, 0, NEG_INF, 0, NEG_INF, 0, 0]
    assert logits[1].eq(0).all() and logits[2].eq(0).all()   # prefix not output: not masked


def test_min_p_equals_vllm_formula():
    logits = torch.tensor([[2.0, 1.0, 0.0, -3.0], [0.0, 0.0, 0.0, 0.0]])
    got = apply_min_p(logits.clone(), torch.tensor([0.3, 0.9]))
    probs = logits.softmax(-1)
    keep = probs >= probs.max(-1, keepdim=True).values * torch.tensor([[0.3], [0.9]])
    assert torch.equal(torch.isfinite(got), keep) and keep[0].tolist() == [True, True, False, False]


def test_logits_processors_run_in_vllm_order():
    """allowed mask -> bad words -> min_tokens -> logit bias -> penalties (bias before the
    multiplicative repetition penalty: the order shows in the numbers)."""
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 9, generator=gen)
    params = [SamplingParams(temperature=0.0, repetition_penalty=2.0, frequency_penalty=0.5,
                             logit_bias={3: 1.5, 4: -0.5}, allowed_token_ids=[1, 3, 4, 6]),
              SamplingParams(temperature=0.0, presence_penalty=1.0, min_tokens=4)]
    params[1]._bad_words_token_ids = [[2], [7, 8]]
    params[1]._eos_token_id = 0
    prompt, output = [[3, 5], [8]], [[4, 4], [7]]
    md = SamplingMetadata.from_params(params, prompt_token_ids=prompt, output_token_ids=output)
    got = apply_logits_processors(logits.clone(), md)
    want = logits.clone()
    allowed = torch.full((9,), NEG_INF)
    allowed[[1, 3, 4, 6]] = 0
    want[0] += allowed
    want[1, [2, 8, 0]] = NEG_INF       # bad words [2], [7, 8] after 7; min_tokens masks EOS 0
    want[0, 3] += 1.5
    want[0, 4] -= 0.5
    want = _vllm_penalties(want, prompt, output, [0.0, 1.0], [0.5, 0.0], [2.0, 1.0])
    torch.testing.assert_close(got, want)
    assert Sampler()(logits, md).tolist() == want.argmax(-1).tolist()


def _sequential_greedy(target_logits, drafts, params, prompt, output):
    """What plain decoding picks at each draft position, one position at a time: the reference."""
    picks, row = [], 0
    for i, d in enumerate(drafts):
        out, mine = list(output[i]), []
        for j in range(len(d)):
            md = SamplingMetadata.from_params([params[i]], prompt_token_ids=[prompt[i]],
                                              output_token_ids=[out])
            tok = Sampler()(target_logits[row:row + 1], md).item()
            mine.append(tok)
            row += 1
            if tok != d[j]:
                row += len(d) - j - 1
                break
            out.append(d[j])
        picks.append(mine)
    return picks


def _penalised_case():
    """Drafts that the target accepts only when each earlier draft counts as an output."""
    vocab = 12
    drafts = [[5, 5, 5, 5], [7, 8, 9], [3]]
    params = [SamplingParams(temperature=0.0, frequency_penalty=1.0),
              SamplingParams(temperature=0.0, presence_penalty=2.0, logit_bias={9: 1.0}),
              SamplingParams(temperature=0.0, repetition_penalty=1.5, allowed_token_ids=[2, 3])]
    params[1]._bad_words_token_ids = [[8, 10]]
    n = sum(map(len, drafts))
    logits = torch.zeros(n, vocab)
    logits[0:4, 5] = 3.0
    logits[0:4, 6] = torch.tensor([2.5, 1.5, 0.5, 2.5])    # 5 loses to 6 once counted 1-3 times
    logits[4:7, [7, 8, 9]] = 2.0
    logits[4, 7] = 3.0
    logits[5, 8] = 3.0
    logits[6, 10] = 3.5                                    # masked after [.., 8] as a bad word
    logits[7, 3] = 1.0
    return drafts, params, logits, [[1], [2], [3]], [[0], [1], []]


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_rejection_sampler_counts_earlier_drafts_as_outputs(backend):
    drafts, params, logits, prompt, output = _penalised_case()
    md = SamplingMetadata.from_params(params, prompt_token_ids=prompt, output_token_ids=output,
                                      spec_token_ids=drafts)
    spec = SpecDecodeMetadata.make_dummy(drafts)
    out = RejectionSampler(backend)(spec, None, logits, torch.zeros(3, 1, dtype=torch.int32), md)
    got = [[t for t in row if t >= 0] for row in out.tolist()]
    want = _sequential_greedy(logits, drafts, params, prompt, output)
    for g, w, d in zip(got, want, drafts):
        assert g[:len(w)] == w
    assert got[0] == [5, 5, 5, 6]         # frequency 1.0: the fourth 5 loses to 6
    assert got[1][:3] == [7, 8, 9]        # bad word [8, 10] masks 10 after the draft 8


def test_ignoring_the_drafts_gives_a_different_answer(monkeypatch):
    """The rule the test above checks, broken on purpose: drafts not counted as outputs."""
    drafts, params, logits, prompt, output = _penalised_case()
    md = SamplingMetadata.from_params(params, prompt_token_ids=prompt, output_token_ids=output,
                                      spec_token_ids=drafts)
    spec = SpecDecodeMetadata.make_dummy(drafts)
    monkeypatch.setattr(draft_rows, "combine_outputs_with_spec_tokens",
                        lambda outs, ds: [list(o) for o, d in zip(outs, ds) for _ in d])
    out = RejectionSampler("torch")(spec, None, logits, torch.zeros(3, 1, dtype=torch.int32), md)
    got = [[t for t in row if t >= 0] for row in out.tolist()]
    assert got[0] != [5, 5, 5, 6] and got[1][:3] != [7, 8, 9]


def test_random_rows_torch_equals_triton_with_penalties():
    gen = torch.Generator().manual_seed(3)
    drafts = [[1, 2, 3], [4, 4], [], [5]]
    vocab, n = 29, 6
    params = [SamplingParams(temperature=0.9, frequency_penalty=0.7, min_p=0.05),
              SamplingParams(temperature=1.2, presence_penalty=1.0, logit_bias={4: 2.0}, top_k=8),
              SamplingParams(temperature=0.0),
              SamplingParams(temperature=0.7, repetition_penalty=1.3, allowed_token_ids=[5, 6, 7],
                             seed=11)]
    for trial in range(3):
        logits = torch.randn(n, vocab, generator=gen) * 2
        outs = []
        for backend in ("torch", "triton"):
            md = SamplingMetadata.from_params(params, prompt_token_ids=[[1], [2], [3], [4]],
                                              output_token_ids=[[1, 2], [4], [], [5]],
                                              spec_token_ids=drafts)
            torch.manual_seed(trial)
            outs.append(RejectionSampler(backend)(SpecDecodeMetadata.make_dummy(drafts), None,
                                                  logits, torch.zeros(4, 1, dtype=torch.int32), md))
        assert torch.equal(outs[0], outs[1])
        assert all(t in (5, 6, 7, -1) for t in outs[0][3].tolist()[:1])


def test_bonus_row_counts_all_drafts():
    """vLLM's _combine_outputs_with_spec_tokens for the bonus row: outputs + every draft."""
    params = [SamplingParams(temperature=0.0, frequency_penalty=2.0)]
    md = SamplingMetadata.from_params(params, prompt_token_ids=[[0]], output_token_ids=[[1]],
                                      spec_token_ids=[[2, 2]])
    logits = torch.tensor([[0.0, 0.0, 3.0, 0.5]])
    assert Sampler()(logits, md).item() == 2
    assert Sampler()(logits, md, num_draft_tokens=[2]).item() == 3
    assert processors.combine_outputs_with_spec_tokens([[1]], [[2, 2, 7]], [2]) == [[1, 2, 2]]


def _position_distributions(batch=12000):
    """Random rows with penalties and a bias, drafts [2, 2] (one-hot, as n-gram's): the tokens at
    the first position, and at the second when the first draft was accepted."""
    params = SamplingParams(temperature=1.0, frequency_penalty=0.8, presence_penalty=0.3,
                            logit_bias={3: 1.0})
    l0 = torch.tensor([0.0, 0.5, 2.0, 0.2, -1.0, 0.3, 0.0, 0.1])
    l1 = torch.tensor([0.1, 0.4, 2.2, 0.0, -0.5, 0.6, 0.2, 0.0])
    prompt, output = [1, 2], [2, 5]
    drafts = [[2, 2]] * batch
    md = SamplingMetadata.from_params([params] * batch, prompt_token_ids=[prompt] * batch,
                                      output_token_ids=[output] * batch, spec_token_ids=drafts)
    logits = torch.stack([l0, l1]).repeat(batch, 1)
    torch.manual_seed(0)
    out = RejectionSampler("torch")(SpecDecodeMetadata.make_dummy(drafts), None, logits,
                                    torch.zeros(batch, 1, dtype=torch.int32), md)

    def expected(row, outs):
        one = SamplingMetadata.from_params([params], prompt_token_ids=[prompt],
                                           output_token_ids=[outs])
        return S.compute_probs(row.unsqueeze(0), one)[0].double().numpy()

    first, second = out[:, 0].numpy(), out[:, 1].numpy()
    return (first, expected(l0, output)), (second[first == 2], expected(l1, output + [2]))


def _chi2_p(samples, probs):
    import numpy as np
    from scipy.stats import chisquare
    counts = np.bincount(samples, minlength=len(probs))
    keep = probs > 0
    return chisquare(counts[keep], len(samples) * probs[keep] / probs[keep].sum()).pvalue


def test_random_positions_follow_the_penalised_target():
    """Chi-squared: each position is distributed as plain sampling would draw it, the earlier
    draft counted by the penalties."""
    (first, p0), (second, p1) = _position_distributions()
    assert len(second) > 2000
    assert _chi2_p(first, p0) > 0.01 and _chi2_p(second, p1) > 0.01


def test_random_positions_reject_the_wrong_rule(monkeypatch):
    """The same test finds drafts left uncounted (p < 1e-3)."""
    monkeypatch.setattr(draft_rows, "combine_outputs_with_spec_tokens",
                        lambda outs, ds: [list(o) for o, d in zip(outs, ds) for _ in d])
    (first, p0), (second, p1) = _position_distributions()
    assert _chi2_p(second, p1) < 1e-3
