"""Paged-attention backends: the Triton kernels (interpreted on CPU) and the planned CPU backend against
the torch reference, and the torch reference against a naive per-token dense attention written here.
(tests/test_attention_backends.py has all three on random mixed batches.)"""
import math
import subprocess
import sys

import pytest
import torch

from minivllm.attention.backends import cpu_attn, get_attn_backend, torch_ref

triton_attn = get_attn_backend("triton")

GARBAGE_BLOCK = 1 << 20   # block-table entries past a sequence's blocks: must never be dereferenced


def make_case(seqs, num_heads, num_kv_heads, head_dim, block_size, dtype, seed=0, pad_tokens=0):
    """A batch of sequences given as (query_len, seq_len) pairs, their K/V written into a paged cache.

    Blocks are handed out in a random order with spare blocks left over; every cache slot that does
    not hold a real token is NaN, so reading one shows up in the output. Returns the dense per-sequence
    K/V too, for the naive reference.
    """
    g = torch.Generator().manual_seed(seed)
    n_blocks = [math.ceil(s / block_size) for _, s in seqs]
    num_blocks = sum(n_blocks) + 3
    perm = torch.randperm(num_blocks, generator=g)
    block_table = torch.full((len(seqs), max(n_blocks) + 2), GARBAGE_BLOCK, dtype=torch.int32)
    used = 0
    for i, n in enumerate(n_blocks):
        block_table[i, :n] = perm[used:used + n].to(torch.int32)
        used += n
    kv_cache = torch.full((2, num_blocks, block_size, num_kv_heads, head_dim), float("nan"), dtype=dtype)

    keys, values, slots = [], [], []
    for i, (_, s) in enumerate(seqs):
        keys.append(torch.randn(s, num_kv_heads, head_dim, generator=g).to(dtype))
        values.append(torch.randn(s, num_kv_heads, head_dim, generator=g).to(dtype))
        pos = torch.arange(s)
        slots.append(block_table[i, pos // block_size].long() * block_size + pos % block_size)
    # Write the context through reshape_and_cache, with a padding token (slot -1) in between.
    pad = torch.zeros(1, num_kv_heads, head_dim, dtype=dtype)
    torch_ref.reshape_and_cache(torch.cat(keys + [pad]), torch.cat(values + [pad]), kv_cache,
                                torch.cat(slots + [torch.tensor([-1])]))

    q_lens = [q for q, _ in seqs]
    query = torch.randn(sum(q_lens) + pad_tokens, num_heads, head_dim, generator=g).to(dtype)
    query_start_loc = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0).to(torch.int32)
    seq_lens = torch.tensor([s for _, s in seqs], dtype=torch.int32)
    args = (query, kv_cache, block_table, seq_lens, query_start_loc, max(q_lens),
            int(seq_lens.max()), head_dim ** -0.5)
    return args, keys, values


def naive_attention(query, keys, values, seqs, scale):
    """Token by token, head by head, in float64, from the dense K/V (not the cache)."""
    num_heads, num_kv_heads = query.shape[1], keys[0].shape[1]
    out = torch.zeros(query.shape, dtype=torch.float64)
    start = 0
    for (q_len, seq_len), k, v in zip(seqs, keys, values):
        for j in range(q_len):
            p = seq_len - q_len + j                 # absolute position of this query token
            for h in range(num_heads):
                kv = h // (num_heads // num_kv_heads)
                q = query[start + j, h].double()
                w = torch.softmax((k[:p + 1, kv].double() @ q) * scale, dim=0)
                out[start + j, h] = w @ v[:p + 1, kv].double()
        start += q_len
    return out


# (query_len, seq_len): plain prefill, chunked prefill after context, decode, k+1 = 4 verify,
# a one-token sequence, and contexts that cross several 32-position kernel tiles.
MIXED = [(7, 7), (5, 13), (1, 20), (4, 11), (1, 1), (3, 45)]
CONFIGS = [  # num_heads, num_kv_heads, head_dim, block_size, dtype
    (4, 2, 64, 4, torch.float32),
    (6, 1, 48, 8, torch.float32),
    (4, 4, 40, 16, torch.float32),
    (9, 3, 64, 16, torch.float32),      # SmolLM2-135M's heads: a GQA group of 3 (not a power of two)
    (4, 2, 64, 8, torch.bfloat16),
    (6, 1, 40, 4, torch.bfloat16),
    (9, 3, 64, 16, torch.bfloat16),
]


def tol(dtype):
    return dict(atol=2e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,block_size,dtype", CONFIGS)
def test_unified_attention_matches_naive_and_triton(num_heads, num_kv_heads, head_dim, block_size, dtype):
    args, keys, values = make_case(MIXED, num_heads, num_kv_heads, head_dim, block_size, dtype,
                                   seed=block_size + head_dim, pad_tokens=2)
    expected = naive_attention(args[0], keys, values, MIXED, args[-1])
    n = sum(q for q, _ in MIXED)
    ref = torch_ref.unified_attention(*args)
    assert ref.dtype == dtype and ref.shape == args[0].shape
    torch.testing.assert_close(ref[:n].double(), expected[:n], **tol(dtype))
    assert torch.all(ref[n:] == 0)       # batch padding rows
    tri = triton_attn.unified_attention(*args)
    assert tri.dtype == dtype
    torch.testing.assert_close(tri.double(), ref.double(), **tol(dtype))
    cpu = cpu_attn.unified_attention(*args, shared={})
    assert cpu.dtype == dtype
    torch.testing.assert_close(cpu.double(), ref.double(), **tol(dtype))


@pytest.mark.parametrize("seqs", [
    [(20, 20)],                            # one prefill longer than a query tile
    [(1, 37)], [(6, 25)],                  # a lone decode, a lone prefill chunk
    [(1, 9), (1, 33), (1, 2), (1, 16)],   # pure decode
    [(4, 9), (4, 30), (4, 4)],            # spec-decode verify only
    [(40, 40), (1, 50), (1, 3), (2, 30)], # long prefill next to decodes: cpu_attn splits the batch
])
def test_batch_shapes(seqs):
    args, keys, values = make_case(seqs, 4, 2, 64, 8, torch.float32, seed=len(seqs))
    expected = naive_attention(args[0], keys, values, seqs, args[-1])
    torch.testing.assert_close(torch_ref.unified_attention(*args).double(), expected, **tol(torch.float32))
    torch.testing.assert_close(triton_attn.unified_attention(*args).double(), expected,
                               **tol(torch.float32))
    torch.testing.assert_close(cpu_attn.unified_attention(*args).double(), expected,
                               **tol(torch.float32))


@pytest.mark.parametrize("seqs", [MIXED, MIXED + [(20, 24)]], ids=["short", "with_long"])
@pytest.mark.parametrize("waste", [0.0, float("inf")])
def test_cpu_attn_schedule_does_not_change_results(monkeypatch, waste, seqs):
    # 0: every long query runs alone; inf: one padded batch for everything once a query is long
    # (all-short batches always run in length-sorted groups).
    monkeypatch.setattr(cpu_attn, "_MAX_PADDING_WASTE", waste)
    args, keys, values = make_case(seqs, 6, 2, 48, 4, torch.float32, seed=3)
    shared = {}
    expected = naive_attention(args[0], keys, values, seqs, args[-1])
    torch.testing.assert_close(cpu_attn.unified_attention(*args, shared=shared).double(),
                               expected, **tol(torch.float32))
    groups = shared[("plan", 4, 3, torch.float32)]
    if seqs is not MIXED:
        assert len(groups) == (1 if waste == float("inf") else 2)   # short ones + the long one


@pytest.mark.parametrize("group_seqs", [1, 3, 64])
def test_cpu_attn_plan_shared_by_layers_gives_each_layer_its_own_result(monkeypatch, group_seqs):
    """The per-step plan (length-sorted groups of decodes and verifies, their gather indices and
    masks) is built by the first layer and reused by the next, whose query and cache differ: both
    layers must match the naive attention, in every grouping, including equal-length decodes."""
    monkeypatch.setattr(cpu_attn, "_GROUP_SEQS", group_seqs)
    seqs = [(1, 9), (1, 30), (4, 17), (1, 30), (1, 2), (2, 40), (1, 23), (30, 30)]
    shared = {}
    args, keys, values = make_case(seqs, 6, 2, 32, 4, torch.float32, seed=1)
    for layer in range(2):   # two layers of one step: same metadata, other queries and K/V
        f = 1.0 + layer
        query, kv_cache = args[0] * (1 / f), args[1] * f + layer   # NaN slots stay NaN
        out = cpu_attn.unified_attention(query, kv_cache, *args[2:], shared=shared)
        expected = naive_attention(query, [k * f + layer for k in keys],
                                   [v * f + layer for v in values], seqs, args[-1])
        torch.testing.assert_close(out.double(), expected, **tol(torch.float32))
    assert any(k[0] == "plan" for k in shared)
    # reshape_and_cache keeps the step's slots in `shared` too: two layers, one slot mapping.
    slots = torch.tensor([5, -1, 0, 9], dtype=torch.long)
    written = {}
    for layer in range(2):
        k, v = torch.randn(4, 2, 8), torch.randn(4, 2, 8)
        for name, sh in (("shared", written), ("alone", None)):
            cache = torch.full((2, 3, 4, 2, 8), float("nan"))
            cpu_attn.reshape_and_cache(k, v, cache, slots, shared=sh)
            torch.testing.assert_close(cache[0].reshape(12, 2, 8)[[5, 0, 9]], k[[0, 2, 3]])
            torch.testing.assert_close(cache[1].reshape(12, 2, 8)[[5, 0, 9]], v[[0, 2, 3]])
            assert int(cache[0].reshape(12, 2, 8).isnan().all(-1).all(-1).sum()) == 9
    equal = [(1, 12)] * 5   # equal-length decodes: no mask at all
    args, keys, values = make_case(equal, 4, 2, 16, 4, torch.float32, seed=4)
    torch.testing.assert_close(cpu_attn.unified_attention(*args, shared={}).double(),
                               naive_attention(args[0], keys, values, equal, args[-1]),
                               **tol(torch.float32))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group_seqs", [1, 3, 16])
def test_cpu_attn_bmm_path_matches_naive(monkeypatch, dtype, group_seqs):
    """Short queries in 16-bit dtypes run as two batched matmuls over a head-major gather
    (``cpu_attn_bmm.py``). Here it is switched on for float32 too, where it must match the naive
    attention as tightly as SDPA does: decodes, verifies and a long prefill beside them (which
    stays on SDPA), two layers sharing one plan, never-written (NaN) slots kept out. A cache that
    is not contiguous cannot be seen as rows of head_dim, so it takes SDPA, with the same result."""
    monkeypatch.setattr(cpu_attn, "_BMM_DTYPES", (dtype,))
    monkeypatch.setattr(cpu_attn, "_BMM_GROUP_SEQS", group_seqs)
    seqs = [(1, 9), (1, 30), (4, 17), (1, 30), (1, 2), (2, 40), (1, 23), (30, 30)]
    args, keys, values = make_case(seqs, 9, 3, 64, 16, dtype, seed=7)
    shared = {}
    for layer in range(2):
        f = 1.0 + layer
        query, kv_cache = args[0] * (1 / f), args[1] * f + layer
        out = cpu_attn.unified_attention(query, kv_cache, *args[2:], shared=shared)
        expected = naive_attention(query, [k * f + layer for k in keys],
                                   [v * f + layer for v in values], seqs, args[-1])
        torch.testing.assert_close(out.double(), expected, **tol(dtype))
    plan = shared[("plan", 16, 3, dtype)]
    bmm = [g.kv_rows is not None for g in plan]   # the rows that only cpu_attn_bmm gathers by
    assert bmm == [True] * -(-7 // group_seqs) + [False]   # 7 short queries, 1 long
    wide = torch.cat([args[1], torch.zeros_like(args[1])], dim=-1)[..., :64]
    assert not wide.is_contiguous()
    out = cpu_attn.unified_attention(args[0], wide, *args[2:], shared={})
    torch.testing.assert_close(out.double(), naive_attention(args[0], keys, values, seqs, args[-1]),
                               **tol(dtype))


@pytest.mark.parametrize("backend", ["torch", "cpu_attn", "triton"])
def test_strided_query(backend):
    # Models split a fused qkv projection, so the query rows are strided views.
    seqs = [(3, 10), (1, 7)]
    args, keys, values = make_case(seqs, 4, 2, 64, 4, torch.float32, seed=5)
    query = args[0]
    fused = torch.cat([query.flatten(1), torch.randn(query.shape[0], 128)], dim=1)
    strided = fused[:, :query[0].numel()].view_as(query)
    assert not strided.is_contiguous()
    out = get_attn_backend(backend).unified_attention(strided, *args[1:])
    torch.testing.assert_close(out.double(), naive_attention(query, keys, values, seqs, args[-1]),
                               **tol(torch.float32))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_kv_heads,head_dim,block_size", [(2, 64, 4), (3, 40, 16), (1, 48, 8)])
def test_reshape_and_cache_triton_matches_torch(dtype, num_kv_heads, head_dim, block_size):
    g = torch.Generator().manual_seed(head_dim)
    num_blocks, num_tokens = 6, 17
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=g).to(dtype)
    # Strided key/value, as split from a fused projection.
    kv = torch.randn(num_tokens, 2 * num_kv_heads * head_dim + 8, generator=g).to(dtype)
    key = kv[:, :num_kv_heads * head_dim].view(num_tokens, num_kv_heads, head_dim)
    value = kv[:, num_kv_heads * head_dim:2 * num_kv_heads * head_dim].view_as(key)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:num_tokens]
    slots[[0, 5, 16]] = -1                                  # padding tokens are skipped
    expected, got = cache.clone(), cache.clone()
    torch_ref.reshape_and_cache(key, value, expected, slots)
    triton_attn.reshape_and_cache(key, value, got, slots)
    assert torch.equal(got, expected)
    got = cache.clone()
    cpu_attn.reshape_and_cache(key, value, got, slots, shared={})
    assert torch.equal(got, expected)
    keep = slots >= 0
    b, o = slots[keep] // block_size, slots[keep] % block_size
    assert torch.equal(expected[0, b, o], key[keep]) and torch.equal(expected[1, b, o], value[keep])
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool)
    untouched[slots[keep]] = False
    assert torch.equal(expected.flatten(1, 2)[:, untouched], cache.flatten(1, 2)[:, untouched])


