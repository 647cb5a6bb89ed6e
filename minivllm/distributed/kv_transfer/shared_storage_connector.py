"""The article's debugging connector ``SharedStorageConnector``; vLLM 0.32 calls it
``ExampleConnector`` (vllm/distributed/kv_transfer/kv_connector/v1/example_connector.py, classes
``ExampleConnector`` and ``ExampleConnectorMetadata``; the article's file
``.../v1/shared_storage_connector.py`` and its name no longer exist there). minivllm registers both
names for one class: ``kv_connector="SharedStorageConnector"`` (the article's) and
``kv_connector="ExampleConnector"`` (vLLM today) behave the same and share stored folders.

"External server" = a local folder (``storage.SharedStorage``, with its format).
Prefill (P) stores each prompt's KV, decode (D) loads it, synchronously, whole blocks only; the
last prompt token is always recomputed (its logits give the first output token). The scheduler
half (lookup, state update, metadata) comes first, then the worker half (load, save), in the
article's order. Differences from vLLM 0.32's ExampleConnector, on purpose:
- store, lookup and load all use ``n = align_to_block_size(len(prompt))``; lookup also tries shorter
  multiples of bs, so D finds P's folder when D's prompt is P's plus the generated token, even when
  P's length is a multiple of bs (vLLM then looks up one folder and loads another);
- the match is clamped at 0, and only blocks beyond the local prefix hit are written;
- a store is emitted in the step whose forward completes the prefix (chunked prefill:
  ``_update_cached_requests``, which also re-loads a preempted request's KV);
- bad folders (missing, truncated, corrupt, another model) are skipped at lookup with a warning,
  so they are recomputed; a layer that still fails at load time (a file changed after the lookup)
  is reported by ``get_block_ids_with_load_errors()``.

Paged cache per layer: ``[2, num_blocks, block_size, num_kv_heads, head_dim]``, viewed as
``[2, num_blocks * block_size, num_kv_heads * head_dim]`` so a ``ReqMeta.slot_mapping`` ``[n]``
indexes token rows directly; the files hold the same rows ``[2, n, num_kv_heads * head_dim]``.
vLLM 0.32's ExampleConnector stores ``[n, num_kv_heads, K||V]`` instead (its per-layer cache is
``[num_blocks, num_kv_heads, block_size, 2 * head_dim]``, vllm/v1/kv_cache_interface.py): same
folders and file names, a different tensor inside.

``kv_connector_extra_config``: ``shared_storage_path`` (required); ``layerwise`` (load each layer in
``wait_for_layer_load`` instead of all in ``start_load_kv``); ``verify_on_lookup`` (default True:
the scheduler checks every file's CRC32, so corrupt bytes are never counted as computed; False
checks only metadata, headers and sizes, and leaves the CRC to the load).
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from minivllm.distributed.kv_transfer import storage
from minivllm.distributed.kv_transfer.base import (KVConnectorBase_V1, KVConnectorMetadata,
                                                   KVConnectorRole, checked_extra_config, recorded)
from minivllm.distributed.kv_transfer.storage import align_to_block_size

EXTRA_CONFIG_KEYS = ("shared_storage_path", "layerwise", "verify_on_lookup")


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
        self.requests.append(ReqMeta.make_meta(req_id, token_ids=token_ids, folder=folder,
                                               block_ids=block_ids, block_size=block_size,
                                               is_store=is_store, start=start))

    def describe(self) -> list[dict[str, Any]]:
        return [{"req_id": r.req_id, "is_store": r.is_store, "folder": r.folder,
                 "tokens": [r.start, len(r.token_ids)], "block_ids": r.block_ids} for r in self.requests]


class SharedStorageConnector(KVConnectorBase_V1):
    """Scheduler half first (what to move, per step), worker half after (moving it)."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        ktc = self._kv_transfer_config
        self._block_size = vllm_config.cache_config.block_size
        self._storage_path = ktc.get_from_extra_config("shared_storage_path", "/tmp")
        self._layerwise = bool(ktc.get_from_extra_config("layerwise", False))
        self._verify_on_lookup = bool(ktc.get_from_extra_config("verify_on_lookup", True))
        self._is_producer, self._is_consumer = ktc.is_kv_producer, ktc.is_kv_consumer
        self._storage = storage.SharedStorage(self._storage_path, vllm_config)
        # Scheduler state.
        self._lookups: dict[str, tuple[int, str]] = {}          # req_id -> (n, folder) last answer
        self._requests_need_load: dict[str, tuple[list[int], str, int]] = {}   # ids, folder, start
        self._pending_stores: dict[str, tuple[list[int], str, list[int]]] = {}  # ids, folder, blocks
        # Worker state.
        self._kv_caches: dict[str, torch.Tensor] = {}
        self._loads: list[tuple[ReqMeta, dict[str, Any]]] = []   # (request, its folder's meta)
        self._invalid_block_ids: set[int] = set()

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

    def get_stats(self) -> dict[str, Any]:
        return dict(self._storage.stats)

    # ------------------------------------------------------------------ scheduler side
    @recorded
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        """Article step "Cache lookup": the longest stored, valid prefix ``n`` (a multiple of bs,
        < len(prompt)), counted beyond the local prefix hit; always synchronous (``False``)."""
        prompt = request.prompt_token_ids
        n_max = align_to_block_size(len(prompt), self._block_size) if self._is_consumer else 0
        n, name = 0, ""
        if n_max > num_computed_tokens:
            n, name = self._storage.lookup(prompt, self._block_size, n_max, num_computed_tokens,
                                           self._verify_on_lookup)
        self._lookups[request.request_id] = (n, name)
        return max(n - num_computed_tokens, 0), False

    @recorded
    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """Article step "State update": remember the requests that will load (and from where)."""
        n, name = self._lookups.pop(request.request_id, (0, ""))
        if num_external_tokens > 0:
            assert n >= num_external_tokens, "update_state_after_alloc without a matching lookup"
            self._requests_need_load[request.request_id] = (
                request.prompt_token_ids[:n], name, n - num_external_tokens)

    @recorded
    def build_connector_meta(self, scheduler_output: Any) -> SharedStorageConnectorMetadata:
        """Article step "Build metadata object": this step's loads (requests that had a hit) and
        stores (prefixes not stored yet, once this step's forward has computed them)."""
        meta = SharedStorageConnectorMetadata()
        bs = self._block_size
        num_computed: dict[str, int] = {}
        for req in scheduler_output.scheduled_new_reqs:
            block_ids = list(req.block_ids[0])
            num_computed[req.req_id] = req.num_computed_tokens
            load = self._requests_need_load.pop(req.req_id, None)
            if load is not None:
                token_ids, folder, start = load
                meta.add_request(req.req_id, token_ids=token_ids, folder=folder, block_ids=block_ids,
                                 block_size=bs, is_store=False, start=start)
            self._maybe_track_store(req.req_id, req.prompt_token_ids, block_ids,
                                    num_loaded=len(load[0]) if load is not None else 0)
        cached = scheduler_output.scheduled_cached_reqs
        if cached.req_ids and (self._requests_need_load or self._pending_stores):
            # A resumed request re-loads; a prefix prefilled in chunks collects its new blocks.
            self._update_cached_requests(meta, cached, num_computed)
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
                    meta.add_request(req_id, token_ids=ids, folder=name, block_ids=blocks,
                                     block_size=bs, is_store=True)
        return meta

    def _update_cached_requests(self, meta: SharedStorageConnectorMetadata, cached: Any,
                                num_computed: dict[str, int]) -> None:
        """The requests the worker already knows (vLLM's ``scheduled_cached_reqs``: running, or
        resumed after a preemption), while one of them still has a transfer pending: a preempted
        request whose lookup found stored KV again re-loads it into its new block list; a prefix
        prefilled in chunks is stored only once its last chunk is computed, so its store collects
        each step's new blocks. Notes each request's computed tokens in ``num_computed``. In the
        article's examples every prompt is prefilled in one step and nothing is preempted."""
        for i, req_id in enumerate(cached.req_ids):
            new_ids = list(cached.new_block_ids[i][0]) if cached.new_block_ids[i] else []
            num_computed[req_id] = cached.num_computed_tokens[i]
            resumed = req_id in cached.resumed_req_ids
            load = self._requests_need_load.pop(req_id, None)
            if load is not None:     # a preempted request re-loads into its new block list
                assert resumed, f"{req_id}: a load can only start a (re)scheduled request"
                token_ids, folder, start = load
                meta.add_request(req_id, token_ids=token_ids, folder=folder, block_ids=new_ids,
                                 block_size=self._block_size, is_store=False, start=start)
            if req_id in self._pending_stores:
                ids, name, blocks = self._pending_stores[req_id]
                self._pending_stores[req_id] = (ids, name, new_ids if resumed else blocks + new_ids)

    def _maybe_track_store(self, req_id: str, prompt: list[int], block_ids: list[int],
                           num_loaded: int) -> None:
        """vLLM's ``_found_match_for_prompt`` test before a store: a prefix already stored (and
        valid) is not stored again, nor the one this request loads whole (its lookup has just
        checked it); a request either loads or stores, once."""
        n = align_to_block_size(len(prompt), self._block_size)
        if not self._is_producer or n <= num_loaded:
            return
        name = storage.prefix_hashes(prompt, self._block_size, n)[-1][1]
        if not self._storage.is_stored(name, prompt[:n]):
            self._pending_stores[req_id] = (prompt[:n], name, list(block_ids))

    @recorded
    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, None]:
        """Free the blocks at once: the KV left in ``wait_for_save``, inside the step."""
        for d in (self._lookups, self._requests_need_load, self._pending_stores):
            d.pop(request.request_id, None)
        return False, None

    # ------------------------------------------------------------------ worker side
    @recorded
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._kv_caches = dict(kv_caches)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        self._invalid_block_ids = set()
        self._storage.drop_staged()    # a step whose forward stopped half-way left some behind
        super().bind_connector_metadata(connector_metadata)

    @recorded
    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """Article: "On enter: kv_connector.start_load_kv" -- D reads the files into paged memory
        (all layers here, or one by one in ``wait_for_layer_load`` with ``layerwise``)."""
        md = self._connector_metadata
        self._loads = []
        if not self._kv_caches and forward_context is not None:
            self._kv_caches = {name: layer.kv_cache
                               for name, layer in forward_context.no_compile_layers.items()}
        if md is None or not self._kv_caches:
            return
        layout = storage.layout_of(next(iter(self._kv_caches.values())))
        for req in md.requests:
            if not req.is_store:
                try:
                    meta = self._storage.open(req.folder, req.token_ids, layout, list(self._kv_caches))
                    self._loads.append((req, meta))
                except storage.KVStorageError as e:
                    self._load_failed(req, e)
        if not self._layerwise:
            for name in self._kv_caches:
                self._load_layer(name)

    def _load_layer(self, layer_name: str) -> int:
        """vLLM's ``inject_kv_into_layer``: the stored rows of every load, into their slots."""
        t0, nbytes = time.perf_counter(), 0
        kv = self._kv_caches[layer_name]
        flat = kv.view(2, -1, kv.shape[3] * kv.shape[4])    # [2, num_blocks * block_size, H * D]
        for req, meta in list(self._loads):
            try:
                data = self._storage.read_layer(req.folder, layer_name, meta)
            except storage.KVStorageError as e:
                self._loads.remove((req, meta))
                self._load_failed(req, e)
                continue
            rows = storage.copy_to_device(data[:, req.start:], kv.device).to(kv.dtype)
            flat[:, storage.copy_to_device(req.slot_mapping, kv.device)] = rows
            nbytes += rows.numel() * rows.element_size()
        self._storage.count(num_loaded_bytes=nbytes, load_time_s=time.perf_counter() - t0)
        if layer_name == next(reversed(self._kv_caches)):   # last layer: requests complete
            self._storage.count(num_loaded_tokens=sum(len(r.slot_mapping) for r, _ in self._loads))
        return nbytes

    def _load_failed(self, req: ReqMeta, err: Exception) -> None:
        """A load that failed after the lookup counted it (a file changed since): its blocks are
        reported by ``get_block_ids_with_load_errors()`` and recomputed, with a warning."""
        self._storage.count(num_load_errors=1)
        self._invalid_block_ids.update(req.block_ids)
        storage.warn(f"SharedStorageConnector: loading {req.req_id} failed ({err}); "
                     f"blocks {req.block_ids} will be recomputed.")

    @recorded
    def wait_for_layer_load(self, layer_name: str) -> None:
        """Entering each attention layer: with ``layerwise``, load this layer now."""
        if self._layerwise and self._loads:
            self._load_layer(layer_name)

    @recorded
    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        """P: gather this layer's stored-prefix rows from the paged cache into host memory (vLLM's
        ``extract_kv_from_layer``). The files are written in ``wait_for_save``: on CUDA the rows
        travel into pinned buffers without stalling the forward pass."""
        md = self._connector_metadata
        t0, nbytes = time.perf_counter(), 0
        flat = kv_layer.view(2, -1, kv_layer.shape[3] * kv_layer.shape[4])
        for req in (md.requests if md is not None else []):
            if req.is_store and self._storage.start_store(req.req_id, req.folder):
                slots = storage.copy_to_device(req.slot_mapping, kv_layer.device)
                rows = storage.copy_to_host(flat[:, slots])
                self._storage.stage(req.req_id, req.folder, layer_name, rows)
                nbytes += rows.numel() * rows.element_size()
        self._storage.count(num_stored_bytes=nbytes, save_time_s=time.perf_counter() - t0)

    @recorded
    def wait_for_save(self) -> None:
        """Article: "On exit: kv_connector.wait_for_save" -- write the gathered rows, one file
        per layer, and publish each finished folder at once (a reader sees all of it or none)."""
        md = self._connector_metadata
        if self._storage.has_staged():   # the rows were copied to host memory without waiting
            storage.wait_for_copies_to_host(next(iter(self._kv_caches.values())).device)
        stores = [(r.req_id, r.folder, r.token_ids)
                  for r in (md.requests if md is not None else []) if r.is_store]
        self._storage.commit(stores, self._kv_caches)

    @recorded
    def get_finished(self, finished_req_ids: set[str]) -> tuple[None, None]:
        """Nothing is asynchronous: every load and save completed inside its step."""
        return None, None

    @recorded
    def get_block_ids_with_load_errors(self) -> set[int]:
        return set(self._invalid_block_ids)


# vLLM 0.32's names for the same classes (example_connector.py).
ExampleConnector = SharedStorageConnector
ExampleConnectorMetadata = SharedStorageConnectorMetadata
