"""RoPE frequency scaling for long contexts, mirroring vllm/model_executor/layers/rotary_embedding/
(``LinearScalingRotaryEmbedding``, ``Llama3RotaryEmbedding``), for a checkpoint whose ``rope_type``
is not ``"default"`` (the article's models need none); the types minivllm does not have are refused.
"""
from __future__ import annotations

import math

import torch

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def scale_inv_freq(inv_freq: torch.Tensor, rope_parameters: dict) -> torch.Tensor:
    """``inv_freq [head_dim // 2]`` scaled by ``rope_parameters["rope_type"]``: "linear" divides by
    ``factor``; "llama3" as below; any other type is refused."""
    rope_type = rope_parameters["rope_type"]
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise NotImplementedError(
            f"rope_type {rope_type!r} is not supported; supported: {SUPPORTED_ROPE_TYPES}.")
    if rope_type == "linear":
        return inv_freq / rope_parameters["factor"]
    return _llama3_inv_freq(inv_freq, rope_parameters)


def _llama3_inv_freq(inv_freq: torch.Tensor, p: dict) -> torch.Tensor:
    """Llama 3.1 frequency scaling: long wavelengths / factor, short kept, smooth blend between."""
    factor, low, high = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
    old_len = p["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(is_medium, blended, scaled)
