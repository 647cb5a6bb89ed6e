"""Dynamic k: how many tokens to draft this step, from the batch size (vLLM 0.32:
``vllm/v1/spec_decode/dynamic/utils.py``).

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

# The schedule's checks run when the configuration is made, so they sit below the drafters, beside
# the configuration's other speculative checks; vLLM keeps them in this file.
from minivllm.config.speculative import validate_and_normalize_dynamic_sd_schedule  # noqa: F401


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
