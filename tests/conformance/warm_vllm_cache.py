"""Fill vLLM's model-info cache for the architectures the conformance suite starts (run by
setup_vllm.sh in the vLLM venv, after the install; a no-op when the cache is already there).

The first time a vLLM process meets a model class, its registry inspects the class (which
interfaces it implements) in a fresh subprocess that imports vLLM again, and keeps the answer in
``$VLLM_CACHE_ROOT/modelinfos`` keyed by a hash of the model's source file
(vllm/model_executor/models/registry.py, ``_LazyRegisteredModel.inspect_model_cls``). On two cores
each such subprocess costs about 16 s, and the suite meets four classes (Llama, EAGLE, EAGLE-3,
Medusa): a one-time cost of any vLLM install, paid here instead of inside the first tests that
start an engine. This script computes the same answers in one process, with vLLM's own functions,
and writes them where vLLM looks. Nothing is written when a class cannot be inspected: vLLM then
inspects it itself, as it would have.
"""
import os
import sys
import time
from pathlib import Path

# The classes the suite's engines use (cases a, b, f, g, h): registry name -> (module, class).
ARCHITECTURES = {"LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
                 "EagleLlamaForCausalLM": ("llama_eagle", "EagleLlamaForCausalLM"),
                 "Eagle3LlamaForCausalLM": ("llama_eagle3", "Eagle3LlamaForCausalLM"),
                 "MedusaModel": ("medusa", "Medusa")}


def cache_files() -> list[Path]:
    """Where vLLM keeps each class's answer (``VLLM_CACHE_ROOT``, as vllm/envs.py defaults it)."""
    root = os.environ.get("VLLM_CACHE_ROOT") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "vllm")
    return [Path(root) / "modelinfos" / f"vllm-model_executor-models-{m}-{c}.json"
            for m, c in ARCHITECTURES.values()]


def main() -> int:
    start = time.monotonic()
    if all(f.exists() for f in cache_files()):   # no vLLM import (~7 s) on a second set-up
        print("vLLM model-info cache: already there (0 s)")
        return 0
    from vllm.model_executor.models import registry

    done, cached = [], []
    for arch, (module, _) in ARCHITECTURES.items():
        model = registry.ModelRegistry.models[arch]
        source = Path(registry.__file__).parent / f"{module}.py"
        module_hash = model._get_modelinfo_module_hash(source)
        if model._load_modelinfo_from_cache(module_hash) is not None:
            cached.append(arch)
            continue
        info = registry._ModelInfo.from_model_cls(model.load_model_cls())
        model._save_modelinfo_to_cache(info, module_hash)
        if model._load_modelinfo_from_cache(module_hash) is None:
            print(f"vLLM model-info cache: {arch} was not stored", file=sys.stderr)
            return 1
        done.append(arch)
    print(f"vLLM model-info cache: {len(done)} stored, {len(cached)} already there "
          f"({time.monotonic() - start:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
