"""P/D as deployed: prefill (P) and decode (D) instances share a KV-cache service, a real Redis
server (article: "Prefill workers write KV to a dedicated KV-cache service; decode workers read
from it"). vLLM's closest relatives: LMCache's Redis backend behind
vllm/distributed/kv_transfer/kv_connector/v1/lmcache_connector.py, and MooncakeStore.

Key layout, checks and the client: ``redis_store.py``. Scheduler side here, worker side in
``redis_store_worker.py``, the metadata between them in ``redis_store_metadata.py``. Two load modes
(``kv_connector_extra_config["load_async"]``):
- synchronous: the worker loads in ``start_load_kv``, inside the forward that needs the KV (as
  ``SharedStorageConnector``): every running request waits for it;
- asynchronous (default, vLLM V1's path): ``get_num_new_matched_tokens`` returns ``(n, True)``;
  the scheduler allocates the blocks and parks the request in ``WAITING_FOR_REMOTE_KVS``; a worker
  thread fetches; ``get_finished()`` reports ``finished_recving``; the scheduler's
  ``_update_waiting_for_remote_kv`` puts the request back in ``WAITING`` with its tokens computed.
  Running requests keep decoding meanwhile.

``kv_connector_extra_config``: ``url`` (``redis://HOST:PORT/DB`` or ``unix:///PATH``; absent: this
process starts and owns a server, ``redis_server.owned_server``), ``load_async`` (True),
``chunk_size`` (256 tokens, rounded down to a multiple of the block size), ``timeout_s`` (5.0, every
Redis call), ``on_unavailable`` (``"error"``: an unreachable server at start is an error;
``"recompute"``: a warning, then plain recompute), ``password`` / ``password_file`` (for a URL
without one; ``python -m minivllm.kvstore --password-file``). A password the store refuses (wrong,
or missing) is an error at start whatever ``on_unavailable`` says, naming the store, never the
password: URLs in messages are ``redis_store.redacted``. A server that fails mid-run is never fatal:
lookups miss, loads report their blocks invalid (recomputed), stores are dropped with a warning,
and Redis is left alone for ``retry_s`` seconds before the next try.
"""
from __future__ import annotations

import logging
import time
import warnings
from typing import Any, Optional

from minivllm.distributed.kv_transfer import redis_store, storage
from minivllm.distributed.kv_transfer.base import (KVConnectorBase_V1, KVConnectorRole,
                                                   checked_extra_config)
from minivllm.distributed.kv_transfer.redis_store import Chunk, connect, redacted, redis_errors
from minivllm.distributed.kv_transfer.redis_server import owned_server, read_password_file
from minivllm.distributed.kv_transfer.redis_store_metadata import (RedisReqMeta,
                                                                   RedisStoreConnectorMetadata)
from minivllm.distributed.kv_transfer.redis_store_worker import RedisStoreWorkerMixin
from minivllm.distributed.kv_transfer.storage import align_to_block_size

logger = logging.getLogger(__name__)
EXTRA_CONFIG_KEYS = ("url", "load_async", "chunk_size", "timeout_s", "on_unavailable", "retry_s",
                     "password", "password_file")
URL_SCHEMES = ("redis://", "rediss://", "unix://")
STATS = ("num_lookups", "num_lookup_hits", "num_matched_tokens", "num_redis_errors",
         "num_loaded_tokens", "num_loaded_bytes", "load_time_s", "num_load_errors",
         "num_stored_tokens", "num_stored_bytes", "save_time_s", "num_chunks_committed",
         "num_store_races_lost", "num_store_errors")


def _password(extra: dict) -> Optional[str]:
    """``password``, else the first line of ``password_file`` (None: the URL's, or none)."""
    if extra.get("password"):
        return extra["password"]
    if extra.get("password_file"):
        return read_password_file(extra["password_file"])
    return None


