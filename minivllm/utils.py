"""Small helpers shared across the package (vLLM: vllm/utils/)."""
from __future__ import annotations

import gc
import importlib
import os
from contextlib import contextmanager
from typing import Any, Iterator


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for integers (vLLM's ``cdiv``): e.g. the blocks that hold ``a`` tokens."""
    return -(a // -b)


def resolve_auto_dtype(dtype: str, device: Any) -> str:
    """``dtype="auto"`` -> ``"bfloat16"`` on CUDA (as vLLM serves Llama models), ``"float32"``
    elsewhere, where bfloat16 matmuls are slow on most processors; any other name as it is. The
    one rule for the model's weights and for the KV layout its connectors expect."""
    if dtype != "auto":
        return dtype
    return "bfloat16" if str(device).startswith("cuda") else "float32"


@contextmanager
def frozen_gc_heap() -> Iterator[None]:
    """The cyclic garbage collector skips every object that exists on entry, until exit: vLLM's
    ``freeze_gc_heap`` (vllm/utils/gc_utils.py), which its EngineCore calls once at start.

    Why: steps make container objects (a suffix tree grows by up to ``max_tree_depth`` nodes per
    token), and CPython's full collections then walk every tracked object, the model's and the
    tokenizer's included: some 400,000, about 0.17 s each time (0.35 s per run of ``bench
    vllm``'s 8-request suffix workload). Frozen, they walk only what was made since.
    Scoped to one call, since minivllm's engine lives in the caller's process: a heap frozen for
    good would keep the cyclic garbage of engines dropped later. Freezing and unfreezing move
    whole lists, in constant time. A heap something else froze is left as it is."""
    if gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def resolve_obj_by_qualname(qualname: str) -> Any:
    """``"package.module.Name"`` (or ``"package.module.Class.method"``) -> the object (vLLM's
    ``resolve_obj_by_qualname``): the longest importable prefix is the module, the rest are
    attributes. Variants that stand beside the article's code are named this way in registries,
    so the article's modules never import them unless they are asked for."""
    parts = qualname.split(".")
    for i in range(len(parts) - 1, 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:i]))
        except ModuleNotFoundError as e:
            if e.name is None or not ".".join(parts[:i]).startswith(e.name):
                raise   # a missing import inside that module, not a shorter module path
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(f"no module in {qualname!r}")


def cache_dir() -> str:
    """Where minivllm keeps what it computes once per machine (converted checkpoints, linear
    route choices): ``$MINIVLLM_CACHE_DIR``, else ``~/.cache/minivllm``."""
    return os.path.expanduser(os.environ.get("MINIVLLM_CACHE_DIR") or "~/.cache/minivllm")


def keep_off_openmp() -> None:
    """Call first in a thread that is not the engine's (a KV loader, a side channel, the HTTP
    server): its torch ops then run on that thread alone and never start a libgomp team.

    Why: PyTorch's CPU wheels use libgomp, which gives every thread that starts a parallel region
    its own team of worker threads. Once the process holds more of them than there are cores, idle
    workers stop spinning and sleep, so each parallel region of the engine then pays for waking
    them. Measured on a 2-core CPU: one parallel ``add`` of 200,000 floats in the main thread took
    21 us; after a side thread had made one copy of that size, and while it stayed alive, 116 us;
    with ``torch.set_num_threads(1)`` first in the side thread, 21 us. ``torch.set_num_threads``
    is per thread for OpenMP and MKL, so the main thread keeps its count. It also sets the default
    of threads that have not run a parallel op yet; a background engine thread therefore sets its
    own count (``AsyncLLM.start``)."""
    import torch   # a thread that calls this runs torch already; utils itself stays torch-free
    torch.set_num_threads(1)
