"""One speculative-decoding verify step, drawn from its records (in the spirit of the article's Fig. 11).

Reads the step's ``"schedule"`` event (``scheduled_spec_decode_tokens``: the drafts the target model
verifies this step) and its ``"spec_verify"`` events: per request, one dict per emitted position with
``draft_token_id``, ``p_target``, ``p_draft`` (1.0 for one-hot n-gram drafts), ``uniform`` (None on
greedy rows), ``accepted``, ``kind`` (accepted | rejected | recovered | bonus) and
``output_token_id``. A rejected draft's position also carries the recovered token the sampler drew
from ``max(p_target - p_draft, 0)``; a bonus position has no draft.
"""
from __future__ import annotations

from typing import Any, Optional

from minivllm.trace import StepRecord
from minivllm.learn.viz.records import StepsLike, schedule_of, spec_verify_of, steps_of

KIND_COLORS = {"context": "#f5f5f5", "accepted": "#59a14f", "rejected": "#e15759", "recovered": "#f28e2b",
               "bonus": "#4e79a7", "untested": "#e0e0e0"}


def token_text(tokenizer: Any, token_id: Optional[int]) -> str:
    if token_id is None:
        return "-"
    if tokenizer is None:
        return str(token_id)
    return repr(tokenizer.decode([token_id]))[1:-1] or "\u2205"


def verify_rows(step: StepRecord, req_id: str) -> dict[str, Any]:
    """The drafts and the emitted tokens of one request's verify, each with its status.

    ``drafts``: [(token, status)] with status accepted | rejected | untested (after a rejection the
    sampler stops); ``outputs``: [(token, kind)] with kind accepted | recovered | bonus;
    ``positions``: the recorded dicts."""
    positions = spec_verify_of(step).get(req_id)
    if positions is None:
        raise ValueError(f"step {step.step} has no verify for request {req_id!r}.")
    scheduled = list(schedule_of(step)["scheduled_spec_decode_tokens"].get(req_id, []))
    drafts, outputs = [], []
    for i, p in enumerate(positions):
        if p["draft_token_id"] is not None:
            drafts.append((p["draft_token_id"], "accepted" if p["accepted"] else "rejected"))
        if p["output_token_id"] is not None and p["output_token_id"] >= 0:
            kind = p["kind"] if p["kind"] in ("accepted", "bonus") else "recovered"
            outputs.append((p["output_token_id"], kind))
    for t in scheduled[len(drafts):]:
        drafts.append((t, "untested"))
    return {"drafts": drafts, "outputs": outputs, "positions": positions}


def default_position(positions: list[dict[str, Any]]) -> int:
    """The first rejected draft's position, else the last tested draft's."""
    tested = [i for i, p in enumerate(positions) if p["draft_token_id"] is not None]
    for i in tested:
        if not positions[i]["accepted"]:
            return i
    return tested[-1] if tested else 0


def decision_text(p: dict[str, Any]) -> str:
    """The accept/reject rule, filled in with the recorded numbers."""
    if p["draft_token_id"] is None:
        return "bonus: every draft passed, so one more token comes free from the last target row"
    verdict = "accepted" if p["accepted"] else "rejected"
    if p["uniform"] is None:
        return (f"greedy row: accept iff the draft is the target's argmax -> {verdict}"
                f" (p_target={p['p_target']:.3f})")
    ratio = p["p_target"] / p["p_draft"] if p["p_draft"] else 0.0
    sign = ">=" if ratio >= p["uniform"] else "<"
    return (f"p_target/p_draft = {p['p_target']:.3f}/{p['p_draft']:.3f} = {ratio:.3f} {sign} "
            f"u = {p['uniform']:.3f} -> {verdict}")


def render_spec_step_text(step: StepRecord, tokenizer: Any = None) -> str:
    lines = [f"step {step.step}: verify"]
    for req_id in spec_verify_of(step):
        rows = verify_rows(step, req_id)
        d = " ".join(f"{token_text(tokenizer, t)}[{s}]" for t, s in rows["drafts"])
        o = " ".join(f"{token_text(tokenizer, t)}[{k}]" for t, k in rows["outputs"])
        lines.append(f"  req {req_id}: drafts {d}")
        lines.append(f"  req {req_id}: output {o}")
        for i, p in enumerate(rows["positions"]):
            lines.append(f"    pos {i}: {decision_text(p)}")
    return "\n".join(lines)


def find_spec_verify(source: StepsLike, need_rejection: bool = True,
                     need_accept: bool = True) -> Optional[tuple[int, str]]:
    """(step index, req_id) of the first verify that has (as asked) an accepted and a rejected draft."""
    for i, s in enumerate(steps_of(source)):
        for req_id, positions in spec_verify_of(s).items():
            tested = [p for p in positions if p["draft_token_id"] is not None]
            acc = any(p["accepted"] for p in tested)
            rej = any(not p["accepted"] for p in tested)
            if (acc or not need_accept) and (rej or not need_rejection):
                return i, req_id
    return None


