"""Attention backends by name, a small stand-in for vllm/attention/selector.py (``get_attn_backend``).

A backend is a module with ``reshape_and_cache(key, value, kv_cache, slot_mapping, shared=None)``
and ``unified_attention(query, kv_cache, block_table, seq_lens, query_start_loc, max_query_len,
max_seq_len, scale, shared=None)``; ``shared`` is the step's ``AttentionMetadata.shared``, where a
backend may keep what all layers of one step compute alike:

- ``"torch"``: plain PyTorch (``torch_ref.py``), the CPU default and the reference;
- ``"triton"``: the Triton kernels (``triton_attn.py``), interpreted on CPU (``TRITON_INTERPRET=1``);
- ``"auto"``: Triton on CUDA, torch elsewhere.

The Triton module is imported only when asked for, so the default path never imports Triton.
"""
from __future__ import annotations

import importlib
from types import ModuleType

import torch

# name -> module path, imported on first use
ATTENTION_BACKENDS: dict[str, str] = {
    "torch": "minivllm.attention.backends.torch_ref",
    "triton": "minivllm.attention.backends.triton_attn",
}


def get_attn_backend(name: str) -> ModuleType:
    """Return the backend module for ``name`` ("auto", "torch" or "triton")."""
    if name == "auto":
        name = "triton" if torch.cuda.is_available() else "torch"
    if name not in ATTENTION_BACKENDS:
        allowed = ("auto",) + tuple(ATTENTION_BACKENDS)
        raise ValueError(f"attention backend must be one of {allowed}, got {name!r}.")
    return importlib.import_module(ATTENTION_BACKENDS[name])


__all__ = ["ATTENTION_BACKENDS", "get_attn_backend"]
