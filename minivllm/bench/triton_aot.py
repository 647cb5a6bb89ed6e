"""Every minivllm Triton kernel compiled ahead of time for real GPUs, on a machine without one.

Triton compiles for a named target without a driver: ``triton.compile(ASTSource(fn, signature,
constexprs, attrs), target=GPUTarget("cuda", 80, 32))`` goes down to PTX and, through the ``ptxas``
bundled with Triton, to a cubin. This module does that for every configuration the launchers
really produce and reports what the GPU would see: registers per thread, spilled bytes, shared
memory, and whether the kernel fits the architecture.

- The configurations (``aot_cases``) are inputs, not constexprs: each becomes stand-in tensors on
  torch's ``meta`` device, and the kernel's own ``*_launch`` function (the one its launcher runs)
  turns them into the ``KernelLaunch`` that is compiled. The constexprs and signature therefore
  cannot drift from what a real launch would use.
- Kernels must be defined in compiled mode (``TRITON_INTERPRET=0``) to be compiled, and a process
  that runs them on the CPU has them interpreted, so compilation runs in worker subprocesses
  (``compile_all``), sharing Triton's on-disk cache: a configuration compiled once is not compiled
  again in the same run or the next.

Targets: sm_75 (T4, the free notebook GPU), sm_80 (A100), sm_90 (H100/H200).
``python -m minivllm.bench gpu --compile-only`` prints the table.
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from typing import Any, Optional

ARCHS = {75: "sm_75 (T4)", 80: "sm_80 (A100)", 90: "sm_90 (H100/H200)"}
# Largest dynamic shared memory one block may use (opt-in), per compute capability (CUDA guide).
MAX_SHARED_BYTES = {75: 65536, 80: 166912, 90: 232448}
MAX_REGS_PER_THREAD = 255
REGS_PER_SM = 65536
DTYPES = ("float32", "bfloat16", "float16")
DEFAULT_DTYPE = "bfloat16"       # minivllm's dtype on CUDA
DEFAULT_BLOCK_SIZE = 16


@dataclass(frozen=True)
class AotCase:
    """One configuration of one kernel: ``params`` are the inputs its launch function sees."""
    kernel: str
    params: tuple[tuple[str, Any], ...]
    default: bool      # what a GPU user gets with default settings (bfloat16, block size 16)

    @property
    def config(self) -> str:
        return " ".join(f"{k}={v}" for k, v in self.params)


def aot_cases() -> list[AotCase]:
    """Every configuration the launchers produce for the models minivllm targets (Llama family:
    head sizes 64 and 128, GQA groups 1 to 8, block sizes 16 and 32, three KV dtypes; the rejection
    sampler with and without draft probabilities, k up to 16)."""
    cases = []
    for hd in (64, 128):
        for group in range(1, 9):
            for dtype in DTYPES:
                for bs in (16, 32):
                    cases.append(AotCase("unified_attention", (
                        ("head_size", hd), ("gqa", group), ("dtype", dtype), ("block_size", bs)),
                        dtype == DEFAULT_DTYPE and bs == DEFAULT_BLOCK_SIZE))
        for nkv in (1, 2, 3, 8, 32):     # KV_HEADS_PADDED 1, 2, 4, 8, 32 (MQA to Llama-2-7B's MHA)
            for dtype in DTYPES:
                cases.append(AotCase("reshape_and_cache", (
                    ("head_size", hd), ("kv_heads", nkv), ("dtype", dtype)), dtype == DEFAULT_DTYPE))
    cases.append(AotCase("rejection_greedy_sample", (), True))
    for no_draft_probs in (True, False):
        cases.append(AotCase("rejection_random_sample", (("draft_probs", not no_draft_probs),), True))
        cases.append(AotCase("sample_recovered_tokens", (("draft_probs", not no_draft_probs),), True))
    for k in (1, 2, 4, 8, 16):
        for what in ("temperature", "top_k"):
            cases.append(AotCase("expand", (("k", k), ("values", what)), True))
    return cases


def build_launch(case: AotCase) -> Any:
    """The ``KernelLaunch`` the kernel's launcher would make for this configuration, on stand-in
    ``meta`` tensors (shapes, dtypes and strides, no memory)."""
    import torch
    p = dict(case.params)
    meta = dict(device="meta")
    if case.kernel in ("unified_attention", "reshape_and_cache"):
        from minivllm.attention.backends import triton_attn
        dtype = getattr(torch, p["dtype"])
        hd, bs = p["head_size"], p.get("block_size", DEFAULT_BLOCK_SIZE)
        nkv = p.get("kv_heads", 2)
        num_heads = nkv * p.get("gqa", 1)
        num_tokens, num_seqs, num_blocks = 64, 4, 128
        kv_cache = torch.empty(2, num_blocks, bs, nkv, hd, dtype=dtype, **meta)
        if case.kernel == "reshape_and_cache":
            key = torch.empty(num_tokens, nkv, hd, dtype=dtype, **meta)
            slots = torch.empty(num_tokens, dtype=torch.int64, **meta)
            return triton_attn.reshape_and_cache_launch(key, torch.empty_like(key), kv_cache, slots)
        query = torch.empty(num_tokens, num_heads, hd, dtype=dtype, **meta)
        block_table = torch.empty(num_seqs, 32, dtype=torch.int32, **meta)
        seq_lens = torch.empty(num_seqs, dtype=torch.int32, **meta)
        qsl = torch.empty(num_seqs + 1, dtype=torch.int32, **meta)
        return triton_attn.unified_attention_launch(query, kv_cache, block_table, seq_lens, qsl,
                                                    hd ** -0.5, torch.empty_like(query),
                                                    interpreted=False)
    from minivllm.sample import rejection_kernels as K
    batch, k, vocab = 8, 4, 49152
    n = batch * k
    i32 = dict(dtype=torch.int32, **meta)
    out = torch.empty(batch, k + 1, **i32)
    cu, drafts = torch.empty(batch, **i32), torch.empty(n, **i32)
    probs = torch.empty(n, vocab, dtype=torch.float32, **meta)
    bonus = torch.empty(batch, 1, dtype=torch.int64, **meta)
    is_greedy = torch.empty(batch, dtype=torch.bool, **meta)
    draft_probs = probs if p.get("draft_probs") else None
    if case.kernel == "rejection_greedy_sample":
        return K.rejection_greedy_sample_launch(out, cu, drafts, torch.empty(n, dtype=torch.int64,
                                                **meta), bonus, is_greedy, k)
    if case.kernel == "rejection_random_sample":
        return K.rejection_random_sample_launch(out, cu, drafts, draft_probs, probs, bonus,
                                                torch.empty(n, **i32),
                                                torch.empty(n, dtype=torch.float64, **meta),
                                                is_greedy, k)
    if case.kernel == "sample_recovered_tokens":
        return K.sample_recovered_tokens_launch(torch.empty(n, **i32), cu, drafts, draft_probs,
                                                probs, torch.empty(batch, vocab, **meta), k)
    if case.kernel == "expand":
        # As rejection_sampler.py calls it: temperature (float32, 0 -> 1) and top_k (int64, as is).
        if p["values"] == "temperature":
            x, args = torch.empty(batch, dtype=torch.float32, **meta), (0.0, 1.0)
        else:
            x, args = torch.empty(batch, dtype=torch.int64, **meta), (0, 0)
        return K.expand_launch(torch.empty(n, dtype=x.dtype, **meta), x, cu, p["k"], *args)
    raise ValueError(f"unknown kernel {case.kernel!r}")


@dataclass
class AotResult:
    kernel: str
    config: str
    arch: int
    default: bool
    ok: bool
    error: str = ""
    registers: int = 0
    spill_stores: int = 0        # bytes per thread, from ptxas -v
    spill_loads: int = 0
    stack_frame: int = 0
    shared_bytes: int = 0        # dynamic shared memory Triton requests at launch
    num_warps: int = 0
    seconds: float = 0.0

    @property
    def fits(self) -> bool:
        """Launchable on that architecture: registers and shared memory within its limits."""
        return (self.ok and self.registers <= MAX_REGS_PER_THREAD
                and self.registers * self.num_warps * 32 <= REGS_PER_SM
                and self.shared_bytes <= MAX_SHARED_BYTES[self.arch])


_PTXAS_REGS = re.compile(r"Used (\d+) registers")
_PTXAS_SPILL = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")


def _parse_ptxas_log(log: str) -> tuple[int, int, int, int]:
    regs = int(_PTXAS_REGS.search(log).group(1))
    stack, stores, loads = (int(x) for x in _PTXAS_SPILL.search(log).groups())
    return regs, stores, loads, stack


def _ptxas_usage(ptx: str, arch: int) -> tuple[int, int, int, int]:
    """(registers, spill store bytes, spill load bytes, stack frame bytes) from ``ptxas -v``, run
    as Triton runs it (same ptxas, same architecture name); for kernels that came from the cache."""
    from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        proc = subprocess.run([get_ptxas(arch).path, "-v", "--regAllocOptLevel=2",
                               f"--gpu-name={sm_arch_from_capability(arch)}", src, "-o",
                               os.path.join(d, "k.cubin")], capture_output=True, text=True, check=True)
    return _parse_ptxas_log(proc.stdout + proc.stderr)


def _memo_dir() -> str:
    """ptxas's resource counts per compiled kernel hash: a kernel that comes from Triton's cache
    brings no ptxas log, and running ptxas again costs as much as the rest of the compile."""
    from minivllm.utils import cache_dir
    return os.path.join(cache_dir(), "ptxas-usage")


def launch_key(launch: Any, specialisation: bool = True) -> str:
    """What makes two launches one compiled kernel: the function, signature, constexprs, launch
    options and (``specialisation``) the alignment hints. Block sizes 16 and 32, for example, are
    one kernel: block_size is a runtime argument, a multiple of 16 either way.

    Triton also specialises at launch on runtime values (integers equal to 1, multiples of 16);
    the cases here compile the aligned variant, which real launches on real shapes produce."""
    name = getattr(launch.kernel, "__name__", str(launch.kernel))
    parts = [name, launch.signature(), launch.constexprs, launch.options]
    if specialisation:
        parts.append(sorted((k[0], v) for k, v in launch.attrs().items()))
    return json.dumps(parts, sort_keys=True, default=str)


def compile_case(case: AotCase, arch: int) -> AotResult:
    """Compile one configuration for one architecture (needs compiled-mode kernels)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    res = AotResult(case.kernel, case.config, arch, case.default, ok=False)
    t0 = time.perf_counter()
    try:
        launch = build_launch(case)
        src = ASTSource(fn=launch.kernel, signature=launch.signature(),
                        constexprs=launch.constexprs, attrs=launch.attrs())
        # Triton prints ptxas's -v log (TRITON_DUMP_PTXAS_LOG=1, set by compile_all) when it runs
        # ptxas; a kernel from Triton's cache has none, and ptxas is run again on its PTX.
        log = io.StringIO()
        with contextlib.redirect_stdout(log):
            compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32),
                                      options=launch.options)
        memo = os.path.join(_memo_dir(), f"{compiled.hash}.json")
        if _PTXAS_SPILL.search(log.getvalue()):
            usage = _parse_ptxas_log(log.getvalue())
        elif os.path.exists(memo):
            with open(memo) as f:
                usage = tuple(json.load(f))
        else:
            usage = _ptxas_usage(compiled.asm["ptx"], arch)
        os.makedirs(os.path.dirname(memo), exist_ok=True)
        with open(memo, "w") as f:
            json.dump(list(usage), f)
        res.registers, res.spill_stores, res.spill_loads, res.stack_frame = usage
        res.shared_bytes = int(compiled.metadata.shared)
        res.num_warps = int(compiled.metadata.num_warps)
        res.ok = True
    except Exception as e:   # recorded per configuration: one failure must not hide the others
        res.error = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300] if str(e) else ''}"
    res.seconds = time.perf_counter() - t0
    return res


