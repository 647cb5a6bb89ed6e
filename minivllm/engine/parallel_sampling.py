"""Parallel sampling (``SamplingParams.n > 1``), mirroring vllm/v1/engine/parallel_sampling.py
(``ParentRequest``).

A request with ``n > 1`` becomes ``n`` child requests, ``"{i}_{request_id}"``, each with ``n = 1``
and, for a seeded request, ``seed + i`` (vLLM's ``get_child_info``), so the n samples differ and
stay reproducible. They share the prompt: once the first child's prompt blocks are computed and
hashed, the prefix cache hands them to the others. The caller sees one ``RequestOutput`` under the
parent's id, with one ``CompletionOutput`` per child (``index`` i), finished when all are.
No article step of its own: each child goes through the article's steps as a request of its own.
"""
from __future__ import annotations

import copy

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

