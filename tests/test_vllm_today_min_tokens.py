"""``min_tokens`` masks EOS and stop token ids in the logits until the request has ``min_tokens``
output tokens, on plain sampling, on every draft position during verification and on the bonus
token (vLLM's MinTokensLogitsProcessor and ``apply_with_spec_decode``); a stop check alone would
let the stop token into the output."""
from __future__ import annotations

import pytest
import torch

from conftest import generate_tokens, tiny_llm
from minivllm import SamplingParams
from minivllm.request import Request
from minivllm.sample.metadata import SamplingMetadata
from minivllm.sample.rejection_sampler import RejectionSampler
from minivllm.sample.sampler import Sampler
from minivllm.spec_decode.metadata import SpecDecodeMetadata

pytestmark = pytest.mark.usefixtures("one_thread")
STOP, EOS, V = 5, 7, 16


def _params(temperature, min_tokens, seed=None):
    p = SamplingParams(temperature=temperature, min_tokens=min_tokens, max_tokens=20,
                       stop_token_ids=[STOP], seed=seed)
    Request("r", [1, 2], p, eos_token_id=EOS)   # what the engine does: the request sets the EOS id
    return p


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_drafts_of_stop_tokens_are_rejected_before_min_tokens(backend, temperature):
    """Request 0 has 1 output token and min_tokens=4: its drafts sit at output positions 1..4, the
    stop tokens at 2 and 3 are masked. Request 1 has no min_tokens: its stop drafts are accepted."""
    drafts = [[3, STOP, EOS, STOP], [STOP, EOS]]
    logits = torch.full((6, V), -20.0)
    logits[0, 3] = 10.0          # request 0, draft 0 (output position 1): token 3 is fine
    logits[1, STOP] = 10.0       # draft 1 (position 2): STOP would be the target's pick
    logits[2, EOS] = 10.0
    logits[3, STOP] = 10.0
    logits[4, STOP], logits[5, EOS] = 10.0, 10.0
    for row in range(6):
        logits[row, 9] = 5.0     # the best token once a stop token is masked
    params = [_params(temperature, 4, seed=1), _params(temperature, 0, seed=2)]
    sm = SamplingMetadata.from_params(params, num_output_tokens=[1, 3])
    md = SpecDecodeMetadata.make_dummy(drafts)
    bonus = torch.zeros(2, 1, dtype=torch.int32)
    out = RejectionSampler.parse_output(
        RejectionSampler(backend)(md, None, logits, bonus, sm), V)
    # Request 0: output positions 1, 2, 3, 4 for drafts 0..3; min_tokens=4 masks positions 1..3.
    assert out[0] == [3, 9]                     # STOP at position 2 rejected, 9 recovered
    assert out[1] == [STOP, EOS, 0]             # no min_tokens: both accepted, then the bonus


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_sampler_and_bonus_rows_mask_until_min_tokens(temperature):
    logits = torch.full((3, V), -20.0)
    logits[:, EOS] = 10.0
    logits[:, 9] = 5.0
    params = [_params(temperature, 3, seed=i) for i in range(3)]
    sm = SamplingMetadata.from_params(params, num_output_tokens=[0, 2, 3])
    assert Sampler()(logits, sm).tolist() == [9, 9, EOS]
    # Bonus rows after 1, 0 and 0 accepted-or-not drafts: positions 1, 2, 3.
    sm = SamplingMetadata.from_params(params, num_output_tokens=[0, 2, 3])
    assert Sampler()(logits, sm, num_draft_tokens=[3, 0, 0]).tolist() == [EOS, 9, EOS]


@pytest.mark.parametrize("spec", [None, {"method": "ngram", "num_speculative_tokens": 3,
                                         "prompt_lookup_min": 1, "prompt_lookup_max": 3}],
                         ids=["plain", "ngram"])
def test_engine_output_has_no_stop_token_before_min_tokens(tiny_llama_dir, spec):
    """The tiny model's greedy output contains token X at position f; with stop_token_ids=[X] and
    min_tokens > f, X cannot appear before min_tokens, and the output equals plain decoding's."""
    prompt = [3, 17, 29, 3, 17, 29, 3, 17]
    ref = generate_tokens(tiny_llm(tiny_llama_dir), [prompt],
                          SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))[0]
    x = ref[1]
    params = SamplingParams(temperature=0, max_tokens=16, min_tokens=10, stop_token_ids=[x],
                            ignore_eos=True)
    plain = generate_tokens(tiny_llm(tiny_llama_dir), [prompt], params)[0]
    out = generate_tokens(tiny_llm(tiny_llama_dir, spec), [prompt], params)[0]
    assert x not in out[:10], out
    assert len(out) >= 10
    assert out == plain
