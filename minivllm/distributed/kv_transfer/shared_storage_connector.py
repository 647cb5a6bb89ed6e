"""The article's debugging connector ``SharedStorageConnector``; vLLM 0.32 calls it
``ExampleConnector`` (vllm/distributed/kv_transfer/kv_connector/v1/example_connector.py, classes
``ExampleConnector`` and ``ExampleConnectorMetadata``; the article's file
``.../v1/shared_storage_connector.py`` and its name no longer exist there). minivllm registers both
names for one class: ``kv_connector="SharedStorageConnector"`` (the article's) and
``kv_connector="ExampleConnector"`` (vLLM today) behave the same and share stored folders.

"External server" = a local folder (format: ``storage.py``). Prefill (P) stores each prompt's KV,
decode (D) loads it, synchronously, whole blocks only; the last prompt token is always recomputed
(its logits give the first output token). Differences from vLLM (VLLM_REFERENCE 6.3), on purpose:
- store, lookup and load all use ``n = align_to_block_size(len(prompt))``; lookup also tries shorter
  multiples of bs, so D finds P's folder when D's prompt is P's plus the generated token, even when
  P's length is a multiple of bs (vLLM then looks up one folder and loads another);
- the match is clamped at 0, and only blocks beyond the local prefix hit are written;
- a store is emitted in the step whose forward completes the prefix (chunked prefill);
- bad folders (missing, truncated, corrupt, another model) are skipped at lookup with a warning,
  so they are recomputed; a layer that still fails at load time (a file changed after the lookup)
  is reported by ``get_block_ids_with_load_errors()``.
``kv_connector_extra_config``: ``shared_storage_path`` (required); ``layerwise`` (load each layer in
``wait_for_layer_load`` instead of all in ``start_load_kv``); ``verify_on_lookup`` (default True:
the scheduler checks every file's CRC32, so corrupt bytes are never counted as computed; False
checks only metadata, headers and sizes, and leaves the CRC to the load).
"""
from __future__ import annotations

import logging
import os
import warnings
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from minivllm.distributed.kv_transfer import storage
from minivllm.distributed.kv_transfer.base import (KVConnectorBase_V1, KVConnectorMetadata,
                                                   checked_extra_config,
                                                   KVConnectorRole)
from minivllm.distributed.kv_transfer.shared_storage_worker import SharedStorageWorkerMixin

logger = logging.getLogger(__name__)
EXTRA_CONFIG_KEYS = ("shared_storage_path", "layerwise", "verify_on_lookup")
STATS = ("num_lookups", "num_lookup_hits", "num_matched_tokens", "num_invalid_folders",
         "num_loaded_tokens", "num_loaded_bytes", "load_time_s", "num_load_errors",
         "num_stored_tokens", "num_stored_bytes", "save_time_s", "num_folders_committed",
         "num_store_races_lost", "num_store_errors")


def align_to_block_size(num_tokens: int, block_size: int) -> int:
    """Largest multiple of ``block_size`` strictly below ``num_tokens`` (bs 16: 16 -> 0, 17 -> 16)."""
    return max(num_tokens - 1, 0) // block_size * block_size


