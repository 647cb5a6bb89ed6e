"""Small helpers shared across the package (vLLM: vllm/utils/)."""
from __future__ import annotations

import importlib
from typing import Any


def resolve_obj_by_qualname(qualname: str) -> Any:
    """``"package.module.Name"`` -> the object (vLLM's ``resolve_obj_by_qualname``). Variants that
    stand beside the article's code are named this way in registries, so the article's modules
    never import them unless they are asked for."""
    module_name, _, obj_name = qualname.rpartition(".")
    return getattr(importlib.import_module(module_name), obj_name)
