"""``python -m minivllm.bench gpu``: every check that only a GPU can make, in one run.

1. The Triton kernels *compiled* (not interpreted) against their torch references: paged attention
   (``kernel_unified_attention``, ``reshape_and_cache_kernel``) on random paged batches, and the
   rejection sampler's kernels, given the same random draws.
   On a GPU also the attention kernel's time and achieved bandwidth, as a fraction of the GPU's
   copy bandwidth (a 1 GiB device-to-device copy). ``--compile-only`` compiles every kernel
   configuration ahead of time for sm_75/sm_80/sm_90 instead (no GPU needed:
   minivllm.bench.triton_aot).
2. The whole engine on random weights at SmolLM2-135M's shapes (no checkpoint travels to a GPU
   machine): greedy output with ``attention_backend="triton"`` against ``"torch"``, n-gram spec
   decoding against plain decoding, and decode throughput for 1 and 32 requests.

On a CPU it runs the same checks with the kernels interpreted, at small shapes (``--quick`` is then
the default), which is how the script itself is tested. Prints one line per check and a summary;
exits non-zero if any check fails.
"""
from __future__ import annotations

import argparse
import tempfile
import time

import torch

SMOLLM2_SHAPES = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                      num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                      max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=100000.0,
                      tie_word_embeddings=True, initializer_range=0.1)
TINY_SHAPES = dict(SMOLLM2_SHAPES, vocab_size=512, num_hidden_layers=2, intermediate_size=256,
                   hidden_size=192, num_attention_heads=6, num_key_value_heads=2,
                   max_position_embeddings=512)

_results: list[tuple[str, bool, str]] = []


def report(name: str, ok: bool, detail: str) -> None:
    _results.append((name, ok, detail))
    print(f"[{'PASS' if ok else 'FAIL'}] {name}: {detail}", flush=True)


