"""The worker half of ``RedisStoreConnector``: loads (in the forward, or on a loader thread),
stores, and the per-step report ``get_finished()`` (vLLM: the worker side of a connector, e.g.
vllm/distributed/kv_transfer/kv_connector/v1/lmcache_connector.py; the async report follows
vllm/v1/worker/kv_connector_model_runner_mixin.py).

Paged cache per layer ``[2, num_blocks, block_size, num_kv_heads, head_dim]``, viewed as
``[2, num_blocks * block_size, num_kv_heads * head_dim]`` so ``RedisReqMeta.slot_mapping`` ``[n]``
indexes token rows; a stored value holds the same rows ``[2, t, num_kv_heads * head_dim]``.

The loader thread writes only into blocks the scheduler allocated to a request that is parked in
``WAITING_FOR_REMOTE_KVS``: no forward reads or writes them until ``finished_recving`` is reported,
so on the CPU no further synchronisation is needed. On CUDA the host rows go through pinned
buffers (``storage.copy_to_host``) as asynchronous copies queued on the default stream, ahead of any
forward that reads those blocks; a faster build would copy on a side stream with an event per
request, so that loads overlap the forward too.
"""
from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Optional

import torch

from minivllm.distributed.kv_transfer import redis_store
from minivllm.distributed.kv_transfer.redis_store import redis_errors
from minivllm.distributed.kv_transfer.redis_store_metadata import RedisReqMeta
from minivllm.distributed.kv_transfer.storage import (copy_to_device, copy_to_host,
                                                      wait_for_copies_to_host)
from minivllm.utils import keep_off_openmp


