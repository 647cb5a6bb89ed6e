"""The EAGLE-3 draft model, mirroring vllm/model_executor/models/llama_eagle3.py
(``Eagle3LlamaForCausalLM``). Article step: spec step 2 (the drafter's passes), the article's
"Speculative decoding / EAGLE" with EAGLE-3's inputs.

Differences from EAGLE-1 (``llama_eagle.py``):
- Its input features are not the target's last hidden state but three *un-normalised* residual
  streams of the target (entering layers 2, L // 2, L - 3), concatenated ``[n, 3H]`` and mixed by
  ``fc`` (3H -> H) in ``combine_hidden_states``, once, on the first draft pass.
- Layer 0 attends over ``cat(input_layernorm(embeds), hidden_norm(hidden))`` ``[n, 2H]``: its q/k/v
  projections take 2H inputs; the residual stream continues from ``hidden``.
- A final ``norm``; ``forward`` returns ``(norm(x + residual), x + residual)``: the first feeds the
  logits, the second (pre-norm) is fed back as ``hidden`` on draft passes 2..k.
- Its own ``lm_head`` over a reduced draft vocabulary ``[draft_vocab, H]``; ``d2t`` maps draft ids
  back (``target_id = draft_id + d2t[draft_id]``) and ``compute_logits`` scatters the draft logits
  into a full-vocabulary row filled with -inf, so argmax gives a target token id.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from minivllm.attention.layer import Attention
from minivllm.model_executor.linear import Linear, QKVParallelLinear
from minivllm.model_executor.models.llama import LlamaAttention, LlamaMLP, RMSNorm
from minivllm.model_executor.models.llama_eagle import can_share_embed_tokens


class Eagle3DecoderLayer(nn.Module):
    def __init__(self, config: Any, prefix: str, attention_backend: str) -> None:
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = LlamaAttention(config, f"{prefix}.self_attn", attention_backend)
        # q/k/v read the concatenation [normed embeds, normed hidden]: 2H inputs.
        bias = bool(getattr(config, "attention_bias", False))
        attn = self.self_attn
        attn.qkv_proj = QKVParallelLinear(2 * h, attn.head_dim, attn.num_heads, attn.num_kv_heads,
                                          bias=bias)
        self.mlp = LlamaMLP(h, config.intermediate_size, bool(getattr(config, "mlp_bias", False)),
                            config.hidden_act)
        self.input_layernorm = RMSNorm(h, eps)
        self.hidden_norm = RMSNorm(h, eps)
        self.post_attention_layernorm = RMSNorm(h, eps)

    def forward(self, positions: torch.Tensor, embeds: torch.Tensor,
                hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        residual = hidden_states
        x = torch.cat((self.input_layernorm(embeds), self.hidden_norm(hidden_states)), dim=-1)
        x = self.self_attn(positions, x)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class Eagle3LlamaModel(nn.Module):
    def __init__(self, config: Any, start_layer_id: int, attention_backend: str,
                 target_hidden_size: int) -> None:
        super().__init__()
        h = config.hidden_size
        self.embed_tokens: Optional[nn.Embedding] = None   # the target's unless the head has one
        self.fc = Linear(3 * target_hidden_size, h, bias=False)
        self.layers = nn.ModuleList(
            [Eagle3DecoderLayer(config, f"model.layers.{start_layer_id}", attention_backend)])
        self.norm = RMSNorm(h, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x, residual = self.layers[0](positions, self.embed_tokens(input_ids), hidden_states)
        return self.norm(x, residual)


class Eagle3LlamaForCausalLM(nn.Module):
    def __init__(self, config: Any, start_layer_id: int, attention_backend: str = "torch",
                 target_hidden_size: Optional[int] = None, own_lm_head: bool = True) -> None:
        super().__init__()
        self.config = config
        self.vocab_size = config.vocab_size
        self.draft_vocab_size = getattr(config, "draft_vocab_size", None) or config.vocab_size
        self.model = Eagle3LlamaModel(config, start_layer_id, attention_backend,
                                      target_hidden_size or config.hidden_size)
        # None: a full-vocabulary head without one uses the target's (share_target_modules).
        self.lm_head: Optional[nn.Module] = (Linear(config.hidden_size, self.draft_vocab_size,
                                                    bias=False) if own_lm_head else None)
        # d2t: int64 offsets [draft_vocab]; None = identity (full vocabulary).
        self.draft_id_to_target_id: Optional[torch.Tensor] = None

    def share_target_modules(self, target: nn.Module) -> None:
        """vLLM's ``EagleProposer.load_model``: the target's ``embed_tokens`` unless the head
        brought a different one, its ``lm_head`` when the head has none (full vocabulary)."""
        if can_share_embed_tokens(self.model.embed_tokens, target.model.embed_tokens):
            self.model.embed_tokens = target.model.embed_tokens
        if self.lm_head is None:
            self.lm_head = target.lm_head

    def combine_hidden_states(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``[n, 3H]`` (the target's aux states, concatenated) -> ``[n, H]``."""
        return self.model.fc(hidden_states)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``[n]``, ``[n]``, ``[n, H]`` -> ``(normed [n, H], pre-norm [n, H])``."""
        return self.model(input_ids, positions, hidden_states)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``[n, H]`` -> float32 ``[n, target vocab]``; tokens outside the draft vocab get -inf."""
        logits = self.lm_head(hidden_states).float()
        if self.draft_id_to_target_id is None:
            return logits
        d2t = self.draft_id_to_target_id
        targets = torch.arange(d2t.shape[0], device=d2t.device) + d2t
        full = logits.new_full((logits.shape[0], self.vocab_size), float("-inf"))
        full[:, targets] = logits
        return full

    def attn_layers(self) -> dict[str, Attention]:
        attn = self.model.layers[0].self_attn.attn
        return {attn.layer_name: attn}

    @staticmethod
    def checkpoint_to_param_name(name: str) -> Optional[str]:
        """vLLM's loader: ``midlayer.`` is ``layers.0.``, ``t2d`` is skipped, ``d2t`` is a buffer."""
        if name == "t2d":
            return None
        if name == "d2t" or name.startswith("lm_head"):
            return name
        if name.startswith("midlayer."):
            name = "layers.0." + name[len("midlayer."):]
        return "model." + name
