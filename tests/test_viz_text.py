"""Text views fit a screen: a real-sized pool (2,818 blocks) prints as a few lines, with long lists
summarised as length, head and tail, while a small pool still prints every id (test_viz.py)."""
from __future__ import annotations

import matplotlib
import pytest

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from minivllm.trace import StepRecord  # noqa: E402
from minivllm.viz import block_table_figure, parse_block_table_text, render_block_table_text  # noqa: E402
from minivllm.viz.text import id_list_text, limit_lines, summarize_ids  # noqa: E402


def big_pool_step(num_blocks=2818, num_requests=3, blocks_each=1) -> StepRecord:
    """A recorded step as the engine writes it for a default-sized pool: requests hold blocks from
    1 up, block 0 is null, every other block is free (the first two of them still cached)."""
    tables = {f"r{i}": list(range(1 + i * blocks_each, 1 + (i + 1) * blocks_each))
              for i in range(num_requests)}
    held = 1 + num_requests * blocks_each
    free = list(range(held, num_blocks))
    sched = {"kind": "schedule", "num_scheduled_tokens": {r: 1 for r in tables},
             "scheduled_spec_decode_tokens": {}, "preempted_req_ids": [], "token_budget": 8192,
             "total_num_scheduled_tokens": len(tables), "new_req_ids": list(tables), "resumed_req_ids": [],
             "running": list(tables), "waiting": []}
    kv = {"kind": "kv_cache", "block_tables": tables, "num_computed_tokens": {r: 5 for r in tables},
          "num_free_blocks": len(free), "free_block_ids": free, "cached_block_ids": free[:2] + [1],
          "num_gpu_blocks": num_blocks}
    return StepRecord(step=7, events=[sched, kv])


def test_summaries_keep_length_head_and_tail():
    assert summarize_ids(range(4, 2818)) == "4, 5, 6, 7, 8, 9, 10, 11, ... 2815, 2816, 2817"
    assert id_list_text("free queue", range(4, 2818)) == (
        "free queue (2,814 blocks): 4, 5, 6, 7, 8, 9, 10, 11, ... 2815, 2816, 2817")
    assert id_list_text("free queue", [3, 1, 2], note="evicted first -> last") == (
        "free queue (evicted first -> last): [3, 1, 2]")
    assert limit_lines(["a", "b", "c"], 2, "requests") == ["a", "b", "  ... 1 more requests"]


def test_a_default_sized_pool_prints_in_a_few_lines():
    step = big_pool_step()
    text = render_block_table_text(step)
    lines = text.splitlines()
    assert len(lines) < 20 and max(map(len, lines)) < 200, text
    assert "free queue (2,814 blocks, evicted first -> last): 4, 5, 6, 7, 8, 9, 10, 11, ... 2815, 2816, 2817" in text
    assert "pool: 2818 blocks (block 0 = null), 2814 free   (* = in the prefix cache)" in text
    assert "1:rr0[0]*" in text and "4:free#0*" in text and "5:free#1*" in text
    assert "and free, not cached (2,812 blocks): 6, 7," in text
    assert parse_block_table_text(text) == step.first("kv_cache")["block_tables"]


def test_many_requests_are_counted_not_listed():
    step = big_pool_step(num_requests=100)
    text = render_block_table_text(step)
    assert len(text.splitlines()) < 60, text
    assert "... 68 more requests" in text
    assert "new ['r0', 'r1', 'r2', 'r3', 'r4', 'r5', 'r6', 'r7', ... 'r97', 'r98', 'r99'] (100 in all)" in text
    assert "  ... 55 more held or cached blocks" in text    # null + 100 held + 2 cached free - 48


@pytest.mark.parametrize("num_requests,drawn", [(3, 64), (100, 112), (300, 256)])
def test_the_figure_draws_only_the_pool_rows_in_use(num_requests, drawn):
    step = big_pool_step(num_requests=num_requests)
    fig = block_table_figure(step)
    cells = len(fig.axes[0].patches) - min(num_requests, 32)  # one table cell per request drawn
    plt.close(fig)
    assert cells == drawn
