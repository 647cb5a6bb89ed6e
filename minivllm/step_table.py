"""The article's steps, one ``Step`` row each, everything about a stop in that row: its id, the
article's sentence (paraphrased), the function that stops and the statement it stops after, the
condition, the values to show, the stops it needs and what its never stopping means; and the notes a
stop prints under those values (``NOTES``: why the numbers are what they are, token ids as text).
Each note reads the stop's live frame (the same locals the step's ``show`` expressions read) and the
tour (its tokenizer, which instance runs); none changes anything.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable


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


# ---- the notes: what a stop prints under its values, by step id.
def decoded(tokenizer: Any, ids: Any) -> str:
    """``ids`` as text (``repr``), or "" without a tokenizer (a checkpoint without one)."""
    if tokenizer is None:
        return ""
    return repr(tokenizer.decode([int(t) for t in ids if int(t) >= 0]))


def _drafts(frame: Any, tour: Any) -> list[str]:
    """spec.2 / spec.3: the drafts as text."""
    f = frame.f_locals
    drafts = ({f["request"].request_id: f["request"].spec_token_ids} if "request" in f
              else f["drafts"])
    if tour.tokenizer is None:
        return []
    return [f"req {r}: drafts as text {decoded(tour.tokenizer, d)}" for r, d in drafts.items() if d]


def _spec1(frame: Any, tour: Any) -> list[str]:
    """spec.1: per request, its hidden-state rows and the one the LM head reads, and why."""
    f = frame.f_locals
    so, picked = f["so"], [int(i) for i in f["logits_indices"]]
    lines, start = [], 0
    for req_id in f["self"].input_batch.req_ids:
        n = so.num_scheduled_tokens.get(req_id, 0)
        if not n:
            continue
        rows = [r for r in picked if start <= r < start + n]
        k = len(so.scheduled_spec_decode_tokens.get(req_id, []))
        why = (f"a verify of {k} drafts: 1 + {k} rows" if k else
               "a prefill samples one token, from its last prompt row" if n > 1 else
               "a decode: its one row")
        lines.append(f"req {req_id}: rows {start}..{start + n - 1} ({n} tokens) -> logits rows "
                     f"{rows} ({why})")
        start += n
    lines.append(f"logits {tuple(f['logits'].shape)} = (rows picked, vocabulary): the LM head runs "
                 f"on {len(picked)} of the {start} hidden states; the sampler draws from them "
                 "next, and only then can the drafter propose (spec.2)")
    return lines


def _spec2(frame: Any, tour: Any) -> list[str]:
    """spec.2: the drafts as text, and for a drafter with a model of its own, its forward."""
    f = frame.f_locals
    lines = _drafts(frame, tour)
    drafter = getattr(f.get("self"), "drafter", None)
    layers = list(drafter.attn_layers()) if hasattr(drafter, "attn_layers") else []
    if layers:
        lines.append(f"{type(drafter).__name__} ran a forward of its own just now, after the "
                     f"target's: one pass over the tokens the target just computed, then "
                     f"{f['k'] - 1} one-token passes, one per further draft; each writes K/V into "
                     f"its {len(layers)} attention layer(s)' own cache through the target's block "
                     "tables (the slots spec.4 reserves as num_lookahead_tokens)")
    elif getattr(drafter, "last_match", None):
        for req, m in ((r, m) for r, m in drafter.last_match.items() if m.path):
            lines.append(f"req {req}: matched {len(m.matched_suffix)} context tokens in the "
                         f"{m.tree} tree; draft scores {[round(x, 3) for x in m.scores]}")
    return lines


def _spec4(frame: Any, tour: Any) -> list[str]:
    """spec.4: num_new_tokens taken apart, and what the lookahead slots are for."""
    f = frame.f_locals
    req, sched = f["request"], f["self"]
    k = len(req.spec_token_ids)
    return [f"num_new_tokens {f['num_new_tokens']} = 1 sampled token whose KV is not computed yet + "
            f"{k} drafts (len(request.spec_token_ids)): the code's num_tokens_with_spec - "
            f"num_computed_tokens = {req.num_tokens_with_spec} - {req.num_computed_tokens}, the "
            f"article's \"add len(spec_token_ids)\"",
            f"num_lookahead_tokens {sched.num_lookahead_tokens}: extra slots allocate_slots reserves "
            "beyond these for a drafter that writes KV for its own drafts (a draft model, EAGLE: k)"
            + ("; this drafter does: its forward writes the K/V of drafts 1..k-1 there"
               if sched.num_lookahead_tokens else
               "; this drafter reads token ids only (n-gram, suffix), so it needs none")]


def _spec5(frame: Any, tour: Any) -> list[str]:
    """spec.5: the row of token_ids_cpu as text, context then drafts."""
    f = frame.f_locals
    if tour.tokenizer is None:
        return []
    row = f["batch"].token_ids_cpu[f["row"], :f["start"]].tolist()
    return [f"as text: ...{decoded(tour.tokenizer, row[-12:])} + drafts "
            f"{decoded(tour.tokenizer, f['drafts'])}"]


def _spec6(frame: Any, tour: Any) -> list[str]:
    """spec.6: per request, its hidden-state rows and the ones picked for logits, and why."""
    f = frame.f_locals
    cu = [int(c) for c in f["cu_num_scheduled_tokens"]]
    picked = set(int(i) for i in f["logits_indices"])
    req_ids = f["self"].input_batch.req_ids
    lines, start = [], 0
    for i, (end, k) in enumerate(zip(cu, f["num_draft_tokens"])):
        rows = [r for r in range(start, end) if r in picked]
        why = (f"verify of {k} drafts: 1 + {k} rows, the row before each draft scores it, the last "
               "gives the bonus" if k else
               "prefill chunk: only its last row" if end - start > 1 else "decode, no drafts: its one row")
        lines.append(f"req {req_ids[i]}: rows {start}..{end - 1} -> logits rows {rows} ({why})")
        start = end
    return lines


def _spec7(frame: Any, tour: Any) -> list[str]:
    """spec.7: which rule ran, and each row's emitted tokens as text."""
    rule = ("block verification (rejection_sample_method='block')"
            if frame.f_locals["self"].backend == "block" else "the article's token-wise rule")
    if tour.tokenizer is None:
        return [f"rule: {rule}"]
    return [f"rule: {rule}"] + [f"row {i}: emits {decoded(tour.tokenizer, row)}"
                                for i, row in enumerate(frame.f_locals["output"].tolist())]


