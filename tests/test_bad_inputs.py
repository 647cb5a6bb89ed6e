"""Every bad input gets a ValueError naming the field and what is allowed, before any work starts."""
import pytest

from minivllm import LLM, SamplingParams
import minivllm.model_executor.model_loader as loader


@pytest.mark.parametrize("kwargs,match", [
    (dict(max_tokens=0), "max_tokens must be at least 1"),
    (dict(temperature=-0.1), "temperature must be >= 0"),
    (dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
    (dict(top_p=1.5), r"top_p must be in \(0, 1\]"),
    (dict(top_k=-1), "top_k must be >= 0"),
])
def test_bad_sampling_params(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


@pytest.fixture
def no_weights_loaded(monkeypatch):
    """Fails the test if the engine gets as far as reading weights."""
    def fail(*a, **k):
        raise AssertionError("weights were loaded before the bad argument was reported")
    monkeypatch.setattr(loader, "safetensors_weights_iterator", fail)


@pytest.mark.parametrize("block_size", [0, 3, 24, -16])
def test_block_size_must_be_a_power_of_two(tiny_llama_dir, no_weights_loaded, block_size):
    with pytest.raises(ValueError, match="block_size must be a positive power of two"):
        LLM(model=tiny_llama_dir, skip_tokenizer_init=True, block_size=block_size)


@pytest.mark.parametrize("kwargs,match", [
    (dict(attention_backend="cuda"), "attention_backend must be one of"),
    (dict(dtype="int8"), "dtype must be one of"),
    (dict(max_model_len=100000), "max_model_len=100000 exceeds"),
    (dict(speculative_config={"method": "mtp"}), "speculative_config.method must be one of"),
    # the later methods' options, checked with the article's configuration (config/speculative.py)
    (dict(speculative_config={"method": "draft_model"}), "needs exactly one of 'model'"),
    (dict(speculative_config={"method": "eagle", "draft_num_layers": 1}),
     "draft_num_layers is for method 'draft_model' only"),
    (dict(speculative_config={"method": "ngram", "draft_sample_method": "probabilistic"}),
     "needs method 'eagle', 'eagle3' or 'draft_model', not 'ngram'"),
    (dict(speculative_config={"method": "ngram", "draft_sample_method": "random"}),
     "draft_sample_method must be one of"),
])
def test_bad_engine_arguments(tiny_llama_dir, no_weights_loaded, kwargs, match):
    with pytest.raises(ValueError, match=match):
        LLM(model=tiny_llama_dir, skip_tokenizer_init=True, **kwargs)


def test_missing_model_path(tmp_path, no_weights_loaded):
    with pytest.raises(ValueError, match="does not exist"):
        LLM(model=str(tmp_path / "nowhere"), skip_tokenizer_init=True)


def test_bad_prompts_queue_nothing(tiny_llama_dir):
    llm = LLM(model=tiny_llama_dir, skip_tokenizer_init=True, max_model_len=16)
    good = {"prompt_token_ids": [1, 2, 3]}
    for bad, match in [({"prompt_token_ids": []}, "prompt is empty"),
                       ({"prompt_token_ids": list(range(1, 17))}, "leaves no room under max_model_len=16"),
                       ({"prompt_token_ids": [1, 100000]}, r"must be in \[0, 256\)"),
                       ("text without a tokenizer", "skip_tokenizer_init=True")]:
        with pytest.raises(ValueError, match=match):
            llm.generate([good, bad], SamplingParams(max_tokens=2), use_tqdm=False)
        assert not llm.llm_engine.has_unfinished_requests()   # the good prompt was not queued
    with pytest.raises(ValueError, match="sampling_params has 2 entries for 1 prompts"):
        llm.generate([good], [SamplingParams(), SamplingParams()], use_tqdm=False)


# Every option check runs on every construction, whatever the other fields are: a wrong option is
# refused alone, and beside another option set away from its default.
@pytest.mark.parametrize("kwargs,match", [
    (dict(method="ngram", draft_num_layers=2), "draft_num_layers"),
    (dict(method="ngram", draft_num_layers=2, ngram_match="last"), "draft_num_layers"),
    (dict(method="ngram", ngram_match="middle"), "ngram_match"),
    (dict(method="ngram", draft_sample_method="probabilistic"), "draft_sample_method"),
    (dict(method="ngram", draft_sample_method="nope"), "draft_sample_method"),
])
def test_speculative_options_are_always_checked(kwargs, match):
    from minivllm.config import SpeculativeConfig
    with pytest.raises(ValueError, match=match):
        SpeculativeConfig(num_speculative_tokens=2, **kwargs)


@pytest.mark.parametrize("kwargs,match", [
    (dict(kv_load_failure_policy="nope"), "kv_load_failure_policy"),
    (dict(kv_lease_duration=0), "kv_lease_duration"),
    (dict(kv_connector_context="nope"), "kv_connector_context"),
    (dict(kv_connector_context="vllm_today", kv_lease_duration=-1), "kv_lease_duration"),
])
def test_kv_transfer_options_are_always_checked(kwargs, match):
    from minivllm.config import KVTransferConfig
    with pytest.raises(ValueError, match=match):
        KVTransferConfig("SharedStorageConnector", "kv_both", **kwargs)


@pytest.mark.parametrize("kwargs,match", [
    (dict(min_p=2.0), "min_p"),
    (dict(temperature=0.5, presence_penalty=3.0), "presence_penalty"),
    (dict(min_tokens=-1, stop=["x"]), "min_tokens"),
    (dict(allowed_token_ids=[]), "allowed_token_ids"),
])
def test_sampling_options_are_always_checked(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)
