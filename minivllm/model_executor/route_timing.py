"""How ``kernel_choice`` times its candidates, for a (shape, rows) that has no choice yet, neither
from this process nor from the on-disk cache (``route_cache.py``).

Every weight of one shape is timed in turn, candidates interleaved, best of a few rounds; a
candidate replaces ``f_linear`` only if it is at least ``MIN_GAIN`` faster.
"""
from __future__ import annotations

import time
from typing import Optional

import torch

from minivllm.model_executor import kernel_choice
from minivllm.model_executor.kernel_choice import (CANDIDATES, MANY_ROWS_WEIGHTS, MAX_TUNED_ROWS,
                                                   MIN_GAIN, PREPARE, SUPERSEDES, ShapeKey,
                                                   _f_linear, logger, prepare_operands)


def _time_candidates(x: torch.Tensor, weights: list[torch.Tensor], rounds: int = 3,
                     prepared: Optional[dict[str, list[torch.Tensor]]] = None) -> dict[str, float]:
    """Microseconds per call (best of ``rounds``), candidates interleaved so drift hits all alike.

    Each sample runs the product once with every weight in ``weights`` (all of one shape: the
    model's 30 ``qkv_proj`` matrices, say), in turn, as a forward does. Timing one small matrix
    over and over would time it from the cache, where the routes differ little; streamed from
    memory, as in a forward, they can differ by 1.6x. ``prepared``: the copies a prepared-weight
    candidate runs on (``prepare_operands(weights)``, made here when not given)."""
    if x.shape[0] > MAX_TUNED_ROWS:   # compute-bound: a few matrices time it (MANY_ROWS_WEIGHTS)
        weights = weights[:MANY_ROWS_WEIGHTS]
        if prepared is not None:
            prepared = {n: copies[:MANY_ROWS_WEIGHTS] for n, copies in prepared.items()}
    prepared = prepare_operands(weights) if prepared is None else prepared
    superseded = {SUPERSEDES.get(n) for n in prepared}
    names = [n for n in CANDIDATES if (n != "pad2" or x.shape[0] == 1)
             and (n not in PREPARE or n in prepared) and n not in superseded]
    if x.shape[0] > MAX_TUNED_ROWS:
        names = [n for n in names if n == "f_linear" or n in PREPARE or n in SUPERSEDES.values()]
    operands = {n: prepared.get(n, weights) for n in names}
    best = {name: float("inf") for name in names}
    # A sample should last ~1 ms for the timer: a short list of small weights repeats.
    t0 = time.perf_counter()
    for w in weights:
        _f_linear(x, w)
    inner = max(1, min(50, int(1e-3 / max(time.perf_counter() - t0, 1e-7))))
    for _ in range(rounds):
        for name in names:
            fn = CANDIDATES[name]
            t0 = time.perf_counter()
            for _ in range(inner):
                for w in operands[name]:
                    fn(x, w)
            best[name] = min(best[name],
                             (time.perf_counter() - t0) / (inner * len(weights)) * 1e6)
    return best


@torch.no_grad()
def tune(key: ShapeKey, weights: list[torch.Tensor], prepared=None) -> str:
    """Time the candidates for ``key`` over ``weights`` and record the winner in
    ``kernel_choice.CHOICES`` (``f_linear`` unless one is ``MIN_GAIN`` faster)."""
    t0 = time.perf_counter()
    weight = weights[0]
    g = torch.Generator(device=weight.device).manual_seed(0)
    x = torch.randn(key[4], weight.shape[1], generator=g, device=weight.device).to(weight.dtype)
    timings = _time_candidates(x, weights, prepared=prepared)
    name = min(timings, key=timings.get)
    if timings[name] > (1 - MIN_GAIN) * timings["f_linear"]:
        name = "f_linear"
    choices = kernel_choice.CHOICES
    choices.chosen[key], choices.timings_us[key] = name, timings
    choices.tuning_seconds += time.perf_counter() - t0
    logger.debug("linear %s: %s (%s)", key, name,
                 ", ".join(f"{k} {v:.0f} us" for k, v in timings.items()))
    return name
