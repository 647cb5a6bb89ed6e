"""``python -m minivllm.bench spec``: speculative decoding against plain decoding and against
Hugging Face ``generate()`` with prompt lookup, on SmolLM2-135M-Instruct, greedy.

Two kinds of prompts, both through the chat template so the instruct model answers as trained:
- *input-grounded*: repeat or edit given code, quote a passage (the answer copies the prompt,
  which is where n-gram drafting shines);
- *open*: stories and explanations (little to copy).
A third kind, *repeated*: the same editing instruction on similar code snippets (other names),
the workload where suffix decoding's global tree pays (a request drafts from earlier requests'
outputs); it runs ``--repeated-prompts`` requests one after another and, batched, ``--batch``.
Each kind runs with one request at a time (``--batch1-prompts`` of them, one after another) and
with ``--batch`` concurrent requests (a list, each up to 32: past a kind's prompts they repeat). Methods: plain decoding, n-gram with vLLM's first-match rule
and with the last-match rule the article suggests, suffix decoding (vLLM 0.32's ``method="suffix"``,
its default options; each cell starts with an empty global tree, so no run drafts from an earlier
run of the same prompts), a self-draft (the first ``--draft-layers``
layers), the learned drafters EAGLE, EAGLE-3 and Medusa (the heads shipped in
``minivllm/spec_decode/heads/``, or ``--heads-dir``), and Hugging Face ``generate()`` plain and with
``prompt_lookup_num_tokens=k`` (assisted generation runs at batch 1 only in transformers, so the HF
rows are batch 1 only). ``ngram dynamic`` is n-gram first with dynamic k
(``num_speculative_tokens_per_batch_size``, ``--dynamic``); ``--methods`` keeps only the named rows.

Columns: output tokens per second (wall clock of ``generate`` after a warm-up, best of
``--repeats``; the methods take turns cell by cell, so a change in machine load hits them alike);
speedup over minivllm plain on the same cell; ``tok/fwd``: tokens per request per target forward
pass, what speculation saves (minivllm: ``tokens / (tokens - accepted)``, as each pass yields one
token plus the accepted drafts; HF: tokens / model calls); ``acc len``: vLLM's mean acceptance
length ``1 + accepted / drafts`` (over steps that had drafts); per-position acceptance rates;
``=plain``: requests whose greedy output equals minivllm plain's. Requests stop at EOS or
``--max-tokens``. Ratios from one run are what count, not absolute numbers.
"""
from __future__ import annotations

import argparse
import os
import time

CODE = '''def parse_config(path):
    """Read a key=value file into a dict, skipping comments and blank lines."""
    config = {}
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            key, value = line.split("=", 1)
            config[key.strip()] = value.strip()
    return config


def merge_configs(base, override):
    merged = dict(base)
    for key, value in override.items():
        if value is not None:
            merged[key] = value
    return merged
'''
PASSAGE = ("The lighthouse stood at the end of the long stone pier, and every evening the keeper "
           "climbed its one hundred and twelve steps to light the lamp. Ships that passed in the "
           "night could see its beam from twenty miles away, sweeping across the dark water in a "
           "slow, steady circle. In winter the storms were so strong that the waves broke over the "
           "top of the pier, and the keeper had to wait for a lull before he could cross it. He "
           "kept a logbook in which he wrote the weather, the ships he saw, and the hours the lamp "
           "was lit, and after forty years the logbooks filled an entire shelf in his small house.")
GROUNDED = [
    "Repeat this code exactly, with no comments of your own:\n\n" + CODE,
    "Rename the function parse_config to load_config in this code and output the whole "
    "code:\n\n" + CODE,
    "Quote the following passage word for word:\n\n" + PASSAGE,
    "Rewrite this code with the variable name `config` changed to `settings`, and output "
    "all of it:\n\n" + CODE,
    "Copy this text exactly, then stop:\n\n" + PASSAGE,
    "Add a type hint to every function argument in this code and output the full code:\n\n" + CODE,
    "Repeat the following paragraph, replacing 'keeper' with 'guardian':\n\n" + PASSAGE,
    "Output this code unchanged:\n\n" + CODE,
]
EDIT = "Add a type hint to every function argument in this code and output the full code:\n\n"
# (function name, variable name): the snippets of the repeated workload
RENAMES = [("parse_config", "config"), ("read_settings", "setting"), ("load_options", "option"),
           ("parse_params", "param"), ("read_rules", "rule"), ("load_profile", "profile"),
           ("parse_presets", "preset"), ("read_layout", "layout")]
