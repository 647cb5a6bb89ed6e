"""KV cache events: what an engine's prefix cache gained and lost, for a router to read; mirrors
vllm/distributed/kv_events.py (the events, the batch, the ZMQ publisher with its replay socket),
under the same names and on the same wire. Their configuration, ``KVEventsConfig``, is in
config/kv_events.py.

- ``BlockStored``: full blocks entered into the prefix cache, in order: their ``block_hashes`` (the
  very hashes the prefix cache keys them by, core/kv_cache_utils.py), the ``parent_block_hash`` of
  the first (None at the start of a prompt), their ``token_ids`` (``block_size`` per block).
- ``BlockRemoved``: hashes that left the cache (a freed block handed out again: an eviction).
- ``AllBlocksCleared``: ``reset_prefix_cache``.
- ``KVEventBatch``: one engine step's events, with its time. msgspec's msgpack, the batch as an
  array ``[ts, events, data_parallel_rank]``, each event a map tagged by its class name: exactly
  what vLLM 0.32 sends, so a consumer written for vLLM (Ray Serve LLM's ``KVAwareRouter``, llm-d,
  Dynamo) decodes ours.
- ``ZmqEventPublisher``: a PUB socket sends ``(topic, seq as 8 big-endian bytes, payload)``; a
  ROUTER socket (``replay_endpoint``) answers a subscriber that missed batches: it sends the
  starting seq, gets every buffered batch from there, then an end marker (seq -1).

Off by default (``enable_kv_cache_events=False``); ``LLM(kv_events_config={...})`` turns it on
(core/kv_events_block_pool.py: the pool that reports, chosen at construction). No article step:
the KV-aware routing of a fleet of engines (disagg/fleet/), past the article.
"""
from __future__ import annotations

import queue
import threading
from collections import deque
from itertools import count
from typing import Any, Optional, Union

import msgspec
import zmq

from minivllm.config import KVEventsConfig

MEDIUM_GPU = "GPU"      # vLLM's name for the engine's own KV cache (the device's memory)
END_SEQ = (-1).to_bytes(8, "big", signed=True)     # the replay's last frame


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: Optional[int] = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base of the events: tagged, so each is encoded with its class name."""


class BlockStored(KVCacheEvent):
    """Blocks ``block_hashes`` (a chain: each the parent of the next) entered the prefix cache.
    ``token_ids``: ``len(block_hashes) * block_size`` tokens. vLLM's LoRA and medium fields are
    kept (None / "GPU") so that its decoder finds every field it requires."""
    block_hashes: list[Union[bytes, int]]
    parent_block_hash: Optional[Union[bytes, int]]
    token_ids: list[int]
    block_size: int
    lora_id: Optional[int]
    medium: Optional[str]
    lora_name: Optional[str]


class BlockRemoved(KVCacheEvent):
    block_hashes: list[Union[bytes, int]]
    medium: Optional[str]


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[Union[BlockStored, BlockRemoved, AllBlocksCleared]]


def decoder() -> msgspec.msgpack.Decoder:
    """A decoder for one payload: ``decoder().decode(payload)`` is a ``KVEventBatch``."""
    return msgspec.msgpack.Decoder(type=KVEventBatch)


class NullEventPublisher:
    """Events off: publishes nothing."""

    def publish(self, batch: EventBatch) -> None:
        return

    def shutdown(self) -> None:
        return


class ZmqEventPublisher:
    """vLLM's ``ZmqEventPublisher``: ``publish`` queues a batch; a thread numbers it, sends it on
    the PUB socket and keeps it (``buffer_steps``) for the ROUTER socket's replays. ``endpoint``
    and ``replay_endpoint`` may end in port 0 (bind a free port): ``self.endpoint`` and
    ``self.replay_endpoint`` are the bound ones."""

    SHUTDOWN_TIMEOUT_S = 1.0

    def __init__(self, endpoint: str = "tcp://*:5557", replay_endpoint: Optional[str] = None,
                 buffer_steps: int = 10_000, hwm: int = 100_000, max_queue_size: int = 100_000,
                 topic: str = "") -> None:
        self._queue: queue.Queue = queue.Queue(maxsize=max_queue_size)
        self._buffer: deque = deque(maxlen=buffer_steps)
        self._ctx = zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(hwm)
        if _binds(endpoint):
            self.endpoint = _bind(self._pub, endpoint)
        else:
            self._pub.connect(endpoint)
            self.endpoint = endpoint
        self._replay, self.replay_endpoint = None, None
        if replay_endpoint is not None:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self.replay_endpoint = _bind(self._replay, replay_endpoint)
        self._topic = topic.encode()
        self._seq = count()
        self._running = True
        self._thread = threading.Thread(target=self._run, name="kv-events-publisher", daemon=True)
        self._thread.start()

    def publish(self, batch: EventBatch) -> None:
        if not self._running:
            raise RuntimeError("the KV events publisher is shut down")
        self._queue.put(batch)

    def shutdown(self) -> None:
        """Send what is queued (at most ``SHUTDOWN_TIMEOUT_S``), then close the sockets."""
        self._running = False
        self._queue.put(None)
        self._thread.join(timeout=self.SHUTDOWN_TIMEOUT_S)
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)

    def _run(self) -> None:
        encoder = msgspec.msgpack.Encoder()
        while True:
            if self._replay is not None and self._replay.poll(0):
                self._serve_replay()
            try:
                batch = self._queue.get(timeout=0.1)
            except queue.Empty:
                if not self._running:
                    return
                continue
            if batch is None:
                return
            seq, payload = next(self._seq), encoder.encode(batch)
            self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
            self._buffer.append((seq, payload))

    def _serve_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3:            # (client id, empty, start seq): anything else is ignored
            return
        client, _, start = frames
        start_seq = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= start_seq:
                self._replay.send_multipart((client, b"", self._topic, seq.to_bytes(8, "big"),
                                             payload))
        self._replay.send_multipart((client, b"", b"", END_SEQ, b""))


def _binds(endpoint: str) -> bool:
    """vLLM's rule: bind a wildcard, ipc:// or inproc:// endpoint; connect to any other. And a
    port of 0 (a free one, which only a bind can pick)."""
    return ("*" in endpoint or "::" in endpoint or endpoint.endswith(":0")
            or endpoint.startswith(("ipc://", "inproc://")))


def _bind(sock: Any, endpoint: str) -> str:
    """Bind; a port of 0 binds a free one. Returns the endpoint bound."""
    if endpoint.startswith("tcp://") and endpoint.endswith(":0"):
        host = endpoint[len("tcp://"):-2]
        port = sock.bind_to_random_port(f"tcp://{host}")
        return f"tcp://{host}:{port}"
    sock.bind(endpoint)
    return endpoint


def make_publisher(config: Optional[KVEventsConfig]) -> Any:
    """vLLM's ``EventPublisherFactory.create``: the null publisher unless events are on."""
    if config is None or not config.enable_kv_cache_events or config.publisher == "null":
        return NullEventPublisher()
    return ZmqEventPublisher(endpoint=config.endpoint, replay_endpoint=config.replay_endpoint,
                             buffer_steps=config.buffer_steps, hwm=config.hwm,
                             max_queue_size=config.max_queue_size, topic=config.topic)