def find_spec_step(source: StepsLike, need_rejection: bool = True,
                   need_accept: bool = True) -> Optional[int]:
    """Index of the first step whose verify has (as asked) an accepted and a rejected draft."""
    found = find_spec_verify(source, need_rejection, need_accept)
    return None if found is None else found[0]


def spec_step_figure(step: StepRecord, req_id: Optional[str] = None, position: Optional[int] = None,
                     tokenizer: Any = None, context: Optional[list[int]] = None, fig: Any = None):
    """Drafts coloured accepted / rejected / untested, the emitted tokens coloured accepted /
    recovered / bonus, and for ``position`` (default: the first rejection) p_target, p_draft and the
    uniform draw behind the decision (a position past the last emitted one shows the last, so a
    slider can range over k + 1 positions). ``context``: optional token ids shown before the drafts."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch, Rectangle

    verifies = spec_verify_of(step)
    if not verifies:
        raise ValueError(f"step {step.step} verified no drafts; pick a step with a 'spec_verify' event.")
    req_id = req_id if req_id is not None else next(iter(verifies))
    rows = verify_rows(step, req_id)
    positions = rows["positions"]
    position = default_position(positions) if position is None else min(position, len(positions) - 1)
    if position < 0:
        raise ValueError(f"position must be >= 0, got {position}.")
    if fig is None:
        fig = plt.figure(figsize=(10, 3.8))
    grid = fig.add_gridspec(1, 2, width_ratios=[2.3, 1])
    ax, axp = fig.add_subplot(grid[0]), fig.add_subplot(grid[1])
    ctx = [] if context is None else list(context)[-4:]
    ncols = len(ctx) + max(len(rows["drafts"]), len(rows["outputs"]))
    ax.set_xlim(-1.9, ncols + 0.2)
    ax.set_ylim(3.3, -0.6)
    ax.axis("off")

    def box(x, y, token, kind, hl=False):
        ax.add_patch(Rectangle((x, y), 0.94, 0.8, facecolor=KIND_COLORS.get(kind, "white"),
                               edgecolor="black", linewidth=2.2 if hl else 0.6))
        ax.text(x + 0.47, y + 0.4, token_text(tokenizer, token)[:9], ha="center", va="center",
                fontsize=8)

    ax.text(-1.9, -0.35, f"Step {step.step}, request {req_id}: the target model verifies "
            f"{len(rows['drafts'])} drafts in one forward pass", fontsize=9)
    ax.text(-1.85, 0.45, "drafts", fontsize=8, va="center")
    ax.text(-1.85, 2.05, "emitted", fontsize=8, va="center")
    for i, t in enumerate(ctx):
        box(i, 0.05, t, "context")
        box(i, 1.65, t, "context")
    base = len(ctx)
    for i, (t, s) in enumerate(rows["drafts"]):
        box(base + i, 0.05, t, s, hl=i == position)
        p = positions[i] if i < len(positions) else None
        if p is not None and p["p_target"] is not None:
            ax.text(base + i + 0.47, 1.2, f"pt {p['p_target']:.2f}\npd {p['p_draft']:.2f}"
                    + ("" if p["uniform"] is None else f"\nu {p['uniform']:.2f}"),
                    ha="center", va="center", fontsize=6)
    for i, (t, k) in enumerate(rows["outputs"]):
        box(base + i, 1.65, t, k, hl=i == position)
    legend = [Patch(facecolor=c, edgecolor="black", label=k) for k, c in KIND_COLORS.items()]
    ax.legend(handles=legend, fontsize=7, ncol=5, loc="upper center", bbox_to_anchor=(0.5, 0.12))

    p = positions[position]
    axp.set_title(f"position {position}: {p['kind']}", fontsize=9)
    if p["draft_token_id"] is None:
        axp.axis("off")
        axp.text(0, 0.5, "bonus token:\nall drafts passed;\nsampled from the target's\n"
                 "distribution after\nthe last draft", fontsize=8, va="center")
    else:
        vals = [p["p_target"], p["p_draft"]]
        names = ["p_target(x)", "p_draft(x)"]
        colors = ["#4e79a7", "#9c755f"]
        if p["uniform"] is not None:
            ratio = p["p_target"] / p["p_draft"] if p["p_draft"] else 0.0
            vals += [min(ratio, 1.0), p["uniform"]]
            names += ["min(1, pt/pd)", "uniform u"]
            colors += ["#59a14f" if p["accepted"] else "#e15759", "#bab0ac"]
        bars = axp.bar(range(len(vals)), vals, color=colors)
        for b, v in zip(bars, vals):
            axp.text(b.get_x() + b.get_width() / 2, v, f"{v:.3f}", ha="center", va="bottom",
                     fontsize=7)
        axp.set_xticks(range(len(vals)), names, fontsize=7, rotation=15)
        axp.set_ylim(0, 1.15)
        axp.set_xlabel(f"x = {token_text(tokenizer, p['draft_token_id'])!s}", fontsize=8)
        fig.text(0.99, 0.01, decision_text(p), ha="right", va="bottom", fontsize=7)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    return fig
