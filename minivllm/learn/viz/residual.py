"""A rejected draft and the residual distribution its recovered token is drawn from (notebook 02).

The ``"spec_verify"`` records keep, per position, the draft's ``p_target`` and ``p_draft``, the
uniform draw and the emitted token, but not whole distributions. ``VerifyProbe`` keeps those too:
while it is open, each rejection-sampler call adds a ``"verify_probs"`` event to the step being
recorded, with the distributions the sampler tested the drafts against:

- ``target_probs`` ``[num_draft_tokens, vocab]`` float32: the softmax of the sampler's own
  ``last_target_logits`` (its logits after the logits processors and the sampling constraints);
- ``draft_probs`` ``[num_draft_tokens, vocab]`` or ``None`` (one-hot drafts: n-gram, greedy drafters);
- ``req_ids``: the batch rows' request ids, ``num_draft_tokens``: drafts per row;
- ``logits_indices``, ``target_logits_indices``, ``bonus_logits_indices``: the step's
  ``SpecDecodeMetadata`` (step 6: which hidden-state rows got logits).

The residual ``max(p_target - p_draft, 0)`` is then the lesson's arithmetic on those tensors (for a
one-hot draft: ``p_target`` with the draft token set to 0, ``sample/rejection_sampler.py``,
``target_probs.scatter(-1, idx, 0.0)``); the decision and the recovered token are the records'.
"""
from __future__ import annotations

import inspect
from typing import Any, Optional

import torch

from minivllm import trace
from minivllm.trace import StepRecord
from minivllm.learn.viz.records import spec_verify_of
from minivllm.learn.viz.spec import token_text


class VerifyProbe:
    """``with VerifyProbe(engine): engine.step()`` adds ``"verify_probs"`` events (see the module)."""

    def __init__(self, engine: Any) -> None:
        self.runner = engine.engine_core.worker.model_runner
        self.sampler = self.runner.rejection_sampler

    def __enter__(self) -> "VerifyProbe":
        original = type(self.sampler).forward
        sampler, runner = self.sampler, self.runner

        signature = inspect.signature(original)

        def forward(*args, **kwargs):
            output = original(sampler, *args, **kwargs)
            bound = signature.bind(sampler, *args, **kwargs).arguments
            metadata, draft_probs = bound["metadata"], bound["draft_probs"]
            logits = sampler.last_target_logits
            trace.record("verify_probs", req_ids=list(runner.input_batch.req_ids[:output.shape[0]]),
                         num_draft_tokens=list(metadata.num_draft_tokens),
                         logits_indices=metadata.logits_indices.tolist(),
                         target_logits_indices=metadata.target_logits_indices.tolist(),
                         bonus_logits_indices=metadata.bonus_logits_indices.tolist(),
                         target_probs=logits.softmax(dim=-1, dtype=torch.float32).cpu(),
                         draft_probs=None if draft_probs is None else draft_probs.float().cpu())
            return output

        sampler.forward = forward
        return self

    def __exit__(self, *exc: Any) -> None:
        del self.sampler.forward          # the class's forward again


def rejection_of(step: StepRecord, req_id: str) -> Optional[dict[str, Any]]:
    """The first rejected draft of ``req_id`` in ``step``: its recorded position (``draft_token_id``,
    ``p_target``, ``p_draft``, ``uniform``, ``output_token_id`` = the recovered token) plus, from the
    step's ``"verify_probs"`` event, ``target`` and ``draft`` ``[vocab]`` (``draft`` one-hot for a
    one-hot drafter) and ``residual``, ``max(target - draft, 0)`` normalised. None: no rejection."""
    positions = spec_verify_of(step).get(req_id, [])
    pos = next((i for i, p in enumerate(positions)
                if p["draft_token_id"] is not None and not p["accepted"]), None)
    if pos is None:
        return None
    p = positions[pos]
    ev = next(e for e in step.of("verify_probs") if req_id in e["req_ids"])
    row = ev["req_ids"].index(req_id)
    t = sum(ev["num_draft_tokens"][:row]) + pos
    target = ev["target_probs"][t]
    if ev["draft_probs"] is None:
        draft = torch.zeros_like(target)
        draft[p["draft_token_id"]] = 1.0
    else:
        draft = ev["draft_probs"][t]
    residual = (target - draft).clamp_min(0.0)
    return {**p, "position": pos, "target": target, "draft": draft, "one_hot": ev["draft_probs"] is None,
            "residual": residual / residual.sum()}


