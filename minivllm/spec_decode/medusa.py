"""Medusa proposing, mirroring vllm/v1/spec_decode/medusa.py ``MedusaProposer``.

Per engine step, after the target sampled: take each request's target hidden state at its last
accepted token (the row whose logits produced the token just sampled), run the k heads on it and
take each head's argmax: head j drafts the token j + 1 steps after the sampled one. No KV cache, no
draft passes over the context, no lookahead slots (vLLM reserves none for Medusa).

Which row: with no drafts in the step, request i's sampled row is ``i``; after a verify step the
sampled rows of request i are ``num_draft_i + 1`` consecutive ones starting at ``offset_i``, and the
last accepted token is row ``offset_i + len(sampled_i) - 1`` (vLLM's ``propose_draft_token_ids``).
Shapes: hidden ``[B, H]`` -> k heads -> logits k x ``[B, vocab]`` -> drafts ``[B, k]``.
"""
from __future__ import annotations

from typing import Any

import torch

from minivllm import trace
from minivllm.config import VllmConfig
from minivllm.spec_decode.base_proposer import Proposer
from minivllm.spec_decode.utils import TargetStepOutputs


def last_accepted_rows(num_draft_tokens: list[int], sampled_token_ids: list[list[int]]) -> list[int]:
    """Index into the sampled rows (``hidden_states[logits_indices]``) of each request's last
    accepted token; -1 for a request that sampled nothing (partial prefill chunk)."""
    rows, offset = [], 0
    for d, s in zip(num_draft_tokens, sampled_token_ids):
        rows.append(offset + len(s) - 1 if s else -1)
        offset += d + 1
    return rows


class MedusaProposer(Proposer):
    uses_target_hidden_states = True

    def __init__(self, vllm_config: VllmConfig, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        self.spec = vllm_config.speculative_config
        self.k = self.spec.num_speculative_tokens
        self.device, self.dtype = device, dtype
        self.attention_backend = vllm_config.attention_backend
        self.model: Any = None

    def load_model(self, target_model: Any) -> None:
        from minivllm.spec_decode.heads import load_head
        self.model = load_head(self.spec.model, "medusa", target_model, self.k, self.dtype,
                               self.device, self.attention_backend)

    def propose(self, target_hidden_states: torch.Tensor) -> torch.Tensor:
        """``[B, H]`` -> greedy drafts ``[B, k]``."""
        logits = self.model.compute_logits(self.model(target_hidden_states))
        return torch.stack([lg.argmax(dim=-1) for lg in logits], dim=1)

    def propose_for_batch(self, runner: Any, limits: dict[str, int],
                          so: Any) -> dict[str, list[int]]:
        t: TargetStepOutputs = runner.target_step_outputs
        batch = runner.input_batch
        n = batch.num_reqs
        num_draft = (t.spec_decode_metadata.num_draft_tokens
                     if t.spec_decode_metadata is not None else [0] * n)
        rows = last_accepted_rows(num_draft, t.sampled_token_ids)
        drafting = [i for i in range(n) if rows[i] >= 0 and limits.get(batch.req_ids[i], 0) > 0]
        if not drafting:
            return {}
        sample_rows = t.logits_indices[torch.tensor([rows[i] for i in drafting],
                                                    device=t.logits_indices.device)]
        drafts = self.propose(t.hidden_states[sample_rows]).tolist()
        if trace.active and trace.is_recording():
            trace.record("spec_draft_pass", method="medusa", pass_idx=0,
                         req_ids=[batch.req_ids[i] for i in drafting],
                         hidden_state_rows=sample_rows.tolist(), draft_token_ids=drafts)
        return {batch.req_ids[i]: d[:limits[batch.req_ids[i]]] for i, d in zip(drafting, drafts)}
