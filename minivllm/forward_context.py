"""The forward context, mirroring vllm/forward_context.py.

``ModelRunner.execute_model`` enters ``set_forward_context(...)`` around the forward pass; every
``Attention`` layer reads the step's ``attn_metadata`` (and its own ``kv_cache``) from here, and a
KV connector's ``start_load_kv(forward_context)`` finds the layers' caches through ``no_compile_layers``.

vLLM keeps the worker-side connector in a process-wide global (``get_kv_transfer_group()``); we keep
it on the context instead, so that a prefill and a decode instance can live in one Python process.
For the same reason the context is per thread: two engines stepping in two threads of one process
(a server's engine thread beside another instance) must not see, or restore, each other's context.
"""
from __future__ import annotations

import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Optional


@dataclass
class ForwardContext:
    # layer_name -> Attention module (each has .kv_cache [2, num_blocks, block_size, num_kv_heads, head_dim])
    no_compile_layers: dict[str, Any] = field(default_factory=dict)
    attn_metadata: Any = None
    # Worker-side KVConnectorBase_V1 instance, or None.
    kv_connector: Any = None


_local = threading.local()   # .ctx: this thread's ForwardContext, or absent


def get_forward_context() -> ForwardContext:
    ctx = getattr(_local, "ctx", None)
    assert ctx is not None, (
        "Forward context is not set: the model must run inside set_forward_context(...).")
    return ctx


def is_forward_context_available() -> bool:
    return getattr(_local, "ctx", None) is not None


@contextmanager
def set_forward_context(attn_metadata: Any, no_compile_layers: dict[str, Any],
                        kv_connector: Any = None):
    prev = getattr(_local, "ctx", None)
    ctx = _local.ctx = ForwardContext(no_compile_layers=no_compile_layers,
                                      attn_metadata=attn_metadata, kv_connector=kv_connector)
    try:
        yield ctx
    finally:
        _local.ctx = prev
