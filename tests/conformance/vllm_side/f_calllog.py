"""Case f: a call log for KV connectors, shared by both engines (plain Python, no engine imports).

``make_logging_class(Base)`` returns a subclass of a connector class whose every public instance
method (the whole API surface the engine may call, not a chosen list) appends one JSON line per
outermost call to the file named by ``$MINIVLLM_CONF_CALLLOG``: process id, role, method, and the
*shapes* of its arguments and result (tensor shapes, container lengths, request token counts),
never the values. Child processes inherit the variable, so vLLM's EngineCore (scheduler role)
and worker (worker role) write to the same file. ``__init__`` also logs the function names on the
call stack, which show where each role's connector is created.
"""
from __future__ import annotations

import functools
import inspect
import json
import os
import threading

_local = threading.local()


def shape_of(x, depth: int = 0):
    """A JSON-able description of ``x``'s shape."""
    try:
        return _shape_of(x, depth)
    except Exception:    # noqa: BLE001  (a log must never break the engine it watches)
        return type(x).__name__


def _shape_of(x, depth: int):
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        return {"tensor": list(x.shape)}
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    if depth > 1:
        return type(x).__name__
    if hasattr(x, "request_id") and hasattr(x, "num_tokens"):
        return {"request": {"num_tokens": x.num_tokens, "num_prompt_tokens": x.num_prompt_tokens}}
    if hasattr(x, "get_block_ids") and hasattr(x, "blocks"):    # KVCacheBlocks
        return {"blocks": [len(g) for g in x.get_block_ids()]}
    if hasattr(x, "num_scheduled_tokens") and hasattr(x, "finished_req_ids"):   # SchedulerOutput
        return {"scheduler_output": {"num_scheduled_tokens": sorted(x.num_scheduled_tokens.values()),
                                     "finished_req_ids": len(x.finished_req_ids)}}
    if hasattr(x, "requests") and isinstance(getattr(x, "requests"), list):     # connector metadata
        return {type(x).__name__: {"requests": len(x.requests)}}
    if isinstance(x, dict):
        first = next(iter(x.values()), None)
        return {"dict": len(x), "value": shape_of(first, depth + 1)}
    if isinstance(x, (set, frozenset)):
        return {"set": len(x)}
    if isinstance(x, (list, tuple)):
        if len(x) <= 3:
            return [shape_of(v, depth + 1) for v in x]
        return {"list": len(x)}
    return type(x).__name__


def _write(entry: dict) -> None:
    path = os.environ.get("MINIVLLM_CONF_CALLLOG")
    if not path:
        return
    with open(path, "a") as f:
        f.write(json.dumps(entry) + "\n")


def _role(obj) -> str:
    role = getattr(obj, "_role", None)
    return getattr(role, "name", str(role))


def _logged(name: str, fn):
    @functools.wraps(fn)
    def wrapper(self, *args, **kwargs):
        depth = getattr(_local, "depth", 0)
        _local.depth = depth + 1
        try:
            result = fn(self, *args, **kwargs)
        finally:
            _local.depth = depth
        if depth == 0:      # calls the connector makes on itself are not the engine's calls
            _write({"pid": os.getpid(), "role": _role(self), "method": name,
                    "args": [shape_of(a) for a in args],
                    "kwargs": {k: shape_of(v) for k, v in sorted(kwargs.items())},
                    "result": shape_of(result)})
        return result
    return wrapper


def make_logging_class(base: type) -> type:
    ns = {}
    for klass in base.__mro__:
        for key, value in vars(klass).items():
            if key.startswith("_") or key in ns or not inspect.isfunction(value):
                continue   # skips properties, classmethods and staticmethods
            ns[key] = _logged(key, getattr(base, key))

    def __init__(self, *args, **kwargs):
        base.__init__(self, *args, **kwargs)
        _write({"pid": os.getpid(), "role": _role(self), "method": "__init__",
                "args": [shape_of(a) for a in args[2:]],
                "stack": [f.function for f in inspect.stack()[1:40]]})

    ns["__init__"] = __init__
    return type("Logging" + base.__name__, (base,), ns)


def read_log(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]
