"""What a model runner step leaves behind: ``ModelRunnerOutput`` (vllm/v1/outputs.py), the step's
result for the scheduler, and ``ExecuteModelState`` (vllm/v1/worker/gpu_model_runner.py), what
``execute_model`` hands to ``sample_tokens``."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

import numpy as np
import torch

from minivllm.attention.metadata import AttentionMetadata
from minivllm.core.sched.output import SchedulerOutput

if TYPE_CHECKING:   # loaded with spec decode only
    from minivllm.spec_decode.metadata import SpecDecodeMetadata


@dataclass
class ModelRunnerOutput:
    req_ids: list[str]
    req_id_to_index: dict[str, int]
    # One list per request row: accepted drafts + one bonus/recovered token, or [] for a partial
    # prefill chunk.
    sampled_token_ids: list[list[int]]
    kv_connector_output: Any = None
    # vLLM's logprobs (LogprobsLists): per request row ``None`` or, per sampled token, the
    # ``(token_ids, logprobs, rank)`` of the sampled token first and then the top k.
    logprobs: Optional[list[Optional[list[tuple[list[int], list[float], int]]]]] = None
    # vLLM's prompt_logprobs_dict: req_id -> one entry per prompt token after the first, the same
    # triples, given once, in the step that finishes the prompt.
    prompt_logprobs_dict: dict[str, list[tuple[list[int], list[float], int]]] = field(
        default_factory=dict)


@dataclass
class ExecuteModelState:
    """What ``execute_model`` leaves for ``sample_tokens`` (vLLM 0.32's ``ExecuteModelState``):
    ``T`` scheduled tokens of ``n`` requests, ``S`` sampled rows (one per request, plus one per
    scheduled draft). The learned drafters read it as a ``TargetStepOutputs``
    (``TargetStepOutputs.from_state``, spec_decode/utils.py)."""
    scheduler_output: SchedulerOutput
    logits: torch.Tensor                  # [S, vocab]
    spec_decode_metadata: Optional[SpecDecodeMetadata]
    input_ids: torch.Tensor               # [T]
    positions: torch.Tensor               # [T]
    attn_metadata: AttentionMetadata
    seq_lens: np.ndarray                  # [n] context length after this step's tokens
    hidden_states: torch.Tensor           # [T, H]
    aux_hidden_states: Optional[list[torch.Tensor]]   # EAGLE-3: 3 x [T, H], else None
    logits_indices: torch.Tensor          # [S] rows of hidden_states the logits come from
    kv_connector_output: Any = None
