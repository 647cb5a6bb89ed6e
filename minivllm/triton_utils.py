"""Importing Triton so that its kernels run everywhere.

Triton decides at ``@triton.jit`` time whether a kernel is compiled (GPU) or interpreted by NumPy on
the CPU (``TRITON_INTERPRET=1``). So the variable must be set *before* a module defines its kernels:
every kernel module does ``from minivllm.triton_utils import triton, tl`` first.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"

__all__ = ["triton", "tl", "INTERPRETED"]
