"""End-to-end engine tests: minivllm's greedy output equals Hugging Face transformers' token for token;
preemption, chunked prefill and prefix caching never change the output; no KV block leaks."""
from __future__ import annotations

import pytest
import torch

from conftest import make_tiny_llama
from minivllm import LLM, SamplingParams

# Mixed lengths, some crossing block boundaries (block_size 4 and 16 below).
PROMPTS = [[5, 17, 42], list(range(1, 30)), [200, 3, 9, 9, 9, 100, 7], list(range(60, 100)), [7]]


def hf_greedy(model_dir: str, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    from transformers import AutoModelForCausalLM
    model = _hf_models.get(model_dir)
    if model is None:
        model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32,
                                                     attn_implementation="eager").eval()
        _hf_models[model_dir] = model
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens,
                             min_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0)
    return out[0, len(prompt_ids):].tolist()


_hf_models: dict = {}


def token_prompts(prompts):
    return [{"prompt_token_ids": p} for p in prompts]


def greedy(max_tokens=12):
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_variants(tmp_path_factory, tiny_llama_dir, tiny_gqa_dir):
    """Several shapes: MHA tied, GQA untied, GQA 6/1 heads with bias-free 3 layers, head_dim 32."""
    extra = make_tiny_llama(tmp_path_factory.mktemp("tiny_mqa"), seed=3, num_attention_heads=6,
                            num_key_value_heads=1, hidden_size=96, num_hidden_layers=2)
    return [tiny_llama_dir, tiny_gqa_dir, extra]


def test_greedy_matches_hf_on_tiny_checkpoints(tiny_variants):
    for model_dir in tiny_variants:
        llm = LLM(model=model_dir, skip_tokenizer_init=True, block_size=4)
        outs = llm.generate(token_prompts(PROMPTS), greedy(), use_tqdm=False)
        for prompt, out in zip(PROMPTS, outs):
            assert out.outputs[0].token_ids == hf_greedy(model_dir, prompt, 12), model_dir
            assert out.outputs[0].finish_reason == "length"


def test_greedy_matches_hf_on_smollm2(smollm2_dir):
    llm = LLM(model=smollm2_dir)
    tok = llm.get_tokenizer()
    texts = ["The capital of France is", "def fibonacci(n):",
             "Once upon a time, in a small village by the sea, there lived an old fisherman who"]
    outs = llm.generate(texts, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True),
                        use_tqdm=False)
    for text, out in zip(texts, outs):
        ids = tok.encode(text)
        assert out.prompt_token_ids == ids
        assert out.outputs[0].token_ids == hf_greedy(smollm2_dir, ids, 10)
        assert out.outputs[0].text == tok.decode(out.outputs[0].token_ids, skip_special_tokens=True)


def test_preemption_gives_identical_output(tiny_gqa_dir):
    ref = LLM(model=tiny_gqa_dir, skip_tokenizer_init=True, block_size=4)
    expected = [o.outputs[0].token_ids for o in
                ref.generate(token_prompts(PROMPTS), greedy(20), use_tqdm=False)]
    # 19 usable blocks of 4 tokens hold the longest request (60 tokens) but not all five at once.
    small = LLM(model=tiny_gqa_dir, skip_tokenizer_init=True, block_size=4,
                num_gpu_blocks_override=20)
    got = [o.outputs[0].token_ids for o in
           small.generate(token_prompts(PROMPTS), greedy(20), use_tqdm=False)]
    assert got == expected
    metrics = {m.name: m for m in small.get_metrics()}
    assert metrics["vllm:num_preemptions"].value > 0
    pool = small.llm_engine.scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == 20 - 1   # nothing leaked; block 0 is the null block


def test_chunked_prefill_gives_identical_output(tiny_llama_dir):
    ref = LLM(model=tiny_llama_dir, skip_tokenizer_init=True)
    chunked = LLM(model=tiny_llama_dir, skip_tokenizer_init=True, max_num_batched_tokens=7,
                  max_num_seqs=2)
    a = ref.generate(token_prompts(PROMPTS), greedy(), use_tqdm=False)
    b = chunked.generate(token_prompts(PROMPTS), greedy(), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]