def _spec8(frame: Any, tour: Any) -> list[str]:
    """spec.8: which stop condition held, and what happens to the tokens after it."""
    f = frame.f_locals
    req, sched, emitted, i = f["request"], f["self"], f["new_token_ids"], f["i"]
    status = req.status.name
    if status == "FINISHED_LENGTH_CAPPED":
        why = (f"num_output_tokens {req.num_output_tokens} reached max_tokens {req.max_tokens}"
               if req.num_output_tokens >= req.max_tokens else
               f"num_tokens {req.num_tokens} reached max_model_len {sched.max_model_len}")
    elif req.stop_reason is None:
        why = f"token {f['token_id']} is the end-of-sequence token {req.eos_token_id}"
    else:
        why = f"stop {req.stop_reason!r} (a stop token id or stop string) came"
    n, dropped = len(emitted), len(emitted) - i - 1
    return [f"check_stop: {why}, so {status}",
            f"it runs after each token appended: this step gave the request {n} "
            f"token{'s' if n != 1 else ''} (a verify gives up to 1 + k), "
            + (f"the {dropped} after the stop dropped (plain decoding would never have made "
               f"{'it' if dropped == 1 else 'them'})" if dropped else "the stop its last"),
            "next the scheduler frees the request's blocks (_free_request) and its output goes "
            "back finished; the other requests repeat steps 2-7"]


def _lookup(frame: Any, tour: Any) -> list[str]:
    """pd.lookup: why this many tokens can come from the connector."""
    f = frame.f_locals
    n, bs = len(f["request"].prompt_token_ids), f["self"].block_size
    stored = (n - 1) // bs * bs
    lines = [f"the connector stores whole blocks strictly below the last prompt token: (n - 1) // "
             f"{bs} * {bs} = {stored} of {n} tokens; the last token is always computed here, its "
             "logits give the first output token"]
    if tour.instance == "prefill" and not f["num_external_computed_tokens"]:
        lines.append("0 here: nothing stored yet (a kv_both instance looks up on the prefill side "
                     "too; a kv_producer never loads)")
    return lines


