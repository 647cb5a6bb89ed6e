"""Threads beside the engine's (a KV loader, a side channel, the HTTP server) keep their torch ops
off OpenMP, so that the engine's own parallel regions stay fast on the CPU.

PyTorch's CPU wheels use libgomp, which gives every thread that starts a parallel region its own
team of worker threads. Once the process holds more of them than there are cores, idle workers
stop spinning and sleep, so each parallel region of the engine then pays for waking them.
Measured on a 2-core CPU: one parallel ``add`` of 200,000 floats in the main thread took 21 us;
after a side thread had made one copy of that size, and while it stayed alive, it took 116 us.
With ``torch.set_num_threads(1)`` first in the side thread: 21 us.

``torch.set_num_threads`` is per thread for OpenMP and MKL, so the main thread keeps its count.
It also sets the default of threads that have not run a parallel op yet; a background engine
thread therefore sets its own count (``AsyncLLM.start``).
"""
from __future__ import annotations

import torch


def keep_off_openmp() -> None:
    """Call first in a thread that is not the engine's: its torch ops then run on that thread
    alone and never start a libgomp team."""
    torch.set_num_threads(1)
