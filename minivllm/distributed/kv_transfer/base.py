"""The KV connector interface, mirroring vllm/distributed/kv_transfer/kv_connector/v1/base.py
(plus ``KVConnectorOutput`` from vllm/v1/outputs.py).

A connector moves KV cache between engine instances (article, "Disaggregated P/D"). Every engine
process builds it twice, once per role (article step "Instantiation"):

- ``KVConnectorRole.SCHEDULER``, in ``Scheduler.__init__``: decides *what* to move. It answers
  ``get_num_new_matched_tokens`` (cache lookup), ``update_state_after_alloc`` (state update) and
  ``build_connector_meta`` (the per-step ``KVConnectorMetadata`` shipped inside ``SchedulerOutput``).
- ``KVConnectorRole.WORKER``, in ``Worker.init_device()``: *moves* it, between the paged KV caches
  ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` (0 = K, 1 = V) and the outside world:
  ``start_load_kv`` before the forward, ``wait_for_layer_load`` / ``save_kv_layer`` around every
  attention layer, ``wait_for_save`` after the forward.

The two instances never share Python state: everything the worker needs travels in the metadata.
"""
from __future__ import annotations

import enum
import functools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Optional

from minivllm import trace

if TYPE_CHECKING:
    import torch

    from minivllm.config import KVTransferConfig, VllmConfig
    from minivllm.forward_context import ForwardContext
    from minivllm.request import Request


def recorded(method: Callable[..., Any]) -> Callable[..., Any]:
    """A connector method that adds one ``"connector"`` trace event per call when the engine is
    recording (what the event says about each method: recording.py, loaded then). The method's
    own body is the article's logic only."""
    @functools.wraps(method)
    def call(self: "KVConnectorBase_V1", *args: Any, **kwargs: Any) -> Any:
        if not (trace.active and trace.is_recording()):
            return method(self, *args, **kwargs)
        from minivllm.distributed.kv_transfer.recording import record_call
        return record_call(method, self, args, kwargs)
    return call


def checked_extra_config(ktc: Any, allowed: tuple[str, ...], connector: str) -> dict[str, Any]:
    """``ktc.kv_connector_extra_config``, checked to be a dict holding only ``allowed`` keys (a
    ``ValueError`` naming the unknown ones otherwise); each connector then checks its values."""
    extra = ktc.kv_connector_extra_config
    if not isinstance(extra, dict):
        raise ValueError("kv_transfer_config.kv_connector_extra_config must be a dict.")
    unknown = sorted(set(extra) - set(allowed))
    if unknown:
        raise ValueError(f"kv_transfer_config.kv_connector_extra_config has unknown keys {unknown}; "
                         f"{connector} accepts {list(allowed)}.")
    return extra


class KVConnectorRole(enum.Enum):
    SCHEDULER = 0
    WORKER = 1


class KVConnectorMetadata:
    """Opaque marker: whatever the scheduler-side connector tells the worker-side one for one step."""


@dataclass
class KVConnectorOutput:
    """What the worker-side connector reports back after a step (``ModelRunnerOutput.kv_connector_output``).

    ``invalid_block_ids``: blocks whose external KV failed to load although the scheduler already
    counted them as computed; the scheduler must recompute from the first of them.
    """
    finished_sending: Optional[set[str]] = None
    finished_recving: Optional[set[str]] = None
    invalid_block_ids: set[int] = field(default_factory=set)
    kv_connector_stats: Optional[dict[str, Any]] = None

    def is_empty(self) -> bool:
        return not (self.finished_sending or self.finished_recving or self.invalid_block_ids)