def test_prefix_cache_hit_on_repeated_prompt(tiny_llama_dir):
    llm = LLM(model=tiny_llama_dir, skip_tokenizer_init=True, block_size=4)
    prompt = {"prompt_token_ids": list(range(1, 23))}           # 22 tokens: 5 full blocks
    first = llm.generate(prompt, greedy(), use_tqdm=False)[0]
    second = llm.generate(prompt, greedy(), use_tqdm=False)[0]
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens == 20
    assert second.outputs[0].token_ids == first.outputs[0].token_ids
    exact = {"prompt_token_ids": list(range(1, 21))}             # exact multiple of block size
    llm.generate(exact, greedy(), use_tqdm=False)
    again = llm.generate(exact, greedy(), use_tqdm=False)[0]
    assert again.num_cached_tokens == 16                        # the last token is recomputed
    kv = llm.llm_engine.scheduler.kv_cache_manager
    assert kv.block_pool.get_num_free_blocks() == llm.vllm_config.cache_config.num_gpu_blocks - 1
    names = {m.name: m.value for m in llm.get_metrics() if hasattr(m, "value")}
    assert names["vllm:prefix_cache_hits"] >= 36


def test_no_prefix_caching_means_no_hits(tiny_llama_dir):
    llm = LLM(model=tiny_llama_dir, skip_tokenizer_init=True, block_size=4,
              enable_prefix_caching=False)
    prompt = {"prompt_token_ids": list(range(1, 23))}
    llm.generate(prompt, greedy(), use_tqdm=False)
    assert llm.generate(prompt, greedy(), use_tqdm=False)[0].num_cached_tokens == 0


def test_triton_backend_same_greedy_output(tiny_gqa_dir):
    prompts = token_prompts([[5, 17, 42, 8, 1], list(range(1, 12))])
    ref = LLM(model=tiny_gqa_dir, skip_tokenizer_init=True, block_size=4)
    tri = LLM(model=tiny_gqa_dir, skip_tokenizer_init=True, block_size=4,
              attention_backend="triton")
    a = ref.generate(prompts, greedy(5), use_tqdm=False)
    b = tri.generate(prompts, greedy(5), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]


def test_stop_conditions(tiny_llama_dir):
    llm = LLM(model=tiny_llama_dir, skip_tokenizer_init=True)
    prompt = {"prompt_token_ids": [5, 17, 42]}
    free = llm.generate(prompt, greedy(12), use_tqdm=False)[0].outputs[0].token_ids
    stop_tok = free[4]
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12,
                                              stop_token_ids=[stop_tok]), use_tqdm=False)[0]
    first = free.index(stop_tok)
    assert out.outputs[0].token_ids == free[:first + 1]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == stop_tok
    # The model's EOS (config eos_token_id) ends a request unless ignore_eos.
    eos = llm.llm_engine.eos_token_id
    assert eos is not None
    # max_model_len caps the total length.
    short = LLM(model=tiny_llama_dir, skip_tokenizer_init=True, max_model_len=8)
    o = short.generate(prompt, greedy(100), use_tqdm=False)[0]
    assert len(o.outputs[0].token_ids) == 5 and o.outputs[0].finish_reason == "length"


def test_seeded_sampling_is_reproducible(tiny_llama_dir):
    llm = LLM(model=tiny_llama_dir, skip_tokenizer_init=True)
    p = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, max_tokens=10, seed=1234,
                       ignore_eos=True)
    prompts = token_prompts(PROMPTS[:2])
    a = llm.generate(prompts, p, use_tqdm=False)
    # Different batch neighbours must not change a seeded request's output.
    b = llm.generate(token_prompts(PROMPTS[:1]), p, use_tqdm=False)
    assert a[0].outputs[0].token_ids == b[0].outputs[0].token_ids


def test_step_records(tiny_llama_dir):
    llm = LLM(model=tiny_llama_dir, skip_tokenizer_init=True, block_size=4,
              num_gpu_blocks_override=12)
    engine = llm.llm_engine
    engine.tracer.enabled = True
    for i, p in enumerate(PROMPTS[:3]):
        engine.add_request(str(i), {"prompt_token_ids": p}, greedy(6))
    while engine.has_unfinished_requests():
        engine.step()
    steps = engine.tracer.steps
    assert steps and all(s.first("schedule") is not None for s in steps)
    first = steps[0]
    sched = first.first("schedule")
    assert sum(sched["num_scheduled_tokens"].values()) == sched["total_num_scheduled_tokens"]
    kv = first.first("kv_cache")
    for req_id, blocks in kv["block_tables"].items():
        assert 0 not in blocks                           # the null block is never handed out
        n = kv["num_computed_tokens"][req_id]
        assert len(blocks) == -(-n // 4)
    assert any(s.of("preempt") for s in steps)           # 11 usable blocks are too few
    assert engine.tracer.events("sampled")
