"""Medusa heads, mirroring vllm/model_executor/models/medusa.py (``ResidualBlock``, ``Medusa``).

Article, "Speculative decoding / Medusa": extra heads on top of the target's last hidden state, head
j guessing the token j + 1 steps after the one the target's own head just sampled. Each head is a
stack of residual blocks ``x <- x + SiLU(W x)`` followed by an LM head: its own (``lm_heads.{j}``),
or, when the checkpoint has none, the target's ``lm_head``. With a truncated vocabulary
(``truncated_vocab_size`` + ``token_map`` [truncated]), head logits are scattered into a
full-vocabulary row filled with -inf.

Config (a ``MedusaConfig``-like dict): ``hidden_size``, ``vocab_size``, ``num_heads``,
``num_hidden_layers`` (FasterDecoding's ``medusa_num_heads`` / ``medusa_num_layers`` are renamed,
as vLLM's ``MedusaConfig.from_pretrained`` does), optional ``truncated_vocab_size`` and
``medusa_fc_bias``. Only the first ``num_speculative_tokens`` heads are built (vLLM overwrites
``num_lookahead_tokens`` with k).
"""
from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from minivllm.model_executor.linear import Linear


def medusa_config_from_dict(config: dict[str, Any]) -> dict[str, Any]:
    """vLLM's key renaming: any key with "num" and "heads" -> ``num_heads``, "num" and "layers" ->
    ``num_hidden_layers``."""
    out = {}
    for key, value in config.items():
        if "num" in key and "heads" in key:
            key = "num_heads"
        elif "num" in key and "layers" in key:
            key = "num_hidden_layers"
        out[key] = value
    out.setdefault("num_hidden_layers", 1)
    return out


class ResidualBlock(nn.Module):
    def __init__(self, hidden_size: int, num_layers: int, bias: bool) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Linear(hidden_size, hidden_size, bias=bias)
                                    for _ in range(num_layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + F.silu(layer(x))
        return x


class Medusa(nn.Module):
    def __init__(self, config: dict[str, Any], num_heads: int, own_lm_heads: bool) -> None:
        super().__init__()
        h = config["hidden_size"]
        self.orig_vocab_size = config["vocab_size"]
        self.truncated_vocab_size = config.get("truncated_vocab_size") or self.orig_vocab_size
        bias = bool(config.get("medusa_fc_bias", False))
        self.blocks = nn.ModuleList(ResidualBlock(h, config["num_hidden_layers"], bias)
                                    for _ in range(num_heads))
        # None: every head uses the target's lm_head (share_target_modules).
        self.lm_heads: Optional[nn.ModuleList] = None
        self.target_lm_head: Optional[nn.Module] = None
        if own_lm_heads:
            self.lm_heads = nn.ModuleList(Linear(h, self.truncated_vocab_size, bias=False)
                                          for _ in range(num_heads))
        self.token_map: Optional[torch.Tensor] = None   # [truncated] int64 target ids

    def share_target_modules(self, target: nn.Module) -> None:
        """vLLM's ``MedusaProposer.load_model``: the target's ``lm_head``, for heads without
        their own ``lm_heads``."""
        self.target_lm_head = target.lm_head

    def forward(self, hidden_states: torch.Tensor) -> list[torch.Tensor]:
        """``[n, H]`` (the target's final-normed states) -> one ``[n, H]`` per head."""
        return [block(hidden_states) for block in self.blocks]

    def compute_logits(self, hidden_states: list[torch.Tensor]) -> list[torch.Tensor]:
        """One float32 ``[n, vocab]`` per head (-inf outside ``token_map`` when truncated)."""
        out = []
        for j, hs in enumerate(hidden_states):
            head = self.lm_heads[j] if self.lm_heads is not None else self.target_lm_head
            logits = head(hs).float()
            if self.token_map is not None:
                full = logits.new_full((logits.shape[0], self.orig_vocab_size), float("-inf"))
                full[:, self.token_map] = logits
                logits = full
            out.append(logits)
        return out

    @staticmethod
    def checkpoint_to_param_name(name: str) -> Optional[str]:
        return name