def _top(r: dict[str, Any], n: int) -> list[int]:
    """The residual's top ``n`` tokens, plus the draft and the recovered token if not among them."""
    ids = r["residual"].topk(min(n, r["residual"].numel())).indices.tolist()
    extra = [r["draft_token_id"], r["output_token_id"]]
    if not r["one_hot"]:
        extra += r["draft"].topk(2).indices.tolist()     # where the drafter put its own mass
    return ids + [t for t in dict.fromkeys(extra) if t not in ids]


def render_rejection_text(r: dict[str, Any], tokenizer: Any = None, n: int = 6) -> str:
    """The accept test with its numbers, then p_target, p_draft and the normalised residual of the top
    tokens, and the recovered token (the records' ``output_token_id``)."""
    x = token_text(tokenizer, r["draft_token_id"])
    test = ("greedy row: not the target's argmax" if r["uniform"] is None else
            f"p_target/p_draft = {r['p_target']:.3f}/{r['p_draft']:.3f} = "
            f"{r['p_target'] / r['p_draft']:.3f} < u = {r['uniform']:.3f}")
    lines = [f"position {r['position']}: draft {r['draft_token_id']} ({x!r}) rejected: {test}",
             f"residual = max(p_target - p_draft, 0) / sum"
             + ("  (one-hot draft: p_target without the draft token)" if r["one_hot"] else ""),
             f"  {'token':>7} {'text':12} {'p_target':>9} {'p_draft':>8} {'residual':>9}"]
    for t in _top(r, n):
        mark = ("  <- draft" if t == r["draft_token_id"] else "") + (
            "  <- recovered" if t == r["output_token_id"] else "")
        lines.append(f"  {t:7d} {token_text(tokenizer, t)[:12]:12} {r['target'][t].item():9.4f} "
                     f"{r['draft'][t].item():8.4f} {r['residual'][t].item():9.4f}{mark}")
    rec = r["output_token_id"]
    lines.append(f"recovered token: {rec} ({token_text(tokenizer, rec)!r}), residual probability "
                 f"{r['residual'][rec].item():.4f}")
    return "\n".join(lines)


def residual_figure(r: dict[str, Any], tokenizer: Any = None, n: int = 8, ax: Any = None):
    """Bars of p_target, p_draft and the normalised residual over the residual's top tokens."""
    import matplotlib.pyplot as plt
    if ax is None:
        _, ax = plt.subplots(figsize=(9, 3))
    ids = _top(r, n)
    x = torch.arange(len(ids)).float()
    for i, (key, color) in enumerate((("target", "#4e79a7"), ("draft", "#9c755f"),
                                      ("residual", "#f28e2b"))):
        ax.bar((x + (i - 1) * 0.27).tolist(), [r[key][t].item() for t in ids], width=0.27,
               color=color, label={"target": "p_target", "draft": "p_draft",
                                   "residual": "residual (normalised)"}[key])
    labels = [token_text(tokenizer, t)[:8] + ("\n(draft)" if t == r["draft_token_id"] else "")
              + ("\n(recovered)" if t == r["output_token_id"] else "") for t in ids]
    ax.set_xticks(x.tolist(), labels, fontsize=7)
    ax.set_ylabel("probability")
    ax.set_title(f"position {r['position']}: the recovered token is drawn from the residual",
                 fontsize=9)
    ax.legend(fontsize=7)
    return ax.figure


def race_counts(residual: torch.Tensor, draws: int, seed: int = 0) -> torch.Tensor:
    """How often each token wins the exponential race ``argmax(residual / q)``, ``q ~ Exp(1)``
    drawn afresh each time (the recovered-token rule), over ``draws`` races: ``[vocab]`` counts."""
    g = torch.Generator().manual_seed(seed)
    support = residual.nonzero().squeeze(-1)          # tokens with residual 0 never win
    wins = torch.zeros_like(residual)
    for chunk in torch.arange(draws).split(128):
        q = torch.empty(len(chunk), len(support)).exponential_(generator=g)
        winners = support[(residual[support] / q).argmax(dim=-1)]
        wins += torch.bincount(winners, minlength=residual.numel()).to(wins.dtype)
    return wins


def race_figure(residual: torch.Tensor, wins: torch.Tensor, tokenizer: Any = None, n: int = 8,
                ax: Any = None):
    """The race's win frequencies beside the normalised residual, on the residual's top tokens."""
    import matplotlib.pyplot as plt
    if ax is None:
        _, ax = plt.subplots(figsize=(9, 2.8))
    n = min(n, residual.numel())
    ids = residual.topk(n).indices.tolist()
    x = torch.arange(n).float()
    ax.bar((x - 0.2).tolist(), [residual[t].item() for t in ids], width=0.4, color="#f28e2b",
           label="residual (normalised)")
    ax.bar((x + 0.2).tolist(), [(wins[t] / wins.sum()).item() for t in ids], width=0.4,
           color="#76b7b2", label=f"argmax(residual / q): share of {int(wins.sum())} races")
    ax.set_xticks(x.tolist(), [token_text(tokenizer, t)[:8] for t in ids], fontsize=7)
    ax.legend(fontsize=7)
    return ax.figure


