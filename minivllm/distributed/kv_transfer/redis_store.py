"""The KV layout of ``RedisStoreConnector`` in Redis: content-addressed chunks, as LMCache and
MooncakeStore key them.

A prompt prefix of ``n`` tokens (``n`` a multiple of the block size, below the last prompt token)
is cut into chunks of ``chunk_size`` tokens (the last one may be shorter, still whole blocks). Chunk
``i`` has the chained hash ``h_i = sha256(h_{i-1} || token_ids of chunk i as int32 LE)``, so a key
names the whole prefix up to that chunk, and equal prefixes share keys across processes and
machines (hashlib, never Python's seeded ``hash()``). Keys, with ``fp`` the model fingerprint::

    mv:{fp}:{h_i}:meta                 JSON commit marker, written last (SET NX: first writer wins)
    mv:{fp}:{h_i}:{nonce}:{layer}      raw bytes of [2, t, num_kv_heads * head_dim] (0 = K, 1 = V)

``fp`` hashes the model (architecture + weight sample), dtype, layer count, KV heads, head dim and
block size. Every writer puts its values under its own random ``nonce`` and then tries to create
the meta value naming that nonce; a loser deletes its values. A reader trusts values only through
the meta: the nonce, shape, dtype, token count and CRC32 of every layer must match, so evicted,
truncated, corrupt or foreign values are a miss, never loaded, and a read is never torn.
"""
from __future__ import annotations

import hashlib
import json
import os
import struct
import zlib
from dataclasses import dataclass
from typing import Any, Optional

import torch

FORMAT_VERSION = 1
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Delete a stale meta value only if it is still the one we read (another writer may have replaced it).
_DEL_IF_EQUAL = "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0"


def connect(url: str, timeout_s: float, password: Optional[str] = None) -> Any:
    """A redis-py client with bounded waits and no silent retries (a failure shows at once).
    ``password``: for a URL without one (a password in the URL wins, as in redis-py)."""
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry
    extra = {"password": password} if password else {}
    return redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                                retry=Retry(NoBackoff(), 0), **extra)


def redacted(url: str) -> str:
    """``url`` fit for a log line or an error: its password (and ``?password=``) as ``***``."""
    import urllib.parse
    parts = urllib.parse.urlsplit(url)
    netloc = parts.netloc
    if parts.password is not None:
        user = parts.username or ""
        netloc = f"{user}:***@" + netloc.rsplit("@", 1)[1]
    query = "&".join("password=***" if q.split("=", 1)[0] == "password" else q
                     for q in parts.query.split("&")) if parts.query else ""
    return f"{parts.scheme}://{netloc}{parts.path}" + (f"?{query}" if query else "")


def redis_errors() -> tuple[type[BaseException], ...]:
    """What a failing or unreachable server raises (redis-py is imported only when it is used)."""
    import redis
    return (redis.RedisError, OSError)


class KVStoreError(Exception):
    """A chunk is missing, evicted, truncated, corrupt or from another model/dtype."""


@dataclass(frozen=True)
class Chunk:
    """Token positions ``[start, end)`` of a prompt; ``hash``: the chained sha256 (hex) up to ``end``."""
    start: int
    end: int
    hash: str


def chunk_prefix(token_ids: list[int], num_tokens: int, chunk_size: int) -> list[Chunk]:
    """Chunks covering ``token_ids[:num_tokens]``: ``chunk_size`` tokens each, the last one shorter.

    Example: 600 tokens, chunk 256 -> [0, 256), [256, 512), [512, 600)."""
    chunks, prev = [], b""
    for start in range(0, num_tokens, chunk_size):
        end = min(start + chunk_size, num_tokens)
        ids = token_ids[start:end]
        digest = hashlib.sha256(prev + struct.pack(f"<{len(ids)}i", *ids)).digest()
        chunks.append(Chunk(start, end, digest.hex()))
        prev = digest
    return chunks


def store_fingerprint(model_fp: str, layout: dict[str, Any], block_size: int) -> str:
    """16 hex digits naming everything two instances must share to exchange KV values."""
    desc = json.dumps({"model": model_fp, "block_size": block_size, **layout}, sort_keys=True)
    return hashlib.sha256(desc.encode()).hexdigest()[:16]


def meta_key(fp: str, chunk: Chunk) -> str:
    return f"mv:{fp}:{chunk.hash}:meta"


def value_key(fp: str, chunk: Chunk, nonce: str, layer: int) -> str:
    return f"mv:{fp}:{chunk.hash}:{nonce}:{layer}"


