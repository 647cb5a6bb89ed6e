"""Llama-family decoder, mirroring vllm/model_executor/models/llama.py.

The batch is flattened, as in vLLM: the new tokens of all scheduled requests are concatenated into
one ``input_ids`` ``[num_tokens]`` with their ``positions`` ``[num_tokens]``. Where each request's
tokens start and which cache blocks it owns is not passed as an argument; every ``Attention`` layer
reads it from the forward context (``minivllm.forward_context``).

Shapes inside a decoder layer: hidden ``[num_tokens, hidden_size]``; q ``[num_tokens, num_heads *
head_dim]``; k, v ``[num_tokens, num_kv_heads * head_dim]`` (grouped-query attention when
``num_kv_heads < num_heads``); logits ``[num_tokens, vocab_size]`` float32.

As in vLLM, q/k/v are one ``qkv_proj`` and gate/up one ``gate_up_proj`` (one matrix product each
instead of three and two); the checkpoint keeps Hugging Face's separate tensors, which
``load_weights`` stacks through ``stacked_params_mapping``. One device, so the "parallel" linears
are not split across ranks.

Article step: the forward of every step (spec step 1, the target over its drafts; the P/D
consumer's forward after its KV was loaded). EAGLE-3 taps residual streams of the target
(vLLM's ``SupportsEagle3``: ``set_aux_hidden_state_layers``); forward hooks collect them, so
``LlamaModel.forward`` stays the plain loop.
"""
from __future__ import annotations

from typing import Any, Iterable, Optional

import torch
from torch import nn

from minivllm.attention.layer import Attention
from minivllm.model_executor.activation import SiluAndMul
from minivllm.model_executor.layernorm import RMSNorm
from minivllm.model_executor.linear import Linear, MergedColumnParallelLinear, QKVParallelLinear
from minivllm.model_executor.rotary_embedding import (  # noqa: F401  (re-exported, as before)
    RotaryEmbedding, get_rope, rope_config)



class LlamaMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool, hidden_act: str) -> None:
        super().__init__()
        if hidden_act != "silu":
            raise ValueError(f"Llama MLP supports hidden_act='silu' only, got {hidden_act!r}.")
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2, bias=bias)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=bias)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class LlamaAttention(nn.Module):
    def __init__(self, config: Any, prefix: str, attention_backend: str) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(config, "head_dim", None) or hidden // self.num_heads
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_attention_heads ({self.num_heads}) must be a multiple of "
                             f"num_key_value_heads ({self.num_kv_heads}).")
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        bias = bool(getattr(config, "attention_bias", False))
        self.qkv_proj = QKVParallelLinear(hidden, self.head_dim, self.num_heads, self.num_kv_heads,
                                          bias=bias)
        self.o_proj = Linear(self.q_size, hidden, bias=bias)
        self.rotary_emb = get_rope(self.head_dim, *rope_config(config),
                                   max(4096, getattr(config, "max_position_embeddings", 0) or 0))
        self.attn = Attention(self.num_heads, self.head_dim, self.head_dim ** -0.5,
                              self.num_kv_heads, prefix=f"{prefix}.attn", backend=attention_backend)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj.split(self.qkv_proj(hidden_states))
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: Any, prefix: str, attention_backend: str) -> None:
        super().__init__()
        eps = config.rms_norm_eps
        self.self_attn = LlamaAttention(config, f"{prefix}.self_attn", attention_backend)
        self.mlp = LlamaMLP(config.hidden_size, config.intermediate_size,
                            bool(getattr(config, "mlp_bias", False)), config.hidden_act)
        self.input_layernorm = RMSNorm(config.hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor,
                residual: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:   # first layer: the residual stream starts as the embeddings
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


class LlamaModel(nn.Module):
    def __init__(self, config: Any, attention_backend: str, num_layers: int) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, f"model.layers.{i}", attention_backend) for i in range(num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # EAGLE-3's taps (vLLM's aux_hidden_state_layers) and the hooks that collect them.
        self.aux_hidden_state_layers: tuple[int, ...] = ()
        self._aux_hooks: list[torch.utils.hooks.RemovableHandle] = []

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor):
        """-> final-normed hidden states ``[num_tokens, H]``; once EAGLE-3 tapped layers
        (``LlamaForCausalLM.set_aux_hidden_state_layers``), ``(hidden_states, [aux [num_tokens, H]
        per tapped layer, in layer order])`` (vLLM's layout)."""
        hidden_states = self.embed_tokens(input_ids)
        residual = None
        for layer in self.layers:
            hidden_states, residual = layer(positions, hidden_states, residual)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states

    def set_aux_hidden_state_layers(self, layers: tuple[int, ...]) -> None:
        """EAGLE-3: from now on ``forward`` returns ``(hidden_states, [aux [num_tokens, H] per
        tapped layer, in layer order])`` (vLLM's layout), each aux the un-normalised residual
        stream entering a layer of ``layers``; plain hidden states when no layer is tapped. vLLM
        collects them inside its forward loop; here forward hooks do, so the loop stays plain. A
        second call replaces the taps."""
        for handle in self._aux_hooks:
            handle.remove()
        self.aux_hidden_state_layers = tuple(layers)
        captured: list[torch.Tensor] = []

        def before_layer(layer: nn.Module, args: tuple) -> None:
            _, hidden_states, residual = args   # a decoder layer's (positions, hidden, residual)
            captured.append(hidden_states if residual is None else hidden_states + residual)

        def after_model(module: nn.Module, args: tuple, hidden_states: torch.Tensor):
            aux = captured.copy()
            captured.clear()
            return (hidden_states, aux) if aux else None   # None: the output as it is

        self._aux_hooks = [self.register_forward_pre_hook(lambda module, args: captured.clear()),
                           self.register_forward_hook(after_model)]
        self._aux_hooks += [layer.register_forward_pre_hook(before_layer)
                            for idx, layer in enumerate(self.layers) if idx in layers]


