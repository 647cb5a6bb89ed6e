"""Short text for long lists, so a notebook cell's output fits a screen (about 60 lines).

A real pool has thousands of blocks (SmolLM2-135M on a few GB of KV cache: ~2,800), so the text views
print long id lists as their length, head and tail: ``free queue (2,790 blocks): 4, 5, 6, ... 2817``.
Lists up to ``max_items`` long print whole, as Python lists, so small examples read (and parse)
exactly as the records hold them.
"""
from __future__ import annotations

from typing import Iterable, Sequence

MAX_ITEMS = 24       # a list up to this long prints whole
HEAD, TAIL = 8, 3    # otherwise: the first HEAD items, "...", the last TAIL items


def summarize_ids(ids: Sequence[int], head: int = HEAD, tail: int = TAIL) -> str:
    """``"4, 5, 6, ... 2817"``: the first ``head`` and last ``tail`` items of ``ids``, in order."""
    ids = list(ids)
    if len(ids) <= head + tail:
        return ", ".join(map(str, ids))
    return ", ".join(map(str, ids[:head])) + ", ... " + ", ".join(map(str, ids[-tail:]))


def id_list_text(label: str, ids: Sequence[int], noun: str = "blocks", note: str = "",
                 max_items: int = MAX_ITEMS) -> str:
    """``"<label> (<note>): [1, 2, 3]"`` for a short list, else
    ``"<label> (2,790 <noun>, <note>): 4, 5, 6, ... 2817"``; ``note`` (e.g. ``"evicted first -> last"``)
    is optional."""
    ids = list(ids)
    if len(ids) <= max_items:
        return f"{label} ({note}): {ids}" if note else f"{label}: {ids}"
    extra = f", {note}" if note else ""
    return f"{label} ({len(ids):,} {noun}{extra}): {summarize_ids(ids)}"


def brief_list(ids: Sequence, max_items: int = MAX_ITEMS) -> str:
    """``str(list(ids))`` when short, else ``"[a, b, ... z] (100 in all)"``, for inline mentions
    (a count, not a list, prints as it is)."""
    if not isinstance(ids, (list, tuple, set, frozenset)):
        return str(ids)
    ids = list(ids)
    if len(ids) <= max_items:
        return str(ids)
    return f"[{summarize_ids([repr(i) for i in ids])}] ({len(ids):,} in all)"


def wrap_cells(cells: Iterable[str], per_line: int = 12, indent: str = "  ") -> list[str]:
    """Lines of at most ``per_line`` cells each, so a wide pool wraps instead of running off the page."""
    cells = list(cells)
    return [indent + "  ".join(cells[i:i + per_line]) for i in range(0, len(cells), per_line)]


def limit_lines(lines: list[str], max_lines: int, what: str) -> list[str]:
    """``lines`` cut to ``max_lines``, the rest counted in one closing line (``"... 12 more <what>"``)."""
    if len(lines) <= max_lines:
        return lines
    return lines[:max_lines] + [f"  ... {len(lines) - max_lines:,} more {what}"]
