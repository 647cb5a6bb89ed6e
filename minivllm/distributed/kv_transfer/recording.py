"""What a recording engine's ``"connector"`` trace events say about each call of a connector
method marked ``@recorded`` (base.py): the call's arguments and result, what the connector decided
(the folder a lookup found), and the bytes it moved (its storage counters' growth during the call).
minivllm's step records of the article's P/D steps (trace.py), not a vLLM file.

Fields per event: ``role``, ``method``, ``req_id`` (or None), ``args``, ``result``, ``bytes``
(trace.py)."""
from __future__ import annotations

import inspect
from typing import Any, Callable


def _lookup(c: Any, a: dict[str, Any], result: Any) -> dict[str, Any]:
    request = a["request"]
    n, name = c._lookups.get(request.request_id, (0, ""))
    return {"req_id": request.request_id, "result": result,
            "args": {"num_computed_tokens": a["num_computed_tokens"],
                     "num_prompt_tokens": len(request.prompt_token_ids), "folder": name or None,
                     "num_stored_tokens": n}}


def _update_state(c: Any, a: dict[str, Any], result: Any) -> dict[str, Any]:
    blocks, n = a["blocks"], a["num_external_tokens"]
    return {"req_id": a["request"].request_id, "result": "load" if n > 0 else None,
            "args": {"block_ids": blocks.get_block_ids()[0] if blocks is not None else None,
                     "num_external_tokens": n}}


def _start_load(c: Any, a: dict[str, Any], result: Any) -> dict[str, Any]:
    if c._connector_metadata is None or not c._kv_caches:
        return {"result": "nothing to load"}
    return {"args": {"layerwise": c._layerwise, "req_ids": [r.req_id for r, _ in c._loads]}}


def _bind(c: Any, a: dict[str, Any], result: Any) -> dict[str, Any]:
    describe = getattr(a["connector_metadata"], "describe", None)
    return {"args": describe() if describe else None}


DESCRIBE: dict[str, Callable[[Any, dict[str, Any], Any], dict[str, Any]]] = {
    "get_num_new_matched_tokens": _lookup,
    "update_state_after_alloc": _update_state,
    "build_connector_meta": lambda c, a, r: {"result": r.describe()},
    "request_finished": lambda c, a, r: {"req_id": a["request"].request_id, "result": r,
                                         "args": {"block_ids": list(a["block_ids"])}},
    "bind_connector_metadata": _bind,
    "clear_connector_metadata": lambda c, a, r: {},
    "register_kv_caches": lambda c, a, r: {"args": {name: list(t.shape)
                                                    for name, t in a["kv_caches"].items()}},
    "start_load_kv": _start_load,
    "wait_for_layer_load": lambda c, a, r: {"args": {"layer_name": a["layer_name"]}},
    "save_kv_layer": lambda c, a, r: {"args": {"layer_name": a["layer_name"]}},
    "wait_for_save": lambda c, a, r: {"result": c._storage.last_commit},
    "get_finished": lambda c, a, r: {"args": {"finished_req_ids": sorted(a["finished_req_ids"])},
                                     "result": r},
    "get_block_ids_with_load_errors": lambda c, a, r: {"result": sorted(r)},
}
# The storage counters whose growth during a call is that call's ``bytes``.
BYTES = {"start_load_kv": "num_loaded_bytes", "wait_for_layer_load": "num_loaded_bytes",
         "save_kv_layer": "num_stored_bytes"}


def record_call(method: Callable[..., Any], connector: Any, args: tuple, kwargs: dict) -> Any:
    """Call ``method`` and add its ``"connector"`` event to the step being recorded."""
    counter = BYTES.get(method.__name__)
    before = connector.get_stats().get(counter, 0) if counter else 0
    result = method(connector, *args, **kwargs)
    bound = inspect.signature(method).bind(connector, *args, **kwargs)
    bound.apply_defaults()
    event = DESCRIBE[method.__name__](connector, bound.arguments, result)
    if counter:
        event["bytes"] = connector.get_stats().get(counter, 0) - before
    connector._record(method.__name__, **event)
    return result
