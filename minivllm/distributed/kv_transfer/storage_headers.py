"""The cheap check of a stored layer file (format: storage_format.py): its safetensors header and
its size against ``meta.json``, without reading the data. It serves the lookup with
``verify_on_lookup=False`` (the CRC32 is then checked when the file loads) and a producer's
"is this prefix stored already?" (``SharedStorage.is_stored``). The default lookup reads every
byte instead (``storage_format.read_layer_file``), so the article's examples never load this file.
"""
from __future__ import annotations

import json
import os
import struct
from typing import Any

from minivllm.distributed.kv_transfer.storage_format import KEY, KVStorageError

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
