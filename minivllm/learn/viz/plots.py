"""Plots over many steps: token budget, request lifecycle, free blocks, draft acceptance.

Every plot reads recorded events (``minivllm/trace.py``) or ``LLM.get_metrics()``; none recomputes
what the engine did.
"""
from __future__ import annotations

from typing import Any, Mapping, Optional, Union

from minivllm.learn.viz.block_table import request_color
from minivllm.learn.viz.records import (StepsLike, acceptance_counts, kv_cache_of, request_states,
                                  schedule_of, steps_of)

STATE_COLORS = {"waiting": "#d9d9d9", "prefill": "#f28e2b", "decode": "#4e79a7",
                "stalled": "#bab0ac", "preempted": "#e15759", "done": "#ffffff"}


def _axes(ax, figsize):
    import matplotlib.pyplot as plt
    if ax is None:
        fig, ax = plt.subplots(figsize=figsize)
    return ax.figure, ax


def token_budget_plot(source: StepsLike, ax=None, show_budget: Optional[bool] = None):
    """Stacked bars: tokens scheduled per request per step (drafts hatched), against the budget.

    The budget line is drawn when it is within 4x of the busiest step (else it would flatten the
    bars); ``show_budget`` forces it on or off."""
    steps = steps_of(source)
    fig, ax = _axes(ax, (9, 3.2))
    budget = schedule_of(steps[0])["token_budget"]
    peak = 0
    for s in steps:
        sched = schedule_of(s)
        bottom = 0
        for req_id, n in sched["num_scheduled_tokens"].items():
            drafts = len(sched["scheduled_spec_decode_tokens"].get(req_id, []))
            color = request_color(req_id)
            ax.bar(s.step, n - drafts, bottom=bottom, color=color, edgecolor="black", linewidth=0.3)
            if drafts:
                ax.bar(s.step, drafts, bottom=bottom + n - drafts, color=color, hatch="///",
                       edgecolor="black", linewidth=0.3)
            bottom += n
        peak = max(peak, bottom)
        for _ in s.of("preempt"):
            ax.annotate("preempt", (s.step, bottom), xytext=(0, 6), textcoords="offset points",
                        ha="center", fontsize=7, color="#e15759")
    if show_budget or (show_budget is None and budget <= 4 * max(peak, 1)):
        ax.axhline(budget, color="black", linestyle="--", linewidth=1)
        ax.text(steps[-1].step, budget, "token budget", va="bottom", ha="right", fontsize=8)
        ax.set_ylim(0, budget * 1.12)
    else:
        ax.set_title(f"(token budget {budget} per step is off the chart)", fontsize=8, loc="right")
    ax.set_xlabel("engine step")
    ax.set_ylabel("scheduled tokens")
    ids = list(dict.fromkeys(r for s in steps for r in schedule_of(s)["num_scheduled_tokens"]))
    from matplotlib.patches import Patch
    handles = [Patch(color=request_color(r), label=f"req {r}") for r in ids[:10]]
    handles.append(Patch(facecolor="white", edgecolor="black", hatch="///", label="drafts"))
    ax.legend(handles=handles, fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    return fig


def request_timeline_plot(source: StepsLike, ax=None):
    """One row per request, one cell per step: waiting, prefill, decode, stalled, preempted, done."""
    from matplotlib.patches import Patch
    states = request_states(source)
    steps = steps_of(source)
    fig, ax = _axes(ax, (9, 0.45 * len(states) + 1.4))
    for row, (req_id, per_step) in enumerate(states.items()):
        for s, st in zip(steps, per_step):
            if st is None:
                continue
            ax.barh(row, 1, left=s.step - 0.5, color=STATE_COLORS[st], edgecolor="#888888",
                    linewidth=0.3)
    ax.set_yticks(range(len(states)), [f"req {r}" for r in states])
    ax.invert_yaxis()
    ax.set_xlabel("engine step")
    ax.legend(handles=[Patch(facecolor=c, edgecolor="#888888", label=k)
                       for k, c in STATE_COLORS.items()], fontsize=7, ncol=6,
              loc="upper center", bbox_to_anchor=(0.5, -0.3 * 4 / max(len(states), 4)))
    fig.tight_layout()
    return fig


def kv_usage_plot(source: StepsLike, ax=None):
    """Free blocks after each step's scheduling, preemptions marked."""
    steps = steps_of(source)
    fig, ax = _axes(ax, (9, 2.6))
    xs = [s.step for s in steps]
    free = [kv_cache_of(s)["num_free_blocks"] for s in steps]
    total = kv_cache_of(steps[0])["num_gpu_blocks"]
    ax.step(xs, free, where="mid", color="#4e79a7", label="free blocks")
    ax.axhline(total - 1, color="#888888", linestyle=":", linewidth=1, label="usable (all - null)")
    for s in steps:
        if s.of("preempt"):
            ax.axvline(s.step, color="#e15759", linewidth=1, alpha=0.7)
    from matplotlib.ticker import MaxNLocator
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylim(bottom=0)
    ax.set_xlabel("engine step")
    ax.set_ylabel("blocks")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    return fig


AcceptanceSource = Union[Any, Mapping[str, Any]]


def _sources(source: AcceptanceSource) -> dict[str, dict[str, Any]]:
    if isinstance(source, Mapping):
        return {label: acceptance_counts(s) for label, s in source.items()}
    return {"": acceptance_counts(source)}


def acceptance_rates(counts: dict[str, Any]) -> list[float]:
    """vLLM's per-position acceptance rate: accepted at position i / number of drafts."""
    d = counts["num_drafts"]
    return [a / d if d else float("nan") for a in counts["num_accepted_tokens_per_pos"]]


def mean_acceptance_length(counts: dict[str, Any]) -> float:
    """vLLM's mean acceptance length: 1 + accepted tokens / drafts (tokens per verify step)."""
    d = counts["num_drafts"]
    return 1.0 + counts["num_accepted_tokens"] / d if d else float("nan")


def acceptance_per_position_plot(source: AcceptanceSource, ax=None):
    """Bars: acceptance rate at each draft position. ``source``: a Tracer, ``LLM.get_metrics()``, or
    a dict {label: either} to compare runs side by side."""
    import numpy as np
    runs = _sources(source)
    fig, ax = _axes(ax, (6, 3))
    width = 0.8 / len(runs)
    for j, (label, counts) in enumerate(runs.items()):
        rates = acceptance_rates(counts)
        xs = np.arange(len(rates)) + (j - (len(runs) - 1) / 2) * width
        mal = mean_acceptance_length(counts)
        name = f"{label} " if label else ""
        bars = ax.bar(xs, rates, width=width,
                      label=f"{name}(mean acceptance length {mal:.2f}, {counts['num_drafts']} drafts)")
        for b, r in zip(bars, rates):
            ax.text(b.get_x() + b.get_width() / 2, r, f"{r:.2f}", ha="center", va="bottom", fontsize=7)
    k = max(len(c["num_accepted_tokens_per_pos"]) for c in runs.values())
    ax.set_xticks(range(k), [f"draft {i}" for i in range(k)])
    ax.set_ylim(0, 1.12 + 0.1 * len(runs))
    ax.set_yticks([0, 0.2, 0.4, 0.6, 0.8, 1.0])
    ax.set_ylabel("accepted / drafts")
    ax.set_title("Acceptance rate per draft position", fontsize=10)
    ax.legend(fontsize=7, loc="upper center", ncol=1)
    fig.tight_layout()
    return fig


def acceptance_length_plot(source: AcceptanceSource, ax=None):
    """Histogram of tokens emitted per verify step (accepted drafts + 1), from recorded verifies,
    with each run's mean acceptance length as a dashed line."""
    import numpy as np
    runs = _sources(source)
    fig, ax = _axes(ax, (6, 3))
    k = max(len(c["num_accepted_tokens_per_pos"]) for c in runs.values())
    width = 0.8 / len(runs)
    for j, (label, counts) in enumerate(runs.items()):
        if counts["accepted_lengths"] is None:
            raise ValueError("acceptance_length_plot needs step records (a Tracer), not metrics.")
        emitted = np.asarray(counts["accepted_lengths"]) + 1
        freq = np.bincount(emitted, minlength=k + 2)[1:k + 2] / max(len(emitted), 1)
        xs = np.arange(1, k + 2) + (j - (len(runs) - 1) / 2) * width
        mal = mean_acceptance_length(counts)
        name = f"{label}: " if label else ""
        bars = ax.bar(xs, freq, width=width, label=f"{name}mean {mal:.2f} tokens per verify")
        ax.axvline(mal, linestyle="--", linewidth=1, color=bars.patches[0].get_facecolor())
    ax.set_xticks(range(1, k + 2))
    ax.set_xlabel("tokens emitted by one verify step (accepted drafts + 1)")
    ax.set_ylabel("share of verify steps")
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    return fig
