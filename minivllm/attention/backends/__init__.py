"""Attention backends by name, a small stand-in for vllm/attention/selector.py (``get_attn_backend``).

A backend is a module with ``reshape_and_cache(key, value, kv_cache, slot_mapping, shared=None)``
and ``unified_attention(query, kv_cache, block_table, seq_lens, query_start_loc, max_query_len,
max_seq_len, scale, shared=None)``; ``shared`` is the step's ``AttentionMetadata.shared``, where a
backend may keep what all layers of one step compute alike:

- ``"torch"``: the plain reference (``torch_ref.py``): per sequence, gather K/V through the block
  table, then SDPA. What a reader steps through; the spec the others are tested against;
- ``"cpu_attn"``: the same attention planned for speed on a CPU (``cpu_attn.py``; vLLM's
  ``CPUAttentionBackend``): length-sorted groups, one per-step plan shared by all layers;
- ``"triton"``: the Triton kernels (``triton_attn.py``), interpreted on CPU (``TRITON_INTERPRET=1``);
- ``"auto"``: Triton on CUDA, ``cpu_attn`` elsewhere (``resolve_attn_backend``).
"""
from __future__ import annotations

import importlib
from types import ModuleType

import torch

# name -> module path, imported on first use
ATTENTION_BACKENDS: dict[str, str] = {
    "torch": "minivllm.attention.backends.torch_ref",
    "cpu_attn": "minivllm.attention.backends.cpu_attn",
    "triton": "minivllm.attention.backends.triton_attn",
}


def resolve_attn_backend(name: str, device: str = "") -> str:
    """The backend "auto" stands for on ``device`` ("cuda..." or "cpu"; empty: CUDA if available);
    any other name is returned as it is."""
    if name != "auto":
        return name
    on_cuda = device.startswith("cuda") if device else torch.cuda.is_available()
    return "triton" if on_cuda else "cpu_attn"


def get_attn_backend(name: str) -> ModuleType:
    """Return the backend module for ``name`` ("auto", "torch", "cpu_attn" or "triton")."""
    name = resolve_attn_backend(name)
    if name not in ATTENTION_BACKENDS:
        allowed = ("auto",) + tuple(ATTENTION_BACKENDS)
        raise ValueError(f"attention backend must be one of {allowed}, got {name!r}.")
    return importlib.import_module(ATTENTION_BACKENDS[name])


__all__ = ["ATTENTION_BACKENDS", "get_attn_backend", "resolve_attn_backend"]
