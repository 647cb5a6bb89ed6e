"""The three attention backends agree: the plain reference (``torch``), the planned CPU backend
(``cpu_attn``, the CPU default) and the Triton kernels (interpreted on CPU), on random mixed batches
of prefill chunks, decodes, (k+1)-token verifies and prefix-cache hits (sequences whose block tables
share their first blocks), through several layers of one step sharing one metadata object."""
import random
import subprocess
import sys

import pytest
import torch

from minivllm.attention.backends import get_attn_backend, resolve_attn_backend
from minivllm.attention.layer import Attention
from minivllm.attention.metadata import AttentionMetadata
from minivllm.forward_context import set_forward_context

BACKENDS = ("torch", "cpu_attn", "triton")
GARBAGE_BLOCK = 1 << 20


def mixed_step(rng: random.Random, block_size: int, num_blocks: int):
    """One step's metadata: (query_len, seq_len) per sequence and block tables, some sharing a prefix."""
    kinds = ["prefill", "chunk", "decode", "verify", "prefix_hit"]
    seqs, tables, free = [], [], list(range(num_blocks))
    rng.shuffle(free)
    for _ in range(rng.randint(1, 7)):
        kind = rng.choice(kinds if tables else kinds[:4])
        seq_len = rng.randint(1, 40)
        q_len = {"prefill": seq_len, "chunk": rng.randint(1, seq_len), "decode": 1,
                 "verify": min(seq_len, rng.randint(2, 6))}.get(kind)
        n = -(-seq_len // block_size)
        if kind == "prefix_hit":
            # The first blocks are full context blocks of another sequence (a prefix-cache hit):
            # only the tokens after them are new.
            other = rng.randrange(len(tables))
            other_context = seqs[other][1] - seqs[other][0]
            shared = min(other_context // block_size, (seq_len - 1) // block_size)
            table = tables[other][:shared]
            q_len = rng.randint(1, seq_len - shared * block_size)
            table = table + [free.pop() for _ in range(n - shared)]
        else:
            table = [free.pop() for _ in range(n)]
        seqs.append((q_len, seq_len))
        tables.append(table)
    width = max(map(len, tables)) + 2
    block_table = torch.tensor([t + [GARBAGE_BLOCK] * (width - len(t)) for t in tables],
                               dtype=torch.int32)
    return seqs, block_table


def hand_step(block_size: int, num_blocks: int):
    """A decode, two prefix hits on its first blocks (one a decode of its own), a 4-token verify,
    a prefill chunk after context and a whole prefill, in shuffled blocks."""
    blocks = iter(torch.randperm(num_blocks, generator=torch.Generator().manual_seed(1)).tolist())
    seqs = [(1, 4 * block_size + 1), (3, 2 * block_size + 3), (1, 3 * block_size + 2),
            (4, 20), (7, 30), (9, 9)]
    tables = []
    for i, (_, seq_len) in enumerate(seqs):
        n = -(-seq_len // block_size)
        shared = {1: 2, 2: 3}.get(i, 0)            # sequences 1 and 2 reuse sequence 0's blocks
        tables.append((tables[0][:shared] if shared else []) + [next(blocks) for _ in range(n - shared)])
    width = max(map(len, tables)) + 1
    return seqs, torch.tensor([t + [GARBAGE_BLOCK] * (width - len(t)) for t in tables],
                              dtype=torch.int32)


def step_metadata(seqs, block_table, block_size, pad_tokens):
    """The new tokens' slots (padding tokens get -1) and the step's AttentionMetadata."""
    slots = []
    for i, (q_len, seq_len) in enumerate(seqs):
        pos = torch.arange(seq_len - q_len, seq_len)
        slots.append(block_table[i, pos // block_size].long() * block_size + pos % block_size)
    slots.append(torch.full((pad_tokens,), -1, dtype=torch.long))
    q_lens = [q for q, _ in seqs]
    return AttentionMetadata(
        num_actual_tokens=sum(q_lens),
        query_start_loc=torch.tensor([0] + q_lens).cumsum(0).to(torch.int32),
        seq_lens=torch.tensor([s for _, s in seqs], dtype=torch.int32), block_table=block_table,
        slot_mapping=torch.cat(slots), max_query_len=max(q_lens), max_seq_len=max(s for _, s in seqs))


def fill_context(cache, seqs, block_table, block_size, gen):
    """The context before this step's tokens (earlier steps' K/V), written position by position;
    a shared prefix block is written once, with the same values for every sequence that uses it."""
    for i, (q_len, seq_len) in enumerate(seqs):
        for t in range(seq_len - q_len):
            b, o = int(block_table[i, t // block_size]), t % block_size
            if torch.isnan(cache[0, b, o]).any():
                cache[:, b, o] = torch.randn(cache[:, b, o].shape, generator=gen).to(cache.dtype)


@pytest.mark.parametrize("seed", [-1] + list(range(8)))   # -1: hand_step
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,block_size,dtype", [
    (4, 2, 32, 4, torch.float32), (9, 3, 64, 16, torch.float32), (6, 1, 16, 8, torch.bfloat16)])
def test_backends_equal_on_mixed_steps(seed, num_heads, num_kv_heads, head_dim, block_size, dtype):
    gen, num_blocks = torch.Generator().manual_seed(seed + 1), 7 * 10 + 4
    if seed < 0:
        seqs, block_table = hand_step(block_size, num_blocks)
    else:
        seqs, block_table = mixed_step(random.Random(seed), block_size, num_blocks)
    pad = seed % 3 + 1
    md_args = (seqs, block_table, block_size, pad)
    n = sum(q for q, _ in seqs) + pad
    # Unwritten slots are NaN: a backend reading one would show it.
    context = torch.full((2, num_blocks, block_size, num_kv_heads, head_dim), float("nan"), dtype=dtype)
    fill_context(context, seqs, block_table, block_size, gen)
    num_layers = 2
    inputs = [[torch.randn(n, h * head_dim, generator=gen).to(dtype)
               for h in (num_heads, num_kv_heads, num_kv_heads)] for _ in range(num_layers)]
    results = {}
    for backend in BACKENDS:
        layers = {f"layers.{i}": Attention(num_heads, head_dim, head_dim ** -0.5, num_kv_heads,
                                           prefix=f"layers.{i}", backend=backend)
                  for i in range(num_layers)}
        for layer in layers.values():
            layer.kv_cache = context.clone()
        md = step_metadata(*md_args)     # one metadata object for all layers of the step
        with set_forward_context(md, layers):
            outs = [layer(*inputs[i]) for i, layer in enumerate(layers.values())]
        results[backend] = (outs, [layer.kv_cache for layer in layers.values()])
    tol = dict(atol=2e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
    ref_outs, ref_caches = results["torch"]
    real = sum(q for q, _ in seqs)
    for backend in ("cpu_attn", "triton"):
        outs, caches = results[backend]
        for ref, out in zip(ref_outs, outs):
            torch.testing.assert_close(out.float(), ref.float(), **tol)
            assert torch.all(out[real:] == 0) and torch.all(ref[real:] == 0)   # padding rows
        for ref, cache in zip(ref_caches, caches):
            assert torch.equal(cache.isnan(), ref.isnan())
            assert torch.equal(cache.nan_to_num(), ref.nan_to_num())


def test_auto_is_cpu_attn_on_a_cpu():
    assert resolve_attn_backend("auto", "cpu") == "cpu_attn"
    assert resolve_attn_backend("auto", "cuda:0") == "triton"
    assert resolve_attn_backend("torch", "cpu") == "torch"
    assert get_attn_backend("torch").__name__.endswith("torch_ref")


def test_auto_on_a_cpu_does_not_import_triton():
    code = ("import sys; from minivllm.attention.backends import get_attn_backend; "
            "import torch; torch.cuda.is_available = lambda: False; get_attn_backend('auto'); "
            "assert 'triton' not in sys.modules, 'triton imported'")
    subprocess.run([sys.executable, "-c", code], check=True)
