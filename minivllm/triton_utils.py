"""Importing Triton so that its kernels run everywhere, whatever was imported first.

Triton decides at ``@triton.jit`` time whether a function is compiled (GPU) or interpreted by NumPy
on the CPU (``TRITON_INTERPRET=1``). So the variable must be set *before* a module defines its
kernels: every kernel module does ``from minivllm.triton_utils import triton, tl`` first.

That is not enough when something imported Triton earlier (transformers and ``torch._dynamo`` do):
Triton's own ``@jit`` helpers in ``triton.language`` (``tl.cdiv``, ``tl.max``, ``tl.argmax``,
``tl.sum`` ...) were then made in compiled mode, and an interpreted kernel that calls one fails with
"Cannot call @triton.jit'd outside of the scope of a kernel". ``_interpret_triton_language`` remakes
those helpers as interpreted functions, which is exactly the state a fresh ``TRITON_INTERPRET=1``
import would have produced. ``triton_backend_problem`` runs a tiny kernel that uses such helpers, so
``LLM(...)`` can refuse a Triton backend that cannot run, with the cause and the fix, before any work.

``KernelLaunch`` is one kernel call spelled out (grid, arguments, constexprs, launch options). The
launchers build one and run it; ``minivllm.bench.triton_aot`` builds the same object from stand-in
tensors and compiles it ahead of time for real GPU targets, so the two cannot drift apart.
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"


def _interpret_triton_language() -> int:
    """Replace every compiled-mode ``@triton.jit`` helper in ``triton.language`` (module attributes
    and ``tl.tensor`` methods) by an interpreted one; returns how many were replaced (0 when Triton
    was first imported with ``TRITON_INTERPRET=1`` already set)."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    made: dict[int, Any] = {}

    def interpreted(jit_fn: JITFunction) -> Any:
        # One replacement per helper: triton.language, triton.language.standard and tl.tensor all
        # hold the same object, and the interpreter caches rewritten functions by identity.
        if id(jit_fn) not in made:
            made[id(jit_fn)] = InterpretedFunction(jit_fn.fn)
        return made[id(jit_fn)]

    holders = [m for name, m in list(sys.modules.items())
               if m is not None and (name == "triton.language" or name.startswith("triton.language."))]
    holders.append(tl.tensor)
    for holder in holders:
        for attr, value in list(vars(holder).items()):
            if isinstance(value, JITFunction):
                setattr(holder, attr, interpreted(value))
    return len(made)


if INTERPRETED:
    _interpret_triton_language()


@triton.jit
def _probe_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    # Uses @jit helpers of triton.language (cdiv, max, argmax, sum): the ones that break first.
    offs = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n, other=0.0)
    tl.store(out_ptr, tl.max(x, axis=0) + tl.argmax(x, axis=0) + tl.sum(x, axis=0) + tl.cdiv(n, 2))


def triton_backend_problem(device: str) -> Optional[str]:
    """None when Triton kernels can run on ``device`` in this process, else why not and the fix.

    On a CPU that means the interpreter, checked by running a tiny kernel (a few milliseconds);
    on CUDA the kernels are compiled on first use and nothing is checked here."""
    if device.startswith("cuda"):
        return None
    if not INTERPRETED:
        return ("Triton kernels cannot be compiled for the CPU, and TRITON_INTERPRET is set to "
                f"{os.environ.get('TRITON_INTERPRET')!r} in this process, so minivllm's kernels were "
                "defined in compiled mode. Fix: unset TRITON_INTERPRET (or set TRITON_INTERPRET=1) "
                "before importing minivllm, in a fresh process; or use attention_backend='torch'.")
    x = torch.tensor([0.5, 3.0, 1.0])
    out = torch.zeros(1)
    try:
        _probe_kernel[(1,)](x, out, 3, BLOCK=4)
    except Exception as e:  # report the cause instead of failing in the middle of generate()
        return (f"Triton's interpreter cannot run a kernel in this process ({type(e).__name__}: "
                f"{e}). Fix: import minivllm before other packages that import Triton, in a fresh "
                "process; or use attention_backend='torch'.")
    expected = 3.0 + 1 + 4.5 + 2
    if abs(float(out[0]) - expected) > 1e-5:
        return (f"Triton's interpreter computed {float(out[0])} instead of {expected} in a probe "
                "kernel. Fix: reinstall triton, or use attention_backend='torch'.")
    return None


def check_triton_backend(device: str) -> None:
    """``DeviceConfig``'s check of ``attention_backend="triton"``: a ``ValueError`` with the fix
    when ``triton_backend_problem`` finds one."""
    problem = triton_backend_problem(device)
    if problem is not None:
        raise ValueError(f"attention_backend='triton' cannot run on {device}: {problem}")


# Triton signature names of the torch dtypes the kernels take through pointers.
_POINTER_TYPES = {torch.float32: "*fp32", torch.float16: "*fp16", torch.bfloat16: "*bf16",
                  torch.float64: "*fp64", torch.int32: "*i32", torch.int64: "*i64",
                  torch.bool: "*i1", torch.int8: "*i8", torch.uint8: "*u8"}


@dataclass
class KernelLaunch:
    """One kernel call: ``kernel[grid](*args.values(), **constexprs, **options)``.

    ``args`` maps the kernel's runtime parameters, in order, to tensors, ints or floats;
    ``constexprs`` its compile-time ones; ``options`` launch options such as ``num_warps``."""
    kernel: Any
    grid: tuple[int, ...]
    args: dict[str, Any]
    constexprs: dict[str, Any]
    options: dict[str, Any] = field(default_factory=lambda: {"num_warps": 4, "num_stages": 3})

    def run(self) -> None:
        self.kernel[self.grid](*self.args.values(), **self.constexprs, **self.options)

    def signature(self) -> dict[str, str]:
        """Triton's signature for ahead-of-time compilation: the types a launch would bind.

        As Triton does when it binds a call: tensors become typed pointers, Python ints ``i32`` (or
        ``i64`` when they do not fit), floats ``fp32``; constexprs are marked ``constexpr``."""
        sig = {}
        for name, value in self.args.items():
            if isinstance(value, torch.Tensor):
                sig[name] = _POINTER_TYPES[value.dtype]
            elif isinstance(value, bool):
                sig[name] = "i1"
            elif isinstance(value, int):
                sig[name] = "i32" if -2**31 <= value < 2**31 else "i64"
            elif isinstance(value, float):
                sig[name] = "fp32"
            else:
                raise TypeError(f"{name}: cannot type a {type(value).__name__} argument")
        return {**sig, **{name: "constexpr" for name in self.constexprs}}

    def attrs(self) -> dict[tuple[int, ...], list[list[Any]]]:
        """The specialisations Triton makes at launch: pointers (torch allocations are aligned) and
        ints that are multiples of 16 are marked ``tt.divisibility`` 16."""
        out = {}
        for i, value in enumerate(self.args.values()):
            if isinstance(value, torch.Tensor) or (
                    isinstance(value, int) and not isinstance(value, bool) and value % 16 == 0
                    and value != 0):
                out[(i,)] = [["tt.divisibility", 16]]
        return out


__all__ = ["triton", "tl", "INTERPRETED", "KernelLaunch", "triton_backend_problem",
           "check_triton_backend"]
