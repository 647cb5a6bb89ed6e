"""Block tables and the block pool at one engine step, drawn from the step's records.

Reads the ``"schedule"``, ``"kv_cache"``, ``"prefix_hit"`` and ``"preempt"`` events of one
``StepRecord`` (``minivllm/trace.py``). The ``"kv_cache"`` event is taken right after
``Scheduler.schedule()``: ``block_tables`` {req_id: [physical block ids, in token order]},
``num_computed_tokens`` (already advanced by the tokens scheduled this step), ``free_block_ids`` in
``FreeKVCacheBlockQueue`` order (the head is evicted first), ``cached_block_ids`` (blocks entered in
the prefix cache), ``ref_cnts`` per block. Block 0 is the null block (vLLM's ``null_block``): it is
never handed out.
"""
from __future__ import annotations

from typing import Any

from minivllm.trace import StepRecord
from minivllm.learn.viz.records import kv_cache_of, prefix_hits_of, schedule_of
from minivllm.learn.viz.text import brief_list, id_list_text, limit_lines, summarize_ids, wrap_cells

NULL_BLOCK_ID = 0
POOL_CELLS = 48            # a pool this small prints one cell per block
POOL_CELLS_PER_LINE = 12
MAX_REQUESTS = 32          # block-table lines shown; the rest are counted
SCHEDULED_SHOWN = 8        # requests named in a step's "scheduled ..." line
FIGURE_POOL_MAX = 256      # pool cells block_table_figure draws at most
_PALETTE = ["#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948", "#b07aa1",
            "#ff9da7", "#9c755f", "#86bcb6"]


def request_color(req_id: str) -> str:
    """A stable colour per request id (numeric ids cycle through the palette in order)."""
    key = int(req_id) if str(req_id).isdigit() else sum(map(ord, str(req_id)))
    return _PALETTE[key % len(_PALETTE)]


def block_owners(kv: dict[str, Any]) -> dict[int, list[tuple[str, int]]]:
    """{physical block id: [(req_id, logical index), ...]} from the recorded block tables."""
    owners: dict[int, list[tuple[str, int]]] = {}
    for req_id, blocks in kv["block_tables"].items():
        for i, b in enumerate(blocks):
            owners.setdefault(b, []).append((req_id, i))
    return owners


def _scheduled_text(sched: dict[str, Any]) -> str:
    parts = []
    for req_id, n in sched["num_scheduled_tokens"].items():
        drafts = len(sched["scheduled_spec_decode_tokens"].get(req_id, []))
        parts.append(f"{req_id}:{n}" + (f" ({drafts} drafts)" if drafts else ""))
    if len(parts) > SCHEDULED_SHOWN:
        parts = parts[:SCHEDULED_SHOWN] + [f"... {len(parts) - SCHEDULED_SHOWN} more requests"]
    return ", ".join(parts) or "nothing"


def _pool_cells(kv: dict[str, Any], owners: dict[int, list[tuple[str, int]]],
                free_pos: dict[int, int], cached: set[int]) -> list[str]:
    """One ``<block>:<state>`` cell per block; in a pool over ``POOL_CELLS`` blocks only the null,
    held and cached blocks get a cell (the first ``POOL_CELLS`` of them), the plain free ones a count."""
    n = kv["num_gpu_blocks"]
    big = n > POOL_CELLS
    cells, plain_free = [], []
    for b in range(n):
        if b == NULL_BLOCK_ID:
            cells.append("0:null")
        elif b in owners:
            who = "+".join(f"r{r}[{i}]" for r, i in owners[b])
            cells.append(f"{b}:{who}{'*' if b in cached else ''}")
        elif b in free_pos:
            if big and b not in cached:
                plain_free.append(b)
            else:
                cells.append(f"{b}:free#{free_pos[b]}{'*' if b in cached else ''}")
        else:
            cells.append(f"{b}:?")
    lines = wrap_cells(cells[:POOL_CELLS], per_line=POOL_CELLS_PER_LINE)
    if len(cells) > POOL_CELLS:
        lines.append(f"  ... {len(cells) - POOL_CELLS:,} more held or cached blocks")
    if plain_free:
        lines.append("  " + id_list_text("and free, not cached", plain_free))
    return lines


