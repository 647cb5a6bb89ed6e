"""Writing and reading a head in vLLM's checkpoint format, the directory ``speculative_config=
{"method": ..., "model": DIR}`` loads (spec_decode/heads.py checks it against the target):
``config.json`` + ``model.safetensors`` (float16 by default) + ``train_info.json`` (what was
trained, how long, the held-out acceptance). Not an article step: ``python -m minivllm.train``
writes the heads the EAGLE, EAGLE-3 and Medusa drafters load.

Tensor names are the modules' own parameter names, which were chosen to be vLLM's:
- EAGLE (``llama_eagle.py``): ``fc.weight`` [H, 2H], ``layers.0.self_attn.{q,k,v,o}_proj.weight``,
  ``layers.0.mlp.{gate,up,down}_proj.weight``, ``layers.0.post_attention_layernorm.weight``; no
  ``embed_tokens``/``lm_head`` (the target's are used).
- EAGLE-3 (``llama_eagle3.py``): ``fc.weight`` [H, 3H], ``layers.0.{input_layernorm,hidden_norm}
  .weight``, q/k/v over 2H, ``norm.weight``, ``lm_head.weight`` [draft_vocab, H], ``d2t`` [draft_vocab].
- Medusa (``models/medusa.py``): ``blocks.{h}.layers.{l}.weight``, ``lm_heads.{h}.weight``
  [truncated_vocab, H], ``token_map`` [truncated_vocab].

vLLM 0.32 loads no Medusa checkpoint that has a ``token_map``: it builds each ``lm_heads.{h}`` at
the full vocabulary, then slices the checkpoint's rows through ``token_map`` and its weight loader
asserts the full-vocabulary row count (``models/medusa.py`` load_weights, ``vocab_parallel_embedding
.py`` weight_loader), whichever row count was stored. ``medusa_full_vocab`` writes the layout it
does load: full-vocabulary ``lm_heads`` and no ``token_map``.
"""
from __future__ import annotations

import json
import os
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from minivllm.train.heads import DraftConfig, EagleDraft, MedusaHeads

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def head_config(method: str, head, target_config: Any, dtype: str) -> dict:
    if method == "medusa":
        return {"model_type": "medusa", "architectures": ["MedusaModel"],
                "hidden_size": target_config.hidden_size, "vocab_size": target_config.vocab_size,
                "num_heads": len(head.blocks), "num_hidden_layers": len(head.blocks[0].layers),
                "truncated_vocab_size": len(head.token_map), "medusa_fc_bias": False,
                "original_lm_head": False, "torch_dtype": dtype}
    c: DraftConfig = head.cfg
    config = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLMEagle3" if method == "eagle3" else "LlamaForCausalLM"],
        "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
        "num_hidden_layers": 1, "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads, "head_dim": c.head_dim,
        "hidden_act": "silu", "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta,
        "rope_scaling": None if c.rope_parameters.get("rope_type") == "default"
        else c.rope_parameters,
        "max_position_embeddings": target_config.max_position_embeddings,
        "vocab_size": c.vocab_size, "bias": False, "tie_word_embeddings": False,
        "torch_dtype": dtype,
    }
    if method == "eagle3":
        from minivllm.model_executor.models.llama import default_eagle3_aux_layers
        config.update(draft_vocab_size=c.draft_vocab_size, target_hidden_size=c.hidden_size,
                      eagle_aux_hidden_state_layer_ids=list(
                          default_eagle3_aux_layers(target_config.num_hidden_layers)))
    return config


def save_head(out_dir: str, method: str, head, target_config: Any, info: dict,
              dtype: str = "float16") -> None:
    """Write ``out_dir/{config.json, model.safetensors, train_info.json}``."""
    os.makedirs(out_dir, exist_ok=True)
    tensors = {}
    for name, t in head.state_dict().items():
        t = t.detach()
        tensors[name] = (t if not t.is_floating_point() else t.to(DTYPES[dtype])).contiguous()
    save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(head_config(method, head, target_config, dtype), f, indent=2)
    with open(os.path.join(out_dir, "train_info.json"), "w") as f:
        json.dump(info, f, indent=2)


def load_head(head_dir: str, method: str) -> torch.nn.Module:
    """Rebuild the dense module from a directory ``save_head`` wrote (float32)."""
    with open(os.path.join(head_dir, "config.json")) as f:
        c = json.load(f)
    sd = {k: v.float() if v.is_floating_point() else v
          for k, v in load_file(os.path.join(head_dir, "model.safetensors")).items()}
    if method == "medusa":
        head = MedusaHeads(c["hidden_size"], c["num_heads"], c["num_hidden_layers"], sd["token_map"])
    else:
        rope = c.get("rope_scaling") or {"rope_type": "default"}
        cfg = DraftConfig(c["hidden_size"], c["intermediate_size"], c["num_attention_heads"],
                          c["num_key_value_heads"], c["head_dim"], c["rms_norm_eps"],
                          c["rope_theta"], rope, c["vocab_size"],
                          c.get("draft_vocab_size", c["vocab_size"]))
        head = EagleDraft(cfg, method)
    head.load_state_dict(sd, strict=True)
    return head.eval()


def medusa_full_vocab(head_dir: str, out_dir: str, target_lm_head: torch.Tensor) -> dict:
    """Rewrite a truncated-vocabulary Medusa head (``token_map`` [T], ``lm_heads.{h}`` [T, H]) as a
    full-vocabulary one: ``lm_heads.{h}`` [V, H] whose rows at ``token_map`` are the trained ones
    and whose other rows are the target's ``lm_head`` [V, H] (Medusa-1 starts its heads from the
    target's head), ``truncated_vocab_size = vocab_size``, no ``token_map``. The only Medusa
    layout vLLM 0.32 loads; its drafts can differ from the truncated head's (a token outside the
    map can now win). Returns the new config."""
    with open(os.path.join(head_dir, "config.json")) as f:
        config = json.load(f)
    sd = load_file(os.path.join(head_dir, "model.safetensors"))
    token_map = sd.pop("token_map", None)
    vocab, hidden = config["vocab_size"], config["hidden_size"]
    if tuple(target_lm_head.shape) != (vocab, hidden):
        raise ValueError(f"target lm_head is {tuple(target_lm_head.shape)}, the head needs "
                         f"{(vocab, hidden)}")
    for name in [n for n in sd if n.startswith("lm_heads.")]:
        rows = sd[name]
        if rows.shape[0] == vocab:
            continue
        if token_map is None or rows.shape[0] != token_map.numel():
            raise ValueError(f"{head_dir}: {name} has {rows.shape[0]} rows and no token_map of "
                             "that length")
        full = target_lm_head.detach().to(rows.dtype).clone()
        full[token_map.long()] = rows
        sd[name] = full.contiguous()
    config = dict(config, truncated_vocab_size=vocab)
    os.makedirs(out_dir, exist_ok=True)
    save_file(sd, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    return config
