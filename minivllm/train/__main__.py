"""``python -m minivllm.train {eagle,eagle3,medusa} [--quick] [--out DIR] [--seed S] ...``"""
from __future__ import annotations

import argparse
import json

from minivllm.train import DEFAULTS, METHODS, TrainConfig, train


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m minivllm.train",
                                 description="Train a learned drafter by self-distillation.")
    ap.add_argument("method", choices=METHODS + ("data",))
    ap.add_argument("--model", default=TrainConfig.model)
    ap.add_argument("--quick", action="store_true", help="small data and few steps (~2 minutes)")
    ap.add_argument("--out", default=None, help="write the vLLM-format head directory here")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--k", type=int, default=3, help="Medusa heads / EAGLE-3 unrolled steps")
    for name in ("num-prompts", "max-tokens", "epochs", "batch-size", "draft-vocab-size",
                 "intermediate-size", "threads"):
        ap.add_argument(f"--{name}", type=int, default=None)
    ap.add_argument("--lr", type=float, default=None)
    ap.add_argument("--noise", type=float, default=0.2)
    ap.add_argument("--labels", choices=("hard", "soft"), default="hard",
                    help="EAGLE-3 token loss: the greedy token or the target's distribution")
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--no-cache", action="store_true", help="regenerate the data")
    a = ap.parse_args(argv)
    if a.method == "data":
        _data_only(a)
        return
    cfg = TrainConfig(method=a.method, model=a.model, quick=a.quick, out=a.out, seed=a.seed, k=a.k,
                      num_prompts=a.num_prompts, max_tokens=a.max_tokens, epochs=a.epochs,
                      lr=a.lr, batch_size=a.batch_size, draft_vocab_size=a.draft_vocab_size,
                      intermediate_size=a.intermediate_size, noise=a.noise, threads=a.threads,
                      labels=a.labels, dtype=a.dtype, use_cache=not a.no_cache)
    result = train(cfg)
    print(json.dumps({k: result.info[k] for k in ("method", "steps", "data_s", "train_s",
                                                  "draft_vocab_coverage_of_answers", "held_out")},
                     indent=1))
    if a.out:
        print(f"wrote {a.out}")


def _data_only(a) -> None:
    import torch

    from minivllm.train.data import load_or_build
    if a.threads:
        torch.set_num_threads(a.threads)
    q = int(a.quick)
    data = load_or_build(a.model, a.num_prompts or DEFAULTS["num_prompts"][q],
                         a.max_tokens or DEFAULTS["max_tokens"][q], use_cache=True)
    print(json.dumps(dict(data.info, train_prompts=len(data.train),
                          held_out_prompts=len(data.held_out)), indent=1))


if __name__ == "__main__":
    main()
