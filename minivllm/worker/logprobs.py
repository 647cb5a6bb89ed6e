"""Logprobs in the model runner, mirroring the logprobs parts of vllm/v1/worker/gpu_model_runner.py
(``SamplerOutput.logprobs_tensors`` -> ``LogprobsLists``, ``_get_prompt_logprobs_dict``).

The sampler (or, with drafts, the sampler for the bonus rows and the rejection sampler for the
draft rows) leaves one row of numbers per sampled position, in the engine's ``logprobs_mode``; a
request's emitted tokens read their rows: with drafts, token j of request i is row
``cu_num_sampled[i - 1] + j``, the target's logits at draft j (accepted, or recovered there) or the
bonus row. Prompt logprobs are the target's ``log_softmax`` at each prompt position, gathered over
the prefill chunks and given once the prompt is done. The runner imports this file only when a
request asks for either.
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from minivllm.sample.ops.logprobs import gather_logprobs, logprobs_source

Triple = tuple[list[int], list[float], int]


def logprobs_outputs(runner: Any, sampled_token_ids: list[list[int]], state: Any) -> dict[str, Any]:
    """``{"logprobs": ..., "prompt_logprobs_dict": ...}`` of this step for ``ModelRunnerOutput``;
    the step's logprob rows (``runner._logprobs_rows``) are used once."""
    kept, runner._logprobs_rows = runner._logprobs_rows, None
    return {"logprobs": None if kept is None else take_logprobs(runner, *kept, sampled_token_ids),
            "prompt_logprobs_dict": get_prompt_logprobs_dict(runner, state)}


def spec_logprobs_rows(runner: Any, spec_md: Any, logits: torch.Tensor,
                       bonus_rows: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
    """The rows of a verification step ``[S, vocab]``: the target's at each draft, then the bonus
    row; and where each request's tokens start."""
    mode = runner.sampler.logprobs_mode
    target = (runner.rejection_sampler.last_target_logits if mode.startswith("processed")
              else logits[spec_md.target_logits_indices])
    rows = torch.empty((logits.shape[0], logits.shape[-1]), dtype=torch.float32,
                       device=logits.device)
    rows[spec_md.target_logits_indices] = logprobs_source(target, mode)
    rows[spec_md.bonus_logits_indices] = bonus_rows
    return rows, [0, *spec_md.cu_num_sampled_tokens.tolist()][:-1]


def take_logprobs(runner: Any, rows: torch.Tensor, starts: list[int],
                  sampled_token_ids: list[list[int]]) -> list:
    """Per request row: ``None``, or per emitted token its ``(ids, logprobs, rank)``; request i's
    tokens read ``rows`` from ``starts[i]`` on."""
    out: list[Optional[list[Triple]]] = []
    for i, req_id in enumerate(runner.input_batch.req_ids):
        k, toks = runner.input_batch.sampling_params[req_id].logprobs, sampled_token_ids[i]
        if k is None or not toks:
            out.append(None)
            continue
        idx = torch.arange(starts[i], starts[i] + len(toks), device=rows.device)
        token_ids = torch.tensor(toks, dtype=torch.long, device=rows.device)
        out.append(gather_logprobs(rows[idx], k, token_ids).tolists())
    return out


def get_prompt_logprobs_dict(runner: Any, state: Any) -> dict[str, list[Triple]]:
    """vLLM's ``_get_prompt_logprobs_dict``: for requests with ``prompt_logprobs`` whose prompt
    was (partly) computed this step, the logprobs of prompt token p + 1 at each position p."""
    if runner._prompt_logprobs_progress is None:
        runner._prompt_logprobs_progress = {}
    progress = runner._prompt_logprobs_progress
    for req_id in [r for r in progress if r not in runner.requests]:
        del progress[req_id]
    done: dict[str, list[Triple]] = {}
    qsl = state.attn_metadata.query_start_loc.tolist()
    positions = state.positions
    for i, req_id in enumerate(runner.input_batch.req_ids):
        req = runner.requests[req_id]
        k, num_prompt = req.sampling_params.prompt_logprobs, len(req.prompt_token_ids)
        if k is None or progress.get(req_id) == "done":
            continue
        first = int(positions[qsl[i]])
        if first == 0:
            progress[req_id] = []
        if not isinstance(progress.get(req_id), list):
            continue   # the prompt's start came from a cache: nothing to compute it from
        rows = [qsl[i] + j for j in range(qsl[i + 1] - qsl[i]) if first + j + 1 < num_prompt]
        if rows:
            logits = runner.model.compute_logits(state.hidden_states[rows])
            targets = torch.tensor([req.prompt_token_ids[first + r - qsl[i] + 1] for r in rows],
                                   device=logits.device)
            progress[req_id] += gather_logprobs(logits.log_softmax(-1, dtype=torch.float32),
                                                k, targets).tolists()
        if first + qsl[i + 1] - qsl[i] >= num_prompt:
            done[req_id], progress[req_id] = progress[req_id], "done"
    return done
