"""Read step records (``minivllm.trace``) into the plain shapes the views draw.

Nothing here recomputes what the engine did: every function only selects and regroups fields of the
events the engine recorded (see ``minivllm/trace.py`` for the event kinds).
"""
from __future__ import annotations

from collections import Counter
from typing import Any, Iterable, Optional, Sequence, Union

from minivllm.trace import StepRecord, Tracer

StepsLike = Union[Tracer, Sequence[StepRecord]]


def steps_of(source: StepsLike) -> list[StepRecord]:
    """The step records of a ``Tracer`` (or a list of them), checked to be non-empty."""
    steps = list(source.steps if isinstance(source, Tracer) else source)
    if not steps:
        raise ValueError("no step records: set engine.tracer.enabled = True before running requests.")
    return steps


def schedule_of(step: StepRecord) -> dict[str, Any]:
    """The step's ``"schedule"`` event (there is exactly one per engine step)."""
    ev = step.first("schedule")
    if ev is None:
        raise ValueError(f"step {step.step} has no 'schedule' event.")
    return ev


def kv_cache_of(step: StepRecord) -> dict[str, Any]:
    """The step's ``"kv_cache"`` event: block tables and the pool, right after scheduling."""
    ev = step.first("kv_cache")
    if ev is None:
        raise ValueError(f"step {step.step} has no 'kv_cache' event.")
    return ev


def prefix_hits_of(step: StepRecord) -> dict[str, tuple[int, int]]:
    """{req_id: (num_local_computed_tokens, num_external_computed_tokens)} for requests admitted."""
    return {e["req_id"]: (e["num_local_computed_tokens"], e["num_external_computed_tokens"])
            for e in step.of("prefix_hit")}


def spec_verify_of(step: StepRecord) -> dict[str, list[dict[str, Any]]]:
    """{req_id: positions} of the rejection sampler's decisions in this step.

    The model runner records one event per request with drafts, keyed by ``req_id``; the rejection
    sampler may record the same decisions keyed by batch row (``req_index``). Row events are used only
    when no ``req_id`` event exists, mapped to ids through the step's ``"slot_mapping"`` row order,
    and only for rows that were scheduled with drafts.
    """
    by_id = {e["req_id"]: e["positions"] for e in step.of("spec_verify") if "req_id" in e}
    if by_id:
        return by_id
    rows = step.first("slot_mapping")
    sched = step.first("schedule")
    if rows is None:
        return {}
    with_drafts = set(sched["scheduled_spec_decode_tokens"]) if sched else None
    out = {}
    for e in step.of("spec_verify"):
        req_id = rows["req_ids"][e["req_index"]]
        if with_drafts is None or req_id in with_drafts:
            out[req_id] = e["positions"]
    return out


def verify_steps(source: StepsLike) -> list[tuple[int, str, list[dict[str, Any]]]]:
    """Every (step, req_id, positions) with drafts, in order."""
    return [(s.step, r, pos) for s in steps_of(source) for r, pos in spec_verify_of(s).items()]


def num_accepted(positions: Iterable[dict[str, Any]]) -> int:
    """Drafts accepted in one verify (the accepted prefix, as recorded)."""
    return sum(1 for p in positions if p.get("accepted") and p.get("draft_token_id") is not None)


def num_drafted(positions: Iterable[dict[str, Any]], scheduled: Optional[int] = None) -> int:
    """Drafts tested in one verify: the scheduled count when known (positions stop at a rejection)."""
    if scheduled is not None:
        return scheduled
    return sum(1 for p in positions if p.get("draft_token_id") is not None)


