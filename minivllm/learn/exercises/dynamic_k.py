"""The check for the spec_decode assignment's dynamic-k exercise (after the article: vLLM 0.32's
``speculative_config={"num_speculative_tokens_per_batch_size": [(start, end, k), ...]}``,
``vllm/v1/spec_decode/dynamic/utils.py``; minivllm's spec_decode/dynamic.py).

The student writes ``dynamic_k(schedule, num_speculative_tokens, batch_size)``: this step's k. It is
checked against the engine's own lookup, ``build_dynamic_sd_schedule_lookup`` read by
``num_spec_tokens_to_schedule``: each range's k clamped to ``num_speculative_tokens``, a batch size
in a gap between ranges (or past the last one) keeping the k of the range before it, the ranges
taken in order of their start.
"""
from __future__ import annotations

import random
from typing import Callable

from minivllm.learn.exercises.registry import exercise
from minivllm.learn.exercises.spec import ASSIGNMENT, _call, _done, _fail, _wants, quiet

__all__ = ["check_dynamic_k"]


def _engine_k(schedule: list[tuple[int, int, int]], num_speculative_tokens: int,
              batch_sizes: list[int]) -> list[int]:
    """The engine's k at each batch size: its dense lookup table (``max_num_seqs`` = the largest
    batch size asked), read as the scheduler reads it."""
    from minivllm.spec_decode.dynamic import (build_dynamic_sd_schedule_lookup,
                                              num_spec_tokens_to_schedule)
    lookup = build_dynamic_sd_schedule_lookup(schedule, max(batch_sizes), num_speculative_tokens)
    return [num_spec_tokens_to_schedule(num_speculative_tokens, lookup, b) for b in batch_sizes]


def _variant(schedule, num_speculative_tokens, batch_size, clamp=True, carry=True, sort=True,
             gap=0):
    """This step's k with one rule changed (what the common wrong answers give): ``gap`` is
    what an uncovered batch size gets when nothing carries forward ("nst": the fixed k)."""
    k = num_speculative_tokens if gap == "nst" else gap
    for start, end, range_k in (sorted(schedule) if sort else schedule):
        if start <= batch_size <= end or (carry and start <= batch_size):
            k = min(range_k, num_speculative_tokens) if clamp else range_k
    return k


_HINTS = [
    ({"clamp": False}, "each range's k is clamped to num_speculative_tokens, the most any step "
                       "drafts (the lookahead slots and the heads are sized by it)."),
    ({"carry": False}, "a batch size no range covers (a gap, or past the last range) keeps the k "
                       "of the range before it, not 0."),
    ({"carry": False, "gap": "nst"}, "a batch size no range covers (a gap, or past the last "
                                     "range) keeps the k of the range before it, not "
                                     "num_speculative_tokens."),
    ({"sort": False}, "the schedule may list its ranges in any order: take them by their start."),
]


def _hint(schedule, nst, batch_sizes, expected, got) -> str:
    for change, hint in _HINTS:
        variant = [_variant(schedule, nst, b, **change) for b in batch_sizes]
        if got == variant and variant != expected:
            return hint
    return ""


# (case, schedule, num_speculative_tokens, batch sizes)
_VISIBLE = [
    ("three ranges end to end, each k within num_speculative_tokens",
     [(1, 4, 5), (5, 16, 3), (17, 64, 1)], 5, [1, 2, 4, 5, 16, 17, 40, 64]),
    ("one range for every batch size", [(1, 32, 2)], 4, [1, 7, 32]),
]
_HIDDEN = [
    ("a k above num_speculative_tokens is clamped", [(1, 2, 8), (3, 8, 2)], 4, [1, 2, 3, 8]),
    ("a gap between ranges keeps the earlier range's k", [(1, 2, 3), (6, 8, 1)], 4,
     [1, 2, 3, 4, 5, 6, 8]),
    ("past the last range: its k carries on", [(1, 4, 3), (5, 8, 2)], 3, [4, 5, 8, 9, 100]),
    ("ranges listed out of order: by their start", [(9, 16, 1), (1, 8, 3)], 3, [1, 8, 9, 16, 20]),
    ("k = 0: no drafts at that batch size", [(1, 1, 2), (2, 8, 0)], 2, [1, 2, 8, 9]),
]


def _random_schedule(rng: random.Random) -> tuple[list[tuple[int, int, int]], int, list[int]]:
    """A valid schedule (the first range starts at 1, no overlap), gaps allowed, listed in any
    order; k up to 2 more than num_speculative_tokens."""
    nst = rng.randint(1, 5)
    schedule, start = [], 1
    for _ in range(rng.randint(1, 4)):
        end = start + rng.randint(0, 6)
        schedule.append((start, end, rng.randint(0, nst + 2)))
        start = end + 1 + rng.choice([0, 0, 1, 3])
    rng.shuffle(schedule)
    return schedule, nst, list(range(1, start + 4))


@exercise(name="dynamic_k", assignment=ASSIGNMENT,
          article_step="After the article: dynamic k, this step's number of drafts from the batch "
                       "size (vLLM 0.32 num_speculative_tokens_per_batch_size)",
          forbidden=("minivllm.spec_decode.dynamic:build_dynamic_sd_schedule_lookup",
                     "minivllm.spec_decode.dynamic:num_spec_tokens_to_schedule"),
          mistakes=("no clamp at num_speculative_tokens",
                    "a batch size in a gap or past the last range given 0 or "
                    "num_speculative_tokens instead of the earlier range's k",
                    "the ranges taken in the order listed, not by their start"))
def check_dynamic_k(fn: Callable, cases: str = "all") -> None:
    """``fn(schedule, num_speculative_tokens, batch_size)`` -> this step's k: ``schedule`` is a
    valid list of ``(range_start, range_end, k)`` (ranges inclusive, no overlap, the first
    starting at 1), ``batch_size`` >= 1 the number of requests scheduled this step."""
    name = "dynamic_k"
    hand = _VISIBLE * _wants(cases)[0] + _HIDDEN * _wants(cases)[1]
    rng = random.Random(0)
    n_ref = 50 if _wants(cases)[1] else 0
    randoms = [(f"random schedule {i}, answered by build_dynamic_sd_schedule_lookup",
                *_random_schedule(rng)) for i in range(n_ref)]
    with quiet():
        for case, schedule, nst, batch_sizes in hand + randoms:
            expected = _engine_k(schedule, nst, batch_sizes)
            got = []
            for b in batch_sizes:
                kw = {"schedule": list(schedule), "num_speculative_tokens": nst, "batch_size": b}
                value = _call(name, fn, case, kw)
                got.append(int(value) if isinstance(value, int) or hasattr(value, "__index__")
                           else value)
            if got != expected:
                shown = {"schedule": schedule, "num_speculative_tokens": nst,
                         "batch_size (one call each)": batch_sizes}
                _fail(name, f"{case} (one call per batch size)", shown, expected, got,
                      _hint(schedule, nst, batch_sizes, expected, got))
    _done(name, cases, len(hand), n_ref, "build_dynamic_sd_schedule_lookup")
