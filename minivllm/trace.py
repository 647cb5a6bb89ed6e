"""Step records: what the engine did at each step, as events (minivllm's own, not a vLLM file).

Recording is off by default and then costs one read of the module's ``active`` count per call
site, and no call into this file. ``EngineCore.step()``
opens a ``StepRecord`` when its ``Tracer`` is enabled; any code running inside that step (scheduler,
KV cache manager, model runner, rejection sampler, KV connector) adds events with ``record(kind, ...)``.

Event kinds (each a plain dict with ``"kind"`` plus the fields listed):
- ``"schedule"``: num_scheduled_tokens {req_id: n}, scheduled_spec_decode_tokens, preempted_req_ids,
  token_budget, total_num_scheduled_tokens, new_req_ids, resumed_req_ids, running, waiting,
  statuses {req_id: RequestStatus name} (after this schedule())
- ``"kv_cache"``: block_tables {req_id: [block ids]}, num_computed_tokens {req_id: n},
  num_free_blocks, free_block_ids (queue order), cached_block_ids, num_gpu_blocks
- ``"prefix_hit"``: req_id, num_local_computed_tokens, num_external_computed_tokens
- ``"preempt"``: req_id, num_computed_tokens_before
- ``"remote_kv_wait"``: req_id, num_local_computed_tokens, num_external_computed_tokens (an async
  KV load starts: the request enters WAITING_FOR_REMOTE_KVS)
- ``"remote_kv_ready"``: req_id, num_computed_tokens (its load was reported: back to WAITING)
- ``"spec_propose"``: drafts {req_id: [token ids]}
- ``"spec_token_ids"``: spec_token_ids {req_id: request.spec_token_ids} of the running requests at
  the end of the step (the drafts, or -1 placeholders with ``async_scheduling``)
- ``"spec_substitute"``: req_id, drafts (async scheduling: the runner's own drafts written over the
  scheduled placeholders, -1 where it had none)
- ``"spec_draft_pass"``: one per EAGLE / EAGLE-3 draft pass: method, pass_idx (0 = the pass over the
  target's tokens), req_ids, query_start_loc, positions, slot_mapping (-1 = write skipped),
  input_ids, draft_token_ids; Medusa: method, pass_idx 0, req_ids, hidden_state_rows,
  draft_token_ids [per request: k ids]
- ``"spec_verify"``: req_id, positions [ {draft_token_id, p_target, p_draft, uniform, accepted, kind,
  output_token_id; on draft positions also penalty, penalty_drafts_ignored, p_target_drafts_ignored,
  accepted_if_drafts_ignored, target_argmax, target_argmax_drafts_ignored} ]  (kind in accepted | recovered | bonus; penalty: processed minus raw
  logit of the draft, earlier drafts counted as outputs; *_drafts_ignored: only committed outputs
  counted; sample/verify_record.py)
- ``"connector"``: role, method, req_id (optional), args, result, bytes
- ``"slot_mapping"``: req_ids (batch row order), positions and slot_mapping of every scheduled token
- ``"sampled"``: {req_id: [token ids appended this step]}
"""
from __future__ import annotations

import threading
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional


@dataclass
class StepRecord:
    step: int
    events: list[dict[str, Any]] = field(default_factory=list)

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e["kind"] == kind]

    def first(self, kind: str) -> Optional[dict[str, Any]]:
        found = self.of(kind)
        return found[0] if found else None


_current: ContextVar[Optional[StepRecord]] = ContextVar("minivllm_step_record", default=None)

# How many steps are being recorded now, in any thread. Call sites read this plain flag before
# calling in (``if trace.active: trace.record(...)``), so a run that records nothing never enters
# this file; ``record()`` and ``is_recording()`` still check the step's own context.
active = 0
_active_lock = threading.Lock()


def is_recording() -> bool:
    return _current.get() is not None


def record(kind: str, **fields: Any) -> None:
    rec = _current.get()
    if rec is not None:
        rec.events.append({"kind": kind, **fields})


@dataclass
class Tracer:
    enabled: bool = False
    steps: list[StepRecord] = field(default_factory=list)

    @contextmanager
    def step(self, index: int) -> Iterator[Optional[StepRecord]]:
        if not self.enabled:
            yield None
            return
        global active
        rec = StepRecord(step=index)
        token = _current.set(rec)
        with _active_lock:
            active += 1
        try:
            yield rec
        finally:
            with _active_lock:
                active -= 1
            _current.reset(token)
            self.steps.append(rec)

    def clear(self) -> None:
        self.steps.clear()

    def events(self, kind: str) -> list[dict[str, Any]]:
        """All events of one kind, each tagged with the step it happened in."""
        return [{"step": s.step, **e} for s in self.steps for e in s.events if e["kind"] == kind]
