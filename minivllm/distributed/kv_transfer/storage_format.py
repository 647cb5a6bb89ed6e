"""The on-disk format behind ``storage.SharedStorage`` (vLLM 0.32's ExampleConnector writes it
inline in vllm/distributed/kv_transfer/kv_connector/v1/example_connector.py, with
``safetensors.torch.save_file`` per layer; here it is hardened: checked metadata, checksums, atomic
folders).

One folder per stored prompt prefix of ``n`` tokens (``n`` a multiple of the block size)::

    {shared_storage_path}/{md5(token_ids[:n] as little-endian int64)}/
        {layer_name}.safetensors   one key "kv_cache": [2, n, num_kv_heads * head_dim] (0 = K, 1 = V;
                                   vLLM 0.32 stores [n, num_kv_heads, K||V] under the same key)
        meta.json                  model fingerprint, token ids, dtype, KV shape, per-file size + CRC32

The layout does not depend on the block size: any instance whose block size divides ``n`` can
load it. A folder appears in one ``os.rename`` of a finished temporary folder, so a reader sees a
whole folder or none.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import tempfile
import zlib
from typing import Any, Callable, Optional

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

FORMAT_VERSION = 1
META_FILE = "meta.json"
KEY = "kv_cache"
_META_SCHEMA = {"model_fingerprint": str, "num_tokens": int, "token_ids": list, "num_kv_heads": int,
                "head_dim": int, "dtype": str, "layers": dict}


class KVStorageError(Exception):
    """A stored folder or layer file is missing, truncated, corrupt or from another model."""


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
        if os.sep in name or name.startswith(".") or not isinstance(info, dict) or not all(
                isinstance(info.get(k), int) for k in ("nbytes", "crc32")):
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
    ``storage_race.publish_over`` decides: "exists" (another producer won the race with a valid
    folder; ours is dropped) or "replaced" (an invalid folder was in the way). Raises ``OSError``
    only if publishing failed altogether."""
    try:
        os.rename(tmp, final)   # atomic; fails when final is a non-empty folder
        return "committed"
    except OSError:
        if not os.path.exists(final):
            raise
    from minivllm.distributed.kv_transfer.storage_race import publish_over
    return publish_over(tmp, final, final_is_valid)