@dataclass
class ReqMeta:
    """One request's transfer this step: token positions ``[start, len(token_ids))`` of the stored
    prefix ``token_ids`` go to / come from the paged-cache slots ``slot_mapping`` ``[n - start]``."""
    req_id: str
    token_ids: list[int]
    folder: str
    slot_mapping: torch.Tensor
    block_ids: list[int]
    start: int
    is_store: bool

    @staticmethod
    def make_meta(req_id: str, token_ids: list[int], folder: str, block_ids: list[int],
                  block_size: int, is_store: bool, start: int = 0) -> "ReqMeta":
        n = len(token_ids)
        assert n % block_size == 0 and start % block_size == 0 and len(block_ids) * block_size >= n
        # Host tensors on purpose (built by the scheduler; the worker copies them to the device).
        pos = torch.arange(start, n, device="cpu")
        blocks = torch.tensor(block_ids, dtype=torch.long, device="cpu")
        slot_mapping = blocks[pos // block_size] * block_size + pos % block_size
        return ReqMeta(req_id, list(token_ids), folder, slot_mapping,
                       list(block_ids[start // block_size:n // block_size]), start, is_store)


@dataclass
class SharedStorageConnectorMetadata(KVConnectorMetadata):
    requests: list[ReqMeta] = field(default_factory=list)

    def add_request(self, req_id: str, token_ids: list[int], folder: str, block_ids: list[int],
                    block_size: int, is_store: bool, start: int = 0) -> None:
        self.requests.append(ReqMeta.make_meta(req_id, token_ids, folder, block_ids, block_size,
                                               is_store, start))

    def describe(self) -> list[dict[str, Any]]:
        return [{"req_id": r.req_id, "is_store": r.is_store, "folder": r.folder,
                 "tokens": [r.start, len(r.token_ids)], "block_ids": r.block_ids} for r in self.requests]


class SharedStorageConnector(SharedStorageWorkerMixin, KVConnectorBase_V1):
    """Scheduler side here; worker side (loads, saves) in ``SharedStorageWorkerMixin``."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        ktc = self._kv_transfer_config
        self._block_size = vllm_config.cache_config.block_size
        self._storage_path = ktc.get_from_extra_config("shared_storage_path", "/tmp")
        self._layerwise = bool(ktc.get_from_extra_config("layerwise", False))
        self._verify_on_lookup = bool(ktc.get_from_extra_config("verify_on_lookup", True))
        self._is_producer, self._is_consumer = ktc.is_kv_producer, ktc.is_kv_consumer
        self._fingerprint: Optional[str] = None   # lazily: hf_config is loaded after construction
        # Scheduler state.
        self._lookups: dict[str, tuple[int, str]] = {}          # req_id -> (n, folder) last answer
        self._requests_need_load: dict[str, tuple[list[int], str, int]] = {}
        self._pending_stores: dict[str, tuple[list[int], str, list[int]]] = {}  # ids, folder, blocks
        # Worker state.
        self._kv_caches: dict[str, torch.Tensor] = {}
        self._loads: list[tuple[ReqMeta, dict[str, Any]]] = []
        self._writers: dict[str, Optional[storage.FolderWriter]] = {}   # None: failed this step
        self._pending_writes: list = []   # (ReqMeta, layer_name, host rows) until wait_for_save
        self._invalid_block_ids: set[int] = set()
        self._stats: dict[str, Any] = dict.fromkeys(STATS, 0)

    @classmethod
    def validate_kv_transfer_config(cls, ktc: Any) -> None:
        extra = checked_extra_config(ktc, EXTRA_CONFIG_KEYS, "SharedStorageConnector")
        for key in ("layerwise", "verify_on_lookup"):
            if not isinstance(extra.get(key, True), bool):
                raise ValueError(f"kv_transfer_config.kv_connector_extra_config['{key}'] must be a bool.")
        path = extra.get("shared_storage_path")
        field_name = "kv_transfer_config.kv_connector_extra_config['shared_storage_path']"
        if not isinstance(path, (str, os.PathLike)) or not str(path):
            raise ValueError(f"{field_name} is required (a folder shared by the P and D instances).")
        try:
            storage.check_storage_path(str(path), writable=ktc.is_kv_producer)
        except OSError as e:
            raise ValueError(f"{field_name} = {str(path)!r} cannot be created or written: {e}") from None

    # ------------------------------------------------------------------ helpers
    def _folder(self, name: str) -> str:
        return os.path.join(self._storage_path, name)

    def _fp(self) -> str:
        if self._fingerprint is None:
            self._fingerprint = storage.model_fingerprint(self._vllm_config)
        return self._fingerprint

    def _check_folder(self, name: str, token_ids: list[int], verify_data: bool) -> None:
        folder = self._folder(name)
        meta = storage.read_meta(folder)
        storage.check_meta(meta, folder, token_ids, self._fp(),
                           storage.expected_layout(self._vllm_config))
        for layer_name in meta["layers"]:
            storage.check_layer_file(folder, layer_name, meta, verify_data)

    def _warn(self, msg: str) -> None:
        logger.warning(msg)
        warnings.warn(msg, RuntimeWarning, stacklevel=3)

    def get_stats(self) -> dict[str, Any]:
        return dict(self._stats)

    # ------------------------------------------------------------------ scheduler side
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        """Longest stored, valid prefix ``n`` (a multiple of bs, < len(prompt)) beyond the local hit."""
        prompt = request.prompt_token_ids
        n_max = align_to_block_size(len(prompt), self._block_size) if self._is_consumer else 0
        match = (0, "")
        if n_max > num_computed_tokens:
            self._stats["num_lookups"] += 1
            for n, name in reversed(storage.prefix_hashes(prompt, self._block_size, n_max)):
                if n <= num_computed_tokens:
                    break
                if not os.path.isdir(self._folder(name)):
                    continue
                try:
                    self._check_folder(name, prompt[:n], self._verify_on_lookup)
                except storage.KVStorageError as e:
                    self._stats["num_invalid_folders"] += 1
                    self._warn(f"SharedStorageConnector: ignoring stored KV ({e}); recomputing.")
                    continue
                match = (n, name)
                break
        num_external = max(match[0] - num_computed_tokens, 0)
        self._lookups[request.request_id] = match
        if num_external:
            self._stats["num_lookup_hits"] += 1
            self._stats["num_matched_tokens"] += num_external
        self._record("get_num_new_matched_tokens", request.request_id,
                     args={"num_computed_tokens": num_computed_tokens, "num_prompt_tokens": len(prompt),
                           "folder": match[1] or None, "num_stored_tokens": match[0]},
                     result=(num_external, False))
        return num_external, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        n, name = self._lookups.pop(request.request_id, (0, ""))
        if num_external_tokens > 0:
            assert n >= num_external_tokens, "update_state_after_alloc without a matching lookup"
            self._requests_need_load[request.request_id] = (
                request.prompt_token_ids[:n], name, n - num_external_tokens)
        self._record("update_state_after_alloc", request.request_id,
                     args={"block_ids": blocks.get_block_ids()[0] if blocks is not None else None,
                           "num_external_tokens": num_external_tokens},
                     result="load" if num_external_tokens > 0 else None)

    def _maybe_track_store(self, req_id: str, prompt: list[int], block_ids: list[int]) -> None:
        n = align_to_block_size(len(prompt), self._block_size)
        if not self._is_producer or n == 0:
            return
        name = storage.prefix_hashes(prompt, self._block_size, n)[-1][1]
        try:
            self._check_folder(name, prompt[:n], verify_data=False)
            return          # already stored and valid: a request either loads or stores, once
        except storage.KVStorageError:
            pass
        self._pending_stores[req_id] = (prompt[:n], name, list(block_ids))

    def build_connector_meta(self, scheduler_output: Any) -> SharedStorageConnectorMetadata:
        meta = SharedStorageConnectorMetadata()
        bs = self._block_size
        num_computed: dict[str, int] = {}
        for req in scheduler_output.scheduled_new_reqs:
            block_ids = list(req.block_ids[0])
            num_computed[req.req_id] = req.num_computed_tokens
            load = self._requests_need_load.pop(req.req_id, None)
            if load is not None:
                meta.add_request(req.req_id, load[0], load[1], block_ids, bs, False, load[2])
            self._maybe_track_store(req.req_id, req.prompt_token_ids, block_ids)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            new_ids = list(cached.new_block_ids[i][0]) if cached.new_block_ids[i] else []
            num_computed[req_id] = cached.num_computed_tokens[i]
            resumed = req_id in cached.resumed_req_ids
            load = self._requests_need_load.pop(req_id, None)
            if load is not None:     # a preempted request re-loads into its new block list
                assert resumed, f"{req_id}: a load can only start a (re)scheduled request"
                meta.add_request(req_id, load[0], load[1], new_ids, bs, False, load[2])
            if req_id in self._pending_stores:
                ids, name, blocks = self._pending_stores[req_id]
                self._pending_stores[req_id] = (ids, name, new_ids if resumed else blocks + new_ids)
        assert not self._requests_need_load, (
            f"loads counted but not scheduled: {sorted(self._requests_need_load)}")
        stored_now: set[str] = set()
        for req_id, (ids, name, blocks) in list(self._pending_stores.items()):
            n_sched = scheduler_output.num_scheduled_tokens.get(req_id, 0)
            # Only once this step's forward has computed the whole prefix (chunked prefill).
            if n_sched and num_computed[req_id] + n_sched >= len(ids):
                del self._pending_stores[req_id]
                if name not in stored_now:   # two identical prompts in one step: store once
                    stored_now.add(name)
                    meta.add_request(req_id, ids, name, blocks, bs, True)
        self._record("build_connector_meta", args=None, result=meta.describe())
        return meta

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, None]:
        for d in (self._lookups, self._requests_need_load, self._pending_stores):
            d.pop(request.request_id, None)
        self._record("request_finished", request.request_id, args={"block_ids": list(block_ids)},
                     result=(False, None))
        return False, None

    def _is_valid(self, name: str, token_ids: list[int]) -> bool:
        try:
            self._check_folder(name, token_ids, verify_data=False)
            return True
        except storage.KVStorageError:
            return False


# vLLM 0.32's names for the same classes (example_connector.py).
ExampleConnector = SharedStorageConnector
ExampleConnectorMetadata = SharedStorageConnectorMetadata
