"""The article's steps, one ``Step`` row each, everything about a stop in that row: its id, the
article's sentence (paraphrased), the function that stops and the statement it stops after, the
condition, the values to show, the stops it needs and what its never stopping means.
``steps.py`` loads this table only when a breakpoint is armed (or a tour, a test or the README
asks), so a plain run does not read it.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Step:
    id: str
    article: str        # the article's sentence, paraphrased
    function: str       # qualified name of the function holding the hook
    file: str           # path inside the package
    show: str           # comma-separated expressions over that frame's locals: the values to look at
    anchor: str = ""    # the statement the stop follows: the text its first line starts with
    when: str = "True"  # the condition over the frame's locals under which it stops
    inside: bool = False   # the anchor is a compound statement: stop at the head of its block
    # Stops that, if they never came either, explain why this one never came (the first such one's
    # ``never_means``); compiled in beside it as witnesses (they record, never stop).
    needs: tuple[str, ...] = ()
    never_means: str = ""  # why a run never reaches this stop, when nothing it needs explains it
    # A second site for the same id: (module, qualified name, anchor).
    also: tuple[tuple[str, str, str], ...] = ()


STEPS: tuple[Step, ...] = (
    # ---- speculative decoding: setup, then the article's numbered steps 1-8.
    Step("spec.setup", "Init device: create the drafter (e.g. NgramProposer) and the rejection sampler.",
         "ModelRunner.__init__", "worker/model_runner.py",
         "type(self.drafter).__name__, self.rejection_sampler.backend",
         anchor='self.rejection_sampler = RejectionSampler(',
         never_means='the engine has no speculative_config'),
    Step("spec.load", "Load model: load the draft model's weights (nothing to load for n-gram).",
         "ModelRunner.load_model", "worker/model_runner.py",
         "type(self.model).__name__, type(self.drafter).__name__",
         anchor='for name, layer in self.drafter.attn_layers()',
         needs=('spec.setup',)),
    Step("spec.1.forward", "Run the regular prefill step with the large model: the forward is the "
         "next line (pdb: 's' steps into self.model).",
         "ModelRunner.execute_model", "worker/model_runner.py",
         "so.num_scheduled_tokens, input_ids, positions, md.slot_mapping",
         anchor='with self.maybe_get_kv_connector_output(so) as kv_connector_output:',
         when='so.scheduled_new_reqs',
         inside=True,
         needs=('spec.setup',)),
    Step("spec.1", "Run the regular prefill step with the large model.",
         "ModelRunner.execute_model", "worker/model_runner.py",
         "so.num_scheduled_tokens, logits_indices, tuple(logits.shape)",
         anchor='self.execute_model_state = ExecuteModelState(',
         when='so.scheduled_new_reqs',
         needs=('spec.setup',)),
    Step("spec.2", "After the forward pass and sampling, propose k draft tokens "
         "(propose_draft_token_ids).",
         "ModelRunner.propose_draft_token_ids", "worker/model_runner.py",
         "k, limits, drafts, getattr(self.drafter, 'last_match', None)",
         anchor='self.target_step_outputs = None',
         when='any(drafts.values())',
         needs=('spec.setup',),
         never_means='no request had drafts (n-gram drafts need a prompt that repeats itself)'),
    Step("spec.3", "Store the drafts in request.spec_token_ids.",
         "Scheduler.update_draft_token_ids", "core/sched/scheduler.py",
         "request.request_id, request.spec_token_ids",
         anchor='request.spec_token_ids = list(drafts)',
         when='drafts',
         needs=('spec.setup', 'spec.2')),
    Step("spec.4", "Next step: count len(request.spec_token_ids) as new tokens, so allocate_slots "
         "reserves KV blocks for them.",
         "Scheduler.schedule_running", "core/sched/scheduler.py",
         "request.request_id, request.spec_token_ids, num_new_tokens, token_budget, "
         "self.num_lookahead_tokens, new_blocks.get_block_ids(), "
         "self.kv_cache_manager.get_block_ids(request.request_id)",
         anchor='if new_blocks is None:',
         when='request.spec_token_ids',
         needs=('spec.setup', 'spec.2')),
    Step("spec.5", "Copy spec_token_ids into input_batch.token_ids_cpu (context + draft tokens).",
         "ModelRunner._update_states", "worker/model_runner.py",
         "req_id, drafts, start, batch.token_ids_cpu[row, :start + len(drafts)].tolist()",
         anchor='batch.spec_token_ids[req_id] = list(drafts)',
         when='drafts',
         needs=('spec.setup', 'spec.2')),
    Step("spec.6", "_calc_spec_decode_metadata: which rows get logits, then the large model runs "
         "over the drafts.",
         "ModelRunner._calc_spec_decode_metadata", "worker/model_runner.py",
         "num_draft_tokens, cu_num_scheduled_tokens, logits_indices, target_logits_indices, "
         "bonus_logits_indices, draft_token_ids",
         anchor='draft_token_ids = self.input_batch.token_ids_cpu[',
         needs=('spec.setup', 'spec.2')),
    Step("spec.7", "The rejection sampler accepts/rejects left to right and produces "
         "output_token_ids.",
         "RejectionSampler.forward", "sample/rejection_sampler.py",
         "self.backend, metadata.num_draft_tokens, metadata.draft_token_ids, output",
         anchor='output, uniform_probs = rejection_sample(',
         needs=('spec.setup', 'spec.2')),
    Step("spec.8", "Repeat steps 2-7 until a stop condition is met (here one request meets one).",
         "Scheduler._update_request_with_output", "core/sched/scheduler.py",
         "request.request_id, request.status.name, request.num_output_tokens, token_id",
         anchor='if check_stop(request, self.max_model_len, self.detokenize):',
         inside=True,
         needs=('spec.setup',)),
    # ---- disaggregated P/D, in the article's order (layer-wise transfer happens inside the
    # context manager, between enter and exit; the async load is minivllm's RedisStore/pull path).
    Step("pd.init.worker", "Instantiation: the worker's init device procedure "
         "(init_worker_distributed_environment) creates the connector with role WORKER.",
         "Worker.init_device", "worker/worker.py",
         "type(self.kv_connector).__name__, self.kv_connector.role",
         anchor='self.kv_connector = init_worker_distributed_environment(',
         when='self.kv_connector is not None',
         needs=('pd.init.scheduler',)),
    Step("pd.init.scheduler", "Instantiation: the scheduler constructor creates the connector "
         "with role SCHEDULER.",
         "Scheduler.__init__", "core/sched/scheduler.py",
         "type(self.connector).__name__, self.connector.role",
         anchor='self.connector = KVConnectorFactory.create_connector(',
         never_means='the engine has no kv_transfer_config'),
    Step("pd.lookup", "Cache lookup: after the local prefix-cache check, get_num_new_matched_tokens "
         "counts externally cached tokens (prefill: always 0; decode: maybe a hit).",
         "Scheduler._get_computed_tokens", "core/sched/scheduler.py",
         "request.request_id, len(request.prompt_token_ids), self.block_size, "
         "num_new_local_computed_tokens, num_external_computed_tokens, load_kv_async",
         anchor='request.num_external_computed_tokens = num_external_computed_tokens',
         needs=('pd.init.scheduler',)),
    Step("pd.update_state", "State update: update_state_after_alloc records the requests that had "
         "an external hit (no-op for prefill).",
         "Scheduler._allocate_and_update_state", "core/sched/scheduler.py",
         "request.request_id, new_blocks.get_block_ids(), num_external_computed_tokens",
         anchor='self.connector.update_state_after_alloc(',
         needs=('pd.init.scheduler',)),
    Step("pd.build_meta", "Build metadata: meta = build_connector_meta(); prefill adds requests with "
         "is_store=True, decode with is_store=False.",
         "Scheduler._make_scheduler_output", "core/sched/scheduler.py",
         "type(scheduler_output.kv_connector_metadata).__name__",
         anchor='scheduler_output.kv_connector_metadata = self.connector.build_connector_meta(',
         when='scheduler_output.kv_connector_metadata',
         needs=('pd.init.scheduler',)),
    Step("pd.enter", "Context manager, on enter: start_load_kv (decode loads external KV into the "
         "paged memory; prefill: no-op).",
         "KVConnectorModelRunnerMixin._get_kv_connector_output",
         "worker/kv_connector_model_runner_mixin.py",
         "type(connector).__name__, connector.role",
         anchor='connector.start_load_kv(get_forward_context())',
         needs=('pd.init.scheduler',),
         also=(('minivllm.worker.vllm_today.kv_connector_context', 'get_kv_connector_output',
                'if not start_after_forward:'),)),
    Step("pd.layer_load", "Layer by layer: before a layer's attention, wait_for_layer_load.",
         "Attention.forward", "attention/layer.py",
         "self.layer_name, getattr(connector, '_layerwise', None)",
         anchor='connector.wait_for_layer_load(self.layer_name)',
         needs=('pd.init.scheduler',)),
    Step("pd.layer_save", "Layer by layer: after a layer's attention, save_kv_layer.",
         "Attention.forward", "attention/layer.py", "self.layer_name, tuple(md.slot_mapping.shape)",
         anchor='connector.save_kv_layer(self.layer_name',
         needs=('pd.init.scheduler',)),
    Step("pd.exit", "Context manager, on exit: wait_for_save (prefill blocks until its KV is "
         "uploaded; decode: no-op).",
         "KVConnectorModelRunnerMixin.finalize_kv_connector",
         "worker/kv_connector_model_runner_mixin.py",
         "type(connector).__name__, connector.role",
         anchor='connector.wait_for_save()',
         needs=('pd.init.scheduler',)),
    Step("pd.async_wait", "An asynchronous load starts: the request waits in "
         "WAITING_FOR_REMOTE_KVS, blocks allocated, while the worker fetches its KV.",
         "Scheduler._start_async_load", "core/sched/scheduler.py",
         "request.request_id, num_external_computed_tokens, self.waiting_for_remote_kvs",
         anchor='trace.record("remote_kv_wait"',
         needs=('pd.init.scheduler',),
         never_means='no load was asynchronous (SharedStorageConnector loads in the forward)'),
    Step("pd.async_ready", "The worker reported the load done (finished_recving): the loaded tokens "
         "count as computed and the request is scheduled again.",
         "Scheduler._update_waiting_for_remote_kv", "core/sched/scheduler.py",
         "req_id, num_computed_tokens",
         anchor='trace.record("remote_kv_ready"',
         needs=('pd.init.scheduler', 'pd.async_wait')),
)
REGISTRY: dict[str, Step] = {s.id: s for s in STEPS}
GROUPS = {"all": tuple(REGISTRY), "spec": tuple(i for i in REGISTRY if i.startswith("spec.")),
          "pd": tuple(i for i in REGISTRY if i.startswith("pd."))}


def markdown_table() -> str:
    """The id table README shows: id, the article's sentence (paraphrased), function."""
    rows = ["| id | article step (paraphrased) | where |", "|---|---|---|"]
    rows += [f"| `{s.id}` | {s.article} | `{s.function}` ({s.file}) |" for s in STEPS]
    return "\n".join(rows)