class KVConnectorBase_V1:
    """Base class of every connector. Abstract methods raise ``NotImplementedError``."""

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole,
                 kv_cache_config: Any = None) -> None:
        self._vllm_config = vllm_config
        self._role = role
        self._kv_transfer_config = vllm_config.kv_transfer_config
        self._kv_cache_config = kv_cache_config
        self._connector_metadata: Optional[KVConnectorMetadata] = None

    @property
    def role(self) -> KVConnectorRole:
        return self._role

    @classmethod
    def validate_kv_transfer_config(cls, kv_transfer_config: "KVTransferConfig") -> None:
        """Called by ``validate_kv_transfer_config`` before any weights load; raise ``ValueError``."""

    def _record(self, method: str, req_id: Optional[str] = None, args: Any = None,
                result: Any = None, bytes: int = 0) -> None:
        """One ``"connector"`` trace event per call (a no-op unless the engine is recording)."""
        if trace.active:
            trace.record("connector", role=self._role.name.lower(), method=method, req_id=req_id,
                         args=args, result=result, bytes=bytes)

    def get_stats(self) -> dict[str, Any]:
        """Cumulative counters (tokens and bytes loaded / stored ...) for ``LLM.get_metrics()``."""
        return {}

    # ------------------------------------------------------------------ worker side
    @recorded
    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """Worker, before the forward: keep this step's metadata (from ``SchedulerOutput``)."""
        self._connector_metadata = connector_metadata

    @recorded
    def clear_connector_metadata(self) -> None:
        """Worker, after the forward (always, even when it raised): forget this step's metadata."""
        self._connector_metadata = None

    def has_connector_metadata(self) -> bool:
        """Worker, in every attention layer: are there per-layer hooks to run this step?"""
        return self._connector_metadata is not None

    def _get_connector_metadata(self) -> KVConnectorMetadata:
        assert self._connector_metadata is not None, "no connector metadata bound for this step"
        return self._connector_metadata

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Worker, once after the KV caches are allocated: ``layer_name -> [2, num_blocks,
        block_size, num_kv_heads, head_dim]``. Connectors that move data keep the tensors."""

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        """Worker, entering the connector context inside ``set_forward_context`` (before the
        forward): start loading external KV into the paged cache (may return before it is done)."""
        raise NotImplementedError

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Worker, entering each attention layer: block until that layer's external KV is in place."""
        raise NotImplementedError

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        """Worker, leaving each attention layer (its new K/V are already in ``kv_layer``): start
        saving that layer's KV for the requests the metadata marks ``is_store``."""
        raise NotImplementedError

    def wait_for_save(self) -> None:
        """Worker, leaving the connector context after the forward: block until every save of
        this step is complete. The article's order skips it on steps without a forward; vLLM 0.32
        calls it on every step, empty ones included (``kv_connector_context="vllm_today"``)."""
        raise NotImplementedError

    def get_finished(self, finished_req_ids: set[str]) -> tuple[Optional[set[str]], Optional[set[str]]]:
        """Worker, after each step: (ids whose async send finished, ids whose async receive
        finished). ``finished_req_ids`` are the requests the scheduler finished since last step.
        Synchronous connectors return ``(None, None)``."""
        return None, None

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Worker, after each step: block ids whose load failed after the scheduler counted them
        as computed. The scheduler recomputes them (vLLM's ``_handle_invalid_blocks``)."""
        return set()

    # ------------------------------------------------------------------ scheduler side
    def get_num_new_matched_tokens(self, request: "Request",
                                   num_computed_tokens: int) -> tuple[Optional[int], bool]:
        """Scheduler, waiting loop, for a request with ``num_computed_tokens == 0``, after the
        local prefix-cache lookup found ``num_computed_tokens`` tokens (article step "Cache
        lookup"). Returns (tokens available externally *beyond* the local hit, or ``None`` = ask
        again next step; whether they load asynchronously). Must not change scheduling state."""
        raise NotImplementedError

    def update_state_after_alloc(self, request: "Request", blocks: Any,
                                 num_external_tokens: int) -> None:
        """Scheduler, right after ``allocate_slots`` succeeded for a waiting request (article step
        "State update"). ``blocks``: all of the request's blocks (``KVCacheBlocks``, local hit
        first); ``num_external_tokens``: the count ``get_num_new_matched_tokens`` returned."""
        raise NotImplementedError

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        """Scheduler, end of ``schedule()`` (article step "Build metadata object"): what the worker
        must load / store this step. ``scheduler_output``: the step's ``SchedulerOutput``
        (core/sched/output.py, a layer above this one: annotated ``Any`` so that the connector
        never imports the scheduler). Must not modify it; resets per-step state."""
        raise NotImplementedError

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Scheduler, in ``update_from_output``: the worker's ``KVConnectorOutput`` for the step."""

    def request_finished(self, request: "Request",
                         block_ids: list[int]) -> tuple[bool, Optional[dict[str, Any]]]:
        """Scheduler, ``_free_request``, once per request before its blocks are freed. Returns
        (delay freeing the blocks until ``finished_sending``, ``kv_transfer_params`` for the
        client). Default: free at once, no params."""
        return False, None

    def shutdown(self) -> None:
        """Release files, threads or sockets the connector holds."""