class KVEventSubscriber:
    """A consumer of one publisher: SUB on ``endpoint``; on a gap in the sequence numbers, asks the
    ``replay_endpoint`` (when there is one) for what it missed. ``poll(timeout_s)`` returns the
    batches received, in sequence order, as ``[(seq, KVEventBatch)]``."""

    def __init__(self, endpoint: str, replay_endpoint: Optional[str] = None,
                 topic: str = "") -> None:
        self._ctx = zmq.Context.instance()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.connect(endpoint)
        self._sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self._replay_endpoint = replay_endpoint
        self._decode = decoder()
        self.next_seq = 0             # the first seq not yet seen
        self.missed = 0               # batches lost for good (no replay, or aged out of it)

    def catch_up(self) -> list:
        """Everything the publisher still buffers from ``next_seq`` on (a subscriber that joins
        late: what was sent before it connected never reached it)."""
        got = self._replay(self.next_seq, None)
        if got:
            self.next_seq = got[-1][0] + 1
        return got

    def poll(self, timeout_s: float = 0.0) -> list:
        out = []
        while self._sub.poll(int(timeout_s * 1000)):
            _, seq_bytes, payload = self._sub.recv_multipart()
            seq = int.from_bytes(seq_bytes, "big")
            if seq > self.next_seq:
                out += self._replay(self.next_seq, seq)
            if seq >= self.next_seq:
                out.append((seq, self._decode.decode(payload)))
                self.next_seq = seq + 1
            timeout_s = 0.0
        return out

    def _replay(self, start: int, stop: Optional[int]) -> list:
        """Batches ``start .. stop - 1`` (None: to the last) from the replay socket (what was
        buffered of them)."""
        got = []
        if self._replay_endpoint is not None:
            # DEALER, not REQ: one request, many replies (the ROUTER streams every batch).
            dealer = self._ctx.socket(zmq.DEALER)
            dealer.connect(self._replay_endpoint)
            try:
                dealer.send_multipart((b"", start.to_bytes(8, "big")))
                while dealer.poll(2000):
                    _, _, seq_bytes, payload = dealer.recv_multipart()
                    if seq_bytes == END_SEQ:
                        break
                    seq = int.from_bytes(seq_bytes, "big")
                    if start <= seq and (stop is None or seq < stop):
                        got.append((seq, self._decode.decode(payload)))
            finally:
                dealer.close(linger=0)
        if stop is not None:
            self.missed += (stop - start) - len(got)
        return got

    def close(self) -> None:
        self._sub.close(linger=0)

