"""The EAGLE-1 draft model, mirroring vllm/model_executor/models/llama_eagle.py
(``EagleLlamaForCausalLM``).

Article, "Speculative decoding / EAGLE": "model surgery": keep the target's embeddings and LM head,
replace its decoder stack by something light. Per token:

    x = fc(cat(embed(token), hidden))          # [num_tokens, 2H] -> [num_tokens, H]
    x = decoder layers (layer 0 has no input norm: its input is already a mix of normed features)
    out = x + residual                          # no final norm: EAGLE-1 regresses the target's
                                                # final-normed hidden state directly

``hidden`` is the target's final-normed hidden state at the previous position on the first draft
pass, and the draft's own output on later passes; ``forward`` returns ``(out, out)`` (states for the
logits, states fed back), the same pair EAGLE-3 returns. ``embed_tokens`` and ``lm_head`` are the
target's (a checkpoint may bring its own ``embed_tokens``; vLLM keeps it only if it differs).

The decoder layers are minivllm's ``LlamaDecoderLayer``, so their attention is the same paged
``Attention`` (torch or triton backend). Their layer names continue after the target's
(``model.layers.{target_num_layers + i}``) so the two never collide.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from minivllm.attention.layer import Attention
from minivllm.model_executor.linear import Linear
from minivllm.model_executor.models.llama import LlamaDecoderLayer


def can_share_embed_tokens(own: Optional[nn.Embedding], target: nn.Embedding) -> bool:
    """Whether a head uses the target's ``embed_tokens``: it has none, or an identical copy
    (vLLM's ``EagleProposer.load_model`` compares shape and values)."""
    return own is None or (own.weight.shape == target.weight.shape
                           and torch.equal(own.weight, target.weight.to(own.weight.dtype)))


class EagleLlamaModel(nn.Module):
    def __init__(self, config: Any, start_layer_id: int, attention_backend: str,
                 fc_bias: bool = False) -> None:
        super().__init__()
        h = config.hidden_size
        self.embed_tokens: Optional[nn.Embedding] = None   # the target's (share_target_modules)
        self.fc = Linear(2 * h, h, bias=fc_bias)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, f"model.layers.{start_layer_id + i}", attention_backend)
            for i in range(config.num_hidden_layers))
        self.layers[0].input_layernorm = nn.Identity()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        embeds = self.embed_tokens(input_ids)
        x = self.fc(torch.cat((embeds, hidden_states), dim=-1))
        residual = None
        for layer in self.layers:
            x, residual = layer(positions, x, residual)
        x = x + residual
        return x, x


class EagleLlamaForCausalLM(nn.Module):
    """``model`` (fc + decoder layers) over the target's embeddings, logits by the target's head."""

    def __init__(self, config: Any, start_layer_id: int, attention_backend: str = "torch",
                 fc_bias: bool = False) -> None:
        super().__init__()
        self.config = config
        self.model = EagleLlamaModel(config, start_layer_id, attention_backend, fc_bias)
        self.lm_head: Optional[nn.Module] = None   # the target's (share_target_modules)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``input_ids``, ``positions`` ``[n]``, ``hidden_states`` ``[n, H]`` -> two ``[n, H]``."""
        return self.model(input_ids, positions, hidden_states)

    def share_target_modules(self, target: nn.Module) -> None:
        """vLLM's ``EagleProposer.load_model``: the target's ``embed_tokens`` unless the head
        brought a different one, and always the target's ``lm_head`` (EAGLE-1 has none)."""
        if can_share_embed_tokens(self.model.embed_tokens, target.model.embed_tokens):
            self.model.embed_tokens = target.model.embed_tokens
        self.lm_head = target.lm_head

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``[n, H]`` -> float32 ``[n, target vocab]``."""
        return self.lm_head(hidden_states).float()

    def attn_layers(self) -> dict[str, Attention]:
        return {layer.self_attn.attn.layer_name: layer.self_attn.attn
                for layer in self.model.layers}

    @staticmethod
    def checkpoint_to_param_name(name: str) -> Optional[str]:
        """vLLM's loader: every tensor but ``lm_head`` lives under ``model.``; None = skipped."""
        return None if name.startswith("lm_head") else "model." + name
