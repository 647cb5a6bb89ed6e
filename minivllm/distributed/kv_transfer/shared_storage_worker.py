"""The worker half of ``SharedStorageConnector`` (``ExampleConnector`` in vLLM 0.32, which keeps
both halves in vllm/distributed/kv_transfer/kv_connector/v1/example_connector.py; the article's
``.../v1/shared_storage_connector.py`` is gone; split here only so that each file reads in one
sitting). State lives in ``SharedStorageConnector.__init__``.

Paged cache per layer: ``[2, num_blocks, block_size, num_kv_heads, head_dim]``, viewed as
``[2, num_blocks * block_size, num_kv_heads * head_dim]`` so a ``ReqMeta.slot_mapping`` ``[n]``
indexes token rows directly; the files hold the same rows ``[2, n, num_kv_heads * head_dim]``.
vLLM 0.32's ExampleConnector stores ``[n, num_kv_heads, K||V]`` instead (its per-layer cache is
``[num_blocks, num_kv_heads, block_size, 2 * head_dim]``, vllm/v1/kv_cache_interface.py): same
folders and file names, a different tensor inside.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import torch

from minivllm import trace
from minivllm.distributed.kv_transfer import storage
from minivllm.host_copy import copy_to_device, copy_to_host, wait_for_copies_to_host
from minivllm.distributed.kv_transfer.base import KVConnectorMetadata

if TYPE_CHECKING:
    from minivllm.distributed.kv_transfer.shared_storage_connector import ReqMeta


def layout_of(kv: torch.Tensor) -> dict[str, Any]:
    """KV layout of a paged cache ``[2, num_blocks, block_size, num_kv_heads, head_dim]``."""
    return {"num_kv_heads": kv.shape[3], "head_dim": kv.shape[4],
            "dtype": str(kv.dtype).removeprefix("torch.")}


class SharedStorageWorkerMixin:
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._kv_caches = dict(kv_caches)
        self._record("register_kv_caches", args={name: list(t.shape) for name, t in kv_caches.items()})

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        self._invalid_block_ids = set()
        self._pending_writes = []    # a step whose forward stopped half-way left some behind
        super().bind_connector_metadata(connector_metadata)

    def _load_failed(self, req: ReqMeta, err: Exception) -> None:
        self._stats["num_load_errors"] += 1
        self._invalid_block_ids.update(req.block_ids)
        self._warn(f"SharedStorageConnector: loading {req.req_id} failed ({err}); "
                   f"blocks {req.block_ids} will be recomputed.")

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """Article: "On enter: kv_connector.start_load_kv" -- D reads the files into paged memory."""
        md = self._connector_metadata
        self._loads = []
        if not self._kv_caches and forward_context is not None:
            self._kv_caches = {name: layer.kv_cache
                               for name, layer in forward_context.no_compile_layers.items()}
        if md is None or not self._kv_caches:
            self._record("start_load_kv", result="nothing to load")
            return
        layout = layout_of(next(iter(self._kv_caches.values())))
        for req in md.requests:
            if req.is_store:
                continue
            try:
                folder = self._folder(req.folder)
                meta = storage.read_meta(folder)
                storage.check_meta(meta, folder, req.token_ids, self._fp(), layout,
                                   list(self._kv_caches))
                self._loads.append((req, meta))
            except storage.KVStorageError as e:
                self._load_failed(req, e)
        req_ids = [r.req_id for r, _ in self._loads]
        nbytes = 0 if self._layerwise else sum(self._load_layer(name) for name in self._kv_caches)
        self._record("start_load_kv", args={"layerwise": self._layerwise, "req_ids": req_ids},
                     bytes=nbytes)

    def _load_layer(self, layer_name: str) -> int:
        t0, nbytes = time.perf_counter(), 0
        kv = self._kv_caches[layer_name]
        flat = kv.view(2, -1, kv.shape[3] * kv.shape[4])    # [2, num_blocks * block_size, H * D]
        for req, meta in list(self._loads):
            try:
                data = storage.read_layer_file(self._folder(req.folder), layer_name, meta)
            except storage.KVStorageError as e:
                self._loads.remove((req, meta))
                self._load_failed(req, e)
                continue
            rows = copy_to_device(data[:, req.start:], kv.device).to(kv.dtype)
            flat[:, copy_to_device(req.slot_mapping, kv.device)] = rows
            nbytes += rows.numel() * rows.element_size()
        self._stats["num_loaded_bytes"] += nbytes
        self._stats["load_time_s"] += time.perf_counter() - t0
        if layer_name == next(reversed(self._kv_caches)):   # last layer: requests complete
            self._stats["num_loaded_tokens"] += sum(len(r.slot_mapping) for r, _ in self._loads)
        return nbytes

    def wait_for_layer_load(self, layer_name: str) -> None:
        nbytes = self._load_layer(layer_name) if self._layerwise and self._loads else 0
        if trace.is_recording():
            self._record("wait_for_layer_load", args={"layer_name": layer_name}, bytes=nbytes)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        """P: gather this layer's stored-prefix rows from the paged cache into host memory.

        The files are written in ``wait_for_save``: on CUDA the rows travel into pinned buffers
        without stalling the forward pass, and only become readable after the forward."""
        md = self._connector_metadata
        t0, nbytes = time.perf_counter(), 0
        flat = kv_layer.view(2, -1, kv_layer.shape[3] * kv_layer.shape[4])
        for req in (md.requests if md is not None else []):
            if not req.is_store or self._writers.get(req.folder, 0) is None:   # None: failed
                continue
            try:
                if req.folder not in self._writers:
                    self._writers[req.folder] = storage.FolderWriter(self._storage_path, req.folder)
            except OSError as e:
                self._store_failed(req, e)
                continue
            kv = copy_to_host(flat[:, copy_to_device(req.slot_mapping, kv_layer.device)])
            self._pending_writes.append((req, layer_name, kv))
            nbytes += kv.numel() * kv.element_size()
        self._stats["num_stored_bytes"] += nbytes
        self._stats["save_time_s"] += time.perf_counter() - t0
        if trace.is_recording():
            self._record("save_kv_layer", args={"layer_name": layer_name}, bytes=nbytes)

    def _write_pending(self) -> None:
        """Write the rows ``save_kv_layer`` gathered, one file per (prefix, layer)."""
        pending, self._pending_writes = self._pending_writes, []
        if pending:
            wait_for_copies_to_host(next(iter(self._kv_caches.values())).device)
        t0 = time.perf_counter()
        for req, layer_name, kv in pending:
            writer = self._writers.get(req.folder)
            if writer is None:       # an earlier layer of this prefix failed to write
                continue
            try:
                writer.write_layer(layer_name, kv)
            except OSError as e:
                self._store_failed(req, e)
        self._stats["save_time_s"] += time.perf_counter() - t0

    def _store_failed(self, req: ReqMeta, err: Exception) -> None:
        self._stats["num_store_errors"] += 1
        self._warn(f"SharedStorageConnector: storing {req.req_id} failed ({err}); not stored.")
        writer = self._writers.get(req.folder)
        if writer is not None:
            writer.abort()
        self._writers[req.folder] = None

    def wait_for_save(self) -> None:
        """Article: "On exit: kv_connector.wait_for_save" -- publish each finished folder at once."""
        md = self._connector_metadata
        results: dict[str, str] = {}
        self._write_pending()
        kv = next(iter(self._kv_caches.values()), None)
        for req in (md.requests if md is not None else []):
            writer = self._writers.pop(req.folder, None) if req.is_store else None
            if writer is None:
                continue
            if set(writer.layers) != set(self._kv_caches):   # a forward that stopped half-way
                writer.abort()
                self._stats["num_store_errors"] += 1
                results[req.req_id] = "incomplete"
                continue
            meta = {"format": storage.FORMAT_VERSION, "model_fingerprint": self._fp(),
                    "num_tokens": len(req.token_ids), "token_ids": req.token_ids,
                    **layout_of(kv), "block_size": self._block_size,
                    "num_target_layers": storage.expected_layout(self._vllm_config).get(
                        "num_layers", len(self._kv_caches))}
            t0 = time.perf_counter()
            try:
                outcome = writer.commit(meta, lambda: self._is_valid(req.folder, req.token_ids))
            except OSError as e:
                self._store_failed(req, e)
                outcome = "failed"
            self._stats["save_time_s"] += time.perf_counter() - t0
            if outcome == "exists":        # another producer published the same prefix first
                self._stats["num_store_races_lost"] += 1
            elif outcome != "failed":      # "committed", or "replaced" an invalid folder
                self._stats["num_folders_committed"] += 1
                self._stats["num_stored_tokens"] += len(req.token_ids)
            results[req.req_id] = outcome
        for writer in self._writers.values():
            if writer is not None:
                writer.abort()
        self._writers = {}
        self._record("wait_for_save", result=results)

    def get_block_ids_with_load_errors(self) -> set[int]:
        self._record("get_block_ids_with_load_errors", result=sorted(self._invalid_block_ids))
        return set(self._invalid_block_ids)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[None, None]:
        self._record("get_finished", args={"finished_req_ids": sorted(finished_req_ids)},
                     result=(None, None))
        return None, None