def render_block_table_text(step: StepRecord) -> str:
    """The step's block tables, pool, free queue, cached blocks and prefix hits as plain text.

    One line per request reads ``  req <id>: [<block ids>]  computed=<n>``, exactly the recorded
    ``block_tables`` and ``num_computed_tokens`` (at most ``MAX_REQUESTS`` requests, the rest
    counted). A pool, free queue or cached-block list too long for a screen is summarised as its
    length, head and tail (``minivllm/learn/viz/text.py``), so the text stays under ~60 lines."""
    sched, kv = schedule_of(step), kv_cache_of(step)
    owners = block_owners(kv)
    free_pos = {b: i for i, b in enumerate(kv["free_block_ids"])}
    cached = set(kv["cached_block_ids"])
    budget = sched["token_budget"]
    lines = [f"step {step.step}: scheduled {_scheduled_text(sched)} = "
             f"{sched['total_num_scheduled_tokens']} of {budget} budget tokens",
             f"running {brief_list(sched['running'])}  waiting {brief_list(sched['waiting'])}  "
             f"new {brief_list(sched['new_req_ids'])}  resumed {brief_list(sched['resumed_req_ids'])}  "
             f"preempted {brief_list(sched['preempted_req_ids'])}",
             f"pool: {kv['num_gpu_blocks']} blocks (block 0 = null), {kv['num_free_blocks']} free"
             "   (* = in the prefix cache)"]
    lines += _pool_cells(kv, owners, free_pos, cached)
    lines.append("block tables (logical -> physical):")
    tables = []
    for req_id, blocks in kv["block_tables"].items():
        n = kv.get("num_computed_tokens", {}).get(req_id)
        tables.append(f"  req {req_id}: {list(blocks)}" + (f"  computed={n}" if n is not None else ""))
    lines += limit_lines(tables, MAX_REQUESTS, "requests")
    lines.append(id_list_text("free queue", kv["free_block_ids"], note="evicted first -> last"))
    lines.append(id_list_text("cached blocks", kv["cached_block_ids"], note="prefix cache"))
    hits = prefix_hits_of(step)
    if hits:
        lines.append("prefix hits: " + ", ".join(
            f"req {r}: {loc} local + {ext} external tokens" for r, (loc, ext) in hits.items()))
    for e in step.of("preempt"):
        lines.append(f"preempted req {e['req_id']} (had {e['num_computed_tokens_before']} "
                     "computed tokens; its blocks went back to the free queue)")
    return "\n".join(lines)


def parse_block_table_text(text: str) -> dict[str, list[int]]:
    """Read the ``req <id>: [...]`` lines back (what tests compare with the trace)."""
    import ast
    import re
    out = {}
    for m in re.finditer(r"^  req (\S+): (\[[0-9, ]*\])", text, flags=re.M):
        out[m.group(1)] = list(ast.literal_eval(m.group(2)))
    return out


