"""The server honours the sampling fields, through the real ``openai`` client against a real
``python -m minivllm.serve`` process: penalties, logit_bias, min_p, repetition_penalty change the
answer exactly as ``LLM.generate`` with the same SamplingParams; logprobs in OpenAI's completion and
chat shapes; a list of prompts gives one choice per prompt; ``echo``, streamed or not, puts the
prompt (and its logprobs) first; out-of-range values are 400s naming the field. The same fields
under speculative decoding: test_serve_sampling_spec.py."""
from __future__ import annotations

import openai
import pytest

from server_utils import sampling_fixtures

PROMPT = "The capital of France is"
_pair, server, client, llm = sampling_fixtures("serve_sampling", [])


def _offline(llm, **kw):
    from minivllm import SamplingParams
    params = SamplingParams(**{"temperature": 0, "max_tokens": 10, **kw})
    return llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0]


# A bias makes token 100 repeat; each penalty then turns it away sooner or later.
BIAS = {"100": 4.0}


@pytest.mark.parametrize("kw,extra", [
    (dict(frequency_penalty=1.5), {}), (dict(presence_penalty=2.0), {}),
    ({}, dict(repetition_penalty=1.8)),
])
def test_penalties_are_honoured(client, llm, kw, extra):
    got = client.completions.create(model="smol", prompt=PROMPT, max_tokens=10, temperature=0,
                                    logit_bias=BIAS, extra_body=extra, **kw).choices[0].text
    bias = {100: 4.0}
    assert got == _offline(llm, logit_bias=bias, **kw, **extra).text
    assert got != _offline(llm, logit_bias=bias).text        # the field changes the answer
    assert _offline(llm, logit_bias=bias).text != _offline(llm).text


def test_min_p_is_honoured(client, llm):
    """min_p acts on random rows: a seeded draw with and without it."""
    kw = dict(temperature=1.5, seed=3)
    got = [client.completions.create(model="smol", prompt=PROMPT, max_tokens=10, extra_body={"min_p": m},
                                     **kw).choices[0].text for m in (0.0, 0.3)]
    assert got == [_offline(llm, min_p=m, **kw).text for m in (0.0, 0.3)]
    assert got[0] != got[1]


def test_completion_logprobs_shape(client, llm):
    r = client.completions.create(model="smol", prompt=PROMPT, max_tokens=6, temperature=0,
                                  logprobs=3)
    lp = r.choices[0].logprobs
    want = _offline(llm, logprobs=3)
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert "".join(lp.tokens) == r.choices[0].text
    for got, pos, tok in zip(lp.token_logprobs, want.logprobs, want.token_ids):
        assert got == pytest.approx(pos[tok].logprob, abs=1e-4) and got <= 0
    assert all(3 <= len(t) <= 4 for t in lp.top_logprobs)
    assert lp.text_offset[0] == 0


def test_chat_logprobs_shape(client):
    r = client.chat.completions.create(model="smol", messages=[{"role": "user", "content": "Hi"}],
                                       max_tokens=5, temperature=0, logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob >= -9999
        assert bytes(entry.bytes).decode("utf-8", errors="replace") == entry.token


def test_list_of_prompts_gives_one_choice_each(client, llm):
    prompts = [PROMPT, "Once upon a time"]
    r = client.completions.create(model="smol", prompt=prompts, max_tokens=5, temperature=0)
    assert [c.index for c in r.choices] == [0, 1]
    from minivllm import SamplingParams
    want = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)
    assert [c.text for c in r.choices] == [w.outputs[0].text for w in want]
    assert r.usage.completion_tokens == 10


@pytest.mark.parametrize("kw,field", [
    (dict(frequency_penalty=3.0), "frequency_penalty"), (dict(presence_penalty=-2.5), "presence_penalty"),
    (dict(logit_bias={"999999": 1.0}), "logit_bias"), (dict(logprobs=50), "logprobs"),
    (dict(extra_body={"min_p": 1.5}), "min_p"), (dict(extra_body={"repetition_penalty": 0}), "repetition_penalty"),
])
def test_out_of_range_is_400_naming_the_field(client, kw, field):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="smol", prompt=PROMPT, max_tokens=3, **kw)
    assert field in str(e.value)


