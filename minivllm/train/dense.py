"""The target model run densely: one sequence (or a right-padded batch) at a time, no KV cache,
no paging, with the very ``LlamaForCausalLM`` weights minivllm serves.

Training needs the target's hidden states over prompt + answer. minivllm's ``Attention`` layer
reads its block table from the forward context; here each decoder layer's projections, rotary
embedding, norms and MLP are called directly and attention is ``scaled_dot_product_attention``
with a causal mask. The numbers agree with the paged engine to float32 rounding.

What comes back mirrors vLLM:
- ``hidden``: the final-normed last hidden state, what ``LlamaModel.forward`` returns and what
  EAGLE-1 and Medusa draft from (``[B, T, H]``);
- ``aux``: EAGLE-3's auxiliary states, the un-normalised residual stream *entering* layers
  ``default_eagle3_aux_layers(L)`` = (2, L//2, L-3), concatenated (``[B, T, 3H]``), as vLLM's
  ``LlamaModel.forward`` records ``hidden_states + residual`` before running those layers.

No vLLM file mirrors it and no article step uses it: ``python -m minivllm.train`` trains on it.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from minivllm.model_executor.models.llama import (LlamaForCausalLM, default_eagle3_aux_layers,
                                                   valid_eagle3_aux_layers)


def dense_attention(attn_module, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """One ``LlamaAttention`` (q/k/v/o projections + RoPE) run densely.

    ``positions`` ``[B, T]``, ``x`` ``[B, T, H_in]`` -> ``[B, T, H]``; causal over each row.
    """
    b, t, _ = x.shape
    nh, nkv, hd = attn_module.num_heads, attn_module.num_kv_heads, attn_module.head_dim
    flat = x.reshape(b * t, -1)
    q, k, v = attn_module.qkv_proj.split(attn_module.qkv_proj(flat))
    q, k = attn_module.rotary_emb(positions.reshape(-1), q, k)
    q = q.view(b, t, nh, hd).transpose(1, 2)
    k = k.view(b, t, nkv, hd).transpose(1, 2).repeat_interleave(nh // nkv, dim=1)
    v = v.view(b, t, nkv, hd).transpose(1, 2).repeat_interleave(nh // nkv, dim=1)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return attn_module.o_proj(out.transpose(1, 2).reshape(b * t, nh * hd)).view(b, t, -1)


@torch.no_grad()
def target_hidden_states(model: LlamaForCausalLM, input_ids: torch.Tensor,
                         want_aux: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``input_ids`` ``[B, T]`` (right-padded) -> (``hidden`` ``[B, T, H]``, ``aux`` ``[B, T, 3H]``).

    Padding sits after every real token, so the causal mask keeps it out of real positions.
    """
    b, t = input_ids.shape
    positions = torch.arange(t).expand(b, t)
    inner = model.model
    aux_ids = default_eagle3_aux_layers(len(inner.layers)) if want_aux else ()
    if want_aux and not valid_eagle3_aux_layers(aux_ids, len(inner.layers)):
        raise ValueError(f"EAGLE-3 needs 3 distinct target layers (2, L//2, L-3), got {aux_ids} "
                         f"for num_hidden_layers={len(inner.layers)}: use a deeper target.")
    hidden = inner.embed_tokens(input_ids)
    residual = None
    aux = {}
    for idx, layer in enumerate(inner.layers):
        if idx in aux_ids:
            aux[idx] = hidden if residual is None else hidden + residual
        if residual is None:
            residual = hidden
            x = layer.input_layernorm(hidden)
        else:
            x, residual = layer.input_layernorm(hidden, residual)
        x = dense_attention(layer.self_attn, positions, x)
        x, residual = layer.post_attention_layernorm(x, residual)
        hidden = layer.mlp(x.reshape(b * t, -1)).view(b, t, -1)
    final, _ = inner.norm(hidden, residual)
    return final, (torch.cat([aux[i] for i in aux_ids], dim=-1) if want_aux else None)