REPEATED = [EDIT + CODE.replace("parse_config", f).replace("config", v) for f, v in RENAMES]
OPEN = [
    "Write a short story about a robot who learns to paint.",
    "Explain how a bicycle stays upright while moving.",
    "Give me ten tips for learning to cook at home.",
    "Describe the water cycle to a ten-year-old.",
    "Write a letter to a friend about a trip to the mountains.",
    "What are the pros and cons of working from home?",
    "Invent a new board game and explain its rules.",
    "Describe a day in the life of a medieval blacksmith.",
]


def ngram(k, lo, hi, match):
    return dict(method="ngram", num_speculative_tokens=k, prompt_lookup_min=lo,
                prompt_lookup_max=hi, ngram_match=match)


class MiniVLLMRunner:
    def __init__(self, path, spec, max_tokens, num_blocks) -> None:
        from minivllm import LLM, SamplingParams
        self.llm = LLM(model=path, speculative_config=spec, num_gpu_blocks_override=num_blocks)
        self.params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
        self.llm.generate(["Hello"], SamplingParams(temperature=0.0, max_tokens=8),
                          use_tqdm=False)   # warm-up

    def _counters(self) -> dict:
        return {m.name: getattr(m, "values", getattr(m, "value", None))
                for m in self.llm.get_metrics() if "spec_decode_num" in m.name}

    def run(self, prompts, batch) -> dict:
        drafter = self.llm.llm_engine.engine_core.worker.model_runner.drafter
        if hasattr(drafter, "suffix_cache"):   # suffix decoding: every run from an empty cache
            from minivllm.spec_decode.suffix_decoding import SuffixDecodingCache
            c = drafter.suffix_cache
            drafter.suffix_cache = SuffixDecodingCache(c.max_tree_depth, c.max_cached_requests)
            drafter.num_tokens_seen = {}
        before = self._counters()
        groups = [[p] for p in prompts] if batch == 1 else [prompts]
        t0 = time.perf_counter()
        outs = [o for g in groups for o in self.llm.generate(g, self.params, use_tqdm=False)]
        res = dict(time=time.perf_counter() - t0, outputs=[o.outputs[0].token_ids for o in outs])
        res["tokens"] = tokens = sum(map(len, res["outputs"]))
        after = self._counters()
        if not after:
            res["tok_fwd"] = 1.0
            return res
        diff = {n: (after[n] - before[n]) if not isinstance(after[n], list) else
                [a - b for a, b in zip(after[n], before[n])] for n in after}
        drafts = diff["vllm:spec_decode_num_drafts"]
        accepted = diff["vllm:spec_decode_num_accepted_tokens"]
        res["tok_fwd"] = tokens / (tokens - accepted)
        if drafts:
            res["acc_len"] = 1 + accepted / drafts
            per_pos = diff["vllm:spec_decode_num_accepted_tokens_per_pos"]
            res["per_pos"] = [n / drafts for n in per_pos]
        return res


class HFRunner:
    """Hugging Face ``generate()``, one request at a time; ``k``: prompt_lookup_num_tokens."""

    def __init__(self, model, tok, max_tokens, k) -> None:
        self.model, self.tok, self.calls = model, tok, 0
        extra = {} if k is None else dict(prompt_lookup_num_tokens=k)
        self.gen = dict(do_sample=False, max_new_tokens=max_tokens,
                        pad_token_id=tok.eos_token_id, **extra)

    def count_call(self, *_) -> None:
        self.calls += 1

    def run(self, prompts, batch) -> dict:
        import torch
        outputs, elapsed = [], 0.0
        for p in prompts:
            enc = self.tok([p], return_tensors="pt", add_special_tokens=False)
            handle = self.model.register_forward_pre_hook(self.count_call)
            with torch.no_grad():
                t0 = time.perf_counter()
                out = self.model.generate(**enc, **self.gen)
                elapsed += time.perf_counter() - t0
            handle.remove()
            outputs.append(out[0, enc["input_ids"].shape[1]:].tolist())
        tokens = sum(map(len, outputs))
        res = dict(time=elapsed, outputs=outputs, tokens=tokens, tok_fwd=tokens / self.calls)
        self.calls = 0
        return res


