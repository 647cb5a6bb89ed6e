"""Finding, checking and loading learned drafter heads (EAGLE, EAGLE-3, Medusa) in vLLM's format:
the loading half of ``EagleProposer.load_model`` / ``MedusaProposer.load_model``
(vllm/v1/spec_decode/eagle.py, medusa.py) and the ``load_weights`` of vLLM's head models. Article
step: spec "Setup / load model" (load the draft weights).

A head directory holds ``config.json`` + ``model.safetensors`` with the tensor names vLLM loads
(``checkpoint_to_param_name`` of each head class). EAGLE: a ``LlamaConfig`` with
``num_hidden_layers: 1``; ``fc.weight`` [H, 2H] over ``cat(embedding, hidden)``, one decoder layer
(``layers.0.*``, no input norm), optional ``embed_tokens.weight``; the target's ``lm_head``.
EAGLE-3 adds ``layers.0.{input_layernorm,hidden_norm}.weight`` (or ``midlayer.*``),
``norm.weight``, ``lm_head.weight`` [draft_vocab, H], ``d2t`` and ``fc.weight`` [H, 3H]. Medusa:
``{"model_type": "medusa", "hidden_size", "vocab_size", "num_heads", "num_hidden_layers", ...}``
(FasterDecoding's ``medusa_num_*`` names too); ``blocks.{h}.layers.{l}.weight`` (optional
``.bias``), ``lm_heads.{h}.weight`` (absent: the target's ``lm_head``).

``validate_head`` runs at ``LLM(...)`` before any weights are read: it builds the head on the meta
device (no memory) and compares every tensor name and shape in the checkpoint header with it, so a
head that does not fit the target (hidden size, vocabulary, a missing or unexpected tensor, fewer
Medusa heads than k, a missing path) is a ``ValueError`` naming the field or tensor. ``load_head``
then builds it for real and the head shares the target's ``embed_tokens`` / ``lm_head``
(``share_target_modules``), as vLLM's ``EagleProposer.load_model`` does.

Without ``speculative_config["model"]``, on the default model, the heads shipped in
``minivllm/spec_decode/heads/smollm2-135m-instruct/{method}/`` are used.
"""
from __future__ import annotations

import json
import os
from typing import Any

import torch
from torch import nn

from minivllm.config import SpeculativeConfig
from minivllm.model_executor.models.llama import (checkpoint_parameters, default_eagle3_aux_layers,
                                                   valid_eagle3_aux_layers)

HEADS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "heads")
DEFAULT_MODEL_HEADS = "smollm2-135m-instruct"
HEAD_FILES = ("config.json", "model.safetensors")


def shipped_head_dir(method: str) -> str:
    return os.path.join(HEADS_DIR, DEFAULT_MODEL_HEADS, method)


def resolve_head_dir(spec: SpeculativeConfig, target_model: str) -> str:
    """``spec.model`` (or the shipped head on the default model) -> a checked local directory."""
    from minivllm.model_executor.model_loader import DEFAULT_MODEL
    if spec.model is None:
        if target_model != DEFAULT_MODEL:
            raise ValueError(f"speculative_config.model is required for method {spec.method!r}: "
                             f"trained heads ship only for the default model {DEFAULT_MODEL}.")
        path = shipped_head_dir(spec.method)
        if not all(os.path.isfile(os.path.join(path, f)) for f in HEAD_FILES):
            raise ValueError(
                f"speculative_config.model: no {spec.method} head is shipped in {path} yet. "
                f"Train one with `python -m minivllm.train {spec.method} --out {path}`, or pass "
                "speculative_config['model'] = a vLLM-format head directory.")
        return path
    path = os.path.abspath(os.path.expanduser(spec.model))
    if not os.path.isdir(path):
        raise ValueError(f"speculative_config.model={spec.model!r} does not exist (expected a "
                         f"directory with {' + '.join(HEAD_FILES)}).")
    for f in HEAD_FILES:
        if not os.path.isfile(os.path.join(path, f)):
            raise ValueError(f"speculative_config.model={spec.model!r} has no {f}.")
    return path


