"""``ParallelConfig``: which worker class the engine builds; mirrors vllm/config/parallel.py, of
which minivllm keeps only ``worker_cls`` (one process, one device: no tensor, pipeline or data
parallel sizes). vLLM's executor resolves ``worker_cls`` by qualified name (``"auto"``: the
platform's worker, vllm/v1/worker/gpu_worker.py); so does ``EngineCore.__init__`` here
(engine/core.py ``WORKER_CLS``). No article step: the worker the article's steps run in is
``"auto"``'s; another class (the simulator's ``minivllm.sim.worker.SimulatedWorker``) stands
beside it."""
from __future__ import annotations

import re
from dataclasses import dataclass

_QUALNAME = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)+")


@dataclass
class ParallelConfig:
    """vLLM's ``ParallelConfig.worker_cls``: ``"auto"`` (the article's ``Worker``) or the
    qualified name of a class with the same methods (``"package.module.Class"``)."""
    worker_cls: str = "auto"

    def __post_init__(self) -> None:
        if self.worker_cls != "auto" and not _QUALNAME.fullmatch(str(self.worker_cls)):
            raise ValueError("parallel_config.worker_cls must be 'auto' or a qualified class "
                             f"name such as 'package.module.Class', got {self.worker_cls!r}.")
