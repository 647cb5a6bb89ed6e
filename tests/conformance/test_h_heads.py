"""Case h: minivllm's shipped learned heads in vLLM 0.32 (CPU build).

Each head directory (minivllm/spec_decode/heads/smollm2-135m-instruct/{eagle,eagle3,medusa}) is
given to vLLM as ``speculative_config={"method": m, "model": HEAD_DIR, "num_speculative_tokens":
3}`` (vllm_side/h_heads.py, one engine per method). Where vLLM starts and runs it, greedy outputs
must equal minivllm's with the same head, and the acceptance counters (``vllm:spec_decode_*``)
must be equal. Where vLLM refuses, the test asserts its exact message (EXPECTED_REFUSALS), which
the README quotes.

vLLM 0.32 refuses every Medusa checkpoint with a ``token_map`` (below), so the shipped Medusa head
is also run in the one layout it loads: ``medusa_full``, written by
``minivllm.train.export.medusa_full_vocab`` (full-vocabulary ``lm_heads``, no ``token_map``), in
both engines.
"""
from __future__ import annotations

from pathlib import Path

import pytest

import minivllm
from minivllm import LLM, SamplingParams

HEADS = Path(minivllm.__file__).parent / "spec_decode" / "heads" / "smollm2-135m-instruct"
METHODS = ("medusa", "eagle", "eagle3")
HEAD_NAMES = METHODS + ("medusa_full",)
K, MAX_TOKENS = 3, 16
COUNTERS = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens",
            "vllm:spec_decode_num_accepted_tokens", "vllm:spec_decode_num_accepted_tokens_per_pos")
# method -> vLLM 0.32's refusal (a line of the exception or of what its worker printed).
EXPECTED_REFUSALS: dict[str, str] = {
    # vllm/model_executor/models/medusa.py:78-90 builds each of the K lm_heads at the full vocab
    # (49152); at load (170-192) it slices a checkpoint's lm_head through token_map when it is
    # larger than the map, and vLLM's weight loader (model_executor/layers/vocab_parallel_embedding
    # .py:515) then asserts the full row count. So no token_map checkpoint loads: not minivllm's
    # (lm_heads [1024, 576], cut to its 1024-entry token_map), and not one with full [49152, 576]
    # lm_heads either (sliced to 1024 rows, the same assertion; tried by hand with the head that
    # medusa_full_vocab writes plus the token_map). A vLLM 0.32 regression: its LM heads lost the
    # org_num_embeddings=truncated_vocab_size that earlier vLLM passed.
    "medusa": "assert loaded_weight.shape[output_dim] == self.org_vocab_size",
}


@pytest.fixture(scope="module")
def prompts(chat_prompts):
    return [chat_prompts[0]]     # one grounded bench-spec prompt: spec decode on vLLM's CPU build is slow


@pytest.fixture(scope="module")
def head_dirs(conformance_model, tmp_path_factory) -> dict[str, tuple[str, str]]:
    """name -> (method, directory): the shipped heads and ``medusa_full``."""
    import torch
    from safetensors import safe_open
    from minivllm.model_executor.model_loader import load_model
    from minivllm.train.export import medusa_full_vocab
    # The loaded target's lm_head: the model knows whether it is tied to the embeddings (SmolLM2's is).
    lm_head = load_model(conformance_model, torch.float32, torch.device("cpu")).lm_head.weight
    full = tmp_path_factory.mktemp("medusa_full")
    medusa_full_vocab(str(HEADS / "medusa"), str(full), lm_head)
    with safe_open(str(full / "model.safetensors"), "pt") as f:
        assert "token_map" not in f.keys() and f.get_slice("lm_heads.0.weight").get_shape() == \
            list(lm_head.shape)
    return {**{m: (m, str(HEADS / m)) for m in METHODS}, "medusa_full": ("medusa", str(full))}


@pytest.fixture(scope="module")
def vllm_heads(vllm_side, conformance_model, prompts, head_dirs):
    return vllm_side("h_heads.py", {"model": conformance_model,
                                    "heads": {n: list(v) for n, v in head_dirs.items()},
                                    "prompts": prompts, "max_tokens": MAX_TOKENS, "k": K})


def run_minivllm(model: str, method: str, head_dir: str, prompts: list[list[int]]) -> dict:
    llm = LLM(model=model, dtype="float32", max_model_len=1024,
              speculative_config={"method": method, "model": head_dir,
                                  "num_speculative_tokens": K})
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
                        use_tqdm=False)
    counters = {}
    for m in llm.get_metrics():
        if m.name in COUNTERS:
            counters[m.name] = ([int(v) for v in m.values] if hasattr(m, "values")
                                else int(m.value))
    return {"token_ids": [list(o.outputs[0].token_ids) for o in outs], "counters": counters}


@pytest.mark.parametrize("name", HEAD_NAMES)
def test_head_in_vllm(vllm_heads, conformance_model, prompts, head_dirs, name):
    got = vllm_heads[name]
    if name in EXPECTED_REFUSALS:
        assert not got["loaded"], f"vLLM 0.32 now loads the {name} head: update the README"
        text = "\n".join([got["error"], *got["engine_errors"], got.get("traceback_tail", "")])
        assert EXPECTED_REFUSALS[name] in text, text
        return
    assert got["loaded"], f"vLLM 0.32 refused the {name} head: {got['error']} {got['engine_errors']}"
    method, head_dir = head_dirs[name]
    mini = run_minivllm(conformance_model, method, head_dir, prompts)
    assert mini["token_ids"] == got["token_ids"]
    m, v = mini["counters"], got["counters"]
    # Equal: what the heads got right, position by position.
    for name in ("vllm:spec_decode_num_accepted_tokens",
                 "vllm:spec_decode_num_accepted_tokens_per_pos"):
        assert m[name] == v[name], (name, m, v)
    # Named difference, delta row 18: vLLM V1 drafts K tokens at every decode step, capped only by
    # max_model_len, so with ignore_eos each prompt takes max_tokens - 1 - accepted verification
    # steps of K drafts. minivllm caps drafts at max_tokens - outputs - 1 (model_runner.py
    # 283-300): it drafts fewer near the end and skips the last step's drafts.
    steps = len(prompts) * (MAX_TOKENS - 1) - v["vllm:spec_decode_num_accepted_tokens"]
    assert v["vllm:spec_decode_num_drafts"] == steps, v
    assert v["vllm:spec_decode_num_draft_tokens"] == K * steps, v
    assert m["vllm:spec_decode_num_drafts"] < v["vllm:spec_decode_num_drafts"], (m, v)
    assert m["vllm:spec_decode_num_draft_tokens"] < v["vllm:spec_decode_num_draft_tokens"], (m, v)
