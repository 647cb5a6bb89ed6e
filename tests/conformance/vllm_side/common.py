"""Shared helpers for the vLLM-side scripts of the conformance suite (they run inside the vLLM venv).

Protocol: ``python SCRIPT.py IN.json OUT.json``. ``IN.json`` is what the pytest side asks for (token
ids, configs); the script writes one JSON object to ``OUT.json`` and exits 0. Nothing from minivllm
is importable here: the two sides meet only through these files.
"""
from __future__ import annotations

import json
import os
import sys
import time


def read_input() -> dict:
    if len(sys.argv) != 3:
        raise SystemExit(f"usage: {sys.argv[0]} IN.json OUT.json")
    with open(sys.argv[1]) as f:
        return json.load(f)


def write_output(result: dict) -> None:
    tmp = sys.argv[2] + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result, f)
    os.replace(tmp, sys.argv[2])     # the reader never sees half a file


def _let_kernel_rebind_pass_llvmlite() -> None:
    """An engine in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) with numba loaded (the
    n-gram drafter): vLLM 0.32's CPU worker scans every module attribute for Triton kernels to
    rebind (triton_utils/dispatcher.py ``_rebind_kernels``) and reads ``vars(value).get("kernel")``.
    llvmlite's ``ffi.lib`` answers any attribute name with a C-function wrapper, ``__dict__``
    included, so that read raises. Its class gets an empty ``__dict__`` here: the scan then finds
    no kernel in it (it holds none), and nothing else reads it. The multi-process engine imports
    numba only after the scan, which is why it never met this."""
    try:
        from llvmlite.binding import ffi
    except ImportError:
        return
    if type(ffi.lib).__name__ != "_lib_wrapper":
        return

    class _LibWithEmptyDict(type(ffi.lib)):
        __slots__ = ()
        __dict__ = property(lambda self: {})

    ffi.lib.__class__ = _LibWithEmptyDict


def make_llm(model: str, dtype: str = "float32", speculative_config=None, **kw):
    """A vLLM ``LLM`` as the suite runs it: eager (a 30 s start instead of ~100 s compiled; outputs
    were identical), metrics on (``get_metrics``), a bounded context so the CPU KV cache fits."""
    from vllm import LLM
    if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0":
        _let_kernel_rebind_pass_llvmlite()
    return LLM(model=model, dtype=dtype, enforce_eager=True, disable_log_stats=False,
               speculative_config=speculative_config, seed=0,
               max_model_len=kw.pop("max_model_len", 2048), **kw)


def shutdown(llm) -> None:
    """Stop the EngineCore process now, so the next engine of this script has the memory."""
    llm.llm_engine.engine_core.shutdown()
    del llm
    import gc
    gc.collect()


def spec_counters(llm) -> dict:
    """vLLM's ``vllm:spec_decode_*`` counters as ``{name: int or [int per position]}``."""
    out: dict = {}
    for m in llm.get_metrics():
        if not m.name.startswith("vllm:spec_decode_num"):
            continue
        if hasattr(m, "values"):
            out[m.name] = [int(v) for v in m.values]
        else:
            out[m.name] = int(m.value)
    return out


def counter_diff(after: dict, before: dict) -> dict:
    """``after - before`` for every counter (element-wise for the per-position vector)."""
    diff = {}
    for name, value in after.items():
        old = before.get(name, [0] * len(value) if isinstance(value, list) else 0)
        diff[name] = ([a - b for a, b in zip(value, old)] if isinstance(value, list)
                      else value - old)
    return diff


def generate_ids(llm, prompts: list[list[int]], max_tokens: int, logprobs: int | None = None):
    """Greedy, ``ignore_eos``: each prompt's output ids (and, with ``logprobs``, the top
    ``logprobs`` (token id, logprob) pairs at every output position)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                            logprobs=logprobs)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params,
                        use_tqdm=False)
    ids = [list(o.outputs[0].token_ids) for o in outs]
    if logprobs is None:
        return ids, None
    tops = [[sorted(((int(t), float(lp.logprob)) for t, lp in pos.items()),
                    key=lambda x: -x[1])[:logprobs] for pos in o.outputs[0].logprobs]
            for o in outs]
    return ids, tops


class Timer:
    def __init__(self) -> None:
        self.t0 = time.perf_counter()

    def __call__(self) -> float:
        return round(time.perf_counter() - self.t0, 2)
