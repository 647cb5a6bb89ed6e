"""Disaggregated prefill/decode, drawn from the ``"connector"`` events of two instances' traces and
from the files the prefill instance left on disk (in the spirit of the article's Figure 12).

Each ``"connector"`` event has ``role`` (scheduler | worker), ``method``, ``req_id`` (or None),
``args``, ``result`` and ``bytes`` (moved to or from storage by that call).
"""
from __future__ import annotations

import json
import os
from typing import Any, Optional

from minivllm.learn.viz.records import StepsLike, connector_calls

# The article's order: cache lookup, state update, metadata, then the forward's context manager.
METHOD_ORDER = ["get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta",
                "bind_connector_metadata", "start_load_kv", "wait_for_layer_load", "save_kv_layer",
                "wait_for_save", "get_finished", "get_block_ids_with_load_errors",
                "clear_connector_metadata", "request_finished"]
# Bookkeeping calls left out of the flow diagram (they stay in the timeline).
QUIET = {"get_finished", "get_block_ids_with_load_errors", "clear_connector_metadata",
         "register_kv_caches", "bind_connector_metadata"}
# The article's names for the steps these calls implement.
ARTICLE_STEP = {"get_num_new_matched_tokens": "cache lookup", "update_state_after_alloc": "state update",
                "build_connector_meta": "build metadata", "start_load_kv": "context manager enter",
                "wait_for_save": "context manager exit", "save_kv_layer": "layer by layer",
                "wait_for_layer_load": "layer by layer"}
ROLE_COLORS = {"scheduler": "#f28e2b", "worker": "#4e79a7"}


def _kb(n: int) -> str:
    return f"{n / 1024:.1f} KiB" if n < 1024 * 1024 else f"{n / 1024 / 1024:.2f} MiB"


def connector_timeline(tracer_p: StepsLike, tracer_d: StepsLike, fig: Any = None):
    """Two panels (prefill, decode): one row per connector method, one column per engine step;
    a dot per (step, method), sized by the number of calls, filled when the calls moved bytes."""
    import matplotlib.pyplot as plt
    if fig is None:
        fig = plt.figure(figsize=(10, 6.5))
    axes = fig.subplots(2, 1, sharey=True)
    for ax, (label, source) in zip(axes, (("prefill instance", tracer_p),
                                          ("decode instance", tracer_d))):
        calls = connector_calls(source)
        cells: dict[tuple[int, str], dict[str, Any]] = {}
        for c in calls:
            cell = cells.setdefault((c["step"], c["method"]), {"n": 0, "bytes": 0, "role": c["role"]})
            cell["n"] += 1
            cell["bytes"] += int(c.get("bytes") or 0)
        methods = METHOD_ORDER + sorted({m for _, m in cells} - set(METHOD_ORDER))
        for (step, method), cell in cells.items():
            y = methods.index(method)
            color = ROLE_COLORS.get(cell["role"], "grey")
            ax.scatter(step, y, s=28 + 2 * min(cell["n"], 40), marker="o",
                       facecolor=color if cell["bytes"] else "white", edgecolor=color, linewidth=1.5)
            if cell["n"] > 1:
                ax.annotate(f"x{cell['n']}", (step, y), xytext=(7, -3), textcoords="offset points",
                            fontsize=6)
            if cell["bytes"]:
                ax.annotate(_kb(cell["bytes"]), (step, y), xytext=(7, 5), textcoords="offset points",
                            fontsize=6, color=color)
        ax.set_yticks(range(len(methods)), methods, fontsize=7)
        steps = sorted({s for s, _ in cells}) or [0]
        ax.set_xlim(min(steps) - 0.6, max(steps) + 1.2)
        ax.set_xticks(steps)
        ax.set_title(f"{label}: connector calls per engine step "
                     "(orange = scheduler role, blue = worker role, filled = moved bytes)", fontsize=8)
        ax.grid(axis="x", linewidth=0.3)
    axes[0].invert_yaxis()     # shared y: the article's call order reads top to bottom in both
    axes[-1].set_xlabel("engine step")
    fig.tight_layout()
    return fig


