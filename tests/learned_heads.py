"""Tiny random learned-drafter heads in vLLM's checkpoint format (DESIGN 5.1), for tests.

``make_eagle_head(path, target_dir, method)`` writes an EAGLE ("eagle") or EAGLE-3 ("eagle3") head
for the target checkpoint in ``target_dir``; ``make_medusa_head(path, target_dir, ...)`` a Medusa
head. Weights are N(0, std) from ``seed``, norms 1 + small noise; names exactly as vLLM loads them.
"""
from __future__ import annotations

import json
import os

import torch
from safetensors.torch import save_file


def _target_config(target_dir: str) -> dict:
    with open(os.path.join(target_dir, "config.json")) as f:
        return json.load(f)


def _layer_tensors(prefix: str, cfg: dict, qkv_in: int, g: torch.Generator, std: float) -> dict:
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = h // nh
    r = lambda *shape: torch.randn(*shape, generator=g) * std  # noqa: E731
    return {f"{prefix}self_attn.q_proj.weight": r(nh * hd, qkv_in),
            f"{prefix}self_attn.k_proj.weight": r(nkv * hd, qkv_in),
            f"{prefix}self_attn.v_proj.weight": r(nkv * hd, qkv_in),
            f"{prefix}self_attn.o_proj.weight": r(h, nh * hd),
            f"{prefix}mlp.gate_proj.weight": r(inter, h),
            f"{prefix}mlp.up_proj.weight": r(inter, h),
            f"{prefix}mlp.down_proj.weight": r(h, inter),
            f"{prefix}post_attention_layernorm.weight": 1 + r(h) * 0.1}


