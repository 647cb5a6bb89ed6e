"""What can be checked on a CPU about the GPU path.

1. Every tensor the forward path creates follows the model's device: the engine runs with torch's
   default device set to ``meta``, so a tensor created without an explicit device (it would land
   on the CPU next to CUDA tensors on a GPU machine) meets the CPU tensors and raises.
2. No host sync inside the per-layer forward: ``.item()``, ``.tolist()``, ``.cpu()``, ``.numpy()``,
   ``int()`` / ``float()`` / ``bool()`` of a tensor, called from minivllm code while a decoder layer
   runs, with the Triton backend (the CUDA default), speculative decoding and a KV connector that
   stores and loads. (The torch attention backend is the CPU reference and does sync.)
3. bfloat16 is the CUDA default dtype; ``torch.cuda.synchronize()`` appears only in timing code.
"""
from __future__ import annotations

import ast
import os
import traceback

import pytest
import torch
from torch.overrides import TorchFunctionMode

from conftest import runner_of
from minivllm import LLM, SamplingParams
from minivllm.config import KVTransferConfig

PKG = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "minivllm")
SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2,
        "prompt_lookup_max": 3}
PROMPTS = [{"prompt_token_ids": [1, 2, 3, 1, 2, 3, 1, 2] * 3}, {"prompt_token_ids": [5, 6, 7, 8] * 5}]
PARAMS = [SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
          SamplingParams(temperature=0.8, seed=1, max_tokens=6, ignore_eos=True)]


def _llm(model_dir, backend, storage=None, role="kv_both", spec=SPEC):
    kv = None if storage is None else KVTransferConfig(
        kv_connector="SharedStorageConnector", kv_role=role,
        kv_connector_extra_config={"shared_storage_path": str(storage)})
    return LLM(model=model_dir, skip_tokenizer_init=True, num_gpu_blocks_override=64,
               attention_backend=backend, speculative_config=spec, kv_transfer_config=kv)


def _tokens(outputs):
    return [o.outputs[0].token_ids for o in outputs]


def test_meta_default_device_catches_implicit_device_tensors():
    with pytest.raises(RuntimeError, match="device"):
        with torch.device("meta"):
            torch.zeros(2) + torch.ones(2, device="cpu")


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_forward_path_tensors_follow_the_model_device(backend, tiny_gqa_dir, tmp_path):
    ref = _tokens(_llm(tiny_gqa_dir, backend).generate(PROMPTS, PARAMS, use_tqdm=False))
    producer = _llm(tiny_gqa_dir, backend, tmp_path, "kv_producer")
    consumer = _llm(tiny_gqa_dir, backend, tmp_path, "kv_consumer")
    with torch.device("meta"):
        stored = _tokens(producer.generate(PROMPTS, PARAMS, use_tqdm=False))
        loaded = consumer.generate(PROMPTS, PARAMS, use_tqdm=False)
    assert stored == ref and _tokens(loaded) == ref
    assert all(o.num_cached_tokens > 0 for o in loaded)   # the load path ran too


class HostSyncRecorder(TorchFunctionMode):
    """Records host syncs made by minivllm code while ``depth > 0`` (inside a decoder layer)."""
    SYNCS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.cpu, torch.Tensor.numpy,
             torch.Tensor.__bool__, torch.Tensor.__int__, torch.Tensor.__float__,
             torch.Tensor.__index__}

    def __init__(self, roots=(PKG,)):
        super().__init__()
        self.roots = roots
        self.depth, self.hits = 0, set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        to_cpu = getattr(func, "__name__", "") == "to" and any(
            str(a) == "cpu" for a in [*args[1:], *kwargs.values()])
        if self.depth and (func in self.SYNCS or to_cpu):
            caller = traceback.extract_stack(limit=2)[0]   # who called the tensor method
            if os.path.abspath(caller.filename).startswith(self.roots):
                self.hits.add(f"{func.__name__} at {os.path.basename(caller.filename)}:"
                              f"{caller.lineno}")
        return func(*args, **kwargs)

    def watch(self, llm) -> None:
        for layer in runner_of(llm).model.model.layers:
            layer.register_forward_pre_hook(lambda *_: setattr(self, "depth", self.depth + 1))
            layer.register_forward_hook(lambda *_: setattr(self, "depth", self.depth - 1))


def test_no_host_sync_inside_the_per_layer_forward(tiny_gqa_dir, tmp_path):
    recorder = HostSyncRecorder()
    llms = [_llm(tiny_gqa_dir, "triton", tmp_path, role) for role in ("kv_producer", "kv_consumer")]
    for llm in llms:
        recorder.watch(llm)
    with recorder:
        outs = [_tokens(llm.generate(PROMPTS, PARAMS, use_tqdm=False)) for llm in llms]
    assert outs[0] == outs[1]
    assert recorder.depth == 0
    assert not recorder.hits, sorted(recorder.hits)


def test_recorder_sees_a_sync_inside_a_layer(tiny_gqa_dir):
    """The check above can fail: code that calls .item() while a layer runs is reported, and the
    same call between layers is not."""
    llm = _llm(tiny_gqa_dir, "triton", spec=None)
    recorder = HostSyncRecorder(roots=(PKG, os.path.dirname(os.path.abspath(__file__))))
    layers = runner_of(llm).model.model.layers

    def sync_in_layer(module, args):
        args[1].sum().item()

    def sync_between_layers(module, args, out):
        out[0].sum().tolist()   # the layer returns (hidden_states, residual)

    recorder.watch(llm)   # hooks run in registration order: these come after the depth changes
    layers[1].register_forward_pre_hook(sync_in_layer)        # inside the watched span
    layers[-1].register_forward_hook(sync_between_layers)     # after the depth went back to 0
    with recorder:
        llm.generate(PROMPTS[:1], PARAMS[:1], use_tqdm=False)
    assert any(h.startswith("item at test_gpu_path_audit.py") for h in recorder.hits), recorder.hits
    assert not any(h.startswith("tolist") for h in recorder.hits), recorder.hits


def test_bfloat16_is_the_cuda_default_and_float32_the_cpu_default():
    from minivllm.worker.worker import resolve_dtype
    assert resolve_dtype("auto", torch.device("cuda")) == torch.bfloat16
    assert resolve_dtype("auto", torch.device("cpu")) == torch.float32
    assert resolve_dtype("float16", torch.device("cuda")) == torch.float16


def test_cuda_synchronize_only_in_timing_code():
    """A device-wide synchronize stalls the pipeline: only benchmarks (timing) may call it."""
    found = []
    for root, _, files in os.walk(PKG):
        for name in files:
            if not name.endswith(".py"):
                continue
            path = os.path.join(root, name)
            with open(path) as f:
                tree = ast.parse(f.read())
            for node in ast.walk(tree):
                if isinstance(node, ast.Attribute) and node.attr == "synchronize" and \
                        isinstance(node.value, ast.Attribute) and node.value.attr == "cuda":
                    found.append(os.path.relpath(path, PKG))
    assert found, "the scan found no call at all: the benchmarks time with torch.cuda.synchronize"
    assert all(p.startswith("bench" + os.sep) for p in found), found
