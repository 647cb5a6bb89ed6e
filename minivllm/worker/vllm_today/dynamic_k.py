"""Dynamic k in the model runner (vLLM 0.32's ``num_speculative_tokens_per_batch_size``), a mixin
over the article's ``ModelRunner``: the article drafts ``num_speculative_tokens`` every step; here
the proposer asks ``spec_decode/dynamic.py``'s ``num_spec_tokens_to_schedule`` for this step's k,
from the number of requests this step ran (vLLM's scheduler looks it up the same way and hands the
worker ``num_spec_tokens_to_schedule``). At a batch size whose k is 0 nothing is drafted, so the
next step is a plain decode step. vLLM 0.32 keeps dynamic k in vllm/v1/spec_decode/dynamic/."""
from __future__ import annotations

from typing import Any

from minivllm.spec_decode.dynamic import build_dynamic_sd_schedule_lookup, num_spec_tokens_to_schedule


class DynamicSpecTokensMixin:
    """Overrides ``ModelRunner.num_spec_tokens_to_schedule``: k comes from the batch-size schedule."""

    def __init__(self, vllm_config: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(vllm_config, *args, **kwargs)
        spec = vllm_config.speculative_config
        self.dynamic_sd_lookup = build_dynamic_sd_schedule_lookup(
            spec.num_speculative_tokens_per_batch_size, vllm_config.scheduler_config.max_num_seqs,
            spec.num_speculative_tokens)

    def num_spec_tokens_to_schedule(self, scheduler_output: Any) -> int:
        return num_spec_tokens_to_schedule(self.speculative_config.num_speculative_tokens,
                                           self.dynamic_sd_lookup,
                                           len(scheduler_output.num_scheduled_tokens))
