"""vllm/v1/core/sched/output.py -> minivllm/core/sched/output.py.

A ``SchedulerOutput`` built by hand (vLLM's fields): the encoder, structured-output, EC and aux
fields must be empty (minivllm has none of these); vLLM 0.32 has no ``num_common_prefix_blocks``
(minivllm keeps the article's cascade-attention hint; none given is none shared)."""
from __future__ import annotations

from minivllm.core.sched import output as _mini
from minivllm.core.sched.output import NewRequestData
from minivllm.core.sched.output import SchedulerOutput as _SchedulerOutput
from vllm import _missing


class CachedRequestData(_mini.CachedRequestData):
    @classmethod
    def make_empty(cls) -> "CachedRequestData":
        return cls()


class SchedulerOutput(_SchedulerOutput):
    def __init__(self, scheduled_new_reqs, scheduled_cached_reqs, num_scheduled_tokens,
                 total_num_scheduled_tokens, scheduled_spec_decode_tokens,
                 finished_req_ids, num_common_prefix_blocks=None, preempted_req_ids=None,
                 kv_connector_metadata=None, has_sync_kv_loads=False, **kwargs):
        for name, value in kwargs.items():
            if value:   # scheduled_encoder_inputs, free_encoder_mm_hashes, grammar fields, ...
                _missing._raise(f"vllm.v1.core.sched.output.SchedulerOutput({name}=...)")
        super().__init__(scheduled_new_reqs, scheduled_cached_reqs, num_scheduled_tokens,
                         total_num_scheduled_tokens, scheduled_spec_decode_tokens,
                         list(num_common_prefix_blocks or [0]), finished_req_ids,
                         preempted_req_ids=set(preempted_req_ids or ()),
                         kv_connector_metadata=kv_connector_metadata,
                         has_sync_kv_loads=has_sync_kv_loads)


__getattr__ = _missing.module_getattr(__name__)
__all__ = ["CachedRequestData", "NewRequestData", "SchedulerOutput"]
