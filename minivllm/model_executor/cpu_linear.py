"""The CPU's fast linear method, chosen once after loading; the role of vLLM's CPU GEMM dispatch
(vllm/model_executor/layers/utils.py ``dispatch_cpu_unquantized_gemm``, which
``UnquantizedLinearMethod.process_weights_after_loading`` calls on a CPU).

``process_weights_after_loading(model)`` (the loader calls it) times every distinct CPU weight shape
of the model's ``Linear`` layers at every row bucket (``kernel_choice``), gives each such layer a
``CPUUnquantizedLinearMethod``, and hands it the packed copies its routes read, so no step pays for
either. ``MINIVLLM_LINEAR_ROUTE=f_linear`` leaves every layer on the plain ``F.linear`` method;
another fixed route installs this method without timing. Choices timed once on this machine are
read back from disk (``route_cache``), so a later process times nothing; the timing of one load
stops at ``kernel_choice.tuning_budget()`` seconds, and what it did not reach runs ``F.linear``.

Per call the method looks up the route measured for the row count and runs it; CUDA, non-2-D and
empty inputs, and autograd, still take ``F.linear``. All routes agree with ``F.linear`` to float32
rounding (tests/test_kernel_choice.py).
"""
from __future__ import annotations

import time
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from minivllm.model_executor import kernel_choice, route_cache
from minivllm.model_executor.kernel_choice import (CANDIDATES, MAX_TUNED_ROWS, PREPARE,
                                                   ROW_BUCKETS, KernelChoices,
                                                   forced_route, packing_allowed,
                                                   prepare_operands, shape_key, tuning_budget)
from minivllm.model_executor.linear import Linear, UnquantizedLinearMethod


def choose(weight: torch.Tensor, m: int, same_shape: Optional[list[torch.Tensor]] = None,
           prepared: Optional[dict[str, list[torch.Tensor]]] = None) -> str:
    """The route for ``m`` rows (m >= 1) times ``weight``; timed on first use,
    over ``same_shape`` (every weight of the model with this shape and dtype) when given, with
    ``prepared`` their prepared copies (see ``route_timing._time_candidates``)."""
    forced = forced_route()
    if forced:
        return forced
    key = shape_key(weight, m)
    name = kernel_choice.CHOICES.chosen.get(key)
    if name is None:   # the timing code loads only when something is left to time
        from minivllm.model_executor.route_timing import tune
        name = tune(key, same_shape or [weight], prepared)
    return name


def _f_linear_only(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """No route to choose: CUDA, a non-2-D or empty input, or autograd. The oneDNN routes have no
    backward, and a packed copy is not the parameter, so a gradient would silently miss the
    weight."""
    return x.device.type != "cpu" or x.dim() != 2 or x.shape[0] == 0 or (
        torch.is_grad_enabled() and (weight.requires_grad or x.requires_grad))


def run_route(x: torch.Tensor, operand: torch.Tensor, bias: Optional[torch.Tensor],
              route: str) -> torch.Tensor:
    """``route`` on ``operand`` (the weight, or the copy a prepared route reads), plus ``bias``."""
    if route == "f_linear":
        return F.linear(x, operand, bias)
    out = CANDIDATES[route](x, operand)
    return out if bias is None else out + bias


def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
           route: Optional[str] = None) -> torch.Tensor:
    """``x [m, in]``, ``weight [out, in]``, ``bias [out]`` -> ``[m, out]`` by ``route`` (default:
    the measured one), for a weight that is no layer's."""
    if _f_linear_only(x, weight):
        return F.linear(x, weight, bias)
    return run_route(x, weight, bias, route or choose(weight, x.shape[0]))