def check_attention(device: str, quick: bool) -> None:
    from minivllm.attention.backends import torch_ref
    from minivllm.attention.backends import triton_attn
    g = torch.Generator().manual_seed(0)
    cases = [([(7, 7), (1, 30), (4, 19)], 4, 2, 64, 16), ([(1, 40)] * 3, 9, 3, 64, 16)]
    if not quick:
        cases += [([(512, 512), (1, 2000), (4, 1000), (100, 700)], 9, 3, 64, 16),
                  ([(1, 4000)] * 32, 9, 3, 64, 16), ([(256, 1024)], 32, 8, 128, 16)]
    for dtype in (torch.float32, torch.bfloat16):
        for seqs, nh, nkv, hd, bs in cases:
            n_blocks = [-(-s // bs) for _, s in seqs]
            num_blocks = sum(n_blocks) + 4
            perm = torch.randperm(num_blocks, generator=g)
            block_table = torch.zeros(len(seqs), max(n_blocks), dtype=torch.int32)
            slots, used = [], 0
            for i, n in enumerate(n_blocks):
                block_table[i, :n] = perm[used:used + n].to(torch.int32)
                used += n
                pos = torch.arange(seqs[i][1])
                slots.append(block_table[i, pos // bs].long() * bs + pos % bs)
            slots = torch.cat(slots).to(device)
            k = torch.randn(len(slots), nkv, hd, generator=g).to(device, dtype)
            v = torch.randn(len(slots), nkv, hd, generator=g).to(device, dtype)
            caches = []
            for backend in (torch_ref, triton_attn):
                cache = torch.zeros(2, num_blocks, bs, nkv, hd, dtype=dtype, device=device)
                backend.reshape_and_cache(k, v, cache, slots)
                caches.append(cache)
            q_lens = [q for q, _ in seqs]
            q = torch.randn(sum(q_lens), nh, hd, generator=g).to(device, dtype)
            qsl = torch.tensor([0] + q_lens).cumsum(0).to(torch.int32).to(device)
            seq_lens = torch.tensor([s for _, s in seqs], dtype=torch.int32, device=device)
            args = (block_table.to(device), seq_lens, qsl, max(q_lens), int(seq_lens.max()),
                    hd ** -0.5)
            ref = torch_ref.unified_attention(q, caches[0], *args)
            out = triton_attn.unified_attention(q, caches[1], *args)
            err = (out.float() - ref.float()).abs().max().item()
            tol = 2e-3 if dtype == torch.float32 else 3e-2
            same_cache = torch.equal(caches[0], caches[1])
            speed = ""
            if device == "cuda":   # bytes the kernel must read and write, over its time
                ms = _cuda_ms(lambda: triton_attn.unified_attention(q, caches[1], *args))
                nbytes = (2 * sum(s for _, s in seqs) * nkv * hd + 2 * q.numel()) * q.element_size()
                gbs = nbytes / ms / 1e6
                speed = (f", {ms:.3f} ms, {gbs:.0f} GB/s = {gbs / _copy_bandwidth_gbs():.0%} of "
                         f"copy bandwidth")
            report(f"attention {str(dtype)[6:]} q={q_lens[:4]} heads {nh}/{nkv} hd {hd}",
                   err <= tol and same_cache,
                   f"max|triton-torch|={err:.2e} (tol {tol}), cache equal={same_cache}{speed}")


def _cuda_ms(fn, reps: int = 20) -> float:
    """Mean milliseconds of ``fn`` on the GPU (CUDA events, after a warm-up call)."""
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


_COPY_GBS: list[float] = []


def _copy_bandwidth_gbs() -> float:
    """This GPU's practical memory bandwidth: a 1 GiB device-to-device copy (read + write)."""
    if not _COPY_GBS:
        src = torch.empty(2 ** 30, dtype=torch.uint8, device="cuda")
        dst = torch.empty_like(src)
        _COPY_GBS.append(2 * src.numel() / _cuda_ms(lambda: dst.copy_(src), reps=10) / 1e6)
    return _COPY_GBS[0]


def check_rejection_sampler(device: str, quick: bool) -> None:
    from minivllm.sample.metadata import SamplingMetadata
    from minivllm.sample.rejection_sampler import RejectionSampler
    from minivllm.sampling_params import SamplingParams
    from minivllm.spec_decode.metadata import SpecDecodeMetadata
    vocab = 512 if quick else 49152
    drafts = [[1, 2, 3], [], [4, 5], [6, 7, 8, 9], [10]] * (1 if quick else 8)
    g = torch.Generator().manual_seed(1)
    n = sum(len(d) for d in drafts)
    logits = torch.randn(n, vocab, generator=g).to(device)
    draft_probs = torch.softmax(torch.randn(n, vocab, generator=g), -1).to(device)
    bonus = torch.randint(0, vocab, (len(drafts), 1), generator=g, dtype=torch.int32).to(device)
    for temps in ([0.0] * len(drafts), [0.8] * len(drafts), [0.0, 1.0, 0.7, 0.0, 1.2] *
                  (len(drafts) // 5)):
        for dp in (None, draft_probs):
            outs = []
            for backend in ("torch", "triton"):
                params = [SamplingParams(temperature=t, top_k=50, top_p=0.9, seed=i)
                          for i, t in enumerate(temps)]
                gens = {i: torch.Generator(device=device).manual_seed(i)
                        for i, t in enumerate(temps) if t > 0}
                md = SpecDecodeMetadata.make_dummy(drafts, device)
                sm = SamplingMetadata.from_params(params, gens, device)
                outs.append(RejectionSampler(backend)(md, dp, logits, bonus, sm))
            ok = torch.equal(outs[0], outs[1])
            report(f"rejection sampler temps={sorted(set(temps))} draft_probs="
                   f"{'given' if dp is not None else 'None'}", ok,
                   f"outputs identical={ok} over {len(drafts)} requests, vocab {vocab}")


def check_engine(device: str, quick: bool) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    from minivllm import LLM, SamplingParams
    shapes = TINY_SHAPES if quick else SMOLLM2_SHAPES
    with tempfile.TemporaryDirectory() as d:
        torch.manual_seed(0)
        LlamaForCausalLM(LlamaConfig(**shapes)).save_pretrained(d)
        g = torch.Generator().manual_seed(2)
        vocab = shapes["vocab_size"]
        pattern = torch.randint(0, vocab, (12,), generator=g).tolist()
        prompts = [{"prompt_token_ids": torch.randint(0, vocab, (n,), generator=g).tolist()}
                   for n in (5, 37, 130)] + [{"prompt_token_ids": pattern * 6}]
        greedy = SamplingParams(temperature=0.0, max_tokens=8 if quick else 32, ignore_eos=True)
        kw = dict(model=d, skip_tokenizer_init=True, device=device, dtype="float32",
                  num_gpu_blocks_override=512 if quick else None)
        results = {}
        for name, extra in [("torch", {"attention_backend": "torch"}),
                            ("triton", {"attention_backend": "triton"}),
                            ("triton+ngram", {"attention_backend": "triton", "speculative_config": {
                                "method": "ngram", "num_speculative_tokens": 3,
                                "prompt_lookup_min": 2, "prompt_lookup_max": 4}})]:
            llm = LLM(**kw, **extra)
            results[name] = [o.outputs[0].token_ids
                             for o in llm.generate(prompts, greedy, use_tqdm=False)]
        report("engine greedy: triton == torch backend", results["triton"] == results["torch"],
               f"{len(prompts)} prompts x {greedy.max_tokens} tokens")
        report("engine greedy: n-gram spec == plain", results["triton+ngram"] == results["triton"],
               "same prompts, triton backend")
        if quick:
            return
        llm = LLM(**kw)
        for batch in (1, 32):
            ps = [{"prompt_token_ids": torch.randint(0, vocab, (200,), generator=g).tolist()}
                  for _ in range(batch)]
            p = SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True)
            llm.generate(ps[:1], SamplingParams(max_tokens=4), use_tqdm=False)
            t0 = time.perf_counter()
            llm.generate(ps, p, use_tqdm=False)
            torch.cuda.synchronize()
            dt = time.perf_counter() - t0
            report(f"engine throughput, {batch} request(s), default backend", True,
                   f"{batch * 128 / dt:.1f} output tokens/s (200-token prompts, 128 out)")


def compile_only(jobs: int) -> int:
    """Print the ahead-of-time compile table; non-zero exit on any compile error or misfit."""
    from minivllm.bench.triton_aot import aot_cases, compile_all, format_table
    t0 = time.perf_counter()
    print(f"Compiling {len(aot_cases())} kernel configurations for sm_75, sm_80 and sm_90 "
          f"({jobs} processes) ...", flush=True)
    results = compile_all(jobs=jobs)
    print("Each cell: registers per thread / spilled bytes per thread / shared memory KiB, and "
          "whether it fits the architecture. default = bfloat16 KV, block size 16 (CUDA default).\n")
    print(format_table(results))
    failed = [r for r in results if not r.fits]
    spills = [r for r in results if r.default and r.arch >= 80 and r.spill_stores]
    print(f"\n{len(results)} compiles in {time.perf_counter() - t0:.0f} s: "
          f"{len(results) - len(failed)} fit, {len(failed)} failed or do not fit; "
          f"{len(spills)} default configurations spill on sm_80/sm_90.")
    return 1 if failed else 0


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m minivllm.bench gpu", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small shapes (default on a CPU)")
    ap.add_argument("--compile-only", action="store_true",
                    help="compile every kernel configuration ahead of time for sm_75/sm_80/sm_90 "
                         "(no GPU needed) and print registers / spilled bytes / shared KiB")
    ap.add_argument("--jobs", type=int, default=2, help="compile worker processes")
    args = ap.parse_args(argv)
    if args.compile_only:
        raise SystemExit(compile_only(args.jobs))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    quick = args.quick or device == "cpu"
    from minivllm.triton_utils import INTERPRETED
    print(f"device: {torch.cuda.get_device_name() if device == 'cuda' else 'cpu'}; Triton "
          f"{'interpreted' if INTERPRETED else 'compiled'}; {'quick' if quick else 'full'} shapes",
          flush=True)
    for check in (check_attention, check_rejection_sampler, check_engine):
        try:
            check(device, quick)
        except Exception as e:   # report and go on: one broken check must not hide the others
            report(check.__name__, False, f"{type(e).__name__}: {e}")
    failed = [n for n, ok, _ in _results if not ok]
    print(f"\n{len(_results) - len(failed)} passed, {len(failed)} failed")
    if failed:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
