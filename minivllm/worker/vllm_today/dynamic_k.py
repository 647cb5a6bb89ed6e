"""Dynamic k in the model runner (vLLM 0.32's ``num_speculative_tokens_per_batch_size``), a mixin
over the article's ``ModelRunner``: the article drafts ``num_speculative_tokens`` every step; here
the proposer asks ``spec_decode/dynamic.py``'s ``num_spec_tokens_to_schedule`` for this step's k,
from the number of requests this step ran (vLLM's scheduler looks it up the same way and hands the
worker ``num_spec_tokens_to_schedule``). At a batch size whose k is 0 nothing is drafted, so the
next step is a plain decode step."""
from __future__ import annotations

from typing import Any

from minivllm import trace
from minivllm.spec_decode.dynamic import build_dynamic_sd_schedule_lookup, num_spec_tokens_to_schedule


class DynamicSpecTokensMixin:
    """Overrides ``ModelRunner.propose_draft_token_ids``: k comes from the batch-size schedule."""

    def __init__(self, vllm_config: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(vllm_config, *args, **kwargs)
        spec = vllm_config.speculative_config
        self.dynamic_sd_lookup = build_dynamic_sd_schedule_lookup(
            spec.num_speculative_tokens_per_batch_size, vllm_config.scheduler_config.max_num_seqs,
            spec.num_speculative_tokens)

    def propose_draft_token_ids(self, sampled_token_ids: list[list[int]],
                                state: Any) -> dict[str, list[int]]:
        batch = self.input_batch
        k = num_spec_tokens_to_schedule(self.speculative_config.num_speculative_tokens,
                                        self.dynamic_sd_lookup,
                                        len(state.scheduler_output.num_scheduled_tokens))
        limits = {}
        for i, req_id in enumerate(batch.req_ids):
            if not sampled_token_ids[i]:
                continue   # partial prefill: nothing to draft from yet
            state_i = self.requests[req_id]
            max_tokens = state_i.sampling_params.max_tokens or self.max_model_len
            limits[req_id] = max(0, min(k, max_tokens - len(state_i.output_token_ids) - 1,
                                        self.max_model_len - 1 - int(batch.num_tokens_no_spec[i])))
        if self.drafter.uses_target_hidden_states:   # EAGLE, EAGLE-3, Medusa
            from minivllm.spec_decode.utils import TargetStepOutputs
            self.target_step_outputs = TargetStepOutputs.from_state(state, sampled_token_ids)
        drafts = self.drafter.propose_for_batch(self, limits, state.scheduler_output)
        self.target_step_outputs = None
        trace.record("spec_propose", drafts={r: list(d) for r, d in drafts.items()})
        return drafts
