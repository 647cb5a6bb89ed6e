"""Every Triton kernel compiles for real GPUs (sm_75, sm_80, sm_90) on this GPU-less machine.

One module-scoped run compiles every configuration of ``minivllm.bench.triton_aot.aot_cases()`` in two
worker processes (Triton's on-disk cache makes a second run in the same place fast); the tests
read its results per kernel and architecture. A last test runs the real launchers (interpreted)
and checks that every launch they make is one of the configurations compiled here, so the
compile check and the launchers cannot drift apart.
"""
from __future__ import annotations

import pytest
import torch

from minivllm.bench import triton_aot
from minivllm.bench.triton_aot import ARCHS, aot_cases, build_launch, launch_key

KERNELS = sorted({c.kernel for c in aot_cases()})


@pytest.fixture(scope="module")
def aot_results():
    return triton_aot.compile_all(jobs=2)


@pytest.mark.parametrize("arch", sorted(ARCHS))
@pytest.mark.parametrize("kernel", KERNELS)
def test_every_configuration_compiles_and_fits(aot_results, kernel, arch):
    mine = [r for r in aot_results if r.kernel == kernel and r.arch == arch]
    assert len(mine) == sum(c.kernel == kernel for c in aot_cases())
    errors = [f"{r.config}: {r.error}" for r in mine if not r.ok]
    assert not errors, errors
    misfits = [f"{r.config}: {r.registers} regs x {r.num_warps} warps, {r.shared_bytes} B shared"
               for r in mine if not r.fits]
    assert not misfits, misfits
    assert all(0 < r.registers <= 255 and r.num_warps == 4 for r in mine)


def test_default_configurations_do_not_spill_on_sm80_and_sm90(aot_results):
    spills = [(r.kernel, r.config, r.arch, r.spill_stores) for r in aot_results
              if r.default and r.arch >= 80 and (r.spill_stores or r.spill_loads)]
    assert not spills, spills


def test_table_has_a_row_per_configuration(aot_results):
    table = triton_aot.format_table(aot_results)
    assert len(table.splitlines()) == 2 + len(aot_cases())
    assert "FAILED" not in table and "DOES NOT FIT" not in table


def test_launchers_only_make_launches_that_were_compiled(monkeypatch, tmp_path):
    """Run the attention and store-KV kernels through the engine and every rejection-sampler
    kernel, record each KernelLaunch the launchers build, and find each in the compiled set."""
    from conftest import make_tiny_llama

    from minivllm import LLM, SamplingParams
    from minivllm.sample.metadata import SamplingMetadata
    from minivllm.sample.rejection_sampler import RejectionSampler
    from minivllm.spec_decode.metadata import SpecDecodeMetadata
    from minivllm.triton_utils import KernelLaunch

    seen = {}
    original = KernelLaunch.run

    def recording_run(self):
        seen.setdefault(launch_key(self, specialisation=False), self.kernel.__name__)
        original(self)

    monkeypatch.setattr(KernelLaunch, "run", recording_run)
    # Head size 64, GQA group 2, float32 (the interpreter runs every dot in float32, which is
    # also what a float32 model compiles to).
    model = make_tiny_llama(tmp_path / "m", hidden_size=128, num_attention_heads=2,
                            num_key_value_heads=1, vocab_size=5000)
    llm = LLM(model=model, attention_backend="triton", skip_tokenizer_init=True,
              num_gpu_blocks_override=32, dtype="float32")
    llm.generate([{"prompt_token_ids": [1, 2, 3, 4, 5]}],
                 SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)

    g = torch.Generator().manual_seed(0)
    drafts = [[1, 2, 3], [4]]
    logits = torch.randn(4, 5000, generator=g)
    for temps, dp in (([0.0, 0.0], None), ([1.0, 0.5], None),
                      ([1.0, 0.0], torch.softmax(torch.randn(4, 5000, generator=g), -1))):
        sm = SamplingMetadata.from_params(
            [SamplingParams(temperature=t, top_k=5) for t in temps], {}, "cpu")
        RejectionSampler("triton")(SpecDecodeMetadata.make_dummy(drafts, "cpu"), dp, logits,
                                   torch.tensor([[7], [8]], dtype=torch.int32), sm)

    compiled = {launch_key(build_launch(c), specialisation=False) for c in aot_cases()}
    kernels_seen = set(seen.values())
    assert {"kernel_unified_attention", "reshape_and_cache_kernel", "expand_kernel",
            "rejection_greedy_sample_kernel", "rejection_random_sample_kernel",
            "sample_recovered_tokens_kernel"} <= kernels_seen, kernels_seen
    missing = [name for key, name in seen.items() if key not in compiled]
    assert not missing, missing
