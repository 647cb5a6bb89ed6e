"""The CPU's fast linear method, chosen once after loading; the role of vLLM's CPU GEMM dispatch
(vllm/model_executor/layers/utils.py ``dispatch_cpu_unquantized_gemm``, which
``UnquantizedLinearMethod.process_weights_after_loading`` calls on a CPU).

``process_weights_after_loading(model)`` times every distinct CPU weight shape
of the model's ``Linear`` layers at every row bucket (``kernel_choice``) and gives each such layer a
``CPUUnquantizedLinearMethod``; a weight its routes read packed is replaced by its packed form
(``packed_weight``: one copy, still readable as the plain matrix), as vLLM's CPU build replaces it.
``MINIVLLM_LINEAR_ROUTE=f_linear`` leaves every layer on the plain ``F.linear`` method; another
fixed route installs this method without timing. Choices timed once on this machine are read back
from disk (``route_cache``), so a later process times nothing; the timing of one load stops at
``kernel_choice.tuning_budget()`` seconds, and what it did not reach runs ``F.linear``.

Per call the method looks up the route measured for the row count and runs it; CUDA, non-2-D and
empty inputs, and autograd, still take ``F.linear``. All routes agree with ``F.linear`` to float32
rounding.
"""
from __future__ import annotations

import time
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from minivllm.model_executor import kernel_choice, route_cache
from minivllm.model_executor.kernel_choice import (CANDIDATES, MAX_TUNED_ROWS, PREPARE,
                                                   ROW_BUCKETS, SUPERSEDES, KernelChoices,
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
    """No route to choose: CUDA, a non-2-D or empty input, or autograd (the oneDNN routes have no
    backward)."""
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


def plain_route(route: str) -> str:
    """``route``, or for one on a packed copy the plain route it supersedes (oneDNN, plain)."""
    return SUPERSEDES.get(route, "f_linear") if route in PREPARE else route


class CPUUnquantizedLinearMethod(UnquantizedLinearMethod):
    """One layer's measured routes: ``apply`` pays one list lookup for the route of its row count.

    A packed weight (``PackedWeight``) runs its route at every row count. A plain one runs the
    routes that read it, and where the measured route reads a packed copy, the plain route that
    one supersedes (:func:`plain_route`): no layer holds its weight twice, nothing is cached."""
    packed_type: type = type(None)   # PackedWeight, once the first packing loads packed_weight

    def __init__(self) -> None:
        # Index m for m <= MAX_TUNED_ROWS rows, the last entry for more (a prefill).
        self._route_by_rows: list = [None] * (MAX_TUNED_ROWS + 2)

    def apply(self, layer: nn.Linear, x: torch.Tensor,
              bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        weight = layer.weight
        if type(weight) is self.packed_type:
            return weight.linear(x, bias)
        if _f_linear_only(x, weight):
            return F.linear(x, weight, bias)
        m = x.shape[0]
        i = min(m, MAX_TUNED_ROWS + 1)
        route = self._route_by_rows[i]
        if route is None:
            route = self._route_by_rows[i] = plain_route(choose(weight, m))
        return run_route(x, weight, bias, route)


def process_weights_after_loading(model: nn.Module) -> KernelChoices:
    """Give every CPU ``Linear`` of ``model`` the measured routes, and a packed weight where they
    read one (vLLM: model_loader/utils.py ``process_weights_after_loading``); returns the choices.
    A layer that has them (a drafter's borrowed ``lm_head``, processed before) keeps its own."""
    forced = forced_route()
    if forced == "f_linear":
        return kernel_choice.CHOICES
    t0 = time.perf_counter()
    shapes = _install_cpu_methods(model)
    choices = kernel_choice.CHOICES
    if forced or not shapes:   # a fixed route: nothing to time
        _keep_one_copy(model, shapes, {}, forced)
        return choices
    cache_key = route_cache.machine(packing_allowed()) if route_cache.enabled() else None
    if cache_key is not None:   # what an earlier process on this machine chose
        for key, route in route_cache.load(cache_key, CANDIDATES).items():
            choices.chosen.setdefault(key, route)
    num_timed = len(choices.timings_us)
    prepared = _time_routes(shapes, deadline=t0 + tuning_budget())
    if cache_key is not None and len(choices.timings_us) > num_timed:
        route_cache.save(cache_key, {k: r for k, r in choices.chosen.items()
                                     if k not in choices.provisional})
    packed = _keep_one_copy(model, shapes, prepared, None)
    kernel_choice.logger.info("linear kernel choice (%.2f s this call, %d shapes timed, %d left "
                              "on F.linear for now, %d weights packed): %s",
                              time.perf_counter() - t0, len(choices.timings_us) - num_timed,
                              len(choices.provisional), packed, "; ".join(choices.summary()))
    return choices


Shapes = list[tuple[list[list[Linear]], list[torch.Tensor]]]


def _install_cpu_methods(model: nn.Module) -> Shapes:
    """Give each CPU ``Linear`` without one a ``CPUUnquantizedLinearMethod``; -> per distinct
    weight shape and dtype, its distinct plain weights and the layers holding each."""
    seen: dict[tuple, dict[int, tuple[torch.Tensor, list[Linear]]]] = {}
    for mod in model.modules():
        if not isinstance(mod, Linear) or isinstance(mod.quant_method, CPUUnquantizedLinearMethod):
            continue
        w = mod.weight
        if w.device.type == "cpu" and not w.is_meta:
            mod.quant_method = CPUUnquantizedLinearMethod()
            if type(w) is not CPUUnquantizedLinearMethod.packed_type:
                by_id = seen.setdefault((tuple(w.shape), w.dtype), {})
                by_id.setdefault(id(w), (w, []))[1].append(mod)
    return [([mods for _, mods in by_id.values()], [w for w, _ in by_id.values()])
            for by_id in seen.values()]


def _keep_one_copy(model: nn.Module, shapes: Shapes, prepared: dict[int, dict[str, list]],
                   forced: Optional[str]) -> int:
    """Replace the weights of each shape whose routes read a packed copy by that copy (adopting
    the copies the timing made, ``prepared``); -> how many were packed."""
    if not packing_allowed():
        return 0
    jobs = []   # (holders, weights, route, the timing's copies) per shape that packs
    for i, (holders, weights) in enumerate(shapes):
        routes = [forced] if forced else [kernel_choice.CHOICES.chosen.get(
            shape_key(weights[0], m)) for m in ROW_BUCKETS]
        route = next((r for r in routes if r in PREPARE), None)
        if route is not None:
            jobs.append((holders, weights, route, prepared.get(i, {}).get(route)))
    if not jobs:
        return 0
    from minivllm.model_executor import packed_weight
    CPUUnquantizedLinearMethod.packed_type = packed_weight.PackedWeight
    return packed_weight.pack_layers(model, jobs)


def _time_routes(shapes: Shapes, deadline: float) -> dict[int, dict[str, list[torch.Tensor]]]:
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
