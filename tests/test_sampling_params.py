"""SamplingParams with vLLM 0.32's sampling fields: names, defaults, ranges (a ValueError naming the
field), and bad_words tokenised as vLLM's update_from_tokenizer does."""
import pytest

from minivllm.sampling_params import SamplingParams


def test_defaults_are_vllms():
    p = SamplingParams()
    assert (p.n, p.presence_penalty, p.frequency_penalty, p.repetition_penalty, p.min_p) == (
        1, 0.0, 0.0, 1.0, 0.0)
    assert p.logprobs is None and p.prompt_logprobs is None and p.logit_bias is None
    assert p.allowed_token_ids is None and p.bad_words == [] and p.no_penalties


@pytest.mark.parametrize("field,value", [
    ("presence_penalty", 2.5), ("presence_penalty", -2.1), ("frequency_penalty", 3.0),
    ("frequency_penalty", -2.5), ("repetition_penalty", 0.0), ("repetition_penalty", float("inf")),
    ("min_p", 1.5), ("min_p", -0.1), ("logprobs", -2), ("prompt_logprobs", -5), ("n", 0),
    ("allowed_token_ids", []), ("bad_words", [""]), ("logit_bias", {"x": 1.0}),
])
def test_out_of_range_is_a_value_error_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_edges_are_allowed_and_json_keys_convert():
    SamplingParams(presence_penalty=-2.0, frequency_penalty=2.0, min_p=1.0, logprobs=-1,
                   prompt_logprobs=0, repetition_penalty=0.01)
    assert SamplingParams(logit_bias={"7": 3}).logit_bias == {7: 3.0}
    with pytest.raises(ValueError, match="n must be 1 when using greedy sampling"):
        SamplingParams(n=2, temperature=0.0)
    assert not SamplingParams(frequency_penalty=0.1).no_penalties


def test_verify_for_model_checks_token_ids():
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={300: 1.0}).verify_for_model(256)
    with pytest.raises(ValueError, match="allowed_token_ids"):
        SamplingParams(allowed_token_ids=[1, 256]).verify_for_model(256)
    with pytest.raises(ValueError, match="bad_words"):
        SamplingParams(bad_words=["x"]).verify_for_model(256, tokenizer=None)


def test_bad_words_tokenised_as_vllm(smollm2_dir):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    words = ["hello", " world", "unbelievable"]
    p = SamplingParams(bad_words=words)
    p.verify_for_model(tok.vocab_size + len(tok.get_added_vocab()), tok)
    want = []
    for w in words:   # vLLM's rule, written out
        plain = tok.encode(w.lstrip(), add_special_tokens=False)
        spaced = tok.encode(" " + w.lstrip(), add_special_tokens=False)
        want.append(plain)
        if spaced[0] != plain[0] and len(spaced) == len(plain):
            want.append(spaced)
    assert p.bad_words_token_ids == want
    assert any(len(ids) > 1 for ids in want)      # a multi-token word is among them