def parse_meta(raw: Optional[bytes], fp: str, chunk: Chunk, layout: dict[str, Any]) -> dict[str, Any]:
    """The meta value of ``chunk`` if it describes exactly the values this instance would load."""
    if raw is None:
        raise KVStoreError(f"chunk {chunk.hash[:12]} [{chunk.start}, {chunk.end}) not stored")
    try:
        meta = json.loads(raw)
        t = chunk.end - chunk.start
        hd = layout["num_kv_heads"] * layout["head_dim"]
        ok = (meta["format"] == FORMAT_VERSION and meta["fingerprint"] == fp
              and meta["dtype"] == layout["dtype"] and meta["shape"] == [2, t, hd]
              and meta["num_tokens"] == t and meta["start"] == chunk.start
              and len(meta["crc32"]) == meta["num_layers"] == layout["num_layers"]
              and isinstance(meta["nonce"], str))
    except (ValueError, KeyError, TypeError) as e:
        raise KVStoreError(f"chunk {chunk.hash[:12]}: unreadable meta value ({e})") from None
    if not ok:
        raise KVStoreError(f"chunk {chunk.hash[:12]}: meta value is for another model, dtype or shape")
    return meta


def count_committed(client: Any, fp: str, chunks: list[Chunk], layout: dict[str, Any]) -> int:
    """How many chunks, from the first, have a valid meta value (one MGET round trip)."""
    if not chunks:
        return 0
    raws = client.mget([meta_key(fp, c) for c in chunks])
    for i, (raw, chunk) in enumerate(zip(raws, chunks)):
        try:
            parse_meta(raw, fp, chunk, layout)
        except KVStoreError:
            return i
    return len(chunks)


def put_chunk(client: Any, fp: str, chunk: Chunk, layers: list[torch.Tensor]) -> bool:
    """Write one chunk: every layer's ``[2, t, H * D]`` rows, then the meta value (commit).

    Returns False when another writer committed the chunk first (ours is deleted again)."""
    nonce = os.urandom(8).hex()
    blobs = [t.contiguous().view(torch.uint8).numpy().tobytes() for t in layers]
    pipe = client.pipeline(transaction=False)
    for i, blob in enumerate(blobs):
        pipe.set(value_key(fp, chunk, nonce, i), blob)
    pipe.execute()
    first = layers[0]
    meta = {"format": FORMAT_VERSION, "fingerprint": fp, "nonce": nonce, "start": chunk.start,
            "num_tokens": chunk.end - chunk.start, "shape": list(first.shape),
            "dtype": str(first.dtype).removeprefix("torch."), "num_layers": len(layers),
            "crc32": [zlib.crc32(b) for b in blobs]}
    if client.set(meta_key(fp, chunk), json.dumps(meta), nx=True):
        return True
    client.delete(*[value_key(fp, chunk, nonce, i) for i in range(len(blobs))])
    return False


def get_chunk(client: Any, fp: str, chunk: Chunk, layout: dict[str, Any]) -> list[torch.Tensor]:
    """Read one chunk: ``num_layers`` tensors ``[2, t, H * D]``, each checked against the meta.

    A chunk whose values are gone (evicted) or damaged is a ``KVStoreError``; its meta value is
    removed so that the next producer stores the chunk again."""
    raw_meta = client.get(meta_key(fp, chunk))
    meta = parse_meta(raw_meta, fp, chunk, layout)
    n = meta["num_layers"]
    blobs = client.mget([value_key(fp, chunk, meta["nonce"], i) for i in range(n)])
    dtype = _DTYPES[meta["dtype"]]
    nbytes = meta["shape"][0] * meta["shape"][1] * meta["shape"][2] * torch.empty(0, dtype=dtype).element_size()
    out = []
    for i, blob in enumerate(blobs):
        if blob is None or len(blob) != nbytes or zlib.crc32(blob) != meta["crc32"][i]:
            what = "missing (evicted?)" if blob is None else (
                f"{len(blob)} bytes, expected {nbytes}" if len(blob) != nbytes else "checksum mismatch")
            client.eval(_DEL_IF_EQUAL, 1, meta_key(fp, chunk), raw_meta)
            raise KVStoreError(f"chunk {chunk.hash[:12]} layer {i}: value {what}")
        out.append(torch.frombuffer(bytearray(blob), dtype=torch.uint8).view(dtype).view(meta["shape"]))
    return out
