"""``KVEventsConfig``: whether an engine publishes its prefix cache's changes (the blocks stored and
removed) for a router to read, and where; mirrors vllm/config/kv_events.py, its fields and
defaults. Past the article: the KV-aware routing of a fleet of engines
(``distributed/kv_events.py`` holds the events and the publisher)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union


@dataclass
class KVEventsConfig:
    """vLLM 0.32's ``KVEventsConfig``. Off by default (``enable_kv_cache_events=False``)."""
    enable_kv_cache_events: bool = False
    publisher: Optional[str] = None     # "null" | "zmq"; None: "zmq" when enabled
    endpoint: str = "tcp://*:5557"      # PUB: bind (``*``, ipc://, inproc://) or connect
    replay_endpoint: Optional[str] = None    # ROUTER for replays; None: no replay
    buffer_steps: int = 10_000          # batches kept for a replay
    hwm: int = 100_000                  # ZMQ high-water mark: beyond it, batches are dropped
    max_queue_size: int = 100_000       # batches waiting for the publisher's thread
    topic: str = ""

    def __post_init__(self) -> None:
        if self.publisher is None:
            self.publisher = "zmq" if self.enable_kv_cache_events else "null"
        if self.publisher not in ("null", "zmq"):
            raise ValueError(f"kv_events_config.publisher must be 'null' or 'zmq', "
                             f"got {self.publisher!r}.")

    @classmethod
    def from_any(cls, config: Union[None, dict, "KVEventsConfig"]) -> Optional["KVEventsConfig"]:
        if config is None or isinstance(config, cls):
            return config
        if not isinstance(config, dict):
            raise TypeError(f"kv_events_config must be a dict or KVEventsConfig, got {config!r}.")
        unknown = set(config) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"kv_events_config: unknown field(s) {sorted(unknown)}.")
        return cls(**config)