class CPUUnquantizedLinearMethod(UnquantizedLinearMethod):
    """One layer's measured routes: ``apply`` pays one list lookup for the route of its row count.

    A route that reads a prepared copy of the weight (``kernel_choice.PREPARE``: oneDNN's packed
    layout) gets it from :meth:`prepared_weight`, adopted from the load-time timing or made on
    first use, and remade whenever the layer's ``weight`` is replaced or written in place (its
    version counter moves), so the copy is never stale. The copy lives here, not on the layer."""

    def __init__(self) -> None:
        # Index m for m <= MAX_TUNED_ROWS rows, the last entry for more (a prefill).
        self._route_by_rows: list = [None] * (MAX_TUNED_ROWS + 2)
        self._prepared: tuple | None = None   # (route, weight, its version, the copy)

    def set_prepared(self, layer: nn.Linear, route: str, copy: torch.Tensor) -> None:
        """Adopt ``copy`` (``PREPARE[route](layer.weight)``, made by the load-time timing)."""
        self._prepared = (route, layer.weight, layer.weight._version, copy)

    def prepared_weight(self, layer: nn.Linear, route: str) -> torch.Tensor:
        w, p = layer.weight, self._prepared
        version = w._version
        if p is None or p[0] != route or p[1] is not w or p[2] != version:
            with torch.no_grad():
                p = self._prepared = (route, w, version, PREPARE[route](w.detach()))
        return p[3]

    def apply(self, layer: nn.Linear, x: torch.Tensor,
              bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        weight = layer.weight
        if _f_linear_only(x, weight):
            return F.linear(x, weight, bias)
        m = x.shape[0]
        i = min(m, MAX_TUNED_ROWS + 1)
        route = self._route_by_rows[i]
        if route is None:
            route = self._route_by_rows[i] = choose(weight, m)
        operand = self.prepared_weight(layer, route) if route in PREPARE else weight
        return run_route(x, operand, bias, route)


def process_weights_after_loading(model: nn.Module) -> KernelChoices:
    """Give every ``Linear`` of ``model`` whose weight is on the CPU the measured routes (vLLM:
    model_loader/utils.py ``process_weights_after_loading``, once per loaded model); returns the
    process-wide choices. A layer that already has them (a module shared with a model processed
    before, such as a drafter's borrowed ``lm_head``) keeps its own."""
    forced = forced_route()
    if forced == "f_linear":
        return kernel_choice.CHOICES
    t0 = time.perf_counter()
    shapes = _install_cpu_methods(model)
    if forced or not shapes:   # a fixed route: nothing to time, copies are made on first use
        return kernel_choice.CHOICES
    choices = kernel_choice.CHOICES
    cache_key = route_cache.machine(packing_allowed()) if route_cache.enabled() else None
    if cache_key is not None:   # what an earlier process on this machine chose
        for key, route in route_cache.load(cache_key, CANDIDATES).items():
            choices.chosen.setdefault(key, route)
    num_timed = len(choices.timings_us)
    prepared = _time_routes(shapes, deadline=t0 + tuning_budget())
    for i, (mods, weights) in enumerate(shapes):
        # The layers keep the copies their routes read (so the first step does not pay for
        # them); the rest are dropped here.
        routes = {choices.chosen[shape_key(weights[0], m)] for m in ROW_BUCKETS}
        copies = prepared.get(i, {})
        missing = (routes & set(PREPARE)) - set(copies)   # warm cache: nothing was packed to time
        if missing:
            with torch.no_grad():
                copies.update(prepare_operands(weights, missing))
        for name in routes & set(copies):
            for mod, copy in zip(mods, copies[name]):
                mod.quant_method.set_prepared(mod, name, copy)
    if cache_key is not None and len(choices.timings_us) > num_timed:
        route_cache.save(cache_key, {k: r for k, r in choices.chosen.items()
                                     if k not in choices.provisional})
    kernel_choice.logger.info("linear kernel choice (%.2f s this call, %d shapes timed, %d left "
                              "on F.linear for now): %s", time.perf_counter() - t0,
                              len(choices.timings_us) - num_timed, len(choices.provisional),
                              "; ".join(choices.summary()))
    return choices


def _install_cpu_methods(model: nn.Module) -> list[tuple[list[Linear], list[torch.Tensor]]]:
    """Give each CPU ``Linear`` without one a ``CPUUnquantizedLinearMethod``; -> per distinct
    weight shape and dtype, its layers and their distinct weights (a tied LM head is the
    embedding's weight: one entry per tensor)."""
    seen: dict[tuple, list[Linear]] = {}
    for mod in model.modules():
        if not isinstance(mod, Linear) or isinstance(mod.quant_method, CPUUnquantizedLinearMethod):
            continue
        w = mod.weight
        if w.device.type == "cpu" and not w.is_meta:
            mod.quant_method = CPUUnquantizedLinearMethod()
            seen.setdefault((tuple(w.shape), w.dtype), []).append(mod)
    shapes = []
    for mods in seen.values():
        mods = list({id(mod.weight): mod for mod in mods}.values())
        shapes.append((mods, [mod.weight for mod in mods]))
    return shapes


def _time_routes(shapes: list[tuple[list[Linear], list[torch.Tensor]]],
                 deadline: float) -> dict[int, dict[str, list[torch.Tensor]]]:
    """Time each (shape, row bucket) not chosen yet, fewest rows first (decode steps are most of a
    generation), until ``deadline``. What is left runs ``F.linear`` in this process only
    (``CHOICES.provisional``: never stored, so a later process times it within its own budget).
    -> the prepared copies made for the timing, by index into ``shapes``."""
    choices, prepared = kernel_choice.CHOICES, {}
    for m in ROW_BUCKETS:
        for i, (_, weights) in enumerate(shapes):
            key = shape_key(weights[0], m)
            if key in choices.chosen:
                continue
            if time.perf_counter() > deadline:
                choices.chosen[key] = "f_linear"
                choices.provisional.add(key)
                continue
            if i not in prepared:
                with torch.no_grad():
                    prepared[i] = prepare_operands(weights)   # once per shape, every bucket
            choose(weights[0], m, weights, prepared[i])
    return prepared