def make_eagle_head(path, target_dir: str, method: str = "eagle", seed: int = 0, std: float = 0.15,
                    draft_vocab_size: int | None = None, midlayer: bool = False,
                    embed_tokens: bool = False, **config_overrides) -> str:
    cfg = _target_config(target_dir)
    h, vocab = cfg["hidden_size"], cfg["vocab_size"]
    g = torch.Generator().manual_seed(seed)
    config = {k: cfg[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads",
                                  "num_key_value_heads", "rms_norm_eps", "vocab_size",
                                  "max_position_embeddings", "hidden_act") if k in cfg}
    config.update(model_type="llama", num_hidden_layers=1, bias=False, tie_word_embeddings=False)
    if method == "eagle":
        config["architectures"] = ["EagleLlamaForCausalLM"]
        tensors = {"fc.weight": torch.randn(h, 2 * h, generator=g) * std,
                   **_layer_tensors("layers.0.", cfg, h, g, std)}
    else:
        dv = draft_vocab_size or vocab
        config.update(architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=dv)
        prefix = "midlayer." if midlayer else "layers.0."
        tensors = {"fc.weight": torch.randn(h, 3 * h, generator=g) * std,
                   **_layer_tensors(prefix, cfg, 2 * h, g, std),
                   f"{prefix}input_layernorm.weight": 1 + torch.randn(h, generator=g) * 0.1,
                   f"{prefix}hidden_norm.weight": 1 + torch.randn(h, generator=g) * 0.1,
                   "norm.weight": 1 + torch.randn(h, generator=g) * 0.1,
                   "lm_head.weight": torch.randn(dv, h, generator=g) * std * 3}
        # d2t: draft id i -> target id (every other token when reduced), as offsets.
        ids = torch.arange(dv) * (vocab // dv)
        tensors["d2t"] = (ids - torch.arange(dv)).to(torch.int64)
        tensors["t2d"] = torch.zeros(vocab, dtype=torch.bool)
    if embed_tokens:
        tensors["embed_tokens.weight"] = torch.randn(vocab, h, generator=g) * std
    config.update(config_overrides)
    return _write(path, config, tensors)


def make_medusa_head(path, target_dir: str, num_heads: int = 3, num_layers: int = 1, seed: int = 0,
                     std: float = 0.15, own_lm_heads: bool = True, truncated_vocab_size=None,
                     bias: bool = False, fasterdecoding_names: bool = True) -> str:
    cfg = _target_config(target_dir)
    h, vocab = cfg["hidden_size"], cfg["vocab_size"]
    g = torch.Generator().manual_seed(seed)
    heads_key, layers_key = (("medusa_num_heads", "medusa_num_layers") if fasterdecoding_names
                             else ("num_heads", "num_hidden_layers"))
    config = {"model_type": "medusa", "architectures": ["MedusaModel"], "hidden_size": h,
              "vocab_size": vocab, heads_key: num_heads, layers_key: num_layers}
    tv = truncated_vocab_size or vocab
    if truncated_vocab_size:
        config["truncated_vocab_size"] = truncated_vocab_size
    tensors = {}
    for j in range(num_heads):
        for l in range(num_layers):
            tensors[f"blocks.{j}.layers.{l}.weight"] = torch.randn(h, h, generator=g) * std
            if bias:
                tensors[f"blocks.{j}.layers.{l}.bias"] = torch.randn(h, generator=g) * std
        if own_lm_heads:
            tensors[f"lm_heads.{j}.weight"] = torch.randn(tv, h, generator=g) * std * 3
    if truncated_vocab_size:
        tensors["token_map"] = torch.randperm(vocab, generator=g)[:tv].sort().values
    return _write(path, config, tensors)


def _write(path, config: dict, tensors: dict) -> str:
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    save_file({k: v.contiguous() for k, v in tensors.items()},
              os.path.join(path, "model.safetensors"))
    return str(path)


# ---------------------------------------------------------------- dense reference (no paging)
def load_tensors(path) -> dict:
    from safetensors.torch import load_file
    return load_file(os.path.join(path, "model.safetensors"))


def target_states(target_dir: str, tokens: list[int]) -> tuple[torch.Tensor, tuple]:
    """Hugging Face forward: (final-normed last hidden states [n, H], every layer's input [n, H])."""
    from transformers import LlamaForCausalLM
    model = _hf_cache.get(target_dir)
    if model is None:
        model = _hf_cache[target_dir] = LlamaForCausalLM.from_pretrained(target_dir).eval()
    with torch.no_grad():
        out = model(torch.tensor([tokens]), output_hidden_states=True)
    hs = [h[0] for h in out.hidden_states]
    return hs[-1], tuple(hs[:-1])


_hf_cache: dict = {}


def _rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x, positions, head_dim, theta):
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    f = positions.float()[:, None] * inv[None]
    cos, sin = torch.cat((f, f), -1).cos()[:, None], torch.cat((f, f), -1).sin()[:, None]
    x1, x2 = x[..., :head_dim // 2], x[..., head_dim // 2:]
    return x * cos + torch.cat((-x2, x1), -1) * sin


def _attention(x, w: dict, p: str, cfg: dict):
    """Plain causal multi-head attention over a whole sequence x [n, in]."""
    n, nh, nkv = x.shape[0], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg["hidden_size"] // nh
    pos = torch.arange(n)
    theta = cfg.get("rope_theta") or (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0)
    q = _rope((x @ w[p + "self_attn.q_proj.weight"].T).view(n, nh, hd), pos, hd, theta)
    k = _rope((x @ w[p + "self_attn.k_proj.weight"].T).view(n, nkv, hd), pos, hd, theta)
    v = (x @ w[p + "self_attn.v_proj.weight"].T).view(n, nkv, hd)
    k, v = k.repeat_interleave(nh // nkv, 1), v.repeat_interleave(nh // nkv, 1)
    o = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True)
    return o.transpose(0, 1).reshape(n, nh * hd) @ w[p + "self_attn.o_proj.weight"].T


def _mlp(x, w, p):
    g, u = x @ w[p + "mlp.gate_proj.weight"].T, x @ w[p + "mlp.up_proj.weight"].T
    return (torch.nn.functional.silu(g) * u) @ w[p + "mlp.down_proj.weight"].T


def dense_eagle_drafts(head_dir: str, target_dir: str, tokens: list[int], k: int,
                       method: str = "eagle") -> list[int]:
    """EAGLE / EAGLE-3 greedy drafts after ``tokens`` (the last one just sampled), recomputed over
    the whole sequence each pass: position p gets (token p + 1, target state at p), then the drafts
    with the head's own fed-back states."""
    w, cfg = load_tensors(head_dir), _target_config(head_dir)
    w = {k_.replace("midlayer.", "layers.0."): v for k_, v in w.items()}
    tcfg, eps = _target_config(target_dir), cfg["rms_norm_eps"]
    final, layer_inputs = target_states(target_dir, tokens[:-1])
    embed = load_tensors(target_dir)["model.embed_tokens.weight"]
    lm_head = load_tensors(target_dir).get("lm_head.weight", embed)
    if method == "eagle":
        feats = list(final)
    else:
        n = tcfg["num_hidden_layers"]
        ids = sorted(cfg.get("eagle_aux_hidden_state_layer_ids") or (2, n // 2, n - 3))
        feats = list(torch.cat([layer_inputs[i] for i in ids], -1) @ w["fc.weight"].T)
    ids_in = list(tokens[1:])
    drafts = []
    p = "layers.0."
    for _ in range(k):
        e = embed[torch.tensor(ids_in)]
        h = torch.stack(feats)
        if method == "eagle":
            x = torch.cat((e, h), -1) @ w["fc.weight"].T
            x = _attention(x, w, p, cfg) + x
            pre = _mlp(_rms(x, w[p + "post_attention_layernorm.weight"], eps), w, p) + x
            logits = pre[-1] @ lm_head.T
            fed = pre[-1]
        else:
            x = torch.cat((_rms(e, w[p + "input_layernorm.weight"], eps),
                           _rms(h, w[p + "hidden_norm.weight"], eps)), -1)
            x = _attention(x, w, p, cfg) + h
            pre = _mlp(_rms(x, w[p + "post_attention_layernorm.weight"], eps), w, p) + x
            draft_logits = _rms(pre[-1], w["norm.weight"], eps) @ w["lm_head.weight"].T
            logits = torch.full((cfg["vocab_size"],), float("-inf"))
            logits[torch.arange(len(w["d2t"])) + w["d2t"]] = draft_logits
            fed = pre[-1]
        drafts.append(int(logits.argmax()))
        ids_in.append(drafts[-1])
        feats.append(fed)
    return drafts


def dense_medusa_drafts(head_dir: str, target_dir: str, tokens: list[int], k: int) -> list[int]:
    """Medusa drafts after ``tokens``: head j on the target state of the last context token."""
    w, cfg = load_tensors(head_dir), _target_config(head_dir)
    final, _ = target_states(target_dir, tokens[:-1])
    target = load_tensors(target_dir)
    lm_head = target.get("lm_head.weight", target["model.embed_tokens.weight"])
    n_layers = cfg.get("medusa_num_layers", cfg.get("num_hidden_layers", 1))
    vocab = cfg["vocab_size"]
    drafts = []
    for j in range(k):
        x = final[-1]
        for l in range(n_layers):
            lin = x @ w[f"blocks.{j}.layers.{l}.weight"].T + w.get(f"blocks.{j}.layers.{l}.bias", 0)
            x = x + torch.nn.functional.silu(lin)
        head = w.get(f"lm_heads.{j}.weight", lm_head)
        logits = x @ head.T
        if "token_map" in w:
            full = torch.full((vocab,), float("-inf"))
            full[w["token_map"]] = logits
            logits = full
        drafts.append(int(logits.argmax()))
    return drafts
