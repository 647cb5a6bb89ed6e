"""Draft KV under P/D (vLLM 0.32's ``defer_finalize``): EAGLE's layers are registered with the
connector and ``wait_for_save`` runs after the drafter, so P stores the head's KV with the target's
and D loads it. D's first draft pass then reads P's draft KV for the loaded prompt blocks, never
slots nobody wrote: greedy acceptance per position on D equals a colocated run's.

The drafter's caches are filled with NaN before generating (as the attention tests do), so any read
of a slot that was not written shows up as lost acceptance."""
from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import make_tiny_llama, runner_of, tiny_llm
from learned_heads import load_tensors, make_eagle_head
from minivllm import SamplingParams
from minivllm.config import KVTransferConfig

pytestmark = pytest.mark.usefixtures("one_thread")
PROMPTS = [list(range(3, 14)), [7, 1, 9] * 4, list(range(20, 29))]   # 11, 12, 9 tokens; blocks of 4


@pytest.fixture(scope="module")
def bigram_and_head(tmp_path_factory):
    """A bigram target (attention and MLP outputs zero) and an EAGLE head that predicts it from the
    token (fc = [I | 0]) with a live attention (o_proj kept, scaled): drafts are mostly accepted
    and depend on the head's KV of the whole context."""
    d = tmp_path_factory.mktemp("pd_eagle")
    tgt = make_tiny_llama(d / "bigram", seed=5, vocab_size=32)
    w = load_file(os.path.join(tgt, "model.safetensors"))
    for name in w:
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            w[name].zero_()
    save_file(w, os.path.join(tgt, "model.safetensors"))
    head = make_eagle_head(d / "head", tgt, "eagle", seed=4)
    hw = load_tensors(head)
    h = hw["fc.weight"].shape[0]
    hw["fc.weight"] = torch.cat((torch.eye(h), torch.zeros(h, h)), 1)
    hw["layers.0.self_attn.o_proj.weight"] *= 2.0
    hw["layers.0.mlp.down_proj.weight"].zero_()
    save_file(hw, os.path.join(head, "model.safetensors"))
    return tgt, head


def _llm(tgt, head, kv=None):
    llm = tiny_llm(tgt, {"method": "eagle", "model": head, "num_speculative_tokens": 3},
                   kv_transfer_config=kv, num_gpu_blocks_override=64)
    for layer in runner_of(llm).drafter.model.attn_layers().values():
        layer.kv_cache.fill_(float("nan"))
    return llm


def _per_pos(llm):
    m = {x.name: getattr(x, "values", getattr(x, "value", None)) for x in llm.get_metrics()}
    return m["vllm:spec_decode_num_accepted_tokens_per_pos"], m["vllm:spec_decode_num_drafts"]


def test_acceptance_on_decode_equals_colocated(tmp_path, bigram_and_head):
    tgt, head = bigram_and_head
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    ps = [{"prompt_token_ids": p} for p in PROMPTS]
    colocated = _llm(tgt, head)
    ref = [o.outputs[0].token_ids for o in colocated.generate(ps, greedy, use_tqdm=False)]
    ref_pos = _per_pos(colocated)
    assert sum(ref_pos[0]) > 0

    kv = KVTransferConfig("SharedStorageConnector", "kv_both", {"shared_storage_path": str(tmp_path)})
    _llm(tgt, head, kv).generate(ps, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True),
                                 use_tqdm=False)
    d = _llm(tgt, head, kv)
    out = d.generate(ps, greedy, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in out] == ref
    assert [o.num_cached_tokens for o in out] == [8, 8, 8]     # the prompts' blocks came from P
    assert _per_pos(d) == ref_pos
    # The head's layer travelled: D loaded it alongside the target's.
    runner = runner_of(d)
    assert set(runner.drafter.model.attn_layers()) <= set(runner.kv_connector._kv_caches)
