"""Parallel sampling (``SamplingParams.n > 1``), mirroring vllm/v1/engine/parallel_sampling.py
(``ParentRequest``).

A request with ``n > 1`` becomes ``n`` child requests, ``"{i}_{request_id}"``, each with ``n = 1``
and, for a seeded request, ``seed + i`` (vLLM's ``get_child_info``), so the n samples differ and
stay reproducible. They share the prompt: once the first child's prompt blocks are computed and
hashed, the prefix cache hands them to the others. The caller sees one ``RequestOutput`` under the
parent's id, with one ``CompletionOutput`` per child (``index`` i), finished when all are.
"""
from __future__ import annotations

import copy
from typing import Any, Optional

from minivllm.outputs import CompletionOutput, RequestOutput
from minivllm.sampling_params import SamplingParams


class ParentRequest:
    def __init__(self, request_id: str, params: SamplingParams) -> None:
        self.request_id = request_id
        self.params = params
        self.n = params.n
        self.child_ids = [f"{i}_{request_id}" for i in range(self.n)]
        self._latest: dict[int, RequestOutput] = {}

    def get_child_info(self, index: int) -> tuple[str, SamplingParams]:
        params = copy.copy(self.params)
        params.n = 1
        if params.seed is not None:
            params.seed = self.params.seed + index
        return self.child_ids[index], params

    def index_of(self, child_id: str) -> int:
        return self.child_ids.index(child_id)

    def make_request_output(self, child_id: str, child_output: RequestOutput) -> RequestOutput:
        """The parent's output after ``child_id`` progressed: every child's latest completion."""
        index = self.index_of(child_id)
        self._latest[index] = child_output
        outputs = []
        for i in range(self.n):
            if i in self._latest:
                c = copy.copy(self._latest[i].outputs[0])
                c.index = i
            else:
                c = CompletionOutput(i, "", [])
            outputs.append(c)
        first = self._latest[min(self._latest)]
        finished = len(self._latest) == self.n and all(o.finished for o in self._latest.values())
        return RequestOutput(self.request_id, first.prompt, first.prompt_token_ids, outputs,
                             finished, num_cached_tokens=min(
                                 o.num_cached_tokens for o in self._latest.values()),
                             prompt_logprobs=first.prompt_logprobs)


def add_parent_request(engine: Any, request_id: str, prompt: Any, params: SamplingParams,
                       kv_transfer_params: Optional[dict]) -> Any:
    """``LLMEngine.add_request`` with ``n > 1``: n child requests; returns the first."""
    engine.validate_prompt(prompt)
    engine.verify_sampling_params(params)
    parent = ParentRequest(request_id, params)
    children = []
    for i in range(parent.n):
        child_id, child_params = parent.get_child_info(i)
        engine._parents[child_id] = parent
        children.append(engine.add_request(child_id, prompt, child_params, kv_transfer_params))
    return children[0]


def parent_output(engine: Any, request: Any, child_output: RequestOutput) -> RequestOutput:
    """``LLMEngine.step`` for a child that progressed: its parent's output (every child's latest
    completion); once all children have finished, the engine forgets the parent."""
    parent = engine._parents[request.request_id]
    out = parent.make_request_output(request.request_id, child_output)
    if request.is_finished() and out.finished:
        for child_id in parent.child_ids:
            engine._parents.pop(child_id, None)
    return out