def _summary(method: str, calls: list[dict[str, Any]]) -> str:
    """One line for a group of calls, read from their args / result / bytes."""
    nbytes = sum(int(c.get("bytes") or 0) for c in calls)
    try:
        if method == "get_num_new_matched_tokens":
            return ", ".join(f"req {c['req_id']}: {c['result'][0]} tokens found" for c in calls)
        if method == "update_state_after_alloc":
            return ", ".join(f"req {c['req_id']}: {c['result'] or 'nothing to load'}" for c in calls)
        if method == "build_connector_meta":
            reqs = [r for c in calls for r in (c["result"] or [])]
            if not reqs:
                return "empty metadata"
            return ", ".join(f"req {r['req_id']} is_store={r['is_store']} "
                             f"({r['tokens'][1] - r['tokens'][0]} tok)" for r in reqs)
        if method == "start_load_kv":
            return f"loaded {_kb(nbytes)}" if nbytes else "no-op (nothing to load)"
        if method == "save_kv_layer":       # gathers into host memory; wait_for_save writes
            moved = f", {_kb(nbytes)} copied to host memory" if nbytes else ", nothing to copy"
            return f"x{len(calls)} layers{moved}"
        if method == "wait_for_layer_load":
            moved = f", {_kb(nbytes)} loaded" if nbytes else ", nothing moved"
            return f"x{len(calls)} layers{moved}"
        if method == "wait_for_save":
            res = {k: v for c in calls for k, v in (c["result"] or {}).items()}
            return ("files written: " + ", ".join(f"req {k}: {v}" for k, v in res.items())
                    if res else "no-op (nothing to save)")
        if method == "request_finished":
            return "req " + ", ".join(str(c["req_id"]) for c in calls)
    except (TypeError, KeyError, IndexError):
        pass
    return str(calls[0].get("result"))[:60] + (f" ({_kb(nbytes)})" if nbytes else "")


def flow_entries(source: StepsLike, instance: str, max_steps: int = 1) -> list[dict[str, Any]]:
    """Connector calls of the first ``max_steps`` steps (plus every ``request_finished``), grouped by
    (step, role, method) in first-call order, each with a one-line summary and the bytes moved."""
    calls = [c for c in connector_calls(source) if c["method"] not in QUIET]
    first = min((c["step"] for c in calls), default=0)
    groups: dict[tuple[int, str, str], list[dict[str, Any]]] = {}
    later_steps: set[int] = set()
    for c in calls:
        if c["step"] >= first + max_steps and c["method"] != "request_finished":
            later_steps.add(c["step"])
            continue
        groups.setdefault((c["step"], c["role"], c["method"]), []).append(c)
    out = [{"instance": instance, "step": s, "role": r, "method": m, "bytes":
            sum(int(c.get("bytes") or 0) for c in cs), "summary": _summary(m, cs), "calls": cs}
           for (s, r, m), cs in groups.items()]
    if later_steps:
        moved = sum(int(c.get("bytes") or 0) for c in calls if c["step"] in later_steps)
        out.insert(len(out) - sum(e["method"] == "request_finished" for e in out), {
            "instance": instance, "step": min(later_steps), "role": "worker", "method": "...",
            "bytes": moved, "calls": [], "summary": f"steps {min(later_steps)}-{max(later_steps)}: "
            f"{_kb(moved) if moved else 'no KV moved'} (KV is loaded once, on the first step)"})
    return out


