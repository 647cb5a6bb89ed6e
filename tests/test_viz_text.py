"""Text views fit a screen: a real-sized pool (2,818 blocks) prints as a few lines, with long lists
summarised as length, head and tail, while a small pool still prints every id (test_viz.py). The
penalty-under-speculation view (notebook 02) shows, from hand-made verify records, both rules and
marks where they part."""
from __future__ import annotations

import math

import matplotlib
import pytest

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from minivllm.trace import StepRecord  # noqa: E402
from minivllm.learn.viz import (block_table_figure, find_penalty_verify, parse_block_table_text,  # noqa: E402
                                penalty_verify_figure, render_block_table_text,
                                render_penalty_verify_text)
from minivllm.learn.viz.text import id_list_text, limit_lines, summarize_ids  # noqa: E402


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


# ---------------------------------------------------------------- penalties under speculation
A, B, C, D = 2, 5, 7, 9


def _drafted(draft, accepted, ignored, penalty, penalty_ignored, output, argmax, argmax_ignored,
             uniform=None, p_target=0.5, p_ignored=0.5):
    """One tested draft position as ``minivllm/sample/verify_record.build_record`` writes it."""
    return dict(draft_token_id=draft, p_target=p_target, p_draft=1.0, uniform=uniform,
                accepted=accepted, kind="accepted" if accepted else "recovered",
                output_token_id=output, penalty=penalty, penalty_drafts_ignored=penalty_ignored,
                p_target_drafts_ignored=p_ignored, accepted_if_drafts_ignored=ignored,
                target_argmax=argmax, target_argmax_drafts_ignored=argmax_ignored)


def penalty_steps() -> list[StepRecord]:
    """Three recorded verifies, greedy, frequency_penalty 1, committed output [A]:
    step 3: one draft only (too short to show); step 4: drafts [A, C], both decisions agree, the
    second ends in a bonus; step 5: drafts [A, A, C] where draft 1 sees A twice with the drafts
    counted (penalty -2, B overtakes, rejected) but once with them ignored (accepted)."""
    bonus = dict(draft_token_id=None, p_target=None, p_draft=None, uniform=None, accepted=False,
                 kind="bonus", output_token_id=D)
    one = [_drafted(A, True, True, -1.0, -1.0, A, A, A), bonus]
    agree = [_drafted(A, True, True, -1.0, -1.0, A, A, A),
             _drafted(C, True, True, 0.0, 0.0, C, C, C), bonus]
    flip = [_drafted(A, True, True, -1.0, -1.0, A, A, A),
            _drafted(A, False, True, -2.0, -1.0, B, B, A)]
    return [StepRecord(step=s, events=[{"kind": "spec_verify", "req_id": "r", "positions": pos}])
            for s, pos in ((3, one), (4, agree), (5, flip))]


def test_find_penalty_verify_wants_enough_drafts_and_a_flip():
    steps = penalty_steps()
    assert find_penalty_verify(steps) == (2, "r")
    assert find_penalty_verify(steps, need_flip=False) == (1, "r")      # step 3 has one draft only
    assert find_penalty_verify(steps, min_drafts=1, need_flip=False) == (0, "r")
    assert find_penalty_verify(steps[:2]) is None
    assert find_penalty_verify(steps, min_drafts=3) is None


def test_penalty_text_shows_both_rules_and_marks_the_flip():
    text = render_penalty_verify_text(penalty_steps()[2])
    lines = text.splitlines()
    assert lines[0] == "step 5, request r: 2 drafts tested"
    assert "drafts counted (the sampler)" in lines[1] and "drafts ignored" in lines[1]
    row0, row1 = lines[3], lines[4]
    assert "-1.00  accept (argmax '2')" in row0 and "<- differs" not in row0
    counted, ignored = row1.split(" | ")
    assert "-2.00  reject (argmax '5')" in counted
    assert "-1.00  accept (argmax '2')" in ignored and ignored.endswith("<- differs")
    assert lines[5].strip() == "the sampler stops here and emits '5'"
    assert len(lines) == 6
    # Random rows show p_target of each variant against the same uniform draw.
    random = StepRecord(step=9, events=[{"kind": "spec_verify", "req_id": "q", "positions": [
        _drafted(A, False, True, -math.inf, 0.0, B, B, A, uniform=0.3, p_target=0.0,
                 p_ignored=0.4)]}])
    text = render_penalty_verify_text(random, "q")
    assert "   -inf  reject (p_target 0.000 vs u 0.300)" in text
    assert "+0.00  accept (p_target 0.400 vs u 0.300)   <- differs" in text
    fig = penalty_verify_figure(random, "q")       # a masked draft (-inf) is still drawn
    assert len(fig.axes[0].patches) == 2
    plt.close(fig)
    # An async scheduler's -1 placeholder: rejected, no penalty, never decoded as a token.
    placeholder = _drafted(-1, False, False, None, None, B, B, B)
    step = StepRecord(step=2, events=[{"kind": "spec_verify", "req_id": "p", "positions": [placeholder]}])
    text = render_penalty_verify_text(step, tokenizer=_NoNegativeIds())
    assert "-1 (placeholder)        -  reject" in text
    plt.close(penalty_verify_figure(step, tokenizer=_NoNegativeIds()))


class _NoNegativeIds:
    def decode(self, ids):
        assert min(ids) >= 0, ids
        return f"<{ids[0]}>"


def test_penalty_text_refuses_a_verify_without_penalty_fields():
    step = StepRecord(step=1, events=[{"kind": "spec_verify", "req_id": "r", "positions": [
        dict(draft_token_id=A, p_target=0.9, p_draft=1.0, uniform=0.5, accepted=True,
             kind="accepted", output_token_id=A)]}])
    with pytest.raises(ValueError, match="no tested draft with penalties"):
        render_penalty_verify_text(step)
