"""The engine's CPU kernels (engine/cpu/kernels.c) against torch and float64 references,
on small shapes that reach every code path: vector bodies and scalar tails, row tiles
of 1-3 activation rows, decode rows with split contexts, prefill tiles, grouped-query
heads, block sizes 1 and 16, float32 and bfloat16 caches."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from engine.cpu.build import compile_flags
from engine.cpu.ops import CpuKernels, cpu_kernels
from engine.models.rope import apply_rotary, rotary_table


@pytest.fixture(scope="module")
def k() -> CpuKernels:
    kernels = cpu_kernels()
    if kernels is None:
        pytest.fail("the CPU kernels did not build (gcc missing?)", pytrace=False)
    return kernels


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_kernels_build_with_the_cpus_vector_flags(k):
    """Where the CPU has AVX2 and FMA the library is built for them and says so."""
    flags = compile_flags({"avx2", "fma", "f16c"})
    assert "-mavx2" in flags and "-mfma" in flags
    assert "-mavx2" not in compile_flags(set())
    assert "-mavx512vnni" not in flags
    vnni = compile_flags({"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni"})
    assert "-mavx512vnni" in vnni and "-mprefer-vector-width=256" in vnni
    assert k.simd_level in (0, 2, 3)


@pytest.mark.parametrize("rows,width", [(1, 576), (3, 17), (9, 64)])
def test_add_rms_norm_adds_the_residual_in_place_and_normalises(k, rows, width):
    g = gen(rows)
    x, delta = torch.randn(rows, width, generator=g), torch.randn(rows, width, generator=g)
    w = torch.randn(width, generator=g)
    h = (x + delta).double()
    ref = w.double() * h / torch.sqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5)
    out = k.add_rms_norm(x, delta, w, 1e-5)
    assert torch.allclose(x.double(), h, atol=1e-6)  # the residual stream now holds x + delta
    assert torch.allclose(out.double(), ref, rtol=1e-5, atol=1e-5)
    alone = k.add_rms_norm(delta.clone(), None, w, 1e-5)
    d = delta.double()
    assert torch.allclose(alone.double(), w.double() * d / torch.sqrt(d.pow(2).mean(-1, keepdim=True) + 1e-5),
                          rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("width", [8, 13, 1536])
def test_silu_mul_matches_torch(k, width):
    gu = torch.randn(5, 2 * width, generator=gen(width)) * 6  # reach the exp's clamps
    gate, up = gu.chunk(2, -1)
    assert torch.allclose(k.silu_mul(gu), F.silu(gate) * up, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("head_dim", [16, 64, 20])
def test_rope_rotates_q_and_k_heads_in_place_like_the_reference(k, head_dim):
    h, hkv, t = 4, 2, 7
    table = rotary_table(64, head_dim, 10000.0, None, torch.float32, "cpu")
    qkv = torch.randn(t, (h + 2 * hkv) * head_dim, generator=gen(head_dim))
    positions = torch.tensor([0, 3, 5, 63, 1, 1, 40])
    cos, sin = table[positions].unbind(1)
    heads = qkv.view(t, h + 2 * hkv, head_dim)
    ref = apply_rotary(heads[:, : h + hkv], cos, sin)
    v_before = heads[:, h + hkv:].clone()
    k.rope_(qkv, h + hkv, head_dim, table, positions)
    assert torch.allclose(heads[:, : h + hkv], ref, atol=1e-6)
    assert torch.equal(heads[:, h + hkv:], v_before)  # V untouched


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 7, 17])
@pytest.mark.parametrize("n,width", [(48, 64), (37, 70)])
def test_int8_linear_equals_the_float64_product_of_its_integers(k, rows, n, width):
    """Every row tile (1-3 rows), full and partial 4-row weight tiles, K with and
    without a tail past the vector width, with and without bias, strided x."""
    g = gen(rows * n)
    q = torch.randint(-127, 128, (n, width), dtype=torch.int8, generator=g)
    scale = torch.rand(n, generator=g) + 0.01
    bias = torch.randn(n, generator=g)
    x = torch.randn(rows, width + 5, generator=g)[:, :width]  # rows width+5 floats apart
    ref = (x.double() @ q.double().T) * scale.double()
    assert torch.allclose(k.linear_i8(x, q, scale).double(), ref, rtol=1e-5, atol=1e-4)
    assert torch.allclose(k.linear_i8(x, q, scale, bias).double(), ref + bias.double(), rtol=1e-5, atol=1e-4)


def test_embed_gives_the_scaled_rows(k):
    q = torch.randint(-127, 128, (50, 24), dtype=torch.int8, generator=gen(1))
    scale = torch.rand(50, generator=gen(2))
    full = q.float() * scale[:, None]
    ids = torch.tensor([3, 3, 49, 0])
    assert torch.equal(k.embed_i8(q, scale, ids), full[ids])


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 7, 17])
@pytest.mark.parametrize("n,width", [(48, 64), (37, 96)])
def test_packed_int8_linear_is_within_int16_rounding_of_the_exact_product(k, rows, n, width):
    """The packed kernel quantizes x to int16 per 32 values: each product term carries at
    most half a step of 1/32767 of its block's largest |x|. Partial weight tiles (37 rows)
    are padded with zero rows that never reach the output."""
    g = gen(rows * n + 1)
    q = torch.randint(-127, 128, (n, width), dtype=torch.int8, generator=g)
    scale = torch.rand(n, generator=g) + 0.01
    bias = torch.randn(n, generator=g)
    x = torch.randn(rows, width + 3, generator=g)[:, :width] * torch.logspace(-2, 2, width)  # mixed magnitudes
    packed = k.pack_i8x8(q)
    assert packed.shape == ((n + 7) // 8, width // 32, 256)
    exact = (x.double() @ q.double().T) * scale.double() + bias.double()
    blocks = x.abs().view(rows, width // 32, 32).amax(-1).double() / 32767  # one step per block
    bound = (blocks.repeat_interleave(32, 1) / 2) @ q.double().abs().T * scale.double()
    err = (k.linear_i8_packed(x, packed, scale, bias).double() - exact).abs()
    assert (err <= bound * 1.01 + 1e-4 * exact.abs() + 1e-6).all()
    # a row's result does not depend on the other rows of the call
    assert torch.equal(k.linear_i8_packed(x[:1], packed, scale, bias), k.linear_i8_packed(x, packed, scale, bias)[:1])


def test_vnni_and_avx2_builds_give_bit_identical_linear_results(k, tmp_path):
    """The AVX-512 VNNI path sums the same int16 x int8 products into the same int32 lanes
    as the AVX2 path, so the two builds agree bit for bit (runs where the CPU has VNNI)."""
    import ctypes

    from engine.cpu.build import build, cpu_flags

    if not {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni"} <= cpu_flags():
        pytest.skip("this CPU has no AVX-512 VNNI")
    builds = {}
    for name, cpu in (("avx2", {"avx2", "fma", "f16c"}),
                      ("vnni", {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni"})):
        builds[name] = CpuKernels(ctypes.CDLL(str(build(tmp_path / name, compile_flags(cpu)))))
    assert (builds["avx2"].simd_level, builds["vnni"].simd_level) == (2, 3)
    g = gen(7)
    q = torch.randint(-127, 128, (40, 320), dtype=torch.int8, generator=g)
    scale, x = torch.rand(40, generator=g) + 0.01, torch.randn(5, 320, generator=g) * 30
    packed = k.pack_i8x8(q)
    out = {n: b.linear_i8_packed(x, packed, scale, None) for n, b in builds.items()}
    assert torch.equal(out["avx2"], out["vnni"])


def test_kernel_arguments_of_the_wrong_kind_are_refused(k):
    q = torch.zeros(4, 8, dtype=torch.int8)
    with pytest.raises(ValueError, match="float32"):
        k.linear_i8(torch.zeros(1, 8, dtype=torch.float64), q, torch.ones(4))
    with pytest.raises(ValueError, match="width"):
        k.linear_i8(torch.zeros(1, 9), q, torch.ones(4))
    with pytest.raises(ValueError, match="contiguous"):
        k.linear_i8(torch.zeros(1, 8), q.t().contiguous().t(), torch.ones(4))
    with pytest.raises(ValueError, match="multiple of 32"):
        k.pack_i8x8(q)
    packed = k.pack_i8x8(torch.zeros(4, 64, dtype=torch.int8))
    with pytest.raises(ValueError, match="does not fit"):
        k.linear_i8_packed(torch.zeros(1, 32), packed, torch.ones(4))


# ---- paged attention --------------------------------------------------------------


def paged_case(qlens: list[int], prefixes: list[int], heads: int, kv_heads: int, head_dim: int, block_size: int,
               cache_dtype: torch.dtype, seed: int):
    """A step over a shuffled paged cache: returns the kernel's inputs and a float64
    dense reference of its output. Unused cache slots hold NaN: any stray read shows."""
    g = gen(seed)
    seq = [p + q for p, q in zip(prefixes, qlens)]
    nblocks = [math.ceil(s / block_size) for s in seq]
    total = sum(nblocks) + 3
    perm = torch.randperm(total, generator=g).tolist()
    tables, i = [], 0
    for n in nblocks:
        tables.append(perm[i:i + n])
        i += n
    width = max(nblocks)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    k_cache = torch.full((total, block_size, kv_heads, head_dim), float("nan")).to(cache_dtype)
    v_cache = k_cache.clone()
    keys = [torch.randn(s, kv_heads, head_dim, generator=g) for s in seq]
    values = [torch.randn(s, kv_heads, head_dim, generator=g) for s in seq]
    for b, p in enumerate(prefixes):
        for pos in range(p):
            blk = tables[b][pos // block_size]
            k_cache[blk, pos % block_size] = keys[b][pos].to(cache_dtype)
            v_cache[blk, pos % block_size] = values[b][pos].to(cache_dtype)
    t = sum(qlens)
    qkv = torch.randn(t, (heads + 2 * kv_heads) * head_dim, generator=g)
    q = qkv[:, : heads * head_dim].view(t, heads, head_dim)
    kn = qkv[:, heads * head_dim:(heads + kv_heads) * head_dim].view(t, kv_heads, head_dim)
    vn = qkv[:, (heads + kv_heads) * head_dim:].view(t, kv_heads, head_dim)
    slots, row = [], 0
    for b in range(len(qlens)):
        for j in range(qlens[b]):
            pos = prefixes[b] + j
            slots.append(tables[b][pos // block_size] * block_size + pos % block_size)
            keys[b][pos], values[b][pos] = kn[row], vn[row]
            row += 1
    starts = [0]
    for n in qlens:
        starts.append(starts[-1] + n)
    scale = head_dim ** -0.5
    ref = torch.empty(t, heads, head_dim, dtype=torch.float64)
    group, row = heads // kv_heads, 0
    for b in range(len(qlens)):
        kk, vv = keys[b].to(cache_dtype).double(), values[b].to(cache_dtype).double()
        for j in range(qlens[b]):
            pos = prefixes[b] + j
            for h in range(heads):
                probs = torch.softmax((kk[: pos + 1, h // group] @ q[row, h].double()) * scale, 0)
                ref[row, h] = probs @ vv[: pos + 1, h // group]
            row += 1
    args = (q, kn, vn, torch.tensor(slots), k_cache, v_cache, block_tables, torch.tensor(seq, dtype=torch.int32),
            torch.tensor(starts, dtype=torch.int32), scale)
    return args, ref


CASES = {
    "decode batch": dict(qlens=[1, 1, 1], prefixes=[0, 100, 700]),
    "long decode, split context": dict(qlens=[1], prefixes=[2500]),
    "prefill after a cached prefix": dict(qlens=[37], prefixes=[50]),
    "decode and prefill in one step": dict(qlens=[1, 20, 1, 5], prefixes=[33, 0, 300, 17]),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
def test_paged_attention_matches_dense_float64_attention(k, case, cache_dtype):
    args, ref = paged_case(**CASES[case], heads=9, kv_heads=3, head_dim=64, block_size=16,
                           cache_dtype=cache_dtype, seed=len(case))
    out = k.paged_attention(*args)
    assert torch.isfinite(out).all()
    assert (out.double() - ref).abs().max() < 1e-5


@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size", [(4, 4, 32, 1), (8, 2, 128, 32), (6, 1, 20, 5)])
def test_paged_attention_for_other_head_layouts_and_block_sizes(k, heads, kv_heads, head_dim, block_size):
    args, ref = paged_case([3, 1, 40], [10, 77, 0], heads, kv_heads, head_dim, block_size, torch.float32, seed=heads)
    assert (k.paged_attention(*args).double() - ref).abs().max() < 1e-5


def test_paged_attention_writes_the_steps_keys_and_values_to_their_slots(k):
    args, _ = paged_case([2, 1], [5, 30], 4, 2, 16, 16, torch.bfloat16, seed=7)
    q, kn, vn, slots, k_cache, v_cache = args[:6]
    k.paged_attention(*args)
    flat_k, flat_v = k_cache.view(-1, 2, 16), v_cache.view(-1, 2, 16)
    assert torch.equal(flat_k[slots], kn.to(torch.bfloat16))
    assert torch.equal(flat_v[slots], vn.to(torch.bfloat16))


def test_a_rows_attention_does_not_depend_on_how_the_step_is_split(k):
    """Keys go in fixed chunks with one merge for every row, so a token's output is the same
    bits whether it is decoded alone, decoded beside other requests, or computed inside a
    prefill chunk (the kernel-path engine is batch- and cache-invariant, not just close)."""
    heads, kv_heads, dim, bs = 6, 2, 32, 16
    g = gen(11)
    ctx = 600  # three key chunks
    blocks = -(-(ctx + 1) // bs)
    k_cache = torch.randn(blocks * 3, bs, kv_heads, dim, generator=g).to(torch.bfloat16)
    v_cache = torch.randn(blocks * 3, bs, kv_heads, dim, generator=g).to(torch.bfloat16)
    table = list(range(blocks))
    q_all = torch.randn(40, heads, dim, generator=g)
    kv_new = torch.randn(40, 2, kv_heads, dim, generator=g)

    def run(qlens, prefixes, tables, rows):
        width = max(len(x) for x in tables)
        bt = torch.tensor([x + [0] * (width - len(x)) for x in tables], dtype=torch.int32)
        slots = []
        for n, p, tb in zip(qlens, prefixes, tables):
            slots += [tb[(p + j) // bs] * bs + (p + j) % bs for j in range(n)]
        starts = [0]
        for n in qlens:
            starts.append(starts[-1] + n)
        q = q_all[rows].contiguous()
        kn, vn = kv_new[rows, 0].contiguous(), kv_new[rows, 1].contiguous()
        return k.paged_attention(q, kn, vn, torch.tensor(slots), k_cache, v_cache, bt,
                                 torch.tensor([p + n for p, n in zip(prefixes, qlens)], dtype=torch.int32),
                                 torch.tensor(starts, dtype=torch.int32), dim ** -0.5)

    # the token at position ctx: the last row of a 40-token prefill chunk ...
    chunk = run([40], [ctx - 39], [table], list(range(40)))[-1]
    # ... decoded alone ...
    alone = run([1], [ctx], [table], [39])[0]
    # ... and decoded beside a short and a long request (other blocks of the same cache)
    other = [list(range(blocks, 2 * blocks)), list(range(2 * blocks, 3 * blocks))]
    crowded = run([1, 1, 3], [100, ctx, 500], [other[0], table, other[1]], [5, 39, 6, 7, 8])[1]
    assert torch.equal(chunk, alone) and torch.equal(alone, crowded)


# Decode rows whose contexts end on and beside chunk (256) and page (16) boundaries: a
# first token (one key), a last chunk of one key (257), a context of whole chunks (512),
# odd lengths. Eight requests give enough decode chunks for units that take a chunk of every
# KV head; one request alone is split by KV head and chunk.
SPLIT_PREFIXES = [0, 15, 16, 255, 256, 300, 511, 1201]


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("prefixes", [SPLIT_PREFIXES, [300], [16]], ids=["crowd", "one-300", "one-17"])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
def test_split_decode_attention_matches_dense_float64_attention(k, threads, prefixes, cache_dtype):
    """Decode contexts split across threads by KV head and chunk and merged by log-sum-exp
    (flash-decoding), on one and two threads, through the one-token path that reads
    bfloat16 rows in registers (float32 caches take the general one)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        args, ref = paged_case([1] * len(prefixes), prefixes, heads=9, kv_heads=3, head_dim=64, block_size=16,
                               cache_dtype=cache_dtype, seed=len(prefixes) + threads)
        out = k.paged_attention(*args)
    finally:
        torch.set_num_threads(before)
    assert torch.isfinite(out).all()
    assert (out.double() - ref).abs().max() < 1e-5


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 4, 32), (8, 2, 128), (12, 4, 64), (16, 2, 64)])
def test_split_decode_attention_for_other_head_layouts(k, heads, kv_heads, head_dim):
    """Groups of 1, 3 and 4 query heads a KV head take the one-token path, 8 the general one."""
    args, ref = paged_case([1] * 8, SPLIT_PREFIXES, heads, kv_heads, head_dim, 16, torch.bfloat16, seed=heads)
    assert (k.paged_attention(*args).double() - ref).abs().max() < 1e-5


