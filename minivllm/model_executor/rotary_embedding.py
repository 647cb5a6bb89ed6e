"""Neox-style rotary embedding with a shared ``cos_sin_cache``, mirroring
vllm/model_executor/layers/rotary_embedding/ (``get_rope``, ``RotaryEmbedding``)."""
from __future__ import annotations

import weakref
from typing import Any, Optional

import torch
from torch import nn

from minivllm.forward_context import get_forward_context, is_forward_context_available


def rope_config(hf_config: Any) -> tuple[float, dict]:
    """``(rope_theta, rope_parameters)`` from either config layout.

    transformers 5 stores everything in ``config.rope_parameters`` (``rope_theta`` included; the old
    ``config.rope_theta`` attribute reads ``None`` and ``rope_scaling`` is an alias); transformers 4
    keeps ``config.rope_theta`` and an optional ``config.rope_scaling`` dict (older files spell
    ``rope_type`` as ``type``).
    """
    params = dict(getattr(hf_config, "rope_parameters", None)
                  or getattr(hf_config, "rope_scaling", None) or {})
    theta = params.get("rope_theta") or getattr(hf_config, "rope_theta", None) or 10000.0
    params["rope_type"] = params.get("rope_type", params.get("type", "default"))
    return float(theta), params


class RotaryEmbedding(nn.Module):
    """Neox-style rotary embedding (rotate halves), vllm/model_executor/layers/rotary_embedding.py.

    As in vLLM, a ``cos_sin_cache [max_position, 2 * head_dim]`` (cos | sin, float32) is computed
    once and each call gathers its rows by position; it is built on first use on the positions'
    device, ``max_position`` rows (the config's ``max_position_embeddings``; a later position is an
    index error; the length is not checked per call, which would be a host sync on a GPU).
    ``get_rope`` shares one instance, and so one cache, among the layers. The inverse frequencies are a plain
    attribute, not a buffer, so the model can be built on the meta device and materialised with
    ``to_empty`` without losing them.
    """

    def __init__(self, head_dim: int, rope_theta: float, rope_parameters: dict,
                 max_position: int = 8192) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.max_position = max_position
        # device="cpu" explicitly: this must be a real tensor even under a `with torch.device("meta")`.
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
        inv_freq = 1.0 / (rope_theta ** exponents)
        if rope_parameters["rope_type"] != "default":   # other types: beside, in rope_scaling.py
            from minivllm.model_executor.rope_scaling import scale_inv_freq
            inv_freq = scale_inv_freq(inv_freq, rope_parameters)
        self.inv_freq = inv_freq   # [head_dim // 2] float32
        self.cos_sin_cache: Optional[torch.Tensor] = None   # [max_position, 2 * head_dim]
        # The rows of this forward's positions, made by the first layer and reused by the others
        # (one shared instance serves every layer): (forward context, positions, dtype, cos, sin).
        # Weak references, so that no step's tensors outlive it.
        self._rows: Optional[tuple] = None

    def _build_cache(self, length: int, device: torch.device) -> None:
        freqs = torch.arange(length, device=device).float()[:, None] * self.inv_freq.to(device)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)                          # [length, head_dim]
        self.cos_sin_cache = torch.cat((emb.cos(), emb.sin()), dim=-1)

    def forward(self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor):
        """``positions [n]``, ``query [n, heads * head_dim]``, ``key [n, kv_heads * head_dim]`` ->
        both rotated (new tensors)."""
        cos, sin = self._cos_sin(positions, query.dtype)
        return _rotate(query, cos, sin, self.head_dim), _rotate(key, cos, sin, self.head_dim)

    def _cos_sin(self, positions: torch.Tensor, dtype: torch.dtype):
        """``cos [n, 1, head_dim]`` and ``sin [n, 1, head_dim]`` with the first half negated, in
        ``dtype``: the same for every layer of one forward, so they are gathered once per forward
        (inside ``set_forward_context``; outside it, on every call)."""
        ctx = get_forward_context() if is_forward_context_available() else None
        rows = self._rows
        if ctx is not None and rows is not None and rows[0]() is ctx and rows[1]() is positions \
                and rows[2] == dtype:
            return rows[3], rows[4]
        cache = self.cos_sin_cache
        if cache is None or cache.device != positions.device:   # no length check: no host sync
            self._build_cache(self.max_position, positions.device)
        cos_sin = self.cos_sin_cache.index_select(0, positions)[:, None, :].to(dtype)
        half = self.head_dim // 2
        cos, sin = cos_sin[..., : self.head_dim], cos_sin[..., self.head_dim:].clone()
        sin[..., :half].neg_()   # rotate_half(x) * sin == roll(x, half) * (-sin | sin), exactly
        if ctx is not None:
            self._rows = (weakref.ref(ctx), weakref.ref(positions), dtype, cos, sin)
        return cos, sin


_ROPE_CACHE: dict[tuple, RotaryEmbedding] = {}


def get_rope(head_dim: int, rope_theta: float, rope_parameters: dict,
             max_position: int = 8192) -> RotaryEmbedding:
    """vllm/model_executor/layers/rotary_embedding/__init__.py ``get_rope``: one shared instance
    per configuration, so every layer gathers from the same ``cos_sin_cache``."""
    key = (head_dim, rope_theta, max_position,
           tuple(sorted((k, str(v)) for k, v in rope_parameters.items())))
    if key not in _ROPE_CACHE:
        _ROPE_CACHE[key] = RotaryEmbedding(head_dim, rope_theta, rope_parameters, max_position)
    return _ROPE_CACHE[key]


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Neox rotation ``x * cos + rotate_half(x) * sin`` with ``rotate_half(x) = (-x2, x1)``:
    swapping the halves gives ``(x2, x1)`` and ``sin`` carries the minus sign (``_cos_sin``), so
    the products are the same numbers as the textbook form, in four ops instead of seven. The
    swap is a ``flip`` of the two halves (``x.roll(head_dim // 2, -1)`` gives the same, as eight
    small ops on a CPU)."""
    n = x.shape[0]
    x = x.view(n, -1, head_dim)
    return (x * cos + x.view(n, -1, 2, head_dim // 2).flip(2).view_as(x) * sin).view(n, -1)