def acceptance_from_tracer(source: StepsLike, req_id: Optional[str] = None) -> dict[str, Any]:
    """Per-position counts from the recorded verifies: {num_drafts, num_draft_tokens,
    num_accepted_tokens, num_accepted_tokens_per_pos, accepted_lengths} (vLLM's counter names),
    over every request or, with ``req_id``, that one's alone (vLLM 0.32's per-request metrics)."""
    per_pos: Counter = Counter()
    lengths = []
    num_draft_tokens = 0
    for s in steps_of(source):
        sched = schedule_of(s)["scheduled_spec_decode_tokens"]
        for rid, positions in spec_verify_of(s).items():
            if req_id is not None and rid != req_id:
                continue
            a = num_accepted(positions)
            lengths.append(a)
            num_draft_tokens += num_drafted(positions, len(sched.get(rid, [])) or None)
            for i in range(a):
                per_pos[i] += 1
    k = max(per_pos, default=-1) + 1
    return {"num_drafts": len(lengths), "num_draft_tokens": num_draft_tokens,
            "num_accepted_tokens": sum(lengths),
            "num_accepted_tokens_per_pos": [per_pos[i] for i in range(k)],
            "accepted_lengths": lengths}


def acceptance_from_metrics(metrics: Sequence[Any]) -> dict[str, Any]:
    """The same counters read from ``LLM.get_metrics()`` (names end with vLLM's)."""
    found: dict[str, Any] = {}
    for m in metrics:
        short = m.name.split(":")[-1]
        found[short] = list(m.values) if hasattr(m, "values") else m.value
    needed = ("spec_decode_num_drafts", "spec_decode_num_draft_tokens",
              "spec_decode_num_accepted_tokens", "spec_decode_num_accepted_tokens_per_pos")
    missing = [n for n in needed if n not in found]
    if missing:
        raise ValueError(f"metrics lack {missing}: was the LLM built with a speculative_config?")
    return {"num_drafts": found[needed[0]], "num_draft_tokens": found[needed[1]],
            "num_accepted_tokens": found[needed[2]],
            "num_accepted_tokens_per_pos": found[needed[3]], "accepted_lengths": None}


def acceptance_counts(source: Any) -> dict[str, Any]:
    """Counters from a ``Tracer`` / list of step records, or from ``LLM.get_metrics()``."""
    if isinstance(source, Tracer) or (isinstance(source, (list, tuple)) and source
                                      and isinstance(source[0], StepRecord)):
        return acceptance_from_tracer(source)
    return acceptance_from_metrics(source)


def output_tokens_before(source: StepsLike, step_index: int, req_id: str) -> list[int]:
    """The tokens a request had sampled before ``steps[step_index]``, from the ``"sampled"`` events
    (a preemption keeps them: the request recomputes, it does not resample)."""
    out: list[int] = []
    for s in steps_of(source)[:step_index]:
        ev = s.first("sampled")
        if ev is not None:
            out.extend(ev["sampled"].get(req_id, []))
    return out


def connector_calls(source: StepsLike) -> list[dict[str, Any]]:
    """Every ``"connector"`` event, tagged with its step, in call order."""
    return [{"step": s.step, **e} for s in steps_of(source) for e in s.events
            if e["kind"] == "connector"]


def request_states(source: StepsLike) -> dict[str, list[Optional[str]]]:
    """{req_id: per step one of None (not seen yet), "waiting", "prefill", "decode", "stalled",
    "preempted", "done"}, read from each step's schedule and sampled events.

    A running request is "prefill" in a step where it sampled nothing or had no output before (its
    prompt is being computed), "decode" otherwise; "done" once it stops appearing after running."""
    steps = steps_of(source)
    ids: list[str] = []
    for s in steps:
        ev = schedule_of(s)
        for r in list(ev["num_scheduled_tokens"]) + ev["waiting"] + ev["preempted_req_ids"]:
            if r not in ids:
                ids.append(r)
    states: dict[str, list[Optional[str]]] = {r: [] for r in ids}
    has_output: set[str] = set()
    for s in steps:
        ev = schedule_of(s)
        sampled = (s.first("sampled") or {}).get("sampled", {})
        for r in ids:
            prev = states[r][-1] if states[r] else None
            if r in ev["preempted_req_ids"]:
                st = "preempted"
                has_output.discard(r)
            elif r in ev["num_scheduled_tokens"]:
                st = "decode" if r in has_output else "prefill"
                if sampled.get(r):
                    has_output.add(r)
            elif r in ev["waiting"]:
                st = "waiting"
            elif r in ev["running"]:
                st = "stalled"     # running, but no budget or blocks left for it this step
            elif prev in ("prefill", "decode", "done"):
                st = "done"
            else:
                st = prev
            states[r].append(st)
    return states
