"""Aborting requests, mirroring vLLM's ``LLMEngine.abort_request`` (vllm/v1/engine/llm_engine.py,
which hands the ids to ``EngineCore.abort_requests`` and the scheduler's ``finish_requests``).

Loaded on the first ``abort_request`` (a server whose client went away, a benchmark, the tests);
the article's examples let every request finish and never read this file.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from minivllm.request import RequestStatus

if TYPE_CHECKING:
    from minivllm.engine.llm_engine import LLMEngine


def abort_requests(engine: "LLMEngine", request_ids: list[str]) -> None:
    """Finish the requests as ``FINISHED_ABORTED`` and forget them; a parent's id (``n > 1``)
    aborts its children."""
    request_ids = [c for r in request_ids for c in (
        [c for c, p in engine._parents.items() if p.request_id == r] or [r])]
    for request_id in request_ids:
        engine._parents.pop(request_id, None)
    engine.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)
    for request_id in request_ids:
        engine._requests.pop(request_id, None)
        engine._logprobs.pop(request_id, None)
