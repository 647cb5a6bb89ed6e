"""Pick, by timing on the machine at hand, how ``y = x @ W.T`` runs on the CPU; the role of vLLM's
autotuned kernel configs (vllm/model_executor/layers/fused_moe/configs, Triton's ``autotune``).

The candidates compute the same product with another memory layout or summation order, so they
agree with ``F.linear`` to float32 rounding:

- ``f_linear``: ``F.linear(x, W)``, the default;
- ``gemm_wx``: ``(W @ x.T).T`` (the weight as the left operand: another GEMM kernel of the BLAS);
- ``pad2``: one row duplicated into a two-row ``gemm_wx`` (only for 1 row: 1-row GEMV paths can be
  slow for a wide matrix such as a 49152 x 576 LM head).
- ``onednn``: oneDNN's inner-product primitive on the plain weight
  (``torch.ops.mkldnn._linear_pointwise``, the op PyTorch's CPU compiler emits for a linear;
  vLLM's CPU build also runs its linears through oneDNN). No packed copy of the weight is made, so
  it costs no memory. Measured on a 2-core x86 CPU, SmolLM2's 120 projections at one row:
  25 ms against F.linear's 41 ms in float32; in bfloat16 it lost (27 against 22 ms). Where
  ``onednn_packed`` works it is not timed (``SUPERSEDES``).
- ``onednn_packed``: the same primitive on a copy of the weight reordered once into oneDNN's
  blocked layout (``torch.ops.mkldnn._reorder_linear_weight``, what vLLM's CPU build and PyTorch's
  CPU compiler do with their weights). The copy (opaque) then *is* the layer's weight, for every
  row count (``packed_weight``), so the model is in memory once. Measured on the same CPU,
  SmolLM2's 120 projections called in the model's order: 15.4 against F.linear's 23.9 ms at one
  row in bfloat16; at 128 rows in float32, 147 against 204 ms. There the timing below chose
  ``pad2`` for 1 row and ``gemm_wx`` for 2 rows in float32, and this route for most other shapes
  and row counts in both dtypes (the choices move from run to run where two routes are close).

``x @ W.T`` was a third candidate; measured here it is ``F.linear`` within noise for every shape of
SmolLM2 (F.linear without bias *is* that matmul on the CPU), so it was dropped.

Which one wins depends on the CPU, the BLAS, the dtype, the weight's shape and the row count, so
it is measured once per ``(device, dtype, out, in, row bucket)`` (rows rounded up to a power of
two, up to ``MAX_TUNED_ROWS``; every larger count, a prefill, shares one bucket timed at
``MANY_ROWS`` rows), kept for the process and on disk for the next one (``route_cache.py``). A
candidate replaces ``f_linear`` only if it is at least ``MIN_GAIN`` faster: on a busy machine most
shapes differ by noise, and then the default (and its summation order) is kept. One model's load
times for at most ``MINIVLLM_TUNING_BUDGET_S`` seconds (default 1.5), fewest rows first; what is
left runs ``f_linear`` until a later process times it.
``MINIVLLM_LINEAR_ROUTE=<candidate>`` fixes the choice (for tests and for comparisons);
``MINIVLLM_LINEAR_PACK=0`` keeps the timing but leaves out the prepared-weight candidates: every
weight stays a plain tensor.

Only the CPU is tuned: on CUDA ``F.linear`` is cuBLAS with its own heuristics. This file holds the
candidates and the table of choices; ``route_timing`` times them, ``cpu_linear`` chooses for a
model's shapes at load and runs the chosen routes.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.nn.functional as F

logger = logging.getLogger("minivllm.kernel_choice")

MAX_TUNED_ROWS = 32
# Every row count above MAX_TUNED_ROWS (prefill chunks) takes the route timed at MANY_ROWS rows,
# over at most MANY_ROWS_WEIGHTS weights of the shape: with that many rows a product is bound by
# arithmetic, not by streaming the weight, so a few matrices time it as well as thirty would.
# Only F.linear and oneDNN (packed, or plain where packing is off) compete there: the others are
# few-row tricks.
# Measured on a 2-core x86 CPU, float32 SmolLM2's 120 projections at 1024 rows: 1,070 ms with
# oneDNN's packed weight against 1,340 with F.linear.
MANY_ROWS = 128
MANY_ROWS_WEIGHTS = 2
ROW_BUCKETS = (1, 2, 4, 8, 16, 32, MANY_ROWS)
MIN_GAIN = 0.15   # a candidate must be this much faster than f_linear to be chosen (route_timing)


def _f_linear(x, w):
    return F.linear(x, w)


def _gemm_wx(x, w):
    return (w @ x.T).T.contiguous()


def _pad2(x, w):
    if x.shape[0] != 1:
        return _gemm_wx(x, w)
    return (w @ torch.cat([x, x]).T)[:, :1].T.contiguous()


def _onednn(x, w):
    return torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")


def _pack_onednn(w: torch.Tensor) -> torch.Tensor:
    """``w [out, in]`` -> the same matrix in oneDNN's blocked layout (an opaque tensor), laid out
    for up to ``MAX_TUNED_ROWS`` rows; ``_onednn(x, packed)`` then equals ``F.linear(x, w)``."""
    return torch.ops.mkldnn._reorder_linear_weight(w, MAX_TUNED_ROWS)


def _onednn_available() -> bool:
    try:
        return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn,
                                                                "_linear_pointwise")
    except (AttributeError, RuntimeError):
        return False


CANDIDATES: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "f_linear": _f_linear, "gemm_wx": _gemm_wx, "pad2": _pad2}
# Candidates that run on a prepared copy of the weight: name -> how the copy is made (once);
# UNPACK: how the plain matrix is read back from it (exactly: a reorder, no arithmetic).
PREPARE: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {}
UNPACK: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {}
# A prepared candidate that worked for a shape is not timed against the plain candidate it
# supersedes: the packed layout was never slower here (above), and each candidate costs load time.
SUPERSEDES = {"onednn_packed": "onednn"}
if _onednn_available():
    CANDIDATES["onednn"] = _onednn
    if hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
        CANDIDATES["onednn_packed"] = _onednn
        PREPARE["onednn_packed"] = _pack_onednn
        UNPACK["onednn_packed"] = torch.Tensor.to_dense

ShapeKey = tuple[str, str, int, int, int]   # (device type, dtype, out, in, row bucket)


def row_bucket(m: int) -> int:
    """Smallest power of two >= m up to MAX_TUNED_ROWS; MANY_ROWS above."""
    if m > MAX_TUNED_ROWS:
        return MANY_ROWS
    return 1 << (m - 1).bit_length()


@dataclass
class KernelChoices:
    """The process-wide cache: shape key -> chosen candidate, with the timings that chose it."""
    chosen: dict[ShapeKey, str] = field(default_factory=dict)
    timings_us: dict[ShapeKey, dict[str, float]] = field(default_factory=dict)
    # Left on f_linear untimed when the tuning budget ran out: kept out of the on-disk cache.
    provisional: set[ShapeKey] = field(default_factory=set)
    tuning_seconds: float = 0.0

    def summary(self) -> list[str]:
        """One line per weight shape: ``'49152x576 float32: 1:matmul 2:gemm_wx ...'``."""
        by_shape: dict[tuple, list[str]] = {}
        for (dev, dt, o, i, m), name in sorted(self.chosen.items()):
            by_shape.setdefault((dev, dt, o, i), []).append(f"{m}:{name}")
        return [f"{o}x{i} {dt} on {dev}: " + " ".join(v) for (dev, dt, o, i), v in by_shape.items()]


CHOICES = KernelChoices()


def forced_route() -> Optional[str]:
    route = os.environ.get("MINIVLLM_LINEAR_ROUTE")
    if route and route not in CANDIDATES:
        raise ValueError(f"MINIVLLM_LINEAR_ROUTE={route!r}: use one of {sorted(CANDIDATES)}.")
    return route or None


def tuning_budget() -> float:
    """Seconds of wall time one model's load may spend timing routes (``MINIVLLM_TUNING_BUDGET_S``,
    default 1.5): on a busy machine the timing would otherwise take tens of seconds."""
    value = os.environ.get("MINIVLLM_TUNING_BUDGET_S", "1.5")
    try:
        budget = float(value)
    except ValueError:
        budget = -1.0
    if not budget >= 0:
        raise ValueError(f"MINIVLLM_TUNING_BUDGET_S={value!r}: use a number of seconds >= 0 (inf: no limit).")
    return budget


def packing_allowed() -> bool:
    """False under ``MINIVLLM_LINEAR_PACK=0``: no prepared-weight candidate is made or timed."""
    value = os.environ.get("MINIVLLM_LINEAR_PACK", "1").strip().lower()
    if value not in ("0", "1", "false", "true", "no", "yes", ""):
        raise ValueError(f"MINIVLLM_LINEAR_PACK={value!r}: use 1 (default) or 0.")
    return value not in ("0", "false", "no")


def prepare_operands(weights: list[torch.Tensor],
                     names: Optional[set[str]] = None) -> dict[str, list[torch.Tensor]]:
    """Each prepared-weight candidate's copies of ``weights`` (``PREPARE``, or those of it in
    ``names``); a candidate this oneDNN build cannot prepare for the dtype or CPU is left out, and
    all of them under ``MINIVLLM_LINEAR_PACK=0``."""
    out = {}
    if not packing_allowed():
        return out
    for name, prepare in PREPARE.items():
        if names is not None and name not in names:
            continue
        try:
            out[name] = [prepare(w) for w in weights]
        except RuntimeError:
            pass
    return out


def shape_key(weight: torch.Tensor, m: int) -> ShapeKey:
    return (weight.device.type, str(weight.dtype).replace("torch.", ""), weight.shape[0],
            weight.shape[1], row_bucket(m))