def test_n_gives_n_choices(client, llm):
    from minivllm import SamplingParams
    r = client.completions.create(model="smol", prompt=[PROMPT, "Once upon a time"], max_tokens=5,
                                  temperature=1.0, seed=7, n=2)
    want = llm.generate([PROMPT, "Once upon a time"],
                        SamplingParams(n=2, temperature=1.0, seed=7, max_tokens=5), use_tqdm=False)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert [c.text for c in r.choices] == [c.text for w in want for c in w.outputs]
    assert r.choices[0].text != r.choices[1].text and r.usage.completion_tokens == 20
    msgs = [{"role": "user", "content": "Hi"}]
    chat = client.chat.completions.create(model="smol", messages=msgs, max_tokens=4,
                                          temperature=1.0, seed=1, n=3)
    assert [c.index for c in chat.choices] == [0, 1, 2]
    # Streamed: each choice's deltas, by index, add up to the non-streamed choice.
    texts, reasons = ["", "", ""], [None] * 3
    for chunk in client.chat.completions.create(model="smol", messages=msgs, max_tokens=4,
                                                temperature=1.0, seed=1, n=3, stream=True):
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            reasons[c.index] = c.finish_reason or reasons[c.index]
    assert texts == [c.message.content for c in chat.choices] and reasons == ["length"] * 3


@pytest.mark.parametrize("kw,field", [
    (dict(n=2, temperature=0.0), "n"), (dict(prompt=[PROMPT, "Hi"], stream=True), "prompt"),
    (dict(extra_body={"top_logprobs": 2}), "top_logprobs"),
])
def test_unsupported_combinations_are_400(client, kw, field):
    with pytest.raises(openai.BadRequestError) as e:
        if field == "top_logprobs":
            client.chat.completions.create(model="smol", messages=[{"role": "user", "content": "Hi"}],
                                           max_tokens=3, **kw)
        else:
            client.completions.create(model="smol", **{"prompt": PROMPT, **kw}, max_tokens=3)
    assert field in str(e.value)


def _streamed_choices(stream) -> dict:
    """{index: (text, tokens, token_logprobs, text_offset, first chunk's text)} from a completion
    stream, each the concatenation of that choice's chunks."""
    got: dict = {}
    for chunk in stream:
        for c in chunk.choices:
            text, toks, lps, offs, first = got.get(c.index, ("", [], [], [], None))
            if c.logprobs is not None:
                toks, lps = toks + c.logprobs.tokens, lps + c.logprobs.token_logprobs
                offs = offs + c.logprobs.text_offset
            got[c.index] = (text + c.text, toks, lps, offs, c.text if first is None else first)
    return got


@pytest.mark.parametrize("kw", [
    dict(prompt=PROMPT, temperature=0, logprobs=2),
    dict(prompt=PROMPT, temperature=1.0, seed=5, n=2),
    dict(prompt=None, temperature=0),         # PROMPT's token ids: echoed as their text
], ids=["logprobs", "n=2", "token-ids"])
def test_streamed_echo_adds_up_to_the_echoed_response(client, llm, kw):
    """echo with stream=true, as vLLM: each choice's first chunk starts with the prompt and, with
    logprobs, the prompt's logprobs (the first prompt token's is null), so the deltas add up to
    the non-streamed echo response: text, tokens, logprobs and text offsets."""
    if kw["prompt"] is None:
        kw = {**kw, "prompt": llm.get_tokenizer().encode(PROMPT, add_special_tokens=False)}
    full = client.completions.create(model="smol", max_tokens=5, echo=True, **kw)
    prompt = kw["prompt"] if isinstance(kw["prompt"], str) else llm.get_tokenizer().decode(kw["prompt"])
    got = _streamed_choices(client.completions.create(model="smol", max_tokens=5, echo=True,
                                                      stream=True, **kw))
    assert sorted(got) == [c.index for c in full.choices] == list(range(kw.get("n", 1)))
    for c in full.choices:
        text, toks, lps, offs, first = got[c.index]
        assert c.text.startswith(prompt) and len(c.text) > len(prompt)
        assert first.startswith(prompt)
        assert text == c.text
        if "logprobs" in kw:
            assert lps[0] is None and c.logprobs.token_logprobs[0] is None
            assert toks == c.logprobs.tokens and offs == c.logprobs.text_offset
            assert lps[1:] == pytest.approx(c.logprobs.token_logprobs[1:], abs=1e-6)
            assert len(toks) == full.usage.prompt_tokens + 5


