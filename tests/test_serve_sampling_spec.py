"""The sampling fields over HTTP under speculative decoding: a real ``python -m minivllm.serve`` with
an n-gram ``--speculative-config``, driven by the real ``openai`` client, answers greedy requests
with penalties, logit_bias, bad_words, allowed_token_ids, logprobs / top_logprobs and n exactly as
``LLM.generate`` without speculation (the same tokens; logprobs within 1e-4).

Speculation must actually happen for this to mean anything. The prompt ends in a run of token 100
and the cases bias token 100, so the n-gram drafter proposes runs of it that the target accepts
until a penalty or a mask turns it away; each request checks that the server's draft counter
moved. The requests with ``frequency_penalty`` (its own case, ``logprobs`` and ``n``) are where the
rejection sampler must count the earlier drafts as outputs (``minivllm/sample/ops/drafts.py``):
with them ignored, their answers differ from plain decoding. Each field's value is one that
changes the answer, so a server that dropped the field fails too."""
from __future__ import annotations

import json

import pytest

from server_utils import metric, sampling_fixtures

SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
        "prompt_lookup_min": 1}
RUN = 100                     # the repeated token ("t" in SmolLM2's vocabulary)
BIAS = {str(RUN): 8.0}        # strong enough that the run goes on for a few tokens under a penalty
MAX_TOKENS = 12


_pair, server, client, llm = sampling_fixtures("serve_sampling_spec",
                                                ["--speculative-config", json.dumps(SPEC)])


@pytest.fixture(scope="module")
def prompt_ids(llm) -> list[int]:
    """Some text, then a run of RUN for the n-gram drafter to find."""
    return llm.get_tokenizer().encode("red, green, blue, red, green, blue,",
                                      add_special_tokens=False) + [RUN] * 8


def _offline(llm, prompt, **kw):
    from minivllm import SamplingParams
    params = SamplingParams(**{"temperature": 0, "max_tokens": MAX_TOKENS, **kw})
    if isinstance(prompt, list):
        prompt = {"prompt_token_ids": prompt}
    return llm.generate([prompt], params, use_tqdm=False)[0]


class _Drafts:
    """The server's draft-token and accepted-token counters around one request."""

    def __init__(self, server):
        self.server = server

    def __enter__(self):
        self.before = self._read()
        return self

    def __exit__(self, *exc):
        self.drafted, self.accepted = (a - b for a, b in zip(self._read(), self.before))

    def _read(self):
        return (metric(self.server, "vllm:spec_decode_num_draft_tokens_total"),
                metric(self.server, "vllm:spec_decode_num_accepted_tokens_total"))


def _bannable(llm, token_ids) -> str:
    """A word whose text, spaces stripped, tokenises to one of ``token_ids`` alone (vLLM's rule)."""
    tok = llm.get_tokenizer()
    for t in token_ids:
        word = tok.decode([t]).strip()
        if word and tok.encode(word, add_special_tokens=False) == [t]:
            return word
    raise AssertionError(f"no single-token word among {token_ids}")


# Per field: (request fields, vLLM's extras sent in extra_body). Each biases RUN (or keeps it among
# the allowed ids) so that drafts are proposed, and is chosen so that the field changes the answer.
CASES = {
    "frequency_penalty": (dict(logit_bias=BIAS, frequency_penalty=1.0), {}),
    "presence_penalty": (dict(logit_bias={str(RUN): 4.0}, presence_penalty=2.0), {}),
    "repetition_penalty": (dict(logit_bias={str(RUN): 6.0}), dict(repetition_penalty=2.0)),
    "logit_bias": (dict(logit_bias=BIAS), {}),
    "bad_words": (dict(logit_bias=BIAS), dict(bad_words=None)),    # a word of the answer
    "allowed_token_ids": ({}, dict(allowed_token_ids=[RUN, 200, 300])),
    "logprobs": (dict(logit_bias=BIAS, frequency_penalty=1.0, logprobs=3), {}),
}


def _sampling_kw(kw: dict, extra: dict) -> dict:
    """The SamplingParams of a request's fields (logit_bias keys are strings in JSON)."""
    out = {**kw, **extra}
    if "logit_bias" in out:
        out["logit_bias"] = {int(t): b for t, b in out["logit_bias"].items()}
    return out


