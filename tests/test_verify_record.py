"""The verification record's penalty fields (minivllm/sample/verify_record.py): the penalty the
rejection sampler applied at each draft position, the earlier drafts counted as outputs, and the
decision it would have made had the drafts been ignored (only the committed outputs counted)."""
import math

import torch

from minivllm.sample.metadata import SamplingMetadata
from minivllm.sample.rejection_sampler import RejectionSampler
from minivllm.sampling_params import SamplingParams
from minivllm.spec_decode.metadata import SpecDecodeMetadata

A, B, C = 2, 5, 7
VOCAB = 10


def _verify(params, drafts, logits, outputs, prompts=None):
    """One recorded verify of ``drafts`` (per request) against ``logits`` ``[num_drafts, VOCAB]``."""
    sampler = RejectionSampler("torch")
    sampler.record = True
    md = SamplingMetadata.from_params(params, output_token_ids=outputs,
                                      prompt_token_ids=prompts or [[] for _ in params],
                                      spec_token_ids=drafts)
    out = sampler(SpecDecodeMetadata.make_dummy(drafts), None, logits,
                  torch.zeros(len(drafts), 1, dtype=torch.int32), md)
    return out, sampler.last_record


def test_counting_the_drafts_flips_a_greedy_decision():
    """Greedy, frequency_penalty 1, one committed output A, drafts [A, A, C]. Raw, A leads B by 1.5
    at each position. Draft 0 sees A once (penalty -1: A still leads, accepted); draft 1 sees A twice
    (the committed one and draft 0: penalty -2, B overtakes, rejected, B emitted). Had the drafts
    been ignored, draft 1 would have seen A once and been accepted."""
    logits = torch.zeros(3, VOCAB)
    logits[:2, A], logits[:2, B] = 3.0, 1.5
    logits[2, C] = 4.0
    params = [SamplingParams(temperature=0.0, frequency_penalty=1.0)]
    out, record = _verify(params, [[A, A, C]], logits, [[A]])
    assert out.tolist() == [[A, B, -1, -1]]
    (positions,) = record
    assert [p["kind"] for p in positions] == ["accepted", "recovered"]
    assert [p["penalty"] for p in positions] == [-1.0, -2.0]
    assert [p["penalty_drafts_ignored"] for p in positions] == [-1.0, -1.0]
    assert [p["accepted"] for p in positions] == [True, False]
    assert [p["accepted_if_drafts_ignored"] for p in positions] == [True, True]
    assert [(p["target_argmax"], p["target_argmax_drafts_ignored"]) for p in positions] == [(A, A), (B, A)]
    # p_target_drafts_ignored: the softmax of the logits with only the committed A counted.
    ignored = logits[1].clone()
    ignored[A] -= 1.0
    assert math.isclose(positions[1]["p_target_drafts_ignored"], ignored.softmax(-1)[A].item(),
                        rel_tol=1e-6)
    assert positions[1]["p_target_drafts_ignored"] > positions[1]["p_target"]


def test_a_request_without_processors_has_zero_penalty_and_the_same_decision():
    logits = torch.zeros(2, VOCAB)
    logits[0, A], logits[1, B] = 2.0, 2.0
    _, (positions,) = _verify([SamplingParams(temperature=0.0)], [[A, A]], logits, [[A]])
    assert [p["penalty"] for p in positions] == [0.0, 0.0]
    assert [p["accepted"] for p in positions] == [p["accepted_if_drafts_ignored"] for p in positions]
    assert [p["accepted"] for p in positions] == [True, False]


def test_random_rows_and_bad_words_use_the_same_uniform_and_rule():
    """Random row, bad word "A C": draft 1 (C) follows draft 0 (A), so counting the drafts masks C
    there (penalty -inf, p_target 0, rejected whatever the uniform); ignoring them leaves C as it
    is, and it would have been accepted. The drafts-ignored decision uses the recorded uniform with
    the one-hot rule u <= p_target. In a second request presence_penalty counts draft 0 at draft 1
    only when the drafts are counted (its committed output is another token)."""
    logits = torch.zeros(4, VOCAB)
    logits[0, A] = logits[1, C] = 20.0   # p_target ~ 1: accepted unless masked
    logits[2:, B] = 20.0
    p0 = SamplingParams(temperature=1.0, seed=3)
    p0._bad_words_token_ids = [[A, C]]   # what update_from_tokenizer makes of a two-token word
    p1 = SamplingParams(temperature=1.0, seed=4, presence_penalty=0.5)
    _, (first, second) = _verify([p0, p1], [[A, C], [B, B]], logits, [[], [C]])
    assert first[1]["draft_token_id"] == C
    assert first[1]["penalty"] == -math.inf and first[1]["p_target"] == 0.0
    assert first[1]["accepted"] is False and first[1]["kind"] == "recovered"
    assert first[1]["penalty_drafts_ignored"] == 0.0
    p_ignored = torch.softmax(logits[1], -1)[C].item()
    assert math.isclose(first[1]["p_target_drafts_ignored"], p_ignored, rel_tol=1e-6)
    assert first[1]["accepted_if_drafts_ignored"] == (first[1]["uniform"] <= p_ignored) == True
    # Request 2: presence counts B from draft 0 on at draft 1 only; the committed C is no draft.
    assert [p["penalty"] for p in second[:2]] == [0.0, -0.5]
    assert [p["penalty_drafts_ignored"] for p in second[:2]] == [0.0, 0.0]
    for p in second:
        if p["kind"] != "bonus":
            assert p["accepted"] == (p["uniform"] <= p["p_target"])
            assert p["accepted_if_drafts_ignored"] == (p["uniform"] <= p["p_target_drafts_ignored"])