def render_logits_rows_text(step: StepRecord) -> str:
    """Step 6 from the records: each request's hidden-state rows in the batch, and which of them the
    step's ``SpecDecodeMetadata`` (``"verify_probs"`` event) picked for logits, and why."""
    ev = step.first("verify_probs")
    if ev is None:
        raise ValueError(f"step {step.step} has no 'verify_probs' event: run it inside VerifyProbe.")
    order = step.first("slot_mapping")["req_ids"]
    sched = step.first("schedule")
    picked, start, lines = set(ev["logits_indices"]), 0, []
    for req_id in order:
        n = sched["num_scheduled_tokens"][req_id]
        k = len(sched["scheduled_spec_decode_tokens"].get(req_id, []))
        rows = list(range(start, start + n))
        mine = [r for r in rows if r in picked]
        why = (f"verify: 1 sampled token + {k} drafts; the row before each draft scores that draft, "
               f"the last row gives the bonus" if k else
               "no drafts (a prefill chunk or a plain decode): only its last row samples the next token")
        lines.append(f"  req {req_id}: rows {rows[0]}..{rows[-1]} ({n} tokens) -> logits rows {mine}: {why}")
        start += n
    lines.append(f"  logits_indices = {ev['logits_indices']}")
    lines.append(f"  target_logits_indices = {ev['target_logits_indices']} (into the logits rows), "
                 f"bonus_logits_indices = {ev['bonus_logits_indices']}")
    return "\n".join(lines)


def slot_rows(step: StepRecord, req_id: str, block_size: int, lookahead: int) -> dict[str, int]:
    """One request's KV slots at a step, from its ``"kv_cache"`` and ``"schedule"`` records:
    ``computed`` (KV already written before this step), ``scheduled`` (this step: 1 sampled token +
    the drafts), ``lookahead`` (the scheduler's ``num_lookahead_tokens``, passed in), ``reserved``
    (whole blocks). The ``"kv_cache"`` record is taken after ``_update_after_schedule``, whose
    ``num_computed_tokens`` already counts this step's tokens: they are taken off again."""
    kv, sched = step.first("kv_cache"), step.first("schedule")
    scheduled = sched["num_scheduled_tokens"][req_id]
    return {"computed": kv["num_computed_tokens"][req_id] - scheduled,
            "scheduled": scheduled,
            "drafts": len(sched["scheduled_spec_decode_tokens"].get(req_id, [])),
            "lookahead": lookahead, "blocks": len(kv["block_tables"][req_id]),
            "reserved": len(kv["block_tables"][req_id]) * block_size, "block_size": block_size}


def lookahead_figure(rows: dict[str, dict[str, int]], ax: Any = None):
    """Per request (``{label: slot_rows(...)}``) a bar of its reserved slots: computed, this step's
    1 + k, the lookahead slots a drafter with its own KV writes into, and the rest of the last block."""
    import matplotlib.pyplot as plt
    if ax is None:
        _, ax = plt.subplots(figsize=(9, 0.9 + 0.7 * len(rows)))
    colors = {"computed": "#bab0ac", "scheduled": "#4e79a7", "lookahead": "#f28e2b", "free": "white"}
    for y, (label, r) in enumerate(rows.items()):
        parts = [("computed", r["computed"]), ("scheduled", r["scheduled"]),
                 ("lookahead", r["lookahead"])]
        parts.append(("free", r["reserved"] - sum(n for _, n in parts)))
        left = 0
        for name, n in parts:
            ax.barh(y, n, left=left, color=colors[name], edgecolor="black", linewidth=0.5,
                    label=name if y == 0 else None)
            left += n
        for b in range(1, r["blocks"]):
            ax.axvline(b * r["block_size"], ymin=0, ymax=1, color="black", linewidth=0.3)
    ax.set_yticks(range(len(rows)), list(rows), fontsize=8)
    ax.set_xlabel("KV slots of the request (vertical lines: block boundaries)")
    ax.legend(fontsize=7, ncol=4, loc="upper center", bbox_to_anchor=(0.5, -0.45))
    ax.figure.tight_layout()
    return ax.figure