def test_streamed_logprobs_add_up_to_the_response(client):
    kw = dict(model="smol", prompt=PROMPT, max_tokens=8, temperature=0, logprobs=2)
    full = client.completions.create(**kw).choices[0].logprobs
    tokens, lps = [], []
    for chunk in client.completions.create(**kw, stream=True):
        for c in chunk.choices:
            if c.logprobs is not None:
                tokens += c.logprobs.tokens
                lps += c.logprobs.token_logprobs
    assert tokens == full.tokens and lps == pytest.approx(full.token_logprobs, abs=1e-6)
    msgs = [{"role": "user", "content": "Hi"}]
    chat = dict(model="smol", messages=msgs, max_tokens=6, temperature=0, logprobs=True,
                top_logprobs=1)
    want = [e.token for e in client.chat.completions.create(**chat).choices[0].logprobs.content]
    got = [e.token for chunk in client.chat.completions.create(**chat, stream=True)
           for c in chunk.choices if c.logprobs is not None for e in c.logprobs.content]
    assert got == want


def test_vllm_extras_bad_words_allowed_ids_prompt_logprobs_echo(client, llm):
    base = client.completions.create(model="smol", prompt=PROMPT, max_tokens=6, temperature=0)
    first_word = llm.get_tokenizer().decode(_offline(llm).token_ids[:1]).strip()
    got = client.completions.create(model="smol", prompt=PROMPT, max_tokens=6, temperature=0,
                                    extra_body={"bad_words": [first_word]}).choices[0].text
    assert got == _offline(llm, bad_words=[first_word], max_tokens=6).text != base.choices[0].text
    allowed = [100, 200, 300]
    got = client.completions.create(model="smol", prompt=PROMPT, max_tokens=4, temperature=0,
                                    extra_body={"allowed_token_ids": allowed}).choices[0].text
    assert set(llm.get_tokenizer().encode(got, add_special_tokens=False)) <= set(allowed)
    r = client.completions.create(model="smol", prompt=PROMPT, max_tokens=3, temperature=0,
                                  extra_body={"prompt_logprobs": 1})
    pl = r.choices[0].model_extra["prompt_logprobs"]
    want = llm.generate([PROMPT], __import__("minivllm").SamplingParams(
        temperature=0, max_tokens=3, prompt_logprobs=1), use_tqdm=False)[0].prompt_logprobs
    assert pl[0] is None and len(pl) == len(want) == r.usage.prompt_tokens
    for got_pos, want_pos in zip(pl[1:], want[1:]):
        assert {int(t): v["logprob"] for t, v in got_pos.items()} == pytest.approx(
            {t: lp.logprob for t, lp in want_pos.items()}, abs=1e-4)
    e = client.completions.create(model="smol", prompt=PROMPT, max_tokens=3, temperature=0,
                                  echo=True, logprobs=1).choices[0]
    assert e.text == PROMPT + base.choices[0].text[:len(e.text) - len(PROMPT)]
    assert e.logprobs.token_logprobs[0] is None
    assert len(e.logprobs.tokens) == r.usage.prompt_tokens + 3
    assert "".join(e.logprobs.tokens) == e.text


# ---------------------------------------------------------------- no documented field is ignored
def _post(server, route: str, body: dict):
    """(status, the answer without its id and timestamp) of one raw request; a stream's answer is
    its events' text with ids and timestamps blanked."""
    import json
    import re

    import httpx
    r = httpx.post(f"{server}/v1/{route}", json=body, timeout=120)
    if r.status_code != 200 or not body.get("stream"):
        data = r.json()
        if isinstance(data, dict):
            data.pop("id", None), data.pop("created", None)
        return r.status_code, json.dumps(data, sort_keys=True)
    return 200, re.sub(r'"(id|created)": ?("[^"]*"|\d+)', "", r.text)


def _bannable_word(tokenizer, ids: list[int]) -> str:
    """A word that bans one of the greedy answer's tokens by vLLM's rule: its text, spaces
    stripped, tokenises to that token alone (a word whose stripped form splits into more tokens
    bans only that longer sequence)."""
    for t in ids:
        word = tokenizer.decode([t]).strip()
        if word and tokenizer.encode(word, add_special_tokens=False) == [t]:
            return word
    raise AssertionError(f"no single-token word among {ids}")


