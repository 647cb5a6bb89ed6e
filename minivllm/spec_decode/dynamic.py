"""Dynamic k: how many tokens to draft this step, from the batch size (vLLM 0.32:
``vllm/v1/spec_decode/dynamic/utils.py``, read by ``Scheduler.schedule``).

Speculation spends verify compute: k drafts per request make the target score ``batch * (k + 1)``
tokens per step. At batch 1 a decode step is bound by reading the weights, so the extra tokens ride
along almost for free; at a large batch the step is bound by compute and the drafts that get rejected
cost real time (``python -m minivllm.bench roofline`` shows where the knee is on a machine). So
``speculative_config={"num_speculative_tokens_per_batch_size": [(start, end, k), ...]}`` gives k per
range of batch sizes (inclusive), ``k = 0`` allowed (no drafts at that size).

This stands beside the fixed k: ``num_speculative_tokens`` stays the most any step drafts (the
lookahead slots and the heads are sized by it), and ``num_spec_tokens_to_schedule`` below is the one
function the scheduler asks for this step's k; the scheduler hands the answer to the worker in
``SchedulerOutput.num_spec_tokens_to_schedule``, and the proposer drafts that many.
"""
from __future__ import annotations

from typing import Optional

DynamicSDSchedule = list[tuple[int, int, int]]


def validate_and_normalize_dynamic_sd_schedule(schedule: object) -> DynamicSDSchedule:
    """vLLM 0.32's checks: a non-empty list of ``(range_start, range_end, k)``, ranges positive,
    ``start <= end``, ``k >= 0``, non-overlapping once sorted by start, and the first range starts
    at 1 so every batch size has a k. -> the entries as int tuples, sorted by start."""
    name = "speculative_config.num_speculative_tokens_per_batch_size"
    if not isinstance(schedule, list) or not schedule:
        raise ValueError(f"{name} must be a non-empty list of (range_start, range_end, "
                         f"num_speculative_tokens) entries, got {schedule!r}.")
    parsed: DynamicSDSchedule = []
    for entry in schedule:
        if not isinstance(entry, (list, tuple)) or len(entry) != 3:
            raise ValueError(f"each {name} entry must be a 3-item sequence (range_start, "
                             f"range_end, num_speculative_tokens), got {entry!r}.")
        start, end, k = (int(v) for v in entry)
        if start <= 0 or end <= 0:
            raise ValueError(f"{name}: batch-size range ({start}, {end}) must be positive.")
        if start > end:
            raise ValueError(f"{name}: range start must be <= end in ({start}, {end}, {k}).")
        if k < 0:
            raise ValueError(f"{name}: the number of speculative tokens must be >= 0, got {k}.")
        parsed.append((start, end, k))
    parsed.sort(key=lambda e: e[0])
    previous_end = 0
    for start, end, _ in parsed:
        if start <= previous_end:
            raise ValueError(f"{name}: batch-size ranges must not overlap, got {parsed}.")
        previous_end = end
    if parsed[0][0] != 1:
        raise ValueError(f"{name}: the first range must start at 1 so that every batch size has "
                         f"a k, got {parsed}.")
    return parsed


def build_dynamic_sd_schedule_lookup(schedule: object, max_batch_size: int,
                                     num_speculative_tokens: int) -> list[int]:
    """The schedule as a dense table: ``lookup[batch_size]`` is that batch size's k (index 0 unused).
    As vLLM 0.32: each k is clamped to ``num_speculative_tokens``; a gap between two ranges keeps the
    earlier range's k, and so does every batch size past the last range."""
    if max_batch_size <= 0 or num_speculative_tokens <= 0:
        raise ValueError("max_batch_size and num_speculative_tokens must be > 0, got "
                         f"{max_batch_size} and {num_speculative_tokens}.")
    lookup = [0] * (max_batch_size + 1)
    for start, _end, k in validate_and_normalize_dynamic_sd_schedule(schedule):
        # From this range's start on: a later range overwrites its own part, so a gap before it
        # and the batch sizes past the last range keep the k written last.
        for batch_size in range(start, max_batch_size + 1):
            lookup[batch_size] = min(num_speculative_tokens, k)
    return lookup


def num_spec_tokens_to_schedule(num_speculative_tokens: int, lookup: Optional[list[int]],
                                batch_size: int) -> int:
    """This step's k: the fixed ``num_speculative_tokens``, or the schedule's k at ``batch_size``
    (the number of requests scheduled this step; vLLM's ``len(num_scheduled_tokens)``)."""
    if lookup is None or batch_size <= 0:
        return num_speculative_tokens
    return lookup[min(batch_size, len(lookup) - 1)]
