"""``DeviceConfig``: where the engine runs and which attention backend it uses; mirrors
vllm/config/device.py (vLLM picks the attention backend apart, in vllm/config/attention.py).
Everything the article runs, on a GPU or on a CPU-only laptop."""
from __future__ import annotations

from dataclasses import dataclass

ATTENTION_BACKENDS = ("auto", "torch", "cpu_attn", "triton")


@dataclass
class DeviceConfig:
    """vLLM's DeviceConfig, with the attention backend: ``"auto"`` becomes ``"cuda"`` when a GPU is
    visible, else ``"cpu"``; the backend ``"auto"`` becomes ``"triton"`` on a GPU, else
    ``"cpu_attn"``."""
    device: str = "auto"
    attention_backend: str = "auto"

    def __post_init__(self) -> None:
        if self.device == "auto":
            import torch    # here, not at the top: importing the configuration loads no torch
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        if self.device not in ("cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {self.device!r}.")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, "
                             f"got {self.attention_backend!r}.")
        if self.attention_backend == "auto":
            self.attention_backend = "triton" if self.device.startswith("cuda") else "cpu_attn"
        if self.attention_backend == "triton":
            # A Triton that cannot run here (e.g. TRITON_INTERPRET=0 on a CPU) fails now, with the
            # fix, rather than inside the first forward pass.
            from minivllm.triton_utils import check_triton_backend
            check_triton_backend(self.device)
