"""Copies between host memory and the model's device that never stall the host on CUDA.

A copy from pageable host memory to a GPU, or from a GPU into a fresh CPU tensor (``.cpu()``), makes
the host wait for everything queued on the GPU before it: a pipeline stall per call. vLLM stages
such copies through pinned (page-locked) host buffers with ``non_blocking=True`` instead. On the
CPU these functions are plain copies (or none at all), so the same code runs everywhere.
"""
from __future__ import annotations

import torch


def copy_to_device(host: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """Host -> device. On CUDA through a pinned copy and an asynchronous transfer (the pinned block
    stays alive until the transfer is done: torch's caching host allocator tracks it)."""
    device = torch.device(device)
    if host.device == device:
        return host
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def copy_to_host(t: torch.Tensor) -> torch.Tensor:
    """Device -> host. On CUDA into a pinned buffer without waiting: read it only after
    ``wait_for_copies_to_host``. A host tensor is returned as it is."""
    if t.device.type != "cuda":
        return t
    buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    buf.copy_(t, non_blocking=True)
    return buf


def wait_for_copies_to_host(device: torch.device | str) -> None:
    """Block until the device -> host copies queued so far on the current stream are done: the one
    wait, after the forward pass, that makes ``copy_to_host`` buffers readable."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()