def _layer_load(frame: Any, tour: Any) -> list[str]:
    """pd.layer_load: say when the per-layer call does nothing."""
    connector = frame.f_locals.get("connector")
    if connector is None or getattr(connector, "_layerwise", False):
        return []
    if not hasattr(connector, "_layerwise"):
        return [f"{type(connector).__name__} loads whole requests in start_load_kv (pd.enter) or "
                "its loader thread: this per-layer call returns at once"]
    return ["_layerwise is False (SharedStorageConnector's default): the whole request's KV was "
            "loaded in start_load_kv (pd.enter), so this per-layer call returns at once; "
            "kv_connector_extra_config={'layerwise': True} loads each layer here instead"]


def _layer_save(frame: Any, tour: Any) -> list[str]:
    """pd.layer_save: whose slot_mapping md's is (the batch's), which of its rows a request stores,
    which prompts store nothing, and what the per-layer save does, layerwise or not."""
    f = frame.f_locals
    md, connector = f["md"], f["connector"]
    loc = md.query_start_loc.tolist()
    counts = [b - a for a, b in zip(loc, loc[1:])]
    lines = [f"md.slot_mapping is the whole batch's: one paged-cache slot per token this step "
             f"computes, {sum(counts)} = {' + '.join(map(str, counts))} ({len(counts)} requests)"]
    if tour.instance == "decode":
        return lines + ["on the decode instance nothing is stored (is_store=False): this call "
                        "copies nothing"]
    describe = getattr(connector._get_connector_metadata(), "describe", None)
    stored = [d for d in (describe() if describe else []) if d.get("is_store")]
    lines.append("save_kv_layer copies only the rows the connector's metadata stores (each "
                 "request's own slot mapping): " + ("; ".join(
                     f"req {d['req_id']} tokens [{d['tokens'][0]}, {d['tokens'][1]}), "
                     f"{d['tokens'][1] - d['tokens'][0]} rows" for d in stored) or "none"))
    bs = f["self"].kv_cache.shape[2]
    short = [n for n in md.seq_lens.tolist() if n <= bs]
    if short:
        sizes = [f"{n}-" for n in short]
        sizes = ", ".join(sizes[:-1]) + " and " + sizes[-1] if len(sizes) > 1 else sizes[0]
        lines.append(f"a prompt stores its whole blocks below its last token, (n - 1) // {bs} * "
                     f"{bs} tokens: the {sizes}token prompt{'s' if len(short) > 1 else ''}, no "
                     f"longer than one block, store{'' if len(short) > 1 else 's'} nothing")
    return lines + ["every layer, layerwise or not: save_kv_layer gathers this layer's rows of "
                    "the stored prefix (their slot_mapping) from the paged cache into host memory "
                    "(vLLM's extract_kv_from_layer); storage is written later, in wait_for_save "
                    "(pd.exit; SharedStorageConnector: one file per layer)"]


def _exit(frame: Any, tour: Any) -> list[str]:
    connector = frame.f_locals.get("connector")
    if connector is not None and not hasattr(connector, "_storage_path"):
        return [f"{type(connector).__name__}: " + (
            "the prefill instance's wait_for_save wrote the stored chunks, meta value last; this "
            "decode instance only reads them" if tour.instance == "decode" else
            "wait_for_save just wrote each stored chunk (one value per layer, the meta value last)")]
    if tour.instance == "decode":
        return ["these files are the prefill instance's (its wait_for_save wrote them: meta.json + "
                "one file per attention layer); this decode instance only read them "
                "(is_store=False), its wait_for_save writes nothing"]
    return ["written by this instance's wait_for_save: meta.json + one file per attention layer"]


NOTES: dict[str, Callable[[Any, Any], list[str]]] = {
    "spec.1": _spec1, "spec.2": _spec2, "spec.3": _drafts, "spec.4": _spec4, "spec.5": _spec5,
    "spec.6": _spec6, "spec.7": _spec7, "spec.8": _spec8,
    "pd.lookup": _lookup, "pd.layer_load": _layer_load, "pd.layer_save": _layer_save,
    "pd.exit": _exit}