@pytest.mark.parametrize("field", list(CASES))
def test_completion_fields_under_speculation_equal_plain_decoding(server, client, llm, prompt_ids,
                                                                  field):
    kw, extra = CASES[field]
    if field == "bad_words":
        answer = _offline(llm, prompt_ids, **_sampling_kw(kw, {})).outputs[0]
        extra = {"bad_words": [_bannable(llm, answer.token_ids)]}
    with _Drafts(server) as drafts:
        r = client.completions.create(model="smol", prompt=prompt_ids, max_tokens=MAX_TOKENS,
                                      temperature=0, extra_body=extra or None, **kw)
    assert drafts.drafted > 0, "the drafter proposed nothing: no speculation to test"
    if field == "frequency_penalty":
        assert drafts.accepted > 0
    got = r.choices[0]
    want = _offline(llm, prompt_ids, **_sampling_kw(kw, extra)).outputs[0]
    assert got.text == want.text and r.usage.completion_tokens == len(want.token_ids)
    if field == "logprobs":
        assert len(got.logprobs.token_logprobs) == len(want.token_ids)
        for lp, top, pos, tok in zip(got.logprobs.token_logprobs, got.logprobs.top_logprobs,
                                     want.logprobs, want.token_ids):
            assert lp == pytest.approx(pos[tok].logprob, abs=1e-4)
            assert sorted(top.values()) == pytest.approx(
                sorted(p.logprob for p in pos.values()), abs=1e-4)
    else:
        # The field changes the answer, so a server that dropped it would have failed above.
        without = {k: v for k, v in _sampling_kw(kw, extra).items() if k != field}
        assert _offline(llm, prompt_ids, **without).outputs[0].token_ids != want.token_ids


def test_n_and_logprobs_under_speculation_equal_plain_decoding(server, client, llm, prompt_ids):
    """n > 1 needs a random row; top_k=1 makes it deterministic (the rejection sampler then
    accepts a draft iff it is the argmax), so both choices must be plain decoding's."""
    kw = dict(temperature=1.0, seed=7, n=2, logprobs=2, frequency_penalty=1.0)
    with _Drafts(server) as drafts:
        r = client.completions.create(model="smol", prompt=prompt_ids, max_tokens=MAX_TOKENS,
                                      logit_bias=BIAS, extra_body={"top_k": 1}, **kw)
    assert drafts.drafted > 0 and drafts.accepted > 0, "no speculation happened"
    want = _offline(llm, prompt_ids, top_k=1, **_sampling_kw({"logit_bias": BIAS, **kw}, {})).outputs
    assert [c.index for c in r.choices] == [0, 1]
    for got, w in zip(r.choices, want):
        assert got.text == w.text
        assert got.logprobs.token_logprobs == pytest.approx(
            [pos[t].logprob for pos, t in zip(w.logprobs, w.token_ids)], abs=1e-4)


def test_chat_top_logprobs_under_speculation_equal_plain_decoding(server, client, llm, prompt_ids):
    tok = llm.get_tokenizer()
    messages = [{"role": "user", "content": tok.decode(prompt_ids)}]
    with _Drafts(server) as drafts:
        r = client.chat.completions.create(model="smol", messages=messages, max_tokens=MAX_TOKENS,
                                           temperature=0, logprobs=True, top_logprobs=2,
                                           frequency_penalty=1.0, logit_bias=BIAS)
    assert drafts.drafted > 0 and drafts.accepted > 0, "no speculation happened"
    rendered = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    want = _offline(llm, rendered, logprobs=2,
                    **_sampling_kw({"logit_bias": BIAS, "frequency_penalty": 1.0}, {})).outputs[0]
    assert r.choices[0].message.content == want.text
    content = r.choices[0].logprobs.content
    assert len(content) == len(want.token_ids)
    for entry, pos, t in zip(content, want.logprobs, want.token_ids):
        assert entry.logprob == pytest.approx(pos[t].logprob, abs=1e-4)
        ranked = sorted((p for p in pos.values() if p.rank <= 2), key=lambda p: p.rank)
        assert [e.logprob for e in entry.top_logprobs] == pytest.approx(
            [p.logprob for p in ranked], abs=1e-4)