def default_eagle3_aux_layers(num_layers: int) -> tuple[int, int, int]:
    """vLLM's default EAGLE-3 taps: the residual stream entering layers 2, L // 2 and L - 3."""
    return (2, num_layers // 2, num_layers - 3)


def valid_eagle3_aux_layers(layers: tuple[int, ...], num_layers: int) -> bool:
    """What an EAGLE-3 head can tap: three distinct layers in ``[0, num_layers)``."""
    return len(set(layers)) == 3 and all(0 <= i < num_layers for i in layers)


# vLLM's stacked_params_mapping: (fused parameter, checkpoint name, shard id).
stacked_params_mapping = [
    (".qkv_proj", ".q_proj", "q"),
    (".qkv_proj", ".k_proj", "k"),
    (".qkv_proj", ".v_proj", "v"),
    (".gate_up_proj", ".gate_proj", 0),
    (".gate_up_proj", ".up_proj", 1),
]


def checkpoint_parameters(model: nn.Module) -> dict[str, torch.Tensor]:
    """Checkpoint tensor name -> the tensor it is copied into: the parameter itself, or, for a
    fused projection, a view of its shard's rows (so ``q_proj.weight`` names rows of
    ``qkv_proj.weight``). Loaders copy name for name into this; it works on the meta device too."""
    out: dict[str, torch.Tensor] = {}
    for name, param in model.named_parameters():
        module_name, _, leaf = name.rpartition(".")
        module = model.get_submodule(module_name) if module_name else model
        if not isinstance(module, MergedColumnParallelLinear):
            out[name] = param
            continue
        for fused, shard_name, shard_id in stacked_params_mapping:
            if ("." + module_name).endswith(fused):
                prefix = module_name[: len(module_name) - len(fused) + 1]
                out[f"{prefix}{shard_name[1:]}.{leaf}"] = module.shard(param, shard_id)
    return out


class LlamaForCausalLM(nn.Module):
    """``model`` (embeddings, decoder layers, final norm) plus ``lm_head``.

    ``num_layers`` builds only the first N decoder layers, keeping the final norm and ``lm_head``:
    a cheap "self-draft" model for speculative decoding that shares the target's checkpoint.
    """

    def __init__(self, hf_config: Any, attention_backend: str = "torch",
                 num_layers: Optional[int] = None) -> None:
        super().__init__()
        total = hf_config.num_hidden_layers
        self.num_layers = total if num_layers is None else num_layers
        if not 1 <= self.num_layers <= total:
            raise ValueError(f"num_layers must be in [1, {total}] (the checkpoint's "
                             f"num_hidden_layers), got {num_layers}.")
        self.config = hf_config
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        self.model = LlamaModel(hf_config, attention_backend, self.num_layers)
        self.lm_head = Linear(hf_config.hidden_size, hf_config.vocab_size, bias=False)
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor):
        """``input_ids``, ``positions`` ``[num_tokens]`` -> hidden states ``[num_tokens, hidden_size]``
        (plus the list of aux hidden states once ``set_aux_hidden_state_layers`` was called)."""
        return self.model(input_ids, positions)

    def set_aux_hidden_state_layers(self, layers: tuple[int, ...]) -> None:
        """EAGLE-3 (vLLM ``SupportsEagle3``): also return the residual stream entering ``layers``
        (``LlamaModel.set_aux_hidden_state_layers``)."""
        self.model.set_aux_hidden_state_layers(layers)

    def get_eagle3_aux_hidden_state_layers(self) -> tuple[int, ...]:
        """vLLM's default taps: the stream entering layers 2, L // 2 and L - 3."""
        return default_eagle3_aux_layers(self.config.num_hidden_layers)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``[n, hidden_size]`` -> float32 logits ``[n, vocab_size]`` (called on sampled rows only)."""
        return self.lm_head(hidden_states).float()

    def attn_layers(self) -> dict[str, Attention]:
        """layer_name -> Attention; the runner binds each layer's ``.kv_cache`` and passes this dict
        to ``set_forward_context`` as ``no_compile_layers`` (KV connectors find caches there)."""
        return {layer.self_attn.attn.layer_name: layer.self_attn.attn for layer in self.model.layers}

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy Hugging Face-named tensors into the parameters; returns the checkpoint names loaded.

        vLLM's loop finds each tensor's fused parameter in ``stacked_params_mapping`` and calls its
        ``weight_loader(param, tensor, shard_id)``; ``checkpoint_parameters`` does that lookup once,
        up front, as shard views. Skipped: decoder layers at or past ``num_layers`` (self-draft), rotary ``inv_freq`` buffers
        that old checkpoints store, and ``lm_head.weight`` when it is tied to the embeddings.
        """
        # Materialising from the meta device (to_empty) gives each module its own tensor: re-tie
        # first, so that a tied lm_head is listed once, as model.embed_tokens.weight.
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        params = checkpoint_parameters(self)
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            if name.startswith("model.layers.") and int(name.split(".")[2]) >= self.num_layers:
                continue   # a self-draft's layers end before the checkpoint's
            if name == "lm_head.weight" and self.tie_word_embeddings:
                continue
            if name not in params:
                raise ValueError(f"Checkpoint tensor {name!r} has no matching parameter in "
                                 "minivllm's LlamaForCausalLM: is this a Llama-family checkpoint?")
            param = params[name]
            if param.shape != tensor.shape:
                raise ValueError(f"Shape mismatch for {name!r}: checkpoint {tuple(tensor.shape)}, "
                                 f"model {tuple(param.shape)}.")
            param.copy_(tensor)
            loaded.add(name)
        missing = sorted(set(params) - loaded)
        if missing:
            raise ValueError(f"Checkpoint is missing {len(missing)} weight(s), e.g. {missing[:5]}.")
        return loaded