def _common_cases(llm, prompt: str) -> dict:
    """Per request field: (the base request's extra fields, the same with the field set). Each
    pair is chosen so that a server that dropped the field would give the same answer twice; the
    stops and bad words come from the greedy answer to ``prompt`` (as the server renders it)."""
    from minivllm import SamplingParams
    greedy = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8),
                          use_tqdm=False)[0].outputs[0]
    ids, text = list(greedy.token_ids), greedy.text
    eos = llm.get_tokenizer().eos_token_id
    rand = {"temperature": 1.0, "seed": 3}
    biased = {"logit_bias": BIAS}
    common = {
        "model": ({}, {"model": "another-model"}),
        "temperature": ({}, {"temperature": 1.5, "seed": 1}),
        "top_p": (rand, {**rand, "top_p": 0.05}),
        "top_k": (rand, {**rand, "top_k": 1}),
        "min_tokens": ({"stop_token_ids": [ids[1]]}, {"stop_token_ids": [ids[1]], "min_tokens": 5}),
        "seed": ({"temperature": 1.0, "seed": 1}, {"temperature": 1.0, "seed": 2}),
        "stop": ({}, {"stop": [text[2:5]]}),
        "stop_token_ids": ({}, {"stop_token_ids": [ids[1]]}),
        "ignore_eos": ({"logit_bias": {str(eos): 100}}, {"logit_bias": {str(eos): 100}, "ignore_eos": True}),
        "include_stop_str_in_output": ({"stop": [text[2:5]]},
                                       {"stop": [text[2:5]], "include_stop_str_in_output": True}),
        "n": (rand, {**rand, "n": 2}),
        "presence_penalty": (biased, {**biased, "presence_penalty": 2.0}),
        "frequency_penalty": (biased, {**biased, "frequency_penalty": 1.5}),
        "repetition_penalty": (biased, {**biased, "repetition_penalty": 1.8}),
        "min_p": (rand, {**rand, "min_p": 0.5}),
        "logit_bias": ({}, {"logit_bias": {"100": 100.0}}),
        "bad_words": ({}, {"bad_words": [_bannable_word(llm.get_tokenizer(), ids)]}),
        "allowed_token_ids": ({}, {"allowed_token_ids": [5, 6]}),
        "prompt_logprobs": ({}, {"prompt_logprobs": 1}),
        "stream": ({}, {"stream": True}),
        "stream_options": ({"stream": True}, {"stream": True, "stream_options": {"include_usage": True}}),
        "max_tokens": ({}, {"max_tokens": 2}),
    }
    return common


def _field_cases(llm):
    chat_prompt = llm.get_tokenizer().apply_chat_template(
        [{"role": "user", "content": PROMPT}], add_generation_prompt=True, tokenize=False)
    common = _common_cases(llm, PROMPT)
    completion = {**common, "prompt": ({}, {"prompt": "Once upon a time"}),
                  "echo": ({}, {"echo": True}), "logprobs": ({}, {"logprobs": 2})}
    chat = {**_common_cases(llm, chat_prompt), "messages": ({}, {"messages": [{"role": "user", "content": "Hi there"}]}),
            "max_completion_tokens": ({}, {"max_completion_tokens": 2}),
            "add_generation_prompt": ({}, {"add_generation_prompt": False}),
            "logprobs": ({}, {"logprobs": True}),
            "top_logprobs": ({"logprobs": True}, {"logprobs": True, "top_logprobs": 3})}
    return completion, chat


# Fields whose effect needs more than one server, tested where they act.
EXEMPT = {"kv_transfer_params": "P/D only: the proxy hands P's params to D (tests/test_disagg.py); "
                                "a server without a KV connector ignores them, as vLLM's does"}


def test_every_documented_field_changes_the_answer_or_is_refused(server, llm):
    """No field the request models document (and /openapi.json publishes) is silently ignored: each,
    set to a value other than its default, changes the answer or is a 4xx. A new field without a
    case here fails the test."""
    from minivllm.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
    completion, chat = _field_cases(llm)
    assert set(completion) | set(EXEMPT) == set(CompletionRequest.model_fields)
    assert set(chat) | set(EXEMPT) == set(ChatCompletionRequest.model_fields)
    base_bodies = {"completions": {"model": "smol", "prompt": PROMPT, "max_tokens": 8, "temperature": 0},
                   "chat/completions": {"model": "smol", "max_tokens": 8, "temperature": 0,
                                        "messages": [{"role": "user", "content": PROMPT}]}}
    ignored = []
    for route, cases in (("completions", completion), ("chat/completions", chat)):
        for field, (base, changed) in cases.items():
            status0, before = _post(server, route, {**base_bodies[route], **base})
            assert status0 == 200, (route, field, before)
            status, after = _post(server, route, {**base_bodies[route], **changed})
            if status == 200 and after == before:
                ignored.append(f"{route}: {field}")
    assert not ignored, f"fields that changed nothing: {ignored}"