@pytest.mark.parametrize("backend", ["torch", "cpu_attn", "triton"])
def test_attention_layer_prefill_then_decode(backend):
    # Through minivllm.attention.layer.Attention: prefill 5 tokens, then decode 1, in a 4-block cache.
    from minivllm.attention.layer import Attention
    from minivllm.attention.metadata import AttentionMetadata
    from minivllm.forward_context import set_forward_context
    H, Hkv, D, bs = 4, 2, 16, 4
    layer = Attention(H, D, D ** -0.5, Hkv, prefix="layers.0", backend=backend)
    layer.kv_cache = torch.zeros(2, 4, bs, Hkv, D)
    block_ids = torch.tensor([[3, 1]], dtype=torch.int32)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(6, n * D, generator=g) for n in (H, Hkv, Hkv))
    outs = []
    for tokens in (range(0, 5), range(5, 6)):
        pos = torch.tensor(list(tokens))
        md = AttentionMetadata(
            num_actual_tokens=len(pos), query_start_loc=torch.tensor([0, len(pos)], dtype=torch.int32),
            seq_lens=torch.tensor([tokens.stop], dtype=torch.int32), block_table=block_ids,
            slot_mapping=block_ids[0, pos // bs].long() * bs + pos % bs,
            max_query_len=len(pos), max_seq_len=tokens.stop)
        with set_forward_context(md, {"layers.0": layer}):
            outs.append(layer(q[pos], k[pos], v[pos]))
    seqs = [(6, 6)]
    expected = naive_attention(q.view(6, H, D), [k.view(6, Hkv, D)], [v.view(6, Hkv, D)], seqs, D ** -0.5)
    torch.testing.assert_close(torch.cat(outs).double(), expected.view(6, H * D), **tol(torch.float32))


def test_registry():
    assert get_attn_backend("torch") is torch_ref
    assert get_attn_backend("cpu_attn") is cpu_attn
    assert get_attn_backend("auto") is (triton_attn if torch.cuda.is_available() else cpu_attn)
    for backend in (torch_ref, cpu_attn, triton_attn):
        assert callable(backend.reshape_and_cache) and callable(backend.unified_attention)
    with pytest.raises(ValueError, match="torch.*triton"):
        get_attn_backend("flash_attn")


def test_default_backend_does_not_import_triton():
    code = ("import sys; from minivllm.attention.backends import get_attn_backend; "
            "get_attn_backend('torch'); get_attn_backend('cpu_attn'); "
            "assert 'triton' not in sys.modules, 'triton imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_cpu_attn_outside_inference_mode_after_an_engine_step():
    # The engine steps under inference_mode; cpu_attn's reused gather buffers from there are
    # inference tensors, so a later direct call (a notebook cell, a test) must not write into them.
    seqs = [(3, 10), (1, 7)]
    args, keys, values = make_case(seqs, 4, 2, 64, 4, torch.float32, seed=7)
    expected = naive_attention(args[0], keys, values, seqs, args[-1])
    with torch.inference_mode():
        cpu_attn.unified_attention(*args)
    torch.testing.assert_close(cpu_attn.unified_attention(*args).double(), expected,
                               **tol(torch.float32))