def read_head_config(path: str, method: str) -> dict[str, Any]:
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    if method == "medusa":
        from minivllm.model_executor.models.medusa import medusa_config_from_dict
        config = medusa_config_from_dict(config)
    return config


def checkpoint_shapes(path: str) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape, from the safetensors header only (no tensor data is read)."""
    from safetensors import safe_open
    with safe_open(os.path.join(path, "model.safetensors"), framework="pt", device="cpu") as f:
        return {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}


def _field(config: dict, name: str, target_value: Any, method: str, path: str) -> None:
    if config.get(name) != target_value:
        raise ValueError(f"speculative_config.model={path!r}: the {method} head has {name}="
                         f"{config.get(name)!r}, the target model has {target_value!r}.")


def _llama_config(config: dict[str, Any]) -> Any:
    from transformers import LlamaConfig
    return LlamaConfig.from_dict(config)


def aux_layer_ids(config: dict[str, Any], target_hf_config: Any, path: str) -> tuple[int, ...]:
    """EAGLE-3's taps: the head's ``eagle_aux_hidden_state_layer_ids`` or vLLM's (2, L//2, L-3)."""
    n = target_hf_config.num_hidden_layers
    ids = tuple(config.get("eagle_aux_hidden_state_layer_ids") or default_eagle3_aux_layers(n))
    if not valid_eagle3_aux_layers(ids, n):
        raise ValueError(f"speculative_config.model={path!r}: EAGLE-3 needs 3 distinct target "
                         f"layers in [0, {n}) (eagle_aux_hidden_state_layer_ids or the default "
                         f"(2, L//2, L-3) for num_hidden_layers={n}), got {ids}.")
    return tuple(sorted(ids))


def build_head(method: str, config: dict[str, Any], target_hf_config: Any, k: int,
               shapes: dict[str, tuple[int, ...]], attention_backend: str, path: str) -> nn.Module:
    """The head module (on the current default device), sized from its config and checkpoint."""
    start = target_hf_config.num_hidden_layers   # draft layer names continue after the target's
    if method == "medusa":
        from minivllm.model_executor.models.medusa import Medusa
        num_heads = int(config.get("num_heads") or 0)
        if num_heads < k:
            raise ValueError(f"speculative_config.num_speculative_tokens={k} is larger than the "
                             f"Medusa head's num_heads={num_heads} ({path}).")
        own = any(n.startswith("lm_heads.") for n in shapes)
        config = dict(config, medusa_fc_bias=bool(config.get("medusa_fc_bias"))
                      or "blocks.0.layers.0.bias" in shapes)
        return Medusa(config, k, own_lm_heads=own)
    hf = _llama_config(config)
    if method == "eagle":
        from minivllm.model_executor.models.llama_eagle import EagleLlamaForCausalLM
        model = EagleLlamaForCausalLM(hf, start, attention_backend, fc_bias="fc.bias" in shapes)
    else:
        from minivllm.model_executor.models.llama_eagle3 import Eagle3LlamaForCausalLM
        if hf.num_hidden_layers != 1:
            raise ValueError(f"speculative_config.model={path!r}: EAGLE-3 heads have "
                             f"num_hidden_layers=1, got {hf.num_hidden_layers}.")
        # A full-vocabulary head may leave its lm_head out and share the target's.
        full_vocab = config.get("draft_vocab_size") in (None, config.get("vocab_size"))
        own_lm_head = "lm_head.weight" in shapes or "d2t" in shapes or not full_vocab
        model = Eagle3LlamaForCausalLM(hf, start, attention_backend, target_hf_config.hidden_size,
                                       own_lm_head=own_lm_head)
    if "embed_tokens.weight" in shapes:
        model.model.embed_tokens = nn.Embedding(hf.vocab_size, hf.hidden_size)
    return model


