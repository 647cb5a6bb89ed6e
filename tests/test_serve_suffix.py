"""Suffix decoding over HTTP: a real ``python -m minivllm.serve`` with ``--speculative-config
'{"method": "suffix", ...}'``, driven by the real ``openai`` client, answers greedy requests with
the same tokens as ``LLM.generate`` without speculation, and its drafts reach ``/metrics`` under
vLLM's names. The prompt repeats a phrase, so the request's own tree has suffixes to match; the
second identical request also finds the first one's output in the global tree."""
from __future__ import annotations

import json

from server_utils import metric, sampling_fixtures

SPEC = {"method": "suffix", "num_speculative_tokens": 3, "suffix_decoding_min_token_prob": 0.0}
PROMPT = "red, green, blue, red, green, blue, red, green, blue, red, green,"

_pair, server, client, llm = sampling_fixtures("serve_suffix",
                                                ["--speculative-config", json.dumps(SPEC)])


def test_suffix_over_http_equals_plain_greedy_and_drafts(server, client, llm):
    from minivllm import SamplingParams
    ids = llm.get_tokenizer().encode(PROMPT, add_special_tokens=False)
    want = llm.generate([{"prompt_token_ids": ids}],
                        SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0].text
    drafts = [metric(server, "vllm:spec_decode_num_draft_tokens_total")]
    for _ in range(2):
        out = client.completions.create(model="smol", prompt=ids, max_tokens=16, temperature=0,
                                        extra_body={"ignore_eos": True})
        assert out.choices[0].text == want
        drafts.append(metric(server, "vllm:spec_decode_num_draft_tokens_total"))
    assert drafts[1] > drafts[0], "the server made no suffix drafts"
    assert drafts[2] > drafts[1]
