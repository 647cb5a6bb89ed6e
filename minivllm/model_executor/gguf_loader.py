"""The slow, first-start half of finding a checkpoint (checkpoint_sources.py finds it,
model_loader.py loads it): a GGUF file dequantised into a cached safetensors directory (the role of
vllm/model_executor/model_loader/gguf_loader.py, which reads GGUF weights directly instead), and
a hub download.
"""
from __future__ import annotations

import os
import shutil
import tempfile
import time
from typing import Callable

import torch

from minivllm.utils import cache_dir

_HUB_PATTERNS = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt"]


def convert_gguf(gguf_path: str, target: str, check_config: Callable[[dict, str], None],
                 is_complete: Callable[[str], bool]) -> str:
    """Dequantise ``gguf_path`` into ``target``, written under a temporary name and renamed when
    complete, so an interrupted conversion never leaves a half-written cache that a later start
    would trust. ``check_config(config dict, name)`` refuses a model we cannot run, before the slow
    part; ``is_complete(dir)`` tells a finished conversion (checkpoint_sources.py's)."""
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
