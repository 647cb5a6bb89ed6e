"""What ``ZmqPullConnector``'s scheduler half tells its worker half each step: the pulls to start
(vLLM: the ``reqs_to_recv`` of ``NixlConnectorMetadata``,
vllm/distributed/kv_transfer/kv_connector/v1/nixl/metadata.py, built from the
``kv_transfer_params`` that ``update_state_after_alloc`` records).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from minivllm.distributed.kv_transfer.base import KVConnectorMetadata


@dataclass
class RecvReqMeta:
    """One pull: P's ``remote_block_ids`` -> D's ``local_block_ids`` (same length), the prompt
    tokens they hold beyond D's local prefix hit (``num_tokens``)."""
    req_id: str
    local_block_ids: list[int]
    remote_block_ids: list[int]
    remote_engine_id: str
    remote_request_id: str
    remote_host: str
    remote_port: int
    num_tokens: int


@dataclass
class ZmqPullConnectorMetadata(KVConnectorMetadata):
    reqs_to_recv: list[RecvReqMeta] = field(default_factory=list)

    def describe(self) -> list[dict[str, Any]]:
        return [{"req_id": r.req_id, "local_block_ids": r.local_block_ids,
                 "remote_block_ids": r.remote_block_ids, "remote": f"{r.remote_host}:{r.remote_port}"}
                for r in self.reqs_to_recv]
