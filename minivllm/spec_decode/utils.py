"""What the learned drafters (EAGLE, EAGLE-3, Medusa) read from the target's step
(``TargetStepOutputs``), and the KV caches of the drafters that keep their own
(``DraftKVCacheMixin``: EAGLE's head, the draft model). Article spec step 2 (propose the drafts).

vLLM's ``GPUModelRunner.propose_draft_token_ids`` passes these as arguments (target token ids,
positions, hidden states, ``sample_hidden_states``, ``common_attn_metadata``); minivllm's runner keeps
them in one ``TargetStepOutputs`` that the drafter reads, and only when the drafter asks for them
(``uses_target_hidden_states``), so plain decoding and n-gram pay nothing.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import torch

from minivllm.attention.layer import bind_kv_caches, kv_cache_bytes_per_token
from minivllm.spec_decode.base_proposer import Proposer
from minivllm.spec_decode.metadata import SpecDecodeMetadata

# vLLM's PADDING_SLOT_ID: a token whose K/V must not be written (both attention backends skip it).
PADDING_SLOT_ID = -1


@dataclass
class TargetStepOutputs:
    """One target forward: ``T`` scheduled tokens of ``n`` requests (batch row order)."""
    input_ids: np.ndarray                # [T] token fed at each position
    positions: np.ndarray                # [T]
    slot_mapping: np.ndarray             # [T] where each token's K/V went (the draft reuses it)
    query_start_loc: np.ndarray          # [n + 1] cumulative scheduled tokens
    seq_lens: np.ndarray                 # [n] context length after this step's tokens
    hidden_states: torch.Tensor          # [T, H] final-normed (EAGLE-1, Medusa)
    aux_hidden_states: Optional[list[torch.Tensor]]   # EAGLE-3: 3 x [T, H] residual streams
    logits_indices: torch.Tensor         # rows of hidden_states that were sampled from
    spec_decode_metadata: Optional[SpecDecodeMetadata]
    sampled_token_ids: list[list[int]]   # per request; [] for a partial prefill chunk

    @classmethod
    def from_state(cls, state: Any, sampled_token_ids: list[list[int]]) -> "TargetStepOutputs":
        """From the runner's ``ExecuteModelState`` (worker/outputs.py) and this step's samples: the
        step's inputs and slots on the host, its hidden states (and EAGLE-3's aux streams) on the
        device. ``propose_draft_token_ids`` builds it only for a drafter with
        ``uses_target_hidden_states``; n-gram never reads the target's states."""
        md = state.attn_metadata
        return cls(
            state.input_ids.cpu().numpy(), state.positions.cpu().numpy(),
            md.slot_mapping.cpu().numpy(), md.query_start_loc.cpu().numpy(), state.seq_lens,
            state.hidden_states, state.aux_hidden_states, state.logits_indices,
            state.spec_decode_metadata, sampled_token_ids)


class DraftKVCacheMixin(Proposer):
    """For drafters with attention layers of their own (the draft model, EAGLE's head): their K/V
    lives in caches shaped like the target's, indexed by the same blocks and slots. Needs
    ``self.model`` (with ``attn_layers()``), ``self.dtype`` and ``self.device``."""
    has_kv_cache = True

    def attn_layers(self) -> dict[str, Any]:
        return self.model.attn_layers() if self.model is not None else {}

    def kv_cache_bytes_per_token(self) -> int:
        return kv_cache_bytes_per_token(self.model.attn_layers().values(), self.dtype)

    def initialize_kv_cache(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        bind_kv_caches(self.model.attn_layers().values(), num_blocks, block_size, self.dtype,
                       self.device)