@pytest.mark.parametrize("prefix", [255, 300])
def test_split_decode_attention_with_fewer_units_than_threads(k, prefix):
    """One KV head of 8 query heads: a 256-key context is one unit, so one of two threads
    gets no work (and 301 keys, one full chunk and a short one)."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        args, ref = paged_case([1], [prefix], 8, 1, 64, 16, torch.bfloat16, seed=prefix)
        out = k.paged_attention(*args)
    finally:
        torch.set_num_threads(before)
    assert (out.double() - ref).abs().max() < 1e-5


def test_a_decode_rows_attention_is_the_same_alone_and_in_a_crowd(k):
    """A request decoded alone (its chunks split by KV head) and beside seven others (units
    that take a chunk of every KV head) gets the same bits; so does the AVX2 build."""
    import ctypes

    from engine.cpu.build import build, cpu_flags

    args, _ = paged_case([1] * 8, SPLIT_PREFIXES, 9, 3, 64, 16, torch.bfloat16, seed=5)
    q, kn, vn, slots, k_cache, v_cache, tables, seq, starts, scale = args
    crowd = k.paged_attention(*args)
    i = SPLIT_PREFIXES.index(1201)
    alone = k.paged_attention(q[i:i + 1].contiguous(), kn[i:i + 1].contiguous(), vn[i:i + 1].contiguous(),
                              slots[i:i + 1].contiguous(), k_cache, v_cache, tables[i:i + 1].contiguous(),
                              seq[i:i + 1].contiguous(), torch.tensor([0, 1], dtype=torch.int32), scale)
    assert torch.equal(alone[0], crowd[i])
    if {"avx2", "fma", "f16c"} <= cpu_flags() and k.simd_level >= 2:
        import tempfile
        from pathlib import Path

        with tempfile.TemporaryDirectory() as tmp:
            avx2 = CpuKernels(ctypes.CDLL(str(build(Path(tmp), compile_flags({"avx2", "fma", "f16c"})))))
            assert torch.equal(avx2.paged_attention(*args), crowd)


@pytest.fixture(scope="module")
def avx2() -> CpuKernels:
    """The AVX2-only build (its own 256-bit attention tiles), built here whatever this CPU's best is."""
    import ctypes
    import tempfile
    from pathlib import Path

    from engine.cpu.build import build, cpu_flags

    if not {"avx2", "fma", "f16c"} <= cpu_flags():
        pytest.skip("this CPU has no AVX2/FMA/F16C")
    kernels = CpuKernels(ctypes.CDLL(str(build(Path(tempfile.mkdtemp()), compile_flags({"avx2", "fma", "f16c"})))))
    assert kernels.simd_level == 2
    return kernels


