"""The asynchronous scheduler, mirroring vLLM 0.32's vllm/v1/core/sched/async_scheduler.py.

``LLM(..., async_scheduling=True)``, vLLM 0.32's ``SchedulerConfig.async_scheduling`` (on by
default there for EAGLE and the draft model on GPU). vLLM schedules step N + 1 while step N still runs on the GPU,
so the scheduler cannot know step N's drafts: after scheduling a request it stores
``[-1] * k`` placeholders in ``request.spec_token_ids`` (``_update_after_schedule``). The next
``schedule()`` counts them like drafts (``num_tokens_with_spec``, so ``allocate_slots`` reserves their
KV slots and the token budget pays for them) and sends them in ``scheduled_spec_decode_tokens``.
The real drafts never leave the worker: the model runner writes its own last proposals over the
placeholders (vllm/v1/worker/gpu_model_runner.py, where it scatters ``_draft_token_ids`` into
``input_ids``), and the engine skips ``take_draft_token_ids`` (vllm/v1/engine/core.py ``post_step``).
A placeholder the worker has no draft for stays -1 and is rejected; ``update_from_output`` counts all
placeholders as drafted tokens, as vLLM's spec stats do.

Article step 3 ("store these in request.spec_token_ids") changes here: the scheduler stores
placeholders, not drafts. minivllm keeps the step serial (no batch queue, no
``num_output_placeholders``): only where the drafts live changes, so outputs equal the default.
As minivllm runs a step after the previous one finished, there is no CPU/GPU overlap to gain: the
option shows the data flow, not the speed-up.
"""
from __future__ import annotations

from minivllm.core.sched.output import SchedulerOutput
from minivllm.core.sched.scheduler import Scheduler


class AsyncScheduler(Scheduler):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # One read-only list shared by all requests, as vLLM's _spec_token_placeholders.
        self._spec_token_placeholders: list[int] = [-1] * self.num_spec_tokens
        # num_speculative_tokens_per_batch_size: this step's k sizes the placeholders, as the
        # worker drafts that many (spec_decode/dynamic.py; vLLM's num_spec_tokens_to_schedule).
        spec, self.dynamic_sd_lookup = self.vllm_config.speculative_config, None
        if spec is not None and spec.num_speculative_tokens_per_batch_size:
            from minivllm.spec_decode.dynamic import build_dynamic_sd_schedule_lookup
            self.dynamic_sd_lookup = build_dynamic_sd_schedule_lookup(
                spec.num_speculative_tokens_per_batch_size,
                self.vllm_config.scheduler_config.max_num_seqs, self.num_spec_tokens)

    def _update_after_schedule(self, scheduler_output: SchedulerOutput) -> None:
        super()._update_after_schedule(scheduler_output)
        if not self.num_spec_tokens:
            return
        placeholders = self._spec_token_placeholders
        if self.dynamic_sd_lookup is not None:
            from minivllm.spec_decode.dynamic import num_spec_tokens_to_schedule
            placeholders = placeholders[:num_spec_tokens_to_schedule(
                self.num_spec_tokens, self.dynamic_sd_lookup,
                len(scheduler_output.num_scheduled_tokens))]
        for req_id in scheduler_output.num_scheduled_tokens:
            request = self.requests[req_id]
            # A partial prefill chunk samples nothing, so the worker drafts nothing for it
            # (vLLM's is_prefill_chunk).
            if request.num_computed_tokens < request.num_tokens:
                continue
            request.spec_token_ids = placeholders

    def update_draft_token_ids(self, draft_token_ids: dict[str, list[int]]) -> None:
        raise RuntimeError("With async_scheduling the drafts stay in the worker; the engine must "
                           "not call take_draft_token_ids / update_draft_token_ids.")
