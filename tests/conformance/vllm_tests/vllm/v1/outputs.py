"""vllm/v1/outputs.py -> minivllm's ModelRunnerOutput and KVConnectorOutput."""
from __future__ import annotations

from dataclasses import dataclass

from minivllm.distributed.kv_transfer.base import KVConnectorOutput as _KVConnectorOutput
from minivllm.worker.model_runner import ModelRunnerOutput as _ModelRunnerOutput
from vllm import _missing


def ModelRunnerOutput(req_ids, req_id_to_index, sampled_token_ids=(), logprobs=None,
                      prompt_logprobs_dict=None, pooler_output=None, kv_connector_output=None,
                      **kwargs) -> _ModelRunnerOutput:
    """Logprobs and pooling are not in minivllm (logprobs: the sampling issue)."""
    if logprobs is not None or prompt_logprobs_dict or pooler_output or any(kwargs.values()):
        _missing._raise("vllm.v1.outputs.ModelRunnerOutput(logprobs / pooler_output / ...)")
    return _ModelRunnerOutput(req_ids=list(req_ids), req_id_to_index=dict(req_id_to_index),
                              sampled_token_ids=[list(map(int, t)) for t in sampled_token_ids],
                              kv_connector_output=kv_connector_output)


EMPTY_MODEL_RUNNER_OUTPUT = ModelRunnerOutput(req_ids=[], req_id_to_index={})


def KVConnectorOutput(finished_sending=None, finished_recving=None, invalid_block_ids=None,
                      kv_connector_stats=None, kv_connector_worker_meta=None,
                      **kwargs) -> _KVConnectorOutput:
    if kv_connector_worker_meta is not None or any(kwargs.values()):
        _missing._raise("vllm.v1.outputs.KVConnectorOutput(kv_connector_worker_meta / ...)")
    return _KVConnectorOutput(finished_sending=finished_sending, finished_recving=finished_recving,
                              invalid_block_ids=set(invalid_block_ids or ()),
                              kv_connector_stats=kv_connector_stats)


@dataclass
class DraftTokenIds:
    req_ids: list[str]
    draft_token_ids: list[list[int]]


__getattr__ = _missing.module_getattr(__name__)