# Prefill chunks whose lengths are not a multiple of the row tiles (6 rows of scores, 3-6 rows
# of weighted values; a token has G rows), after contexts that end just before, on and just
# after a page (16) and a key chunk (256) boundary, with a second request beside them; the
# causal diagonal runs through the chunk's own key blocks.
EDGE_STEPS = [([7], [16]), ([1, 13], [15, 255]), ([33], [256]), ([16, 5], [0, 257]), ([50], [511]), ([2], [31])]


@pytest.mark.parametrize("qlens,prefixes", EDGE_STEPS)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (8, 2, 64), (5, 5, 32), (6, 1, 16)])
def test_avx2_prefill_attention_tiles_at_their_edges(k, avx2, qlens, prefixes, heads, kv_heads, head_dim):
    """The AVX2 build's prefill tiles match float64 attention at the tile, page and causal
    edges, and give the same bits as the best build (the same per-lane arithmetic)."""
    args, ref = paged_case(qlens, prefixes, heads, kv_heads, head_dim, 16, torch.bfloat16, seed=sum(qlens) + head_dim)
    out = avx2.paged_attention(*args)
    assert torch.isfinite(out).all()
    assert (out.double() - ref).abs().max() < 1e-5
    assert torch.equal(out, k.paged_attention(*args))