class RedisStoreConnector(RedisStoreWorkerMixin, KVConnectorBase_V1):
    """Scheduler side here; worker side (loads, saves, the loader thread) in ``RedisStoreWorkerMixin``."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        ktc = self._kv_transfer_config
        self._block_size = bs = vllm_config.cache_config.block_size
        self._chunk_size = max(bs, int(ktc.get_from_extra_config("chunk_size", 256)) // bs * bs)
        self._load_async = bool(ktc.get_from_extra_config("load_async", True))
        self._timeout_s = float(ktc.get_from_extra_config("timeout_s", 5.0))
        self._retry_s = float(ktc.get_from_extra_config("retry_s", 5.0))
        self._is_producer, self._is_consumer = ktc.is_kv_producer, ktc.is_kv_consumer
        url = ktc.get_from_extra_config("url", None)
        if url is None:
            url = owned_server().url
        self.url = url
        self._client = connect(url, self._timeout_s,
                               _password(ktc.kv_connector_extra_config))
        self._down_until = 0.0
        self._layout = storage.expected_layout(vllm_config)
        self._fp = redis_store.store_fingerprint(storage.model_fingerprint(vllm_config), self._layout, bs)
        self._stats: dict[str, Any] = dict.fromkeys(STATS, 0)
        # Scheduler state.
        self._lookups: dict[str, tuple[int, list[Chunk]]] = {}   # req_id -> (matched end, chunks)
        self._requests_need_load: dict[str, RedisReqMeta] = {}
        self._pending_stores: dict[str, tuple[int, list[Chunk], list[int]]] = {}
        self._stored: dict[str, dict[str, Any]] = {}              # req_id -> kv_transfer_params
        self._init_worker_state()

    @classmethod
    def validate_kv_transfer_config(cls, ktc: Any) -> None:
        extra = checked_extra_config(ktc, EXTRA_CONFIG_KEYS, "RedisStoreConnector")
        name = "kv_transfer_config.kv_connector_extra_config"
        url = extra.get("url")
        if url is not None and (not isinstance(url, str) or not url.startswith(URL_SCHEMES)):
            raise ValueError(f"{name}['url'] must start with one of {URL_SCHEMES}, got {url!r}.")
        if not isinstance(extra.get("load_async", True), bool):
            raise ValueError(f"{name}['load_async'] must be a bool.")
        cs = extra.get("chunk_size", 256)
        if not isinstance(cs, int) or isinstance(cs, bool) or cs <= 0:
            raise ValueError(f"{name}['chunk_size'] must be a positive int (tokens), got {cs!r}.")
        for key in ("timeout_s", "retry_s"):
            v = extra.get(key, 1.0)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"{name}['{key}'] must be a positive number of seconds, got {v!r}.")
        mode = extra.get("on_unavailable", "error")
        if mode not in ("error", "recompute"):
            raise ValueError(f"{name}['on_unavailable'] must be 'error' or 'recompute', got {mode!r}.")
        for key in ("password", "password_file"):
            if not isinstance(extra.get(key, ""), str):
                raise ValueError(f"{name}['{key}'] must be a string.")
        if url is not None:    # before any weights load: is the service there?
            import redis
            try:
                connect(url, float(extra.get("timeout_s", 5.0)), _password(extra)).ping()
            except redis.AuthenticationError as e:    # never downgraded to recompute
                raise PermissionError(
                    f"RedisStoreConnector: the KV store at {redacted(url)} refused this client "
                    f"({e}): give its password in the URL (redis://:PASSWORD@HOST:PORT/0) or in "
                    f"{name}['password_file'].") from None
            except redis_errors() as e:
                msg = f"{name}['url'] = {redacted(url)!r}: the Redis server is unreachable ({e})"
                if mode == "error":
                    raise ConnectionError(msg + "; start one with `python -m minivllm.kvstore`, or set "
                                          "on_unavailable='recompute' to run without it.") from None
                logger.warning(msg + "; recomputing every prompt (on_unavailable='recompute').")
                warnings.warn(msg + "; recomputing (on_unavailable='recompute').", RuntimeWarning)

    # ------------------------------------------------------------------ helpers
    def __repr__(self) -> str:
        return f"RedisStoreConnector(url={redacted(self.url)!r})"

    def _warn(self, msg: str) -> None:
        logger.warning(msg)
        warnings.warn(msg, RuntimeWarning, stacklevel=3)

    def _redis_ok(self) -> bool:
        """False for ``retry_s`` seconds after a Redis failure: don't wait on a dead server every step."""
        return time.monotonic() >= self._down_until

    def _redis_failed(self, what: str, err: BaseException) -> None:
        self._stats["num_redis_errors"] += 1
        self._down_until = time.monotonic() + self._retry_s
        self._warn(f"RedisStoreConnector: {what} failed ({type(err).__name__}: {err}); "
                   f"recomputing instead, next try in {self._retry_s:g} s.")

    def get_stats(self) -> dict[str, Any]:
        return dict(self._stats)

    def num_prompt_chunks(self, num_prompt_tokens: int) -> int:
        """How many chunks a prompt of this length stores (and can load): whole blocks below the
        last prompt token, cut every ``chunk_size`` tokens."""
        return -(-align_to_block_size(num_prompt_tokens, self._block_size) // self._chunk_size)

    # ------------------------------------------------------------------ scheduler side
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        """Tokens beyond the local prefix hit covered by consecutive committed chunks (article step
        "Cache lookup"); ``(n, load_async)``. The last prompt token is always recomputed."""
        prompt = request.prompt_token_ids
        n_max = align_to_block_size(len(prompt), self._block_size) if self._is_consumer else 0
        matched, chunks = 0, []
        if n_max > num_computed_tokens and self._redis_ok():
            self._stats["num_lookups"] += 1
            chunks = [c for c in redis_store.chunk_prefix(prompt, n_max, self._chunk_size)
                      if c.end > num_computed_tokens]
            try:
                k = redis_store.count_committed(self._client, self._fp, chunks, self._layout)
            except redis_errors() as e:
                self._redis_failed("lookup", e)
                k = 0
            chunks = chunks[:k]
            matched = chunks[-1].end if chunks else 0
        num_external = max(matched - num_computed_tokens, 0)
        self._lookups[request.request_id] = (matched, chunks)
        if num_external:
            self._stats["num_lookup_hits"] += 1
            self._stats["num_matched_tokens"] += num_external
        expected = (request.kv_transfer_params or {}).get("num_tokens")
        if isinstance(expected, int) and matched < min(expected, n_max):
            self._warn(f"RedisStoreConnector: {request.request_id}: kv_transfer_params promise "
                       f"{expected} stored tokens, found {matched}; recomputing the rest.")
        result = (num_external, self._load_async and num_external > 0)
        self._record("get_num_new_matched_tokens", request.request_id,
                     args={"num_computed_tokens": num_computed_tokens, "num_prompt_tokens": len(prompt),
                           "chunks": [c.hash[:12] for c in chunks]}, result=result)
        return result

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        matched, chunks = self._lookups.pop(request.request_id, (0, []))
        block_ids = blocks.get_block_ids()[0] if blocks is not None else []
        if num_external_tokens > 0:
            start = matched - num_external_tokens
            self._requests_need_load[request.request_id] = RedisReqMeta.make(
                request.request_id, chunks, start, matched, block_ids, self._block_size, False,
                self._load_async)
        self._record("update_state_after_alloc", request.request_id,
                     args={"block_ids": block_ids, "num_external_tokens": num_external_tokens},
                     result=("load_async" if self._load_async else "load") if num_external_tokens else None)

    def _maybe_track_store(self, req_id: str, prompt: list[int], block_ids: list[int]) -> None:
        n = align_to_block_size(len(prompt), self._block_size)
        if not self._is_producer or n == 0 or not self._redis_ok():
            return
        chunks = redis_store.chunk_prefix(prompt, n, self._chunk_size)
        try:   # content addressing: a chunk some earlier prompt already stored is not written again
            raws = self._client.mget([redis_store.meta_key(self._fp, c) for c in chunks])
        except redis_errors() as e:
            self._redis_failed("store lookup", e)
            return
        missing = [c for c, raw in zip(chunks, raws) if raw is None]
        self._stored[req_id] = {"do_remote_prefill": True, "num_tokens": n,
                                "chunk_hashes": [c.hash for c in chunks], "fingerprint": self._fp}
        if missing:
            self._pending_stores[req_id] = (n, missing, list(block_ids))

    def build_connector_meta(self, scheduler_output: Any) -> RedisStoreConnectorMetadata:
        """Article step "Build metadata object": this step's loads (sync or async) and stores."""
        meta = RedisStoreConnectorMetadata(list(self._requests_need_load.values()))
        self._requests_need_load = {}
        num_computed: dict[str, int] = {}
        for req in scheduler_output.scheduled_new_reqs:
            num_computed[req.req_id] = req.num_computed_tokens
            self._maybe_track_store(req.req_id, req.prompt_token_ids, list(req.block_ids[0]))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            num_computed[req_id] = cached.num_computed_tokens[i]
            new_ids = list(cached.new_block_ids[i][0]) if cached.new_block_ids[i] else []
            if req_id in self._pending_stores:
                n, chunks, blocks = self._pending_stores[req_id]
                resumed = req_id in cached.resumed_req_ids
                self._pending_stores[req_id] = (n, chunks, new_ids if resumed else blocks + new_ids)
        for req_id, (n, chunks, blocks) in list(self._pending_stores.items()):
            n_sched = scheduler_output.num_scheduled_tokens.get(req_id, 0)
            # Only once this step's forward has computed the whole prefix (chunked prefill).
            if n_sched and num_computed[req_id] + n_sched >= n:
                del self._pending_stores[req_id]
                meta.requests.append(RedisReqMeta.make(req_id, chunks, chunks[0].start, n, blocks,
                                                       self._block_size, True))
        self._record("build_connector_meta", result=meta.describe())
        return meta

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, Optional[dict[str, Any]]]:
        """Free at once: the KV left P inside the forward (an aborted async load keeps its blocks
        until ``finished_recving``, which the scheduler itself sees to); ``kv_transfer_params`` for
        the client: what P stored, for D to load."""
        req_id = request.request_id
        for d in (self._lookups, self._requests_need_load, self._pending_stores):
            d.pop(req_id, None)
        delay = False
        params = self._stored.pop(req_id, None)
        self._record("request_finished", req_id, args={"block_ids": list(block_ids)},
                     result=(delay, params))
        return delay, params