def block_table_figure(step: StepRecord, ncols: int = 16, fig: Any = None):
    """Matplotlib figure: the physical block pool (top) and each request's block table (bottom).

    Pool cells: request colour and ``r<id>[<logical index>]`` for held blocks (hatched when shared
    by several requests through a prefix hit), grey for the null block, white with the free-queue
    position ``q<i>`` for free blocks; a thick border marks blocks in the prefix cache."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    sched, kv = schedule_of(step), kv_cache_of(step)
    owners = block_owners(kv)
    free_pos = {b: i for i, b in enumerate(kv["free_block_ids"])}
    cached = set(kv["cached_block_ids"])
    hits = prefix_hits_of(step)
    num_blocks = kv["num_gpu_blocks"]
    n = _drawn_blocks(num_blocks, set(owners) | cached, ncols)
    ncols = max(1, min(ncols, n))
    pool_rows = -(-n // ncols)
    tables = dict(kv["block_tables"])
    preempted = {e["req_id"]: e["num_computed_tokens_before"] for e in step.of("preempt")}
    for r in preempted:
        tables.setdefault(r, [])
    hidden = max(0, len(tables) - MAX_REQUESTS)
    tables = dict(list(tables.items())[:MAX_REQUESTS])
    longest = max((len(b) for b in tables.values()), default=1)
    width = max(ncols, longest + 9, 16)
    height_units = pool_rows + 1.6 + max(len(tables), 1) + 0.9
    if fig is None:
        fig = plt.figure(figsize=(0.62 * width, 0.55 * height_units + 0.8))
    ax = fig.add_subplot(111)
    ax.set_xlim(-0.2, width + 0.2)
    ax.set_ylim(height_units, -1.0)
    ax.axis("off")

    def cell(x, y, color, text, hatch=None, bold=False, fontsize=7):
        ax.add_patch(Rectangle((x, y), 0.94, 0.8, facecolor=color, edgecolor="black",
                               linewidth=2.4 if bold else 0.6, hatch=hatch))
        box = dict(boxstyle="round,pad=0.1", facecolor="white", edgecolor="none", alpha=0.85)
        ax.text(x + 0.47, y + 0.42, text, ha="center", va="center", fontsize=fontsize,
                bbox=box if hatch else None)

    ax.text(0, -0.75, f"Block pool: {num_blocks} blocks, {kv['num_free_blocks']} free"
            f"{'' if n == num_blocks else f' (blocks {n}..{num_blocks - 1} not drawn)'}.  r<id>[i] = logical "
            "block i of request <id>;  hatched = shared by several requests (prefix-cache hit);\n"
            "thick border = in the prefix cache;  q<i> = place in the free queue (q0 is evicted "
            "first);  pale yellow = free but still cached", fontsize=8, va="top")
    for b in range(n):
        x, y = b % ncols, b // ncols
        if b == NULL_BLOCK_ID:
            cell(x, y, "#555555", "0\nnull")
            ax.texts[-1].set_color("white")
        elif b in owners:
            who = owners[b]
            label = f"{b}\nr{who[0][0]}[{who[0][1]}]" if len(who) == 1 else f"{b}\n{len(who)} reqs"
            cell(x, y, request_color(who[0][0]), label, hatch="//" if len(who) > 1 else None,
                 bold=b in cached, fontsize=6)
        else:
            q = f"q{free_pos[b]}" if b in free_pos else "?"
            cell(x, y, "#fff7d6" if b in cached else "white", f"{b}\n{q}", bold=b in cached)

    top = pool_rows + 1.2
    ax.text(0, top - 0.35, f"Block tables (logical block -> physical block). Step {step.step}: "
            f"scheduled {_scheduled_text(sched)}", fontsize=9)
    for row, (req_id, blocks) in enumerate(tables.items()):
        y = top + row
        computed = kv.get("num_computed_tokens", {}).get(req_id)
        hit = hits.get(req_id)
        note = f"req {req_id}"
        ax.text(0, y + 0.42, note, fontsize=8, va="center", color=request_color(req_id),
                fontweight="bold")
        for i, b in enumerate(blocks):
            shared = len(owners.get(b, ())) > 1
            cell(1.3 + i, y, request_color(req_id), str(b), hatch="//" if shared else None,
                 bold=b in cached)
        extra = [] if computed is None else [f"{computed} tokens computed"]
        if req_id in preempted:
            extra = [f"preempted: its {preempted[req_id]} computed tokens' blocks went back to the "
                     "free queue; it waits and will recompute"]
        if hit is not None and (hit[0] or hit[1]):
            extra.append(f"prefix hit {hit[0]} local + {hit[1]} external")
        ax.text(1.4 + len(blocks), y + 0.42, "; ".join(extra), fontsize=7, va="center")
    foot = top + max(len(tables), 1) + 0.2
    pre = summarize_ids(sched["preempted_req_ids"]) or "none"
    more = f"({hidden} more requests not drawn)    " if hidden else ""
    ax.text(0, foot + 0.2, f"{more}free queue head (evicted first): {kv['free_block_ids'][:12]}"
            f"{' ...' if len(kv['free_block_ids']) > 12 else ''}    preempted this step: {pre}"
            f"    waiting: {sched['waiting']}", fontsize=8)
    fig.tight_layout()
    return fig


def _drawn_blocks(num_blocks: int, notable: set[int], ncols: int) -> int:
    """How many pool cells to draw: all of a small pool; of a big one, whole rows up to the last held
    or cached block (at most ``FIGURE_POOL_MAX`` cells), so 2,800 free blocks do not fill the page."""
    if num_blocks <= FIGURE_POOL_MAX:
        return num_blocks
    last = max(notable, default=0) + 1
    return min(num_blocks, FIGURE_POOL_MAX, max(4 * ncols, -(-last // ncols) * ncols))

