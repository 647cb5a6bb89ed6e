"""A KV cache too small for any waiting request: the error ``EngineCore.step`` raises instead of
stepping forever on nothing (``num_gpu_blocks_override`` may set the cache below what one
request needs).

Loaded the first time a step schedules no token while requests wait; the article's examples
always schedule some and never read this file.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from minivllm.core.sched.output import SchedulerOutput
    from minivllm.engine.core import EngineCore


def check_room(core: "EngineCore", scheduler_output: "SchedulerOutput") -> None:
    """``RuntimeError`` when nothing ran, requests wait, and nothing would free blocks for them:
    no running request, no preemption, no load in flight, no finished request holding blocks."""
    scheduler = core.scheduler
    if (not scheduler.running and not scheduler_output.preempted_req_ids
            and not scheduler.waiting_for_remote_kvs and not scheduler.delayed_free):
        raise RuntimeError(
            "The KV cache cannot hold even one waiting request "
            f"({core.vllm_config.cache_config.num_gpu_blocks} blocks of "
            f"{core.vllm_config.cache_config.block_size} tokens): raise "
            "num_gpu_blocks_override or lower max_model_len.")