def expected_tensors(method: str, model: nn.Module, config: dict[str, Any],
                     shapes: dict[str, tuple[int, ...]]) -> dict[str, str]:
    """Checkpoint name -> parameter name (or ``"d2t"`` / ``"token_map"``) for every tensor read.

    Raises ``ValueError`` for an unexpected tensor (a head of another method?) or a missing one."""
    params = checkpoint_parameters(model)
    names: dict[str, str] = {}
    for ckpt in shapes:
        param = type(model).checkpoint_to_param_name(ckpt)
        if param is None or (method == "eagle" and param == "lm_head.weight"):
            continue   # t2d; EAGLE-1 always uses the target's lm_head
        if method == "medusa" and ckpt.split(".")[0] in ("blocks", "lm_heads") \
                and int(ckpt.split(".")[1]) >= len(model.blocks):
            continue   # heads past k are not built
        if param not in params and param not in ("d2t", "token_map"):
            raise ValueError(f"the {method} head checkpoint has an unexpected tensor {ckpt!r}.")
        names[ckpt] = param
    read = set(names.values())
    missing = [_param_to_ckpt(method, p) for p in params if p not in read]
    if method == "eagle3":
        full_vocab = config.get("draft_vocab_size") in (None, config.get("vocab_size"))
        if not full_vocab and "d2t" not in shapes:
            missing.append("d2t")
    if method == "medusa" and model.truncated_vocab_size < model.orig_vocab_size \
            and "token_map" not in shapes:
        missing.append("token_map")
    if missing:
        raise ValueError(f"the {method} head checkpoint lacks tensor(s) {sorted(missing)}.")
    return names


def _param_to_ckpt(method: str, param: str) -> str:
    return param[len("model."):] if method != "medusa" and param.startswith("model.") else param


def check_shapes(model: nn.Module, names: dict[str, str], shapes: dict[str, tuple[int, ...]],
                 method: str) -> None:
    params = {name: tuple(p.shape) for name, p in checkpoint_parameters(model).items()}
    if method == "eagle3":
        params["d2t"] = (model.draft_vocab_size,)
    if method == "medusa":
        params["token_map"] = (model.truncated_vocab_size,)
    for ckpt, param in names.items():
        if param in params and params[param] != shapes[ckpt]:
            raise ValueError(f"the {method} head tensor {ckpt!r} has shape {shapes[ckpt]}, the "
                             f"head's config and the target need {params[param]}.")


def validate_head(spec: SpeculativeConfig, target_hf_config: Any, target_model: str) -> str:
    """All checks of a head against the target, before any work; returns its directory."""
    path = resolve_head_dir(spec, target_model)
    config = read_head_config(path, spec.method)
    for name in ("hidden_size", "vocab_size"):
        _field(config, name, getattr(target_hf_config, name), spec.method, path)
    if spec.method == "eagle3":
        aux_layer_ids(config, target_hf_config, path)
    shapes = checkpoint_shapes(path)
    with torch.device("meta"):
        model = build_head(spec.method, config, target_hf_config, spec.num_speculative_tokens,
                           shapes, "torch", path)
    names = expected_tensors(spec.method, model, config, shapes)
    check_shapes(model, names, shapes, spec.method)
    return path


def load_head(path: str, method: str, target: nn.Module, k: int, dtype: torch.dtype,
              device: torch.device, attention_backend: str) -> nn.Module:
    """Build the head on ``device`` in ``dtype``, copy its tensors in, share the target's modules."""
    from minivllm.model_executor.model_loader import safetensors_weights_iterator
    config = read_head_config(path, method)
    shapes = checkpoint_shapes(path)
    with torch.device("meta"):
        model = build_head(method, config, target.config, k, shapes, attention_backend, path)
    names = expected_tensors(method, model, config, shapes)
    check_shapes(model, names, shapes, method)
    model = model.to(dtype=dtype).to_empty(device=torch.device(device))
    params = checkpoint_parameters(model)
    with torch.no_grad():
        for ckpt, tensor in safetensors_weights_iterator(path):
            param = names.get(ckpt)
            if param == "d2t":
                model.draft_id_to_target_id = tensor.to(device=device, dtype=torch.int64)
            elif param == "token_map":
                if model.truncated_vocab_size < model.orig_vocab_size:
                    model.token_map = tensor.to(device=device, dtype=torch.int64)
            elif param is not None:
                params[param].copy_(tensor)
    model.share_target_modules(target)
    return model.eval().requires_grad_(False)

