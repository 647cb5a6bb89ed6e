"""Small helpers shared across the package (vLLM: vllm/utils/)."""
from __future__ import annotations

import importlib
import os
from typing import Any


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for integers (vLLM's ``cdiv``): e.g. the blocks that hold ``a`` tokens."""
    return -(a // -b)


def resolve_obj_by_qualname(qualname: str) -> Any:
    """``"package.module.Name"`` (or ``"package.module.Class.method"``) -> the object (vLLM's
    ``resolve_obj_by_qualname``): the longest importable prefix is the module, the rest are
    attributes. Variants that stand beside the article's code are named this way in registries,
    so the article's modules never import them unless they are asked for."""
    parts = qualname.split(".")
    for i in range(len(parts) - 1, 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:i]))
        except ModuleNotFoundError as e:
            if e.name is None or not ".".join(parts[:i]).startswith(e.name):
                raise   # a missing import inside that module, not a shorter module path
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(f"no module in {qualname!r}")


def cache_dir() -> str:
    """Where minivllm keeps what it computes once per machine (converted checkpoints, linear
    route choices): ``$MINIVLLM_CACHE_DIR``, else ``~/.cache/minivllm``."""
    return os.path.expanduser(os.environ.get("MINIVLLM_CACHE_DIR") or "~/.cache/minivllm")
