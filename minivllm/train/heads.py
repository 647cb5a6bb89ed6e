"""Dense torch modules of the three learned drafters, used for training and as the reference the
paged runtime is checked against. Parameter names are vLLM's checkpoint names, so ``state_dict()``
is (nearly) the checkpoint: see ``export.py``.

- ``EagleDraft(method="eagle")``: vLLM ``model_executor/models/llama_eagle.py``. ``fc`` over
  ``cat(embed(token), hidden)`` (2H -> H), one Llama decoder layer whose input norm is the identity,
  no final norm; logits from the target's lm_head.
- ``EagleDraft(method="eagle3")``: vLLM ``llama_eagle3.py``. ``fc`` combines the target's three
  auxiliary states (3H -> H); layer 0 attends over ``cat(input_layernorm(embeds),
  hidden_norm(hidden))`` (2H wide q/k/v); final ``norm``; own ``lm_head`` over a reduced draft
  vocabulary, ``d2t`` maps a draft id back to the target's (target = draft + d2t[draft]).
- ``MedusaHeads``: vLLM ``models/medusa.py``. Head h is ``num_layers`` residual blocks
  ``x + SiLU(W x)`` over the target's final hidden state, each with its own lm_head over a
  truncated vocabulary (``token_map``: draft id -> target id).

The EAGLE step takes a ``cache``: a list of (k, v) pairs, the first ``[B, heads, T, d]`` from the
pass over all positions (attended causally), every later one from a draft pass at the same
positions (each query sees only its own row: the "diagonal" of EAGLE-3's training-time test). That
is exactly what inference sees: the first pass writes KV at every position the target processed,
pass i adds one more KV entry per request at position +i.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from minivllm.model_executor.models.llama import RMSNorm, RotaryEmbedding


@dataclass
class DraftConfig:
    """The draft's LlamaConfig fields (attention geometry equals the target's: same KV cache)."""
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_parameters: dict
    vocab_size: int
    draft_vocab_size: int


class DraftAttention(nn.Module):
    def __init__(self, cfg: DraftConfig, in_size: int) -> None:
        super().__init__()
        self.nh, self.nkv, self.hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = nn.Linear(in_size, self.nh * self.hd, bias=False)
        self.k_proj = nn.Linear(in_size, self.nkv * self.hd, bias=False)
        self.v_proj = nn.Linear(in_size, self.nkv * self.hd, bias=False)
        self.o_proj = nn.Linear(self.nh * self.hd, cfg.hidden_size, bias=False)
        self.rotary_emb = RotaryEmbedding(self.hd, cfg.rope_theta, cfg.rope_parameters)

    def forward(self, x: torch.Tensor, positions: torch.Tensor,
                cache: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """``x`` ``[B, T, in]``, ``positions`` ``[B, T]``; appends this pass's (k, v) to ``cache``."""
        b, t, _ = x.shape
        flat = x.reshape(b * t, -1)
        q, k = self.rotary_emb(positions.reshape(-1), self.q_proj(flat), self.k_proj(flat))
        rep = self.nh // self.nkv
        q = q.view(b, t, self.nh, self.hd).transpose(1, 2)
        k = k.view(b, t, self.nkv, self.hd).transpose(1, 2).repeat_interleave(rep, dim=1)
        v = self.v_proj(flat).view(b, t, self.nkv, self.hd).transpose(1, 2)
        cache.append((k, v.repeat_interleave(rep, dim=1)))
        out = ttt_attention(q, cache)
        return self.o_proj(out.transpose(1, 2).reshape(b * t, -1)).view(b, t, -1)