def _worker(job_path: str, out_path: str) -> None:
    from minivllm.triton_utils import INTERPRETED
    if INTERPRETED:
        raise SystemExit("the ahead-of-time worker needs TRITON_INTERPRET=0")
    with open(job_path) as f:
        job = json.load(f)
    cases = aot_cases()
    results = [asdict(compile_case(cases[i], a)) for i in job["cases"] for a in job["archs"]]
    with open(out_path, "w") as f:
        json.dump(results, f)


def compile_all(archs: Optional[list[int]] = None, jobs: int = 2,
                kernels: Optional[list[str]] = None) -> list[AotResult]:
    """Compile every case for every architecture in ``jobs`` worker processes; results in
    ``aot_cases()`` order. Cases that are one compiled kernel are compiled once. ``kernels`` limits
    the run to some kernels (for quick looks)."""
    archs = archs or list(ARCHS)
    cases = aot_cases()
    wanted = [i for i, c in enumerate(cases) if not kernels or c.kernel in kernels]
    first_of: dict[str, int] = {}
    rep = {i: first_of.setdefault(launch_key(build_launch(cases[i])), i) for i in wanted}
    unique = sorted(set(rep.values()))
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_DEFAULT_FP_FUSION": "1",
           "TRITON_DUMP_PTXAS_LOG": "1"}
    # Workers import this very package, wherever it is (an installed copy or a source tree).
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    by_case: dict[tuple[int, int], AotResult] = {}
    with tempfile.TemporaryDirectory() as d:
        procs, outs = [], []
        for j in range(min(jobs, len(unique))):
            job, out = os.path.join(d, f"job{j}.json"), os.path.join(d, f"out{j}.json")
            with open(job, "w") as f:
                json.dump({"cases": unique[j::jobs], "archs": archs}, f)
            outs.append(out)
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "minivllm.bench.triton_aot", "--worker", job, out], env=env,
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        try:
            logs = [p.communicate(timeout=3600)[0] for p in procs]
        finally:
            for p in procs:       # never leave a worker behind
                if p.poll() is None:
                    p.kill()
                    p.wait()
        for j, (p, log) in enumerate(zip(procs, logs)):
            if p.returncode != 0:
                raise RuntimeError(f"ahead-of-time compile worker failed:\n{log[-3000:]}")
            with open(outs[j]) as f:
                done = [AotResult(**r) for r in json.load(f)]
            for k, i in enumerate(unique[j::jobs]):
                for a, r in zip(archs, done[k * len(archs):(k + 1) * len(archs)]):
                    by_case[(i, a)] = r
    results = []
    for i in wanted:
        for a in archs:
            r = by_case[(rep[i], a)]
            results.append(AotResult(**{**asdict(r), "config": cases[i].config,
                                        "default": cases[i].default}))
    return results


def format_table(results: list[AotResult]) -> str:
    """One row per kernel configuration, one column per architecture:
    ``registers/spilled bytes/shared KiB`` and a mark: ok, or what does not fit."""
    archs = sorted({r.arch for r in results})
    rows: dict[tuple[str, str], dict[int, AotResult]] = {}
    for r in results:
        rows.setdefault((r.kernel, r.config), {})[r.arch] = r
    head = ["kernel", "config", "default"] + [ARCHS.get(a, f"sm_{a}") for a in archs]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for (kernel, config), by_arch in rows.items():
        cells = [kernel, config, "yes" if next(iter(by_arch.values())).default else ""]
        for a in archs:
            r = by_arch[a]
            if not r.ok:
                cells.append(f"FAILED: {r.error[:60]}")
                continue
            mark = "ok" if r.fits else "DOES NOT FIT"
            cells.append(f"{r.registers} / {r.spill_stores} / {r.shared_bytes / 1024:.1f} {mark}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--worker":
        _worker(sys.argv[2], sys.argv[3])
    else:
        raise SystemExit("usage: python -m minivllm.bench gpu --compile-only")
