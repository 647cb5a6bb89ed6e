"""What ``SharedStorage`` (storage.py) and its connector do when stored KV fails them: a folder
the lookup must skip (missing files, truncated, corrupt, another model), a store that cannot be
written, a load that fails after the lookup counted it. Each is a fault the engine survives:
logged, raised as a ``RuntimeWarning`` (tests and notebooks see it) and counted in the storage's
stats; a failed load also reports its blocks, which the scheduler recomputes.

Loaded only on a fault: the article's examples, whose folders are whole and whose disk is
writable, never read this file.
"""
from __future__ import annotations

import logging
import warnings
from typing import Any

# The storage's logger: its warnings keep the name they always had.
logger = logging.getLogger("minivllm.distributed.kv_transfer.storage")


def warn(msg: str) -> None:
    """Logged, and a ``RuntimeWarning`` pointing at the method that met the fault."""
    logger.warning(msg)
    warnings.warn(msg, RuntimeWarning, stacklevel=4)


def invalid_folder(storage: Any, err: Exception) -> None:
    """The lookup skips a stored folder that fails its checks: that prefix is recomputed."""
    storage.stats["num_invalid_folders"] += 1
    warn(f"SharedStorageConnector: ignoring stored KV ({err}); recomputing.")


def store_failed(storage: Any, req_id: str, name: str, err: Exception) -> None:
    """A folder that could not be created, written or published: it is dropped (its temporary
    folder removed) and the step's other stores go on."""
    storage.stats["num_store_errors"] += 1
    warn(f"SharedStorageConnector: storing {req_id} failed ({err}); not stored.")
    writer = storage._writers.get(name)
    if writer is not None:
        writer.abort()
    storage._writers[name] = None


def load_failed(connector: Any, req: Any, err: Exception) -> None:
    """A load that failed after the lookup counted it (a file changed since): its blocks are
    reported by ``get_block_ids_with_load_errors()`` and recomputed."""
    connector._storage.count(num_load_errors=1)
    connector._invalid_block_ids.update(req.block_ids)
    warn(f"SharedStorageConnector: loading {req.req_id} failed ({err}); "
         f"blocks {req.block_ids} will be recomputed.")
