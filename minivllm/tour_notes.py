"""What the tour prints under a stop's values: why the numbers are what they are, and token ids as text.

Each note reads the stop's live frame (the same locals the step's ``show`` expressions read) and the
tour (its tokenizer, which instance runs); none changes anything. ``NOTES`` maps step id to note.
"""
from __future__ import annotations

from typing import Any, Callable


def short(value: Any, limit: int = 240) -> str:
    """``repr(value)`` (a tensor as a list), cut at ``limit`` characters."""
    if hasattr(value, "tolist") and getattr(value, "ndim", 1) <= 2:
        value = value.tolist()
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + " ..."


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
            if frame.f_locals.get("backend") == "block" else "the article's token-wise rule")
    if tour.tokenizer is None:
        return [f"rule: {rule}"]
    return [f"rule: {rule}"] + [f"row {i}: emits {decoded(tour.tokenizer, row)}"
                                for i, row in enumerate(frame.f_locals["output"].tolist())]


def speculation_summary(llm: Any, outputs: list[Any]) -> list[str]:
    """The numbers speculation changes, from the engine's counters: output tokens per engine step
    (one target forward over the batch), and tokens per verify (``vllm:spec_decode_*``)."""
    metrics = {m.name: getattr(m, "value", None) for m in llm.get_metrics()}
    n = sum(len(o.outputs[0].token_ids) for o in outputs)
    steps = llm.llm_engine.engine_core.step_index
    lines = [f"{n} output tokens in {steps} engine steps (one target forward each, over the batch)"]
    verifies = metrics.get("vllm:spec_decode_num_drafts")
    if verifies:
        accepted = metrics["vllm:spec_decode_num_accepted_tokens"]
        lines.append(f"{verifies} verify steps: {accepted} of "
                     f"{metrics['vllm:spec_decode_num_draft_tokens']} drafts accepted, so a verify "
                     f"emitted 1 + {accepted}/{verifies} = {1 + accepted / verifies:.2f} tokens of its "
                     "request for one forward (plain decoding: 1)")
    return lines


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
    """pd.layer_save: what the per-layer save does, layerwise or not."""
    if tour.instance == "decode":
        return ["on the decode instance nothing is stored (is_store=False): this call copies nothing"]
    return ["every layer, layerwise or not: save_kv_layer gathers this layer's rows of the stored "
            "prefix (their slot_mapping) from the paged cache into host memory (vLLM's "
            "extract_kv_from_layer); storage is written later, in wait_for_save (pd.exit; "
            "SharedStorageConnector: one file per layer)"]


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
    "spec.2": _spec2, "spec.3": _drafts, "spec.4": _spec4, "spec.5": _spec5, "spec.6": _spec6, "spec.7": _spec7,
    "pd.lookup": _lookup, "pd.layer_load": _layer_load, "pd.layer_save": _layer_save,
    "pd.exit": _exit}
