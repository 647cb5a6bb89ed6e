"""Article-step breakpoints: a stable id for every numbered step of the article ("Inside vLLM",
part 3), and the one line in the engine where that step's values sit in local variables.

Each engine function that implements a step carries one line::

    if BREAKS and at_step("spec.4", request.spec_token_ids): breakpoint()

``BREAKS`` is a dict, empty unless someone asked for breakpoints, so switched off a step costs one
dictionary lookup. Switched on, ``at_step`` says whether to stop (the id was asked for, its condition
holds, and it has not stopped yet in this engine: each id stops once per ``LLM``), prints one line
naming the step, and the engine calls the builtin ``breakpoint()`` in its own frame, so
``PYTHONBREAKPOINT`` picks the debugger (pdb, ipdb, pudb, VS Code's debugpy; ``0`` disables).

Ask with ``MINIVLLM_BREAK=spec.4,pd.lookup`` (or ``all``, or a group ``spec`` / ``pd``) or
``LLM(..., break_at=["spec.4"])``. ``python -m minivllm.tour spec|pd`` walks them in order.
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Any, Iterable, Optional


@dataclass(frozen=True)
class Step:
    id: str
    article: str        # the article's sentence, paraphrased
    function: str       # qualified name of the function holding the hook
    file: str           # path inside the package
    show: str           # comma-separated expressions over that frame's locals: the values to look at


STEPS: tuple[Step, ...] = (
    # ---- speculative decoding: setup, then the article's numbered steps 1-8.
    Step("spec.setup", "Init device: create the drafter (e.g. NgramProposer) and the rejection sampler.",
         "ModelRunner.__init__", "worker/model_runner.py",
         "type(self.drafter).__name__, self.rejection_sampler.backend"),
    Step("spec.load", "Load model: load the draft model's weights (nothing to load for n-gram).",
         "ModelRunner.load_model", "worker/model_runner.py",
         "type(self.model).__name__, type(self.drafter).__name__"),
    Step("spec.1", "Run the regular prefill step with the large model.",
         "ModelRunner.execute_model", "worker/model_runner.py",
         "so.num_scheduled_tokens, logits_indices, tuple(logits.shape)"),
    Step("spec.2", "After the forward pass and sampling, propose k draft tokens "
         "(propose_draft_token_ids).",
         "ModelRunner.propose_draft_token_ids", "worker/model_runner.py", "k, limits, drafts"),
    Step("spec.3", "Store the drafts in request.spec_token_ids.",
         "Scheduler.update_draft_token_ids", "core/sched/scheduler.py",
         "request.request_id, request.spec_token_ids"),
    Step("spec.4", "Next step: count len(request.spec_token_ids) as new tokens, so allocate_slots "
         "reserves KV blocks for them.",
         "Scheduler.schedule_running", "core/sched/scheduler.py",
         "request.request_id, request.spec_token_ids, num_new_tokens, token_budget, "
         "self.num_lookahead_tokens, new_blocks.get_block_ids(), "
         "self.kv_cache_manager.get_block_ids(request.request_id)"),
    Step("spec.5", "Copy spec_token_ids into input_batch.token_ids_cpu (context + draft tokens).",
         "ModelRunner._update_states", "worker/model_runner.py",
         "req_id, drafts, start, batch.token_ids_cpu[row, :start + len(drafts)].tolist()"),
    Step("spec.6", "_calc_spec_decode_metadata: which rows get logits, then the large model runs "
         "over the drafts.",
         "ModelRunner._calc_spec_decode_metadata", "worker/model_runner.py",
         "num_draft_tokens, cu_num_scheduled_tokens, logits_indices, target_logits_indices, "
         "bonus_logits_indices, draft_token_ids"),
    Step("spec.7", "The rejection sampler accepts/rejects left to right and produces "
         "output_token_ids.",
         "RejectionSampler.forward", "sample/rejection_sampler.py",
         "metadata.num_draft_tokens, metadata.draft_token_ids, output"),
    Step("spec.8", "Repeat steps 2-7 until a stop condition is met (here one request meets one).",
         "Scheduler._update_request_with_output", "core/sched/scheduler.py",
         "request.request_id, request.status.name, request.num_output_tokens, token_id"),
    # ---- disaggregated P/D, in the article's order (layer-wise transfer happens inside the
    # context manager, between enter and exit; the async load is minivllm's RedisStore/pull path).
    Step("pd.init.worker", "Instantiation: the worker's init device procedure "
         "(init_worker_distributed_environment) creates the connector with role WORKER.",
         "Worker.init_device", "worker/worker.py",
         "type(self.kv_connector).__name__, self.kv_connector.role"),
    Step("pd.init.scheduler", "Instantiation: the scheduler constructor creates the connector "
         "with role SCHEDULER.",
         "Scheduler.__init__", "core/sched/scheduler.py",
         "type(self.connector).__name__, self.connector.role"),
    Step("pd.lookup", "Cache lookup: after the local prefix-cache check, get_num_new_matched_tokens "
         "counts externally cached tokens (prefill: always 0; decode: maybe a hit).",
         "Scheduler._get_computed_tokens", "core/sched/scheduler.py",
         "request.request_id, len(request.prompt_token_ids), self.block_size, "
         "num_new_local_computed_tokens, num_external_computed_tokens, load_kv_async"),
    Step("pd.update_state", "State update: update_state_after_alloc records the requests that had "
         "an external hit (no-op for prefill).",
         "Scheduler._allocate_and_update_state", "core/sched/scheduler.py",
         "request.request_id, new_blocks.get_block_ids(), num_external_computed_tokens"),
    Step("pd.build_meta", "Build metadata: meta = build_connector_meta(); prefill adds requests with "
         "is_store=True, decode with is_store=False.",
         "Scheduler._make_scheduler_output", "core/sched/scheduler.py",
         "type(scheduler_output.kv_connector_metadata).__name__"),
    Step("pd.enter", "Context manager, on enter: start_load_kv (decode loads external KV into the "
         "paged memory; prefill: no-op).",
         "_get_kv_connector_output", "distributed/kv_transfer/__init__.py",
         "type(connector).__name__, connector.role"),
    Step("pd.layer_load", "Layer by layer: before a layer's attention, wait_for_layer_load.",
         "Attention.forward", "attention/layer.py",
         "self.layer_name, getattr(connector, '_layerwise', None)"),
    Step("pd.layer_save", "Layer by layer: after a layer's attention, save_kv_layer.",
         "Attention.forward", "attention/layer.py", "self.layer_name, tuple(md.slot_mapping.shape)"),
    Step("pd.exit", "Context manager, on exit: wait_for_save (prefill blocks until its KV is "
         "uploaded; decode: no-op).",
         "finalize_kv_connector", "distributed/kv_transfer/__init__.py",
         "type(connector).__name__, connector.role"),
    Step("pd.async_wait", "An asynchronous load starts: the request waits in "
         "WAITING_FOR_REMOTE_KVS, blocks allocated, while the worker fetches its KV.",
         "KVTransferMixin._start_async_load", "core/sched/kv_transfer.py",
         "request.request_id, num_external_computed_tokens, self.waiting_for_remote_kvs"),
    Step("pd.async_ready", "The worker reported the load done (finished_recving): the loaded tokens "
         "count as computed and the request is scheduled again.",
         "KVTransferMixin._update_waiting_for_remote_kv", "core/sched/kv_transfer.py",
         "req_id, num_computed_tokens"),
)
REGISTRY: dict[str, Step] = {s.id: s for s in STEPS}
GROUPS = {"all": tuple(REGISTRY), "spec": tuple(i for i in REGISTRY if i.startswith("spec.")),
          "pd": tuple(i for i in REGISTRY if i.startswith("pd."))}

# id -> True for every requested id that has not stopped yet. Mutated in place, never rebound: the
# engine files import this very dict.
BREAKS: dict[str, bool] = {}
_requested: tuple[str, ...] = ()
current: Optional[Step] = None     # the step at_step() last stopped at (read by the tour's hook)
quiet = False                      # the tour prints its own header


def parse(ids: "str | Iterable[str] | None") -> tuple[str, ...]:
    """``"spec.4,pd.lookup"`` / ``["spec.4"]`` / ``"all"`` → the ids, in registry order."""
    if ids is None:
        return ()
    items = [i.strip() for i in (ids.split(",") if isinstance(ids, str) else ids)]
    wanted: set[str] = set()
    for item in filter(None, items):
        if item in GROUPS:
            wanted.update(GROUPS[item])
        elif item in REGISTRY:
            wanted.add(item)
        else:
            raise ValueError(f"unknown article step {item!r} in break_at / MINIVLLM_BREAK; valid ids: "
                             f"{', '.join(REGISTRY)} (or the groups {', '.join(GROUPS)}).")
    return tuple(i for i in REGISTRY if i in wanted)


def configure(break_at: "str | Iterable[str] | None" = None) -> tuple[str, ...]:
    """Arm the breakpoints for a new engine: ``break_at`` if given, else ``$MINIVLLM_BREAK``.
    Called by ``LLM.__init__`` before anything is built. Returns the armed ids."""
    global _requested
    source = break_at if break_at is not None else os.environ.get("MINIVLLM_BREAK")
    _requested = parse(source)
    BREAKS.clear()
    BREAKS.update(dict.fromkeys(_requested, True))
    return _requested


def disarm() -> None:
    BREAKS.clear()


def at_step(step_id: str, when: Any = True) -> bool:
    """True (once per id and engine) when ``step_id`` is armed and ``when`` is truthy."""
    global current
    if not BREAKS.get(step_id) or not when:
        return False
    del BREAKS[step_id]
    current = REGISTRY[step_id]
    if not quiet:
        caller = sys._getframe(1)
        print(f"minivllm step {step_id}: {current.article} "
              f"[{caller.f_code.co_filename}:{caller.f_lineno} {current.function}]", file=sys.stderr)
    return True


def markdown_table() -> str:
    """The id table README shows: id, the article's sentence (paraphrased), function."""
    rows = ["| id | article step (paraphrased) | where |", "|---|---|---|"]
    rows += [f"| `{s.id}` | {s.article} | `{s.function}` ({s.file}) |" for s in STEPS]
    return "\n".join(rows)


try:   # arm from the environment at import, so engines built without LLM(...) honour it too
    configure()
except ValueError as _e:     # reported again, as an exception, by LLM(...)
    print(f"minivllm: {_e}", file=sys.stderr)
