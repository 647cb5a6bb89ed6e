"""EAGLE-3's taps on the target model (vLLM: ``SupportsEagle3.set_aux_hidden_state_layers`` and the
``aux_hidden_states`` its ``LlamaModel.forward`` collects): the un-normalised residual stream
entering each chosen decoder layer, returned beside the final hidden states. Forward hooks set by
``LlamaForCausalLM.set_aux_hidden_state_layers``, so ``LlamaModel.forward`` stays the plain loop;
loaded only for EAGLE-3 (its drafter, the training of its heads), with the choice of the layers.
"""
from __future__ import annotations

import torch
from torch import nn


def default_eagle3_aux_layers(num_layers: int) -> tuple[int, int, int]:
    """vLLM's default EAGLE-3 taps: the residual stream entering layers 2, L // 2 and L - 3."""
    return (2, num_layers // 2, num_layers - 3)


def valid_eagle3_aux_layers(layers: tuple[int, ...], num_layers: int) -> bool:
    """What an EAGLE-3 head can tap: three distinct layers in ``[0, num_layers)``."""
    return len(set(layers)) == 3 and all(0 <= i < num_layers for i in layers)


def tap_aux_hidden_states(model: nn.Module, layers: tuple[int, ...]) -> None:
    """From now on ``model`` (a ``LlamaModel``, llama.py) returns ``(hidden_states, [aux [num_tokens,
    H] per tapped layer, in layer order])`` (vLLM's layout), or plain hidden states when no layer is
    tapped. A second call replaces the taps."""
    for handle in getattr(model, "_aux_hooks", ()):
        handle.remove()
    model.aux_hidden_state_layers = tuple(layers)
    captured: list[torch.Tensor] = []

    def before_layer(layer, args) -> None:
        _, hidden_states, residual = args   # a decoder layer's (positions, hidden, residual)
        captured.append(hidden_states if residual is None else hidden_states + residual)

    def after_model(module, args, hidden_states):
        aux = captured.copy()
        captured.clear()
        return (hidden_states, aux) if aux else None   # None: the output as it is

    model._aux_hooks = [model.register_forward_pre_hook(lambda module, args: captured.clear()),
                        model.register_forward_hook(after_model)]
    model._aux_hooks += [layer.register_forward_pre_hook(before_layer)
                         for idx, layer in enumerate(model.layers) if idx in layers]
