"""The article's "external server" for ``SharedStorageConnector`` (``ExampleConnector`` in vLLM
0.32): a local folder, one sub-folder per stored prompt prefix, one ``.safetensors`` file per
attention layer (the format: below). vLLM 0.32 keeps the file handling inline in
vllm/distributed/kv_transfer/kv_connector/v1/example_connector.py (``_generate_foldername_debug``,
``_found_match_for_prompt``, ``safetensors.torch.save_file``/``load_file``); here it sits behind
``SharedStorage``, so the connector reads like vLLM's, with the integrity checks, the atomic
writes and the counters kept out of its way. Article steps (P/D): "Cache lookup"
(``SharedStorage.lookup``), and the worker's loads and stores inside the context manager.

Also the pieces every connector shares: ``align_to_block_size`` (vLLM's helper of the same name),
``model_fingerprint`` and ``expected_layout`` (what two instances must agree on to exchange KV),
and the copies between host memory and the model's device (``copy_to_device``, ``copy_to_host``,
``wait_for_copies_to_host``; vLLM inlines them in each connector).

The on-disk format (vLLM 0.32's ExampleConnector writes it with ``safetensors.torch.save_file`` per
layer; here it is hardened: checked metadata, checksums, atomic folders).

One folder per stored prompt prefix of ``n`` tokens (``n`` a multiple of the block size)::

    {shared_storage_path}/{md5(token_ids[:n] as little-endian int64)}/
        {layer_name}.safetensors   one key "kv_cache": [2, n, num_kv_heads * head_dim] (0 = K, 1 = V;
                                   vLLM 0.32 stores [n, num_kv_heads, K||V] under the same key)
        meta.json                  model fingerprint, token ids, dtype, KV shape, per-file size + CRC32

The layout does not depend on the block size: any instance whose block size divides ``n`` can
load it. A folder appears in one ``os.rename`` of a finished temporary folder, so a reader sees a
whole folder or none; when its name is taken already (another producer published the same prefix
first, or a bad folder is in the way), ``publish_over`` decides.

``check_header``, the cheap check of a stored layer file: its safetensors header and its size
against ``meta.json``, without reading the data. It serves the lookup with
``verify_on_lookup=False`` (the CRC32 is then checked when the file loads) and a producer's
"is this prefix stored already?" (``SharedStorage.is_stored``). The default lookup reads every
byte instead (``read_layer_file``).

No fault stops the engine: a folder the lookup must skip (missing files, truncated,
corrupt, another model), a store that cannot be written, a load that fails after the lookup counted
it (the connector's ``_load_failed``) are each logged, raised as a ``RuntimeWarning`` (tests and
notebooks see it) and counted in ``SharedStorage.stats``; a failed load's blocks are recomputed.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import struct
import tempfile
import time
import warnings
import zlib
from typing import Any, Callable, Optional

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from minivllm.utils import resolve_auto_dtype

logger = logging.getLogger(__name__)

# ------------------------------------------------------------------ the on-disk format

FORMAT_VERSION = 1
META_FILE = "meta.json"
KEY = "kv_cache"
_META_SCHEMA = {"model_fingerprint": str, "num_tokens": int, "token_ids": list, "num_kv_heads": int,
                "head_dim": int, "dtype": str, "layers": dict}


class KVStorageError(Exception):
    """A stored folder or layer file is missing, truncated, corrupt or from another model."""


def warn(msg: str, stacklevel: int = 3) -> None:
    """A fault the engine survives: logged, and a ``RuntimeWarning`` pointing at the method that
    met it (called from a ``_..._failed`` method, so two frames up)."""
    logger.warning(msg)
    warnings.warn(msg, RuntimeWarning, stacklevel=stacklevel)


def _md5():
    try:
        return hashlib.md5(usedforsecurity=False)
    except (TypeError, ValueError):   # FIPS builds refuse MD5: vLLM falls back to SHA-256 too
        return hashlib.sha256()


def prefix_hashes(token_ids: list[int], block_size: int, max_tokens: int) -> list[tuple[int, str]]:
    """``[(n, folder_name)]`` for n = bs, 2*bs, ... <= max_tokens, in one pass over the ids.

    ``folder_name`` is the hex MD5 of ``token_ids[:n]`` as little-endian int64 bytes (vLLM's key)."""
    out, h = [], _md5()
    for start in range(0, max_tokens - max_tokens % block_size, block_size):
        block = token_ids[start:start + block_size]
        h.update(struct.pack(f"<{len(block)}q", *block))
        out.append((start + block_size, h.copy().hexdigest()))
    return out


def check_storage_path(path: str, writable: bool) -> None:
    """Create ``path`` if needed; raise ``OSError`` unless it can be read (and written)."""
    os.makedirs(path, exist_ok=True)
    if writable:
        with tempfile.NamedTemporaryFile(dir=path, prefix=".write-test-"):
            pass
    elif not os.access(path, os.R_OK | os.X_OK):
        raise PermissionError(f"cannot read {path}")


def read_meta(folder: str) -> dict[str, Any]:
    try:
        with open(os.path.join(folder, META_FILE)) as fh:
            meta = json.load(fh)
    except FileNotFoundError:
        raise KVStorageError(f"{folder}: no {META_FILE}") from None
    except (OSError, ValueError) as e:
        raise KVStorageError(f"{folder}: unreadable {META_FILE} ({e})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT_VERSION:
        raise KVStorageError(f"{folder}: {META_FILE} has an unknown format")
    for key, kind in _META_SCHEMA.items():
        if not isinstance(meta.get(key), kind):
            raise KVStorageError(f"{folder}: {META_FILE} lacks a valid {key!r}")
    for name, info in meta["layers"].items():
        # Layer names become file names: no paths, and a size and CRC for each.
        if os.sep in name or name.startswith(".") or not isinstance(info, dict) or not (
                isinstance(info.get("nbytes"), int) and isinstance(info.get("crc32"), int)):
            raise KVStorageError(f"{folder}: {META_FILE} has a bad entry for layer {name!r}")
    return meta


def check_meta(meta: dict[str, Any], folder: str, token_ids: list[int], fingerprint: str,
               layout: dict[str, Any], layer_names: Optional[list[str]] = None) -> None:
    """Raise ``KVStorageError`` unless ``meta`` describes exactly this prefix for this model."""
    if meta.get("model_fingerprint") != fingerprint:
        raise KVStorageError(f"{folder}: stored by another model")
    if meta.get("num_tokens") != len(token_ids) or meta.get("token_ids") != list(token_ids):
        raise KVStorageError(f"{folder}: token ids differ from the prompt prefix")
    for key in ("num_kv_heads", "head_dim", "dtype"):
        if key in layout and meta.get(key) != layout[key]:
            raise KVStorageError(f"{folder}: {key} {meta.get(key)!r} != {layout[key]!r}")
    layers = meta.get("layers")
    if not isinstance(layers, dict) or not layers:
        raise KVStorageError(f"{folder}: no layers listed")
    # A drafter's layers (EAGLE, draft model) may be stored after the target's.
    if "num_layers" in layout and meta.get("num_target_layers", len(layers)) != layout["num_layers"]:
        raise KVStorageError(f"{folder}: {len(layers)} layers stored, model has {layout['num_layers']}")
    if layer_names is not None and set(layer_names) - set(layers):
        raise KVStorageError(f"{folder}: layers {sorted(set(layer_names) - set(layers))[:3]} missing")


def read_layer_file(folder: str, layer_name: str, meta: dict[str, Any]) -> torch.Tensor:
    """The layer's stored KV ``[2, n, num_kv_heads * head_dim]``, checked against ``meta.json``:
    its size and CRC32, then its dtype and shape."""
    path = os.path.join(folder, f"{layer_name}.safetensors")
    info = meta["layers"][layer_name]   # listed: open() checked the layers before any read
    try:
        with open(path, "rb") as fh:
            data = fh.read()
    except OSError as e:
        raise KVStorageError(f"{path}: {e.strerror or e}") from None
    if len(data) != info.get("nbytes") or zlib.crc32(data) != info.get("crc32"):
        raise KVStorageError(f"{path}: size or checksum mismatch (corrupt or truncated)")
    try:
        t = st_load(data)[KEY]
    except Exception as e:  # safetensors raises its own error types
        raise KVStorageError(f"{path}: unreadable ({e})") from None
    shape = (2, meta["num_tokens"], meta["num_kv_heads"] * meta["head_dim"])
    if tuple(t.shape) != shape or str(t.dtype).removeprefix("torch.") != meta["dtype"]:
        raise KVStorageError(f"{path}: expected {KEY} {meta['dtype']} {list(shape)}, "
                             f"found {t.dtype} {list(t.shape)}")
    return t


class FolderWriter:
    """One folder being written: layer files go to a hidden temporary folder next to the final
    one (same file system, so the final ``os.rename`` is atomic); ``commit`` publishes it."""

    def __init__(self, root: str, name: str) -> None:
        os.makedirs(root, exist_ok=True)
        self.final = os.path.join(root, name)
        self.tmp = tempfile.mkdtemp(prefix=f".tmp-{name}-", dir=root)
        self.layers: dict[str, dict[str, int]] = {}

    def write_layer(self, layer_name: str, kv: torch.Tensor) -> None:
        """Write ``kv`` ``[2, n, num_kv_heads * head_dim]`` (on CPU), remembering size and CRC32."""
        data = st_save({KEY: kv.contiguous()})
        with open(os.path.join(self.tmp, f"{layer_name}.safetensors"), "wb") as fh:
            fh.write(data)
        self.layers[layer_name] = {"nbytes": len(data), "crc32": zlib.crc32(data)}

    def commit(self, meta: dict[str, Any], final_is_valid: Callable[[], bool]) -> str:
        """Write ``meta.json`` (plus the layer list) and publish; see ``commit_folder``."""
        try:
            with open(os.path.join(self.tmp, META_FILE), "w") as fh:
                json.dump({**meta, "layers": self.layers}, fh)
            return commit_folder(self.tmp, self.final, final_is_valid)
        finally:
            self.abort()

    def abort(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)


def commit_folder(tmp: str, final: str, final_is_valid: Callable[[], bool]) -> str:
    """Publish ``tmp`` as ``final`` with one rename: "committed". When a folder is already there,
    ``publish_over`` decides: "exists" (another producer won the race with a valid folder; ours is
    dropped) or "replaced" (an invalid folder was in the way). Raises ``OSError`` only if
    publishing failed altogether."""
    try:
        os.rename(tmp, final)   # atomic; fails when final is a non-empty folder
        return "committed"
    except OSError:
        if not os.path.exists(final):
            raise
    return publish_over(tmp, final, final_is_valid)


def publish_over(tmp: str, final: str, final_is_valid: Callable[[], bool]) -> str:
    """Publish ``tmp`` where ``final`` already exists. Returns "exists" (``final`` is valid, or a
    concurrent producer published first: ours is dropped) or "replaced" (an invalid folder was in
    the way; it is moved aside and deleted)."""
    if final_is_valid():
        shutil.rmtree(tmp, ignore_errors=True)
        return "exists"
    trash = f"{final}.old-{os.getpid()}-{os.urandom(4).hex()}"
    try:
        os.rename(final, trash)
    except OSError:             # someone else moved it first: fine, try to put ours there
        trash = None
    try:
        os.rename(tmp, final)
    except OSError:             # a concurrent producer published first
        shutil.rmtree(tmp, ignore_errors=True)
        return "exists"
    finally:
        if trash:
            shutil.rmtree(trash, ignore_errors=True)
    return "replaced"


# ------------------------------------------------------------------ the cheap header check

ST_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}


def read_safetensors_header(path: str) -> tuple[dict[str, Any], int]:
    """(header json, size the file must have) from the first bytes of a .safetensors file."""
    with open(path, "rb") as fh:
        raw = fh.read(8)
        if len(raw) != 8:
            raise KVStorageError(f"{path}: truncated header")
        (n,) = struct.unpack("<Q", raw)
        if n > 1 << 20:
            raise KVStorageError(f"{path}: header length {n} is not plausible")
        try:
            header = json.loads(fh.read(n))
            end = max(int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__")
        except (ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
            raise KVStorageError(f"{path}: unreadable header ({e})") from None
    return header, 8 + n + end


def check_header(folder: str, layer_name: str, meta: dict[str, Any]) -> None:
    """Header, shape, dtype and size of one layer file; raises ``KVStorageError``."""
    path = os.path.join(folder, f"{layer_name}.safetensors")
    info = meta["layers"][layer_name]
    try:
        size = os.path.getsize(path)
        header, want = read_safetensors_header(path)
    except OSError as e:
        raise KVStorageError(f"{path}: {e.strerror or e}") from None
    t = header.get(KEY)
    shape = [2, meta["num_tokens"], meta["num_kv_heads"] * meta["head_dim"]]
    if not isinstance(t, dict) or t.get("shape") != shape or t.get("dtype") != ST_DTYPES.get(meta["dtype"]):
        raise KVStorageError(f"{path}: expected {KEY} {meta['dtype']} {shape}, found {t}")
    if size != want or size != info.get("nbytes"):
        raise KVStorageError(f"{path}: {size} bytes, expected {info.get('nbytes')} (truncated?)")


# ------------------------------------------------------------------ the store

STATS = ("num_lookups", "num_lookup_hits", "num_matched_tokens", "num_invalid_folders",
         "num_loaded_tokens", "num_loaded_bytes", "load_time_s", "num_load_errors",
         "num_stored_tokens", "num_stored_bytes", "save_time_s", "num_folders_committed",
         "num_store_races_lost", "num_store_errors")
# The hf config fields that fix the KV cache's contents (names, paths and versions left out).
_ARCH_KEYS = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
              "num_attention_heads", "num_key_value_heads", "head_dim", "rope_theta", "rope_scaling",
              "rms_norm_eps", "max_position_embeddings", "tie_word_embeddings", "hidden_act")
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt", ".pth")


def align_to_block_size(num_tokens: int, block_size: int) -> int:
    """Largest multiple of ``block_size`` strictly below ``num_tokens`` (bs 16: 16 -> 0, 17 -> 16):
    the whole blocks before the last prompt token, whose logits give the first output token."""
    return max(num_tokens - 1, 0) // block_size * block_size


def layout_of(kv: torch.Tensor) -> dict[str, Any]:
    """KV layout of a paged cache ``[2, num_blocks, block_size, num_kv_heads, head_dim]``."""
    return {"num_kv_heads": kv.shape[3], "head_dim": kv.shape[4],
            "dtype": str(kv.dtype).removeprefix("torch.")}


def model_fingerprint(vllm_config: Any) -> str:
    """What two instances must share to exchange KV: architecture fields of the hf config, and a
    sample of the weight files (size + 64 KiB from the middle), so that two checkpoints with the
    same shapes but different weights do not match."""
    h = hashlib.sha256()
    cfg = vllm_config.hf_config
    if cfg is not None:
        d = cfg.to_dict() if hasattr(cfg, "to_dict") else dict(vars(cfg))
        h.update(json.dumps({k: d.get(k) for k in _ARCH_KEYS}, sort_keys=True, default=str).encode())
    path = vllm_config.model_path
    files = []
    if path and os.path.isdir(path):
        files = sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(_WEIGHT_SUFFIXES))
    elif path and os.path.isfile(path):
        files = [path]
    for f in files:
        size = os.path.getsize(f)
        with open(f, "rb") as fh:
            fh.seek(max(size // 2 - 32768, 0))
            h.update(f"{os.path.basename(f)}:{size}:".encode() + fh.read(65536))
    return h.hexdigest()[:32]


def expected_layout(vllm_config: Any) -> dict[str, Any]:
    """KV layout this instance will have, known to the scheduler before any cache exists."""
    out: dict[str, Any] = {}
    cfg = vllm_config.hf_config
    if cfg is not None:
        heads = getattr(cfg, "num_attention_heads", None)
        out["num_layers"] = getattr(cfg, "num_hidden_layers", None)
        out["num_kv_heads"] = getattr(cfg, "num_key_value_heads", None) or heads
        hidden = getattr(cfg, "hidden_size", None)
        out["head_dim"] = getattr(cfg, "head_dim", None) or (hidden // heads if hidden and heads else None)
    # "auto" as the worker resolves it: bfloat16 on CUDA, float32 elsewhere.
    out["dtype"] = resolve_auto_dtype(vllm_config.model_config.dtype, vllm_config.device)
    return {k: v for k, v in out.items() if v is not None}


class SharedStorage:
    """The folder ``root`` as the connector sees it: find a stored prefix, read a layer, stage and
    publish a new folder; ``stats`` counts it all (names in ``STATS``, for ``LLM.get_metrics()``).

    A bad folder (missing, truncated, corrupt, another model) is never an error: lookups skip it
    with a warning (``_invalid_folder``), and a store that fails is dropped with one
    (``_store_failed``)."""

    def __init__(self, root: str, vllm_config: Any) -> None:
        self.root = root
        self._vllm_config = vllm_config
        self._fingerprint: Optional[str] = None   # lazily: hf_config is loaded after construction
        self.stats: dict[str, Any] = dict.fromkeys(STATS, 0)
        self._writers: dict[str, Optional[FolderWriter]] = {}   # None: failed this step
        self._staged: list[tuple[str, str, str, torch.Tensor]] = []   # req_id, name, layer, rows

    def count(self, **deltas: Any) -> None:
        for key, value in deltas.items():
            self.stats[key] += value

    def fingerprint(self) -> str:
        if self._fingerprint is None:
            self._fingerprint = model_fingerprint(self._vllm_config)
        return self._fingerprint

    def folder(self, name: str) -> str:
        return os.path.join(self.root, name)

    # ------------------------------------------------------------------ scheduler side
    def is_stored(self, name: str, token_ids: list[int], verify_data: bool = False) -> bool:
        """Is a valid folder for exactly ``token_ids`` there? ``verify_data`` also checks each CRC32."""
        try:
            self._check(name, token_ids, verify_data)
            return True
        except KVStorageError:
            return False

    def _check(self, name: str, token_ids: list[int], verify_data: bool) -> None:
        """The whole folder of one prefix, raising ``KVStorageError`` at the first fault:
        ``meta.json`` against this model and prompt, then every layer file. With ``verify_data``
        every byte of it (size, CRC32, dtype and shape: ``read_layer_file``); without, only its
        header and size, which reads no data (``check_header``)."""
        meta = self.open(name, token_ids, expected_layout(self._vllm_config))
        for layer_name in meta["layers"]:
            if verify_data:
                self.read_layer(name, layer_name, meta)
            else:
                check_header(self.folder(name), layer_name, meta)

    def lookup(self, prompt: list[int], block_size: int, n_max: int, num_computed_tokens: int,
               verify_data: bool) -> tuple[int, str]:
        """Longest valid stored prefix ``(n, folder name)`` with ``num_computed_tokens < n <= n_max``
        (``n`` a multiple of ``block_size``), or ``(0, "")``; invalid folders are skipped."""
        self.stats["num_lookups"] += 1
        for n, name in reversed(prefix_hashes(prompt, block_size, n_max)):
            if n <= num_computed_tokens:
                break
            if not os.path.isdir(self.folder(name)):
                continue
            try:
                self._check(name, prompt[:n], verify_data)
            except KVStorageError as e:   # skipped with a warning: that prefix is recomputed
                self._invalid_folder(e)
                continue
            self.count(num_lookup_hits=1, num_matched_tokens=n - num_computed_tokens)
            return n, name
        return 0, ""

    # ------------------------------------------------------------------ worker side: loads
    def open(self, name: str, token_ids: list[int], layout: dict[str, Any],
             layer_names: Optional[list[str]] = None) -> dict[str, Any]:
        """The folder's ``meta.json``, checked against this model, the prompt prefix, ``layout``
        and (a load's) ``layer_names``; raises ``KVStorageError``. Then ``read_layer``."""
        folder = self.folder(name)
        meta = read_meta(folder)
        check_meta(meta, folder, token_ids, self.fingerprint(), layout, layer_names)
        return meta

    def read_layer(self, name: str, layer_name: str, meta: dict[str, Any]) -> torch.Tensor:
        """One layer's stored KV ``[2, n, num_kv_heads * head_dim]`` (CPU), checked against its CRC32."""
        return read_layer_file(self.folder(name), layer_name, meta)

    # ------------------------------------------------------------------ worker side: stores
    def start_store(self, req_id: str, name: str) -> bool:
        """Open (once per step) the temporary folder of prefix ``name``; False if it failed."""
        if name not in self._writers:
            try:
                self._writers[name] = FolderWriter(self.root, name)
            except OSError as e:
                self._store_failed(req_id, name, e)
        return self._writers[name] is not None

    def stage(self, req_id: str, name: str, layer_name: str, rows: torch.Tensor) -> None:
        """Keep one layer's rows ``[2, n, num_kv_heads * head_dim]`` (host memory, possibly still
        being copied there) until ``commit`` writes them."""
        self._staged.append((req_id, name, layer_name, rows))

    def has_staged(self) -> bool:
        return bool(self._staged)

    def drop_staged(self) -> None:
        """A step whose forward stopped half-way may have left rows behind."""
        self._staged = []

    def commit(self, stores: list[tuple[str, str, list[int]]],
               kv_caches: dict[str, torch.Tensor]) -> dict[str, str]:
        """Write the staged rows (one file per prefix and layer), then publish each store
        ``(req_id, name, token_ids)`` whose every layer in ``kv_caches`` was written, in one
        rename. Returns ``{req_id: "committed" | "replaced" | "exists" | "incomplete" | "failed"}``."""
        t0 = time.perf_counter()
        staged, self._staged = self._staged, []
        for req_id, name, layer_name, rows in staged:
            writer = self._writers.get(name)
            if writer is None:       # an earlier layer of this prefix failed to write
                continue
            try:
                writer.write_layer(layer_name, rows)
            except OSError as e:
                self._store_failed(req_id, name, e)
        self.stats["save_time_s"] += time.perf_counter() - t0
        results = {}
        for req_id, name, token_ids in stores:
            writer = self._writers.pop(name, None)
            if writer is not None:
                results[req_id] = self._publish(req_id, name, token_ids, writer, kv_caches)
        for writer in self._writers.values():
            if writer is not None:
                writer.abort()
        self._writers = {}
        self.last_commit = results     # for the connector's trace record
        return results

    def _publish(self, req_id: str, name: str, token_ids: list[int], writer: FolderWriter,
                 kv_caches: dict[str, torch.Tensor]) -> str:
        if set(writer.layers) != set(kv_caches):   # a forward that stopped half-way
            writer.abort()
            self.stats["num_store_errors"] += 1
            return "incomplete"
        meta = {"format": FORMAT_VERSION, "model_fingerprint": self.fingerprint(),
                "num_tokens": len(token_ids), "token_ids": token_ids,
                **layout_of(next(iter(kv_caches.values()))),
                "block_size": self._vllm_config.cache_config.block_size,
                "num_target_layers": expected_layout(self._vllm_config).get("num_layers", len(kv_caches))}
        t0 = time.perf_counter()
        try:
            outcome = writer.commit(meta, lambda: self.is_stored(name, token_ids))
        except OSError as e:
            self._store_failed(req_id, name, e)
            outcome = "failed"
        self.stats["save_time_s"] += time.perf_counter() - t0
        if outcome == "exists":        # another producer published the same prefix first
            self.stats["num_store_races_lost"] += 1
        elif outcome != "failed":      # "committed", or "replaced" an invalid folder
            self.count(num_folders_committed=1, num_stored_tokens=len(token_ids))
        return outcome

    # ------------------------------------------------------------------ faults
    def _invalid_folder(self, err: Exception) -> None:
        """The lookup skips a stored folder that fails its checks: that prefix is recomputed."""
        self.stats["num_invalid_folders"] += 1
        warn(f"SharedStorageConnector: ignoring stored KV ({err}); recomputing.")

    def _store_failed(self, req_id: str, name: str, err: Exception) -> None:
        """A folder that could not be created, written or published: it is dropped (its temporary
        folder removed), with a warning, and the step's other stores go on."""
        self.stats["num_store_errors"] += 1
        warn(f"SharedStorageConnector: storing {req_id} failed ({err}); not stored.")
        writer = self._writers.get(name)
        if writer is not None:
            writer.abort()
        self._writers[name] = None


# ------------------------------------------------------------------ host <-> device copies
# A copy from pageable host memory to a GPU, or from a GPU into a fresh CPU tensor (``.cpu()``),
# makes the host wait for everything queued on the GPU before it: a pipeline stall per call. vLLM
# stages such copies through pinned (page-locked) host buffers with ``non_blocking=True`` instead.
# On the CPU these are plain copies (or none at all), so the same code runs everywhere.

def copy_to_device(host: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """Host -> device. On CUDA through a pinned copy and an asynchronous transfer (the pinned block
    stays alive until the transfer is done: torch's caching host allocator tracks it)."""
    device = torch.device(device)
    if host.device == device:
        return host
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def copy_to_host(t: torch.Tensor) -> torch.Tensor:
    """Device -> host. On CUDA into a pinned buffer without waiting: read it only after
    ``wait_for_copies_to_host``. A host tensor is returned as it is."""
    if t.device.type != "cuda":
        return t
    buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    buf.copy_(t, non_blocking=True)
    return buf


def wait_for_copies_to_host(device: torch.device | str) -> None:
    """Block until the device -> host copies queued so far on the current stream are done: the one
    wait, after the forward pass, that makes ``copy_to_host`` buffers readable."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()
