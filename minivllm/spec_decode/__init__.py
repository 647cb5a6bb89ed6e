"""Speculative-decoding proposers (vllm/v1/spec_decode/), created by ``create_drafter``.

Every drafter is a ``Proposer`` (base_proposer.py): ``load_model(target_model)`` (article "Setup /
load model": a no-op for n-gram) and ``propose_for_batch(runner, limits, scheduler_output) ->
{req_id: drafts}``, called by ``ModelRunner.propose_draft_token_ids`` once per step with each
request's draft limit; what a drafter needs is declared (``uses_target_hidden_states``,
``has_kv_cache``).

| method | drafter | file |
|---|---|---|
| ``ngram`` | ``NgramDrafter`` / ``NgramProposer`` | ngram_proposer.py |
| ``draft_model`` | ``DraftModelProposer`` | draft_model.py |
| ``eagle``, ``eagle3`` | ``EagleProposer`` | eagle.py (heads: models/llama_eagle.py, llama_eagle3.py) |
| ``medusa`` | ``MedusaProposer`` | medusa.py (heads: models/medusa.py) |

Drafters with ``uses_target_hidden_states = True`` read the target's step
(``runner.target_step_outputs``, see utils.py).
"""
from __future__ import annotations

from typing import Any

import torch

from minivllm.config import VllmConfig
from minivllm.spec_decode.base_proposer import Proposer


class NgramDrafter(Proposer):
    """Runs ``NgramProposer`` on each request's row of ``input_batch.token_ids_cpu``."""

    def __init__(self, vllm_config: VllmConfig) -> None:
        super().__init__()
        from minivllm.spec_decode.ngram_proposer import NgramProposer
        spec = vllm_config.speculative_config
        self.proposer = NgramProposer(
            spec.prompt_lookup_min, spec.prompt_lookup_max, spec.num_speculative_tokens,
            max_model_len=vllm_config.model_config.max_model_len, match=spec.ngram_match)

    def load_model(self, target_model: Any) -> None:
        self.proposer.load_model(target_model)

    def propose_for_batch(self, runner: Any, limits: dict[str, int], so: Any) -> dict[str, list[int]]:
        batch = runner.input_batch
        drafts = {}
        for req_id, limit in limits.items():
            if limit <= 0:
                continue
            row = batch.req_id_to_index[req_id]
            context = batch.token_ids_cpu[row, :batch.num_tokens_no_spec[row]]
            proposal = self.proposer.propose(context)[:limit]
            if len(proposal):
                drafts[req_id] = [int(t) for t in proposal]
        return drafts


def create_drafter(vllm_config: VllmConfig, device: torch.device, dtype: torch.dtype) -> Proposer:
    method = vllm_config.speculative_config.method
    if method == "ngram":
        return NgramDrafter(vllm_config)
    if method == "draft_model":
        from minivllm.spec_decode.draft_model import DraftModelProposer
        return DraftModelProposer(vllm_config, device, dtype)
    if method in ("eagle", "eagle3"):
        from minivllm.spec_decode.eagle import EagleProposer
        return EagleProposer(vllm_config, device, dtype)
    if method == "medusa":
        from minivllm.spec_decode.medusa import MedusaProposer
        return MedusaProposer(vllm_config, device, dtype)
    raise ValueError(f"unknown speculative method {method!r}")