class RedisStoreWorkerMixin:
    def _init_worker_state(self) -> None:
        self._kv_caches: dict[str, torch.Tensor] = {}
        self._invalid_block_ids: set[int] = set()
        self._finished_recving: set[str] = set()
        self._lock = threading.Lock()              # guards the three sets above and _stats
        self._load_done = threading.Event()
        self._loader: Optional[ThreadPoolExecutor] = None
        self._num_in_flight = 0
        self._no_forward = False
        self._saves: dict[str, list[torch.Tensor]] = {}   # req_id -> rows per layer, this step

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._kv_caches = dict(kv_caches)
        self._record("register_kv_caches", args={name: list(t.shape) for name, t in kv_caches.items()})

    # ------------------------------------------------------------------ loads
    def _load_request(self, req: RedisReqMeta) -> tuple[int, int]:
        """Fetch ``req``'s chunks and write rows ``[req.start, req.end)`` into the paged cache.
        Returns (tokens loaded, bytes); on the first bad chunk, its blocks and every later block
        of the load go to ``_invalid_block_ids`` (the scheduler recomputes from there)."""
        t0, nbytes, loaded_to = time.perf_counter(), 0, req.start
        caches = list(self._kv_caches.values())
        try:
            for chunk in req.chunks:
                if not self._redis_ok():
                    raise redis_store.KVStoreError("Redis was unavailable a moment ago")
                layers = redis_store.get_chunk(self._client, self._fp, chunk, self._layout)
                lo = max(chunk.start, req.start)
                slots = req.slot_mapping[lo - req.start:chunk.end - req.start]
                for kv, data in zip(caches, layers):
                    flat = kv.view(2, -1, kv.shape[3] * kv.shape[4])
                    rows = copy_to_device(data[:, lo - chunk.start:], kv.device).to(kv.dtype)
                    flat[:, copy_to_device(slots, kv.device)] = rows
                    nbytes += rows.numel() * rows.element_size()
                loaded_to = chunk.end
        except (redis_store.KVStoreError, *redis_errors()) as e:
            if not isinstance(e, redis_store.KVStoreError):
                self._redis_failed("load", e)
            bs = self._block_size
            first_bad = loaded_to // bs - req.start // bs
            with self._lock:
                self._stats["num_load_errors"] += 1
                self._invalid_block_ids.update(req.block_ids[first_bad:])
            self._warn(f"RedisStoreConnector: loading {req.req_id} stopped at token {loaded_to} "
                       f"({e}); the rest is recomputed.")
        with self._lock:
            self._stats["num_loaded_tokens"] += loaded_to - req.start
            self._stats["num_loaded_bytes"] += nbytes
            self._stats["load_time_s"] += time.perf_counter() - t0
        return loaded_to - req.start, nbytes

    def _load_async_job(self, req: RedisReqMeta) -> None:
        self._load_request(req)
        with self._lock:          # errors (if any) are recorded before the request is reported
            self._finished_recving.add(req.req_id)
            self._num_in_flight -= 1
        self._load_done.set()

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """Article: "On enter: kv_connector.start_load_kv". Sync loads happen here, before the
        forward; async ones go to the loader thread and this returns at once."""
        md = self._connector_metadata
        self._no_forward = forward_context is None or forward_context.attn_metadata is None
        if not self._kv_caches and forward_context is not None:
            self._kv_caches = {name: layer.kv_cache
                               for name, layer in forward_context.no_compile_layers.items()}
        loads = [r for r in (md.requests if md is not None else []) if not r.is_store]
        sync_ids, async_ids, nbytes = [], [], 0
        for req in loads:
            if req.load_async:
                if self._loader is None:
                    # keep_off_openmp: its copies into the cache must not start an OpenMP team
                    # beside the engine's (minivllm/utils.py keep_off_openmp)
                    self._loader = ThreadPoolExecutor(1, thread_name_prefix="minivllm-kv-load",
                                                      initializer=keep_off_openmp)
                with self._lock:
                    self._num_in_flight += 1
                self._loader.submit(self._load_async_job, req)
                async_ids.append(req.req_id)
            else:
                nbytes += self._load_request(req)[1]
                sync_ids.append(req.req_id)
        self._record("start_load_kv", args={"sync": sync_ids, "async": async_ids}, bytes=nbytes)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Everything was loaded in ``start_load_kv`` (or is loading in the background)."""

    # ------------------------------------------------------------------ stores
    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        """P: gather this layer's rows of every stored prefix (a copy: the blocks may be freed
        and reused right after this step)."""
        md = self._connector_metadata
        flat = kv_layer.view(2, -1, kv_layer.shape[3] * kv_layer.shape[4])
        for req in (md.requests if md is not None else []):
            if req.is_store:
                rows = flat[:, copy_to_device(req.slot_mapping, flat.device)]
                self._saves.setdefault(req.req_id, []).append(copy_to_host(rows))

    def wait_for_save(self) -> None:
        """Article: "On exit: kv_connector.wait_for_save": write each stored chunk, meta last."""
        md = self._connector_metadata
        results: dict[str, str] = {}
        if self._saves:    # the rows were copied to host memory without waiting
            wait_for_copies_to_host(next(iter(self._kv_caches.values())).device)
        for req in (md.requests if md is not None else []):
            rows = self._saves.pop(req.req_id, None) if req.is_store else None
            if rows is None:
                continue
            if len(rows) != len(self._kv_caches) or not self._redis_ok():
                self._stats["num_store_errors"] += 1
                results[req.req_id] = "dropped"
                continue
            t0, n_ok = time.perf_counter(), 0
            try:
                for chunk in req.chunks:
                    lo, hi = chunk.start - req.start, chunk.end - req.start
                    if redis_store.put_chunk(self._client, self._fp, chunk, [r[:, lo:hi] for r in rows]):
                        n_ok += 1
                        self._stats["num_chunks_committed"] += 1
                        self._stats["num_stored_tokens"] += chunk.end - chunk.start
                        self._stats["num_stored_bytes"] += sum(r[:, lo:hi].numel() * r.element_size()
                                                               for r in rows)
                    else:            # another producer committed the same chunk first
                        self._stats["num_store_races_lost"] += 1
                results[req.req_id] = f"{n_ok}/{len(req.chunks)} chunks committed"
            except redis_errors() as e:
                self._stats["num_store_errors"] += 1
                self._redis_failed(f"storing {req.req_id}", e)
                results[req.req_id] = "dropped"
            self._stats["save_time_s"] += time.perf_counter() - t0
        self._saves = {}
        self._record("wait_for_save", result=results)

    # ------------------------------------------------------------------ per-step report
    def get_finished(self, finished_req_ids: set[str]) -> tuple[Optional[set[str]], Optional[set[str]]]:
        """(finished_sending, finished_recving). Stores are complete inside the step, so nothing
        is ever sending; a step without a forward waits a moment for a load rather than spin."""
        if self._no_forward and self._num_in_flight and not self._finished_recving:
            self._load_done.wait(0.01)
        with self._lock:
            self._load_done.clear()
            done, self._finished_recving = self._finished_recving, set()
        self._record("get_finished", args={"finished_req_ids": sorted(finished_req_ids)},
                     result=(None, sorted(done)))
        return None, (done or None)

    def get_block_ids_with_load_errors(self) -> set[int]:
        with self._lock:
            bad, self._invalid_block_ids = self._invalid_block_ids, set()
        self._record("get_block_ids_with_load_errors", result=sorted(bad))
        return bad

    def shutdown(self) -> None:
        if self._loader is not None:
            self._loader.shutdown(wait=True)   # every fetch is bounded by timeout_s
            self._loader = None
