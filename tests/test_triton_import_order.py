"""The Triton backend works on a CPU whatever was imported before minivllm.

transformers and torch._dynamo import Triton before minivllm can set TRITON_INTERPRET=1, so Triton's
own @jit helpers (tl.cdiv, tl.max, tl.argmax ...) are created in compiled mode; minivllm.triton_utils
must repair that. Each case runs in a fresh subprocess, since the import order is per process:
the attention and store-KV kernels through LLM.generate (against the torch backend), and every
rejection-sampler kernel (greedy, random with and without draft probs, recovered, expand) against
its torch reference. A state that cannot be repaired (TRITON_INTERPRET=0 on a CPU) must be a
ValueError from LLM(...), never an error inside generate().
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CHECK = textwrap.dedent("""
    import sys
    import torch
    from minivllm import LLM, SamplingParams
    from minivllm.sample.metadata import SamplingMetadata
    from minivllm.sample.rejection_sampler import RejectionSampler
    from minivllm.spec_decode.metadata import SpecDecodeMetadata

    prompts = [{"prompt_token_ids": [1, 2, 3, 4, 5, 6, 7]}, {"prompt_token_ids": [9, 8, 7] * 7}]
    greedy = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    outs = {}
    for backend in ("triton", "torch"):
        llm = LLM(model=sys.argv[1], attention_backend=backend, skip_tokenizer_init=True,
                  num_gpu_blocks_override=64, block_size=16)
        outs[backend] = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
    assert outs["triton"] == outs["torch"], outs
    assert all(len(t) == 5 for t in outs["triton"]), outs

    g = torch.Generator().manual_seed(0)
    drafts = [[1, 2, 3], [], [4, 5], [6]]
    n = sum(map(len, drafts))
    logits = torch.randn(n, 50, generator=g)
    draft_probs = torch.softmax(torch.randn(n, 50, generator=g), -1)
    bonus = torch.tensor([[11], [12], [13], [14]], dtype=torch.int32)
    checked = 0
    for temps in ([0.0] * 4, [1.0, 0.7, 0.0, 1.3]):
        for dp in (None, draft_probs):
            got = []
            for backend in ("torch", "triton"):
                params = [SamplingParams(temperature=t, seed=i) for i, t in enumerate(temps)]
                gens = {i: torch.Generator().manual_seed(i) for i, t in enumerate(temps) if t > 0}
                sm = SamplingMetadata.from_params(params, gens, "cpu")
                md = SpecDecodeMetadata.make_dummy(drafts, "cpu")
                got.append(RejectionSampler(backend)(md, dp, logits, bonus, sm))
            assert torch.equal(got[0], got[1]), (temps, dp is None, got)
            checked += 1
    print("OK", checked, outs["triton"])
""")


def _run(first_imports: str, model_dir: str, env_extra: dict | None = None,
         body: str = CHECK) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)   # as in a new terminal
    env.update(env_extra or {})
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO, env.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, "-c", first_imports + "\n" + body, model_dir],
                          capture_output=True, text=True, env=env, timeout=300, cwd=REPO)


@pytest.mark.parametrize("first_imports", [
    "from transformers import AutoTokenizer, LlamaForCausalLM",
    "import torch._dynamo",
    "import triton, triton.language",
], ids=["transformers", "torch._dynamo", "triton"])
def test_triton_backend_works_whatever_was_imported_first(first_imports, tiny_gqa_dir):
    proc = _run(first_imports, tiny_gqa_dir)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "OK 4" in proc.stdout


def test_unrepairable_state_is_a_value_error_at_construction(tiny_gqa_dir):
    body = textwrap.dedent("""
        import sys
        from minivllm import LLM
        try:
            LLM(model=sys.argv[1], attention_backend="triton", skip_tokenizer_init=True,
                num_gpu_blocks_override=64)
        except ValueError as e:
            print("VALUEERROR", e)
        else:
            print("NO ERROR")
        llm = LLM(model=sys.argv[1], attention_backend="torch", skip_tokenizer_init=True,
                  num_gpu_blocks_override=64)   # the torch backend is unaffected
        print("TORCH OK")
    """)
    proc = _run("from transformers import AutoTokenizer", tiny_gqa_dir,
                env_extra={"TRITON_INTERPRET": "0"}, body=body)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "VALUEERROR" in proc.stdout and "TRITON_INTERPRET" in proc.stdout, proc.stdout
    assert "TORCH OK" in proc.stdout


def test_probe_reports_no_problem_in_this_process():
    from minivllm.triton_utils import triton_backend_problem
    assert triton_backend_problem("cpu") is None
