"""The scheduler's KV-transfer bookkeeping, mirroring the parts of vllm/v1/core/sched/scheduler.py
that only a KV connector exercises: failed loads (``_handle_invalid_blocks``), the worker's finished
transfers (``_update_from_kv_xfer_finished``) and waking a request whose asynchronous load landed
(``_update_waiting_for_remote_kv``). A mixin of ``Scheduler``, kept apart so that the scheduling
loop reads in one sitting; it uses the scheduler's ``requests``, ``running``, ``kv_cache_manager``,
``connector``, ``waiting_for_remote_kvs`` and ``finished_recving_kv_req_ids``.
"""
from __future__ import annotations

from typing import Any

from minivllm import trace
from minivllm.request import Request
from minivllm.steps import BREAKS, at_step


class KVTransferMixin:
    def _handle_invalid_blocks(self, invalid_block_ids: set[int]) -> set[str]:
        """External KV that failed to load after it was counted as computed (vLLM's
        ``_handle_invalid_blocks``): cut each affected request back to its first invalid block so
        the next step recomputes from there; its output this step was computed on bad KV."""
        affected = set()
        for req_id, target in list(self.waiting_for_remote_kvs.items()):   # async loads
            block_ids = self.kv_cache_manager.get_block_ids(req_id)[0]
            bad = [i for i, b in enumerate(block_ids[:-(-target // self.block_size)])
                   if b in invalid_block_ids]
            if bad:
                self.waiting_for_remote_kvs[req_id] = min(target, bad[0] * self.block_size)
        for request in self.running:
            block_ids = self.kv_cache_manager.get_block_ids(request.request_id)[0]
            num_blocks = -(-request.num_computed_tokens // self.block_size)
            bad = [i for i, b in enumerate(block_ids[:num_blocks]) if b in invalid_block_ids]
            if not bad:
                continue
            valid = bad[0] * self.block_size
            lost = request.num_computed_tokens - valid
            request.num_computed_tokens = valid
            request.num_cached_tokens = min(request.num_cached_tokens, valid)
            request.num_external_computed_tokens = max(
                0, request.num_external_computed_tokens - lost)
            affected.add(request.request_id)
        return affected

    def _update_from_kv_xfer_finished(self, kv_out: Any) -> None:
        """The worker's async transfers that completed: loads wake their request up in the next
        ``schedule()``; a request finished meanwhile (aborted) frees its blocks only now."""
        self.connector.update_connector_output(kv_out)
        for req_id in (kv_out.finished_recving or ()):
            request = self.requests.get(req_id)
            if request is None:
                continue
            if request.is_finished():
                self.kv_cache_manager.free(request)
                del self.requests[req_id]
            else:
                self.finished_recving_kv_req_ids.add(req_id)

    def _update_waiting_for_remote_kv(self, request: Request) -> bool:
        """vLLM's ``_update_waiting_for_remote_kv``: once the load is reported, the request's loaded
        tokens count as computed (only those before a failed block) and its full blocks enter the
        prefix cache. Returns whether the request can be scheduled now."""
        req_id = request.request_id
        if req_id not in self.finished_recving_kv_req_ids:
            return False
        self.finished_recving_kv_req_ids.remove(req_id)
        num_computed_tokens = min(self.waiting_for_remote_kvs.pop(req_id), request.num_tokens - 1)
        if num_computed_tokens == 0:   # the first block already failed: start over, lookup included
            self.kv_cache_manager.free(request)
        elif self.kv_cache_manager.enable_caching:
            self.kv_cache_manager.cache_blocks(request, num_computed_tokens)
        request.num_computed_tokens = num_computed_tokens
        request.num_external_computed_tokens = min(request.num_external_computed_tokens,
                                                   num_computed_tokens)
        trace.record("remote_kv_ready", req_id=req_id, num_computed_tokens=num_computed_tokens)
        if BREAKS and at_step("pd.async_ready"): breakpoint()
        return True