def pd_flow_figure(tracer_p: StepsLike, tracer_d: StepsLike, title: Optional[str] = None, fig=None):
    """A sequence diagram of one P/D run: lanes for P's scheduler and worker, the shared storage,
    D's scheduler and worker; one row per group of connector calls; arrows where bytes or a lookup
    crossed to or from storage."""
    import matplotlib.pyplot as plt
    lanes = {("P", "scheduler"): 0, ("P", "worker"): 1, "storage": 2,
             ("D", "scheduler"): 3, ("D", "worker"): 4}
    entries = flow_entries(tracer_p, "P") + flow_entries(tracer_d, "D")
    if fig is None:
        fig = plt.figure(figsize=(11, 0.42 * len(entries) + 1.6))
    ax = fig.add_subplot(111)
    ax.set_xlim(-0.6, 4.6)
    ax.set_ylim(len(entries) + 0.2, -1.4)
    ax.axis("off")
    names = ["prefill: scheduler", "prefill: worker", "shared storage\n(local folder)",
             "decode: scheduler", "decode: worker"]
    for i, name in enumerate(names):
        ax.text(i, -0.9, name, ha="center", va="center", fontsize=9, fontweight="bold",
                bbox=dict(boxstyle="round", facecolor="#eeeeee" if i == 2 else "white"))
        ax.plot([i, i], [-0.5, len(entries)], color="#bbbbbb", linewidth=1, zorder=0)
    for row, e in enumerate(entries):
        x = lanes[(e["instance"], e["role"])]
        color = ROLE_COLORS.get(e["role"], "grey")
        # save_kv_layer only gathers rows into the worker's host memory: the files (the arrow to
        # storage) are written by wait_for_save.
        to_storage = False
        committed = e["instance"] == "P" and e["method"] == "wait_for_save" and e["calls"] and any(
            c["result"] for c in e["calls"])
        from_storage = e["instance"] == "D" and (
            (e["bytes"] and e["method"] in ("start_load_kv", "wait_for_layer_load")) or
            (e["method"] == "get_num_new_matched_tokens" and "found" in e["summary"]
             and any(c["result"] and c["result"][0] for c in e["calls"])))
        if to_storage or committed or from_storage:
            start, end = (x, 2) if (to_storage or committed) else (2, x)
            ax.annotate("", xy=(end, row), xytext=(start, row),
                        arrowprops=dict(arrowstyle="->", color=color, linewidth=1.6))
        ax.plot(x, row, "o", color=color, markersize=5)
        text = e["summary"] if e["method"] == "..." else (
            f"[{ARTICLE_STEP[e['method']]}] " if e["method"] in ARTICLE_STEP else "") + \
            f"step {e['step']}: {e['method']}  ->  {e['summary']}"
        left = x <= 1
        ax.text(x + (0.08 if left else -0.08) if x != 2 else x, row - 0.18,
                text[:110], ha="left" if left else "right", va="bottom", fontsize=6.5)
    ax.set_title(title or "Disaggregated prefill/decode, from the connector trace "
                 "(orange = scheduler role, blue = worker role)", fontsize=10)
    fig.tight_layout()
    return fig


def _natural(name: str) -> list:
    """Sort key that puts layers.2 before layers.10."""
    import re
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


class FilesTable:
    """Rows of (folder, num_tokens, file, shape, bytes); prints as text, shows as HTML."""

    def __init__(self, rows: list[tuple[str, Any, str, Any, int]]) -> None:
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __str__(self) -> str:
        head = ("folder (md5 of prompt prefix)", "tokens", "file", "shape", "bytes")
        cells = [head] + [tuple(str(c) for c in r) for r in self.rows]
        widths = [max(len(r[i]) for r in cells) for i in range(len(head))]
        return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in cells)

    __repr__ = __str__

    def _repr_html_(self) -> str:
        head = "".join(f"<th>{h}</th>" for h in ("folder", "tokens", "file", "shape", "bytes"))
        body = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in r) + "</tr>" for r in self.rows)
        return f"<table><tr>{head}</tr>{body}</table>"


def pd_files_table(path: str) -> FilesTable:
    """What the prefill instance left in ``shared_storage_path``: one folder per stored prompt prefix
    (its meta.json gives the token count), one ``.safetensors`` file per attention layer."""
    from safetensors import safe_open
    rows = []
    if not os.path.isdir(path):
        raise ValueError(f"{path!r} is not a directory")
    for folder in sorted(os.listdir(path)):
        full = os.path.join(path, folder)
        if not os.path.isdir(full):
            continue
        meta_path = os.path.join(full, "meta.json")
        meta = json.load(open(meta_path)) if os.path.exists(meta_path) else {}
        for name in sorted(os.listdir(full), key=_natural):
            f = os.path.join(full, name)
            shape: Any = ""
            if name.endswith(".safetensors"):
                with safe_open(f, "pt") as st:
                    shape = [list(st.get_slice(k).get_shape()) for k in st.keys()]
                    shape = shape[0] if len(shape) == 1 else shape
            rows.append((folder[:12], meta.get("num_tokens", "?"), name, shape, os.path.getsize(f)))
    return FilesTable(rows)