def _fmt_row(name, cell, res, plain, pos_width) -> str:
    tps = res["tokens"] / res["time"]
    speedup = tps / (plain["tokens"] / plain["time"])
    same = f"{sum(a == b for a, b in zip(res['outputs'], plain['outputs']))}/{len(res['outputs'])}"
    acc = f"{res['acc_len']:.2f}" if res.get("acc_len") else "-"
    per_pos = " ".join(f"{p:.2f}" for p in res["per_pos"]) if res.get("per_pos") else "-"
    return (f"{cell[0]:<9}{cell[1]:>6}  {name:<18}{tps:>8.1f}{speedup:>8.2f}x"
            f"{res['tok_fwd']:>8.2f}{acc:>8}  {per_pos:<{pos_width}}{same:>6}")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m minivllm.bench spec", description=__doc__.split(
        "\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="HuggingFaceTB/SmolLM2-135M-Instruct")
    ap.add_argument("--max-tokens", type=int, default=128, help="output tokens per request")
    ap.add_argument("--batch", default="8", help="concurrent requests, or a comma list of batch "
                    "sizes (each <= 32; past a kind's prompts they repeat, e.g. 8 prompts x 4 at 32)")
    ap.add_argument("--methods", default=None, help="comma list: run only these rows (e.g. "
                    "'plain,ngram first,ngram dynamic')")
    ap.add_argument("--dynamic", default="1-4:3,5-16:1,17-1024:0",
                    help="the 'ngram dynamic' row's num_speculative_tokens_per_batch_size as "
                    "START-END:K,... (default from the roofline: k=3 where a 4-token verify costs "
                    "a plain step, k=1 at batch 8, none once the batch is compute-bound); '' drops it")
    ap.add_argument("--batch1-prompts", type=int, default=2,
                    help="prompts of each kind run one at a time")
    ap.add_argument("--repeated-prompts", type=int, default=4,
                    help="repeated-workload prompts run one at a time (max 8)")
    ap.add_argument("--kinds", default="grounded,open,repeated", help="prompt kinds to run")
    ap.add_argument("--k", type=int, default=3, help="num_speculative_tokens (and HF's "
                    "prompt_lookup_num_tokens)")
    ap.add_argument("--lookup-min", type=int, default=3, help="prompt_lookup_min (the article: 3)")
    ap.add_argument("--lookup-max", type=int, default=5, help="prompt_lookup_max (the article: 5)")
    ap.add_argument("--draft-layers", type=int, default=8,
                    help="self-draft depth (0 skips the self-draft)")
    ap.add_argument("--learned", default="eagle,eagle3,medusa",
                    help="learned drafters to run, comma-separated ('' for none)")
    ap.add_argument("--heads-dir", default=None,
                    help="folder with eagle/ eagle3/ medusa/ heads (default: the shipped ones)")
    ap.add_argument("--repeats", type=int, default=1, help="best of N timings per cell")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads (default: torch's choice; 1 is steadier on a busy machine)")
    ap.add_argument("--no-hf", action="store_true", help="skip the Hugging Face rows")
    ap.add_argument("--profile", action="store_true",
                    help="also profile one batch-1 grounded n-gram run and print where time goes")
    args = ap.parse_args(argv)
    batches = [int(b) for b in str(args.batch).split(",") if b]
    if not all(1 <= b <= 32 for b in batches):
        ap.error("--batch: each batch size must be in [1, 32]")

    import torch
    from tqdm.auto import tqdm
    if args.threads:
        torch.set_num_threads(args.threads)

    from minivllm.model_executor.model_loader import load_tokenizer, resolve_model_path
    path = resolve_model_path(args.model)
    tok = load_tokenizer(path)

    def chat(text):
        return tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                       add_generation_prompt=True)
    cells = {}
    for kind, texts, n in (("grounded", GROUNDED, args.batch1_prompts),
                           ("open", OPEN, args.batch1_prompts),
                           ("repeated", REPEATED, args.repeated_prompts)):
        if kind not in args.kinds.split(","):
            continue
        cells[(kind, 1)] = [chat(t) for t in texts[:n]]
        for b in (b for b in batches if b > 1):
            cells[(kind, b)] = [chat(texts[i % len(texts)]) for i in range(b)]
    k = args.k
    longest = max(len(tok.encode(p)) for ps in cells.values() for p in ps)
    num_blocks = max(batches) * -(-(longest + args.max_tokens + k) // 16) + 2

    print(f"{args.model}, greedy, up to {args.max_tokens} output tokens per request; k={k}, "
          f"n-gram sizes {args.lookup_min}..{args.lookup_max}; torch threads "
          f"{torch.get_num_threads()}, load average {os.getloadavg()[0]:.1f}", flush=True)
    specs = {"plain": None,
             "ngram first": ngram(k, args.lookup_min, args.lookup_max, "first"),
             "ngram last": ngram(k, args.lookup_min, args.lookup_max, "last"),
             "suffix": dict(method="suffix", num_speculative_tokens=k)}
    if args.dynamic:   # dynamic k: the schedule picks k from the batch size (spec_decode/dynamic.py)
        specs["ngram dynamic"] = dict(ngram(k, args.lookup_min, args.lookup_max, "first"),
                                      num_speculative_tokens_per_batch_size=[
                                          [*map(int, r.split(":")[0].split("-")), int(r.split(":")[1])]
                                          for r in args.dynamic.split(",")])
    if args.draft_layers:
        specs[f"self-draft L{args.draft_layers}"] = dict(
            method="draft_model", num_speculative_tokens=k, draft_num_layers=args.draft_layers)
    for method in [m for m in args.learned.split(",") if m]:
        if method not in ("eagle", "eagle3", "medusa"):
            ap.error(f"--learned: unknown method {method!r} (eagle, eagle3, medusa)")
        from minivllm.spec_decode.heads import shipped_head_dir
        # The engines get the resolved checkpoint path, so the head is named explicitly.
        specs[method] = dict(method=method, num_speculative_tokens=k, model=os.path.join(
            args.heads_dir, method) if args.heads_dir else shipped_head_dir(method))
    if args.methods:
        keep = [m.strip() for m in args.methods.split(",")]
        specs = {name: spec for name, spec in specs.items() if name in keep or name == "plain"}
    runners = {}
    for name, spec in tqdm(specs.items(), desc="loading engines", dynamic_ncols=True):
        runners[name] = MiniVLLMRunner(path, spec, args.max_tokens, num_blocks)
    if not args.no_hf:
        from transformers import AutoModelForCausalLM
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        runners["HF plain"] = HFRunner(hf, tok, args.max_tokens, None)
        runners[f"HF lookup k={k}"] = HFRunner(hf, tok, args.max_tokens, k)
        HFRunner(hf, tok, 8, k).run(["Hello"], 1)   # warm-up

    results: dict = {}
    jobs = [(cell, name) for cell in cells for _ in range(args.repeats) for name in runners
            if cell[1] == 1 or not name.startswith("HF")]
    for cell, name in tqdm(jobs, desc="benchmark runs", dynamic_ncols=True):
        res = runners[name].run(cells[cell], cell[1])
        best = results.get((name, cell))
        if best is None or res["time"] < best["time"]:
            results[(name, cell)] = res

    width = max(16, 5 * k + 1)
    print(f"\n{'prompts':<9}{'batch':>6}  {'method':<18}{'tok/s':>8}{'vs plain':>9}{'tok/fwd':>8}"
          f"{'acc len':>8}  {'acc per pos':<{width}}{'=plain':>6}")
    for cell in cells:
        for name in runners:
            if (name, cell) in results:
                print(_fmt_row(name, cell, results[(name, cell)], results[("plain", cell)], width))
        print()
    if any(m in runners for m in ("eagle", "eagle3", "medusa")):
        print("vLLM's EAGLE-3 regression figures (Llama-3.1-8B, MT-Bench, k=3): acceptance per "
              "position 0.73 0.52 0.35, mean acceptance length 2.60\n")
    if not args.no_hf:
        for cell in [c for c in cells if c[1] == 1]:
            a, b = results[(f"HF lookup k={k}", cell)], results[("HF plain", cell)]
            print(f"HF lookup over HF plain, {cell[0]} batch 1: "
                  f"{(a['tokens'] / a['time']) / (b['tokens'] / b['time']):.2f}x")
    if args.profile:
        _profile(runners["ngram first"], cells[("grounded", 1)][:1])


def _profile(runner, prompts) -> None:
    """Where a batch-1 n-gram run spends its time: minivllm's functions by cumulative time."""
    import cProfile
    import pstats
    prof = cProfile.Profile()
    prof.runcall(runner.run, prompts, 1)
    print("\nProfile of one batch-1 grounded request, n-gram first (cumulative seconds):")
    pstats.Stats(prof).sort_stats("cumulative").print_stats(
        r"minivllm.*(execute_model|propose|rejection_sampler.py.*forward|sampler.py.*forward|"
        r"schedule|update_from_output|_prepare_inputs|compute_logits|llama.py.*forward|"
        r"unified_attention)", 18)


if __name__ == "__main__":
    main()
