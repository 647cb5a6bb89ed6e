"""The linear routes chosen on this machine, kept on disk, so that a later process times nothing.

``kernel_choice`` times every weight shape of a model at load, which costs seconds on a quiet
machine and tens of seconds on a busy one, in every process (each notebook kernel, server, test
and ``LLM()``), and two processes timed under different load could even run different routes.
The first process writes its choices here; every later one on the same machine reads them.

One JSON file per machine, ``{cache_dir}/linear-routes-{hash}.json``::

    {"format": 1, "machine": {...}, "choices": [[device, dtype, out, in, rows, route], ...]}

``machine`` is what a choice depends on besides the shape: the CPU (model name and ISA flags),
the torch version, the thread count and whether packed weights are allowed
(``MINIVLLM_LINEAR_PACK``); ``hash`` is its digest, so another CPU or torch version reads another
file (and a file whose ``machine`` differs is ignored). A file that cannot be read is warned about
and timed again, never a crash. ``MINIVLLM_ROUTE_CACHE=0`` turns the cache off;
``MINIVLLM_LINEAR_ROUTE`` pins a route whatever the cache says. Delete the file to time again.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import tempfile
from typing import Any, Optional

import torch

from minivllm.utils import cache_dir

logger = logging.getLogger("minivllm.kernel_choice")
FORMAT = 1


def enabled() -> bool:
    return os.environ.get("MINIVLLM_ROUTE_CACHE", "1").strip().lower() not in ("0", "false", "no")


def _cpu() -> dict[str, str]:
    """The CPU's model name and ISA flags (/proc/cpuinfo; elsewhere what ``platform`` says)."""
    model = flags = ""
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                key, _, value = (part.strip() for part in line.partition(":"))
                if key in ("model name", "Model", "CPU part") and not model:
                    model = value
                elif key in ("flags", "Features") and not flags:
                    flags = " ".join(sorted(value.split()))
    except OSError:
        pass
    return {"cpu": model or platform.processor() or platform.machine(), "flags": flags}


def machine(packing: bool) -> dict[str, Any]:
    return {**_cpu(), "torch": torch.__version__, "threads": torch.get_num_threads(),
            "packing": packing}


def path_for(key: dict[str, Any]) -> str:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return os.path.join(cache_dir(), f"linear-routes-{digest}.json")


def load(key: dict[str, Any], routes: Any) -> dict[tuple, str]:
    """The choices stored for ``key`` (ShapeKey -> route), those naming a route in ``routes``;
    ``{}`` when there is no file, it is for another machine, or it cannot be read."""
    path = path_for(key)
    try:
        with open(path) as fh:
            data = json.load(fh)
        if data.get("format") != FORMAT or data.get("machine") != key:
            return {}
        return {(d, t, int(o), int(i), int(m)): r for d, t, o, i, m, r in data["choices"]
                if r in routes}
    except FileNotFoundError:
        return {}
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as e:
        logger.warning("ignoring the linear route cache %s (%s); timing the routes again", path, e)
        return {}


def save(key: dict[str, Any], chosen: dict[tuple, str]) -> Optional[str]:
    """Write ``chosen`` for ``key`` atomically (a reader sees the old file or the new one);
    returns the path, or ``None`` if it could not be written (a warning, never an error)."""
    path = path_for(key)
    data = {"format": FORMAT, "machine": key,
            "choices": [[*k, r] for k, r in sorted(chosen.items())]}
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".linear-routes-", dir=os.path.dirname(path))
        with os.fdopen(fd, "w") as fh:
            json.dump(data, fh)
        os.replace(tmp, path)
        return path
    except OSError as e:
        logger.warning("could not write the linear route cache %s (%s)", path, e)
        return None
