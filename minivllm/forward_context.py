"""The forward context, mirroring vllm/forward_context.py.

``ModelRunner.execute_model`` enters ``set_forward_context(...)`` around the forward pass; every
``Attention`` layer reads the step's ``attn_metadata`` (and its own ``kv_cache``) from here, and a
KV connector's ``start_load_kv(forward_context)`` finds the layers' caches through ``no_compile_layers``.

vLLM keeps the worker-side connector in a process-wide global (``get_kv_transfer_group()``); we keep
it on the context instead, so that a prefill and a decode instance can live in one Python process
(tests and notebooks do this).
"""
from __future__ import annotations

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


_forward_context: Optional[ForwardContext] = None


def get_forward_context() -> ForwardContext:
    assert _forward_context is not None, (
        "Forward context is not set: the model must run inside set_forward_context(...).")
    return _forward_context


def is_forward_context_available() -> bool:
    return _forward_context is not None


@contextmanager
def set_forward_context(attn_metadata: Any, no_compile_layers: dict[str, Any],
                        kv_connector: Any = None):
    global _forward_context
    prev = _forward_context
    _forward_context = ForwardContext(no_compile_layers=no_compile_layers,
                                      attn_metadata=attn_metadata, kv_connector=kv_connector)
    try:
        yield _forward_context
    finally:
        _forward_context = prev
