"""Penalties under speculation, drawn from one verify step's ``"spec_verify"`` records.

vLLM 0.32's rejection sampler applies penalties and bad words at draft position j as if drafts
0..j-1 were already output (``RejectionSampler.apply_logits_processors``). Each tested draft's record
(``minivllm/sample/verify_record.py``) carries the ``penalty`` the sampler applied to the draft
token that way and the decision it made, and beside them ``penalty_drafts_ignored`` and
``accepted_if_drafts_ignored``: what a sampler counting only the committed outputs would have done.
These views lay the two side by side; none recomputes them.
"""
from __future__ import annotations

import math
from typing import Any, Optional

from minivllm.trace import StepRecord
from minivllm.learn.viz.records import StepsLike, spec_verify_of, steps_of
from minivllm.learn.viz.spec import token_text


def tested_drafts(positions: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The positions whose draft was tested and that carry the penalty fields."""
    return [p for p in positions if p["draft_token_id"] is not None and "penalty" in p]


def find_penalty_verify(source: StepsLike, min_drafts: int = 2,
                        need_flip: bool = True) -> Optional[tuple[int, str]]:
    """(step index, req_id) of the first verify with at least ``min_drafts`` tested drafts and (if
    ``need_flip``) a decision that ignoring the drafts in the penalty would have changed."""
    for i, s in enumerate(steps_of(source)):
        for req_id, positions in spec_verify_of(s).items():
            tested = tested_drafts(positions)
            flipped = any(p["accepted"] != p["accepted_if_drafts_ignored"] for p in tested)
            if len(tested) >= min_drafts and (flipped or not need_flip):
                return i, req_id
    return None


def _draft_text(tokenizer: Any, token_id: int) -> str:
    """The draft as shown; an async scheduler's ``-1`` placeholder (no draft came) is not a token
    the tokenizer could decode."""
    return "-1 (placeholder)" if token_id < 0 else repr(token_text(tokenizer, token_id))


def _penalty(x: Optional[float]) -> str:
    return "-" if x is None else ("-inf" if x == -math.inf else f"{x:+.2f}")


def _decision(p: dict[str, Any], ignored: bool, tokenizer: Any) -> str:
    suffix = "_drafts_ignored" if ignored else ""
    ok = p["accepted_if_drafts_ignored"] if ignored else p["accepted"]
    verdict = "accept" if ok else "reject"
    if p["uniform"] is None:   # greedy row: the draft against the argmax
        return f"{verdict} (argmax {token_text(tokenizer, p['target_argmax' + suffix])!r})"
    return f"{verdict} (p_target {p['p_target' + suffix]:.3f} vs u {p['uniform']:.3f})"


def render_penalty_verify_text(step: StepRecord, req_id: Optional[str] = None,
                               tokenizer: Any = None) -> str:
    """One line per tested draft: the penalty on the draft token and the decision, drafts counted
    (what the rejection sampler did) | drafts ignored (what it would have done)."""
    verifies = spec_verify_of(step)
    req_id = req_id if req_id is not None else next(iter(verifies))
    tested = tested_drafts(verifies[req_id])
    if not tested:
        raise ValueError(f"step {step.step} request {req_id!r} has no tested draft with penalties.")
    w = max(8, *(len(_draft_text(tokenizer, p["draft_token_id"])) for p in tested))
    lines = [f"step {step.step}, request {req_id}: {len(tested)} drafts tested",
             f"{'pos':>3}  {'draft':<{w}}  {'drafts counted (the sampler)':<36} | "
             f"drafts ignored (counterfactual)",
             f"{'':>3}  {'':<{w}}  {'penalty  decision':<36} | penalty  decision"]
    for j, p in enumerate(tested):
        draft = _draft_text(tokenizer, p["draft_token_id"])
        counted = f"{_penalty(p['penalty']):>7}  {_decision(p, False, tokenizer)}"
        ignored = f"{_penalty(p['penalty_drafts_ignored']):>7}  {_decision(p, True, tokenizer)}"
        flag = "   <- differs" if p["accepted"] != p["accepted_if_drafts_ignored"] else ""
        lines.append(f"{j:>3}  {draft:<{w}}  {counted:<36} | {ignored}{flag}")
        if not p["accepted"]:
            lines.append(f"{'':>3}  the sampler stops here and emits "
                         f"{token_text(tokenizer, p['output_token_id'])!r}")
    return "\n".join(lines)


def penalty_verify_figure(step: StepRecord, req_id: Optional[str] = None, tokenizer: Any = None,
                          fig: Any = None):
    """Bars of the penalty on each tested draft, drafts counted vs ignored, each marked with its
    decision (a masked draft, penalty -inf, is drawn at the bottom of the axis)."""
    import matplotlib.pyplot as plt

    verifies = spec_verify_of(step)
    req_id = req_id if req_id is not None else next(iter(verifies))
    tested = tested_drafts(verifies[req_id])
    if fig is None:
        fig = plt.figure(figsize=(7, 3))
    ax = fig.add_subplot(1, 1, 1)
    finite = [v for p in tested for v in (p["penalty"], p["penalty_drafts_ignored"])
              if v is not None and v != -math.inf]
    floor = min([0.0, *finite]) * 1.25 - 0.5
    for j, p in enumerate(tested):
        for dx, suffix, ok, color in ((-0.2, "", p["accepted"], "#4e79a7"),
                                      (0.2, "_drafts_ignored", p["accepted_if_drafts_ignored"],
                                       "#bab0ac")):
            pen = p["penalty" + suffix]     # None: a -1 placeholder, nothing to penalise
            v = floor if pen == -math.inf else (pen or 0.0)
            ax.bar(j + dx, v, width=0.38, color=color, edgecolor="black", linewidth=0.5,
                   label=None if j else ("earlier drafts counted (the sampler)" if not suffix
                                         else "drafts ignored"))
            ax.text(j + dx, min(v, 0.0) - 0.05 * abs(floor),
                    ("\u2713" if ok else "\u2717") + f"\np {p['p_target' + suffix]:.2f}",
                    ha="center", va="top", fontsize=8, color="#59a14f" if ok else "#e15759")
    ax.axhline(0, color="black", linewidth=0.6)
    ax.set_xticks(range(len(tested)),
                  [f"{j}: {_draft_text(tokenizer, p['draft_token_id'])}" for j, p in enumerate(tested)],
                  fontsize=8)
    ax.set_ylim(floor * 1.45, -0.3 * floor)
    ax.set_ylabel("penalty on the draft's logit", fontsize=8)
    ax.set_xlabel("draft position: \u2713 accepted / \u2717 rejected, p = p_target(draft)", fontsize=8)
    ax.set_title(f"step {step.step}, request {req_id}", fontsize=9)
    ax.legend(fontsize=7, loc="upper center", ncol=2, frameon=False)
    fig.tight_layout()
    return fig