def ttt_attention(q: torch.Tensor, cache: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """Query ``[B, h, T, d]`` over ``cache[0]`` causally and over each later entry's same row.

    With one entry this is plain causal attention.
    """
    scale = q.shape[-1] ** -0.5
    k0, v0 = cache[0]
    if len(cache) == 1:
        return F.scaled_dot_product_attention(q, k0, v0, is_causal=True)
    t = q.shape[2]
    scores = [(q @ k0.transpose(-1, -2)) * scale]
    causal = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
    scores[0] = scores[0].masked_fill(~causal, float("-inf"))
    scores += [((q * k).sum(-1, keepdim=True)) * scale for k, _ in cache[1:]]   # [B, h, T, 1]
    probs = torch.cat(scores, dim=-1).softmax(-1)
    out = probs[..., :t] @ v0
    for j, (_, v) in enumerate(cache[1:]):
        out = out + probs[..., t + j:t + j + 1] * v
    return out


class DraftMLP(nn.Module):
    def __init__(self, hidden: int, inter: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class EagleDecoderLayer(nn.Module):
    """``layers.0``. EAGLE-1: no input norm; EAGLE-3: two input norms, q/k/v over 2H."""

    def __init__(self, cfg: DraftConfig, eagle3: bool) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.eagle3 = eagle3
        self.self_attn = DraftAttention(cfg, 2 * h if eagle3 else h)
        self.mlp = DraftMLP(h, cfg.intermediate_size)
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        if eagle3:
            self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps)
            self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps)

    def forward(self, embeds: Optional[torch.Tensor], hidden: torch.Tensor, positions: torch.Tensor,
                cache: list) -> tuple[torch.Tensor, torch.Tensor]:
        residual = hidden
        if self.eagle3:
            hidden = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)
        x = self.self_attn(hidden, positions, cache)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class EagleDraft(nn.Module):
    """EAGLE-1 (``method="eagle"``) or EAGLE-3 (``"eagle3"``) draft model, dense."""

    def __init__(self, cfg: DraftConfig, method: str) -> None:
        super().__init__()
        if method not in ("eagle", "eagle3"):
            raise ValueError(f"method must be 'eagle' or 'eagle3', got {method!r}.")
        self.cfg, self.method = cfg, method
        h = cfg.hidden_size
        self.eagle3 = method == "eagle3"
        self.fc = nn.Linear((3 if self.eagle3 else 2) * h, h, bias=False)
        self.layers = nn.ModuleList([EagleDecoderLayer(cfg, self.eagle3)])
        if self.eagle3:
            self.norm = RMSNorm(h, cfg.rms_norm_eps)
            self.lm_head = nn.Linear(h, cfg.draft_vocab_size, bias=False)
            self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.int64))

    def combine_hidden_states(self, aux: torch.Tensor) -> torch.Tensor:
        """EAGLE-3: the target's three auxiliary states ``[.., 3H]`` -> ``[.., H]``."""
        return self.fc(aux)

    def step(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
             cache: list) -> tuple[torch.Tensor, torch.Tensor]:
        """One draft pass: ``embeds`` ``[B, T, H]`` of the fed tokens, ``hidden`` ``[B, T, H]``
        (EAGLE-1: target final-normed state or the draft's own output; EAGLE-3: ``fc(aux)`` or the
        draft's own pre-norm output) -> (states for logits, states fed back), both ``[B, T, H]``."""
        if not self.eagle3:
            x = self.fc(torch.cat([embeds, hidden], dim=-1))
            x, residual = self.layers[0](None, x, positions, cache)
            out = x + residual
            return out, out
        x, residual = self.layers[0](embeds, hidden, positions, cache)
        return self.norm(x, residual)

    def draft_logits(self, states: torch.Tensor, target_lm_head: torch.Tensor) -> torch.Tensor:
        """EAGLE-1: target lm_head (full vocab, ``[.., V]``); EAGLE-3: own head (``[.., V']``)."""
        return self.lm_head(states) if self.eagle3 else states @ target_lm_head.T

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids] if self.eagle3 else draft_ids


class ResidualBlock(nn.Module):
    """vLLM ``models/medusa.py:ResidualBlock``: ``x <- x + SiLU(W x)`` for each layer."""

    def __init__(self, hidden: int, num_layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(hidden, hidden, bias=False) for _ in range(num_layers))
        for layer in self.layers:   # Medusa's init: zero weights, so each head starts as identity
            nn.init.zeros_(layer.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + F.silu(layer(x))
        return x


class MedusaHeads(nn.Module):
    """``num_heads`` residual stacks, each with its own lm_head over ``token_map`` (draft ->
    target id), as Medusa-1 trains them (heads start from the target's lm_head rows)."""

    def __init__(self, hidden: int, num_heads: int, num_layers: int, token_map: torch.Tensor) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(ResidualBlock(hidden, num_layers) for _ in range(num_heads))
        self.lm_heads = nn.ModuleList(nn.Linear(hidden, len(token_map), bias=False)
                                      for _ in range(num_heads))
        self.register_buffer("token_map", token_map.clone())

    def forward(self, hidden: torch.Tensor) -> list[torch.Tensor]:
        """``hidden`` ``[.., H]`` (the target's final-normed state) -> per-head logits ``[.., V']``."""
        return [head(block(hidden)) for block, head in zip(self.blocks, self.lm_heads)]
