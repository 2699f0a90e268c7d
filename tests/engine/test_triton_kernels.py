"""Triton attention kernels, the Triton backend and the CUDA-graph decode runner, on the CPU.

Kernels run under Triton's interpreter (``TRITON_INTERPRET=1``, set below before
triton is imported). Each kernel is checked against a dense causal attention in
float64 over the requests' logical K/V, on fresh random inputs every run (the
seed is printed, and ``TEST_SEED=<n>`` replays one): shuffled block tables, GQA
ratios 1/4/8, prefixes of 0 to several blocks, block_size 1 and 16. Unused cache
slots hold NaN and outputs are NaN-poisoned before each call, so a read outside a
request's keys or an element left unwritten fails the check.

The CUDA-graph runner's capture needs CUDA; here its bucket choice, its padding
and its static-buffer forward (run eagerly) are checked on a tiny model.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before any import of triton

import importlib.util  # noqa: E402
import math  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from engine.cuda_graph import CudaGraphDecodeRunner, StaticDecodeInputs, bucket_for, capture_sizes  # noqa: E402
from engine.forward_batch import ForwardBatch  # noqa: E402

HAVE_TRITON = importlib.util.find_spec("triton") is not None


def triton_test(fn):  # noqa: ANN001, ANN201
    """Mark a test that runs Triton kernels (interpreted); skipped without triton."""
    return pytest.mark.triton(pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed")(fn))


TOL = {torch.float32: 1e-5, torch.bfloat16: 1.5e-2}


def case_id(case: tuple) -> str:
    """A readable test id for (num_heads, num_kv_heads, head_dim, block_size, dtype)."""
    h, hkv, d, bs, dtype = case
    return f"gqa{h // hkv}-h{h}-d{d}-bs{bs}-{str(dtype).removeprefix('torch.')}"


def fresh_seed() -> int:
    """``TEST_SEED`` when set, else a new random seed; printed so a failure can be replayed."""
    seed = int(os.environ.get("TEST_SEED") or int.from_bytes(os.urandom(4), "little"))
    print(f"seed={seed} (TEST_SEED={seed} replays this run)")
    return seed


@pytest.fixture
def gen() -> torch.Generator:
    """A torch generator seeded afresh for each test."""
    return torch.Generator().manual_seed(fresh_seed())


@dataclass
class Paged:
    """Requests' logical K/V ([L, Hkv, D] each) and the NaN-poisoned paged cache holding them."""

    k_cache: torch.Tensor
    v_cache: torch.Tensor
    tables: list[list[int]]
    block_tables: torch.Tensor  # [B, max_blocks] int32, padded with 0
    keys: list[torch.Tensor]
    values: list[torch.Tensor]


def make_paged(gen: torch.Generator, cached_lens: list[int], total_lens: list[int], num_kv_heads: int,
               head_dim: int, block_size: int, dtype: torch.dtype) -> Paged:
    """Draw K/V for ``total_lens`` tokens per request; write the first ``cached_lens`` of
    them into shuffled blocks of a cache whose every other slot is NaN."""
    need = [-(-n // block_size) for n in total_lens]
    num_blocks = sum(need) + 3
    order = torch.randperm(num_blocks, generator=gen).tolist()
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    v_cache = torch.full(shape, float("nan"), dtype=dtype)
    tables, keys, values, start = [], [], [], 0
    for n_blocks, cached, total in zip(need, cached_lens, total_lens):
        table = order[start:start + n_blocks]
        start += n_blocks
        k = torch.randn((total, num_kv_heads, head_dim), generator=gen).to(dtype)
        v = torch.randn((total, num_kv_heads, head_dim), generator=gen).to(dtype)
        pos = torch.arange(cached)
        blocks = torch.tensor(table, dtype=torch.int64)[pos // block_size] if cached else pos
        k_cache[blocks, pos % block_size] = k[:cached]
        v_cache[blocks, pos % block_size] = v[:cached]
        tables.append(table)
        keys.append(k)
        values.append(v)
    width = max(1, max(len(t) for t in tables))
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    return Paged(k_cache, v_cache, tables, block_tables, keys, values)


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: list[int],
                    scale: float) -> torch.Tensor:
    """float64 reference: q [n, H, D] at absolute ``positions`` over k/v [L, Hkv, D],
    query i seeing keys 0..positions[i]; query head h reads KV head h // (H // Hkv)."""
    group = q.shape[1] // k.shape[1]
    k64 = k.double().repeat_interleave(group, dim=1)
    v64 = v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("nhd,lhd->hnl", q.double(), k64) * scale
    hidden = torch.arange(k.shape[0])[None, :] > torch.tensor(positions)[:, None]
    scores = scores.masked_fill(hidden[None], float("-inf"))
    return torch.einsum("hnl,lhd->nhd", scores.softmax(-1), v64)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64 (NaN when out holds NaN)."""
    return float((out.double() - ref).norm() / ref.norm())


# --------------------------------------------------------------------------- KV write


@triton_test
@pytest.mark.parametrize("block_size", [1, 16])
def test_store_kv_writes_each_row_to_its_slot_and_skips_negative_slots(gen, block_size):
    from engine.attention.triton_kernels.kv_write import store_kv

    num_blocks, hkv, d = 5, 2, 64
    k_cache = torch.randn((num_blocks, block_size, hkv, d), generator=gen)
    v_cache = torch.randn((num_blocks, block_size, hkv, d), generator=gen)
    before_k, before_v = k_cache.clone(), v_cache.clone()
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:4]
    slots = torch.cat([slots[:2], torch.tensor([-1]), slots[2:]])  # a padding row in the middle
    # k and v as views of one fused projection, as the model hands them.
    fused = torch.randn((5, 3 * hkv, d), generator=gen)
    k, v = fused[:, hkv:2 * hkv], fused[:, 2 * hkv:]
    store_kv(k, v, k_cache, v_cache, slots)
    flat_k, flat_v = k_cache.view(-1, hkv, d), v_cache.view(-1, hkv, d)
    live = slots >= 0
    assert torch.equal(flat_k[slots[live]], k[live])
    assert torch.equal(flat_v[slots[live]], v[live])
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool)
    untouched[slots[live]] = False
    assert torch.equal(flat_k[untouched], before_k.view(-1, hkv, d)[untouched])
    assert torch.equal(flat_v[untouched], before_v.view(-1, hkv, d)[untouched])


# --------------------------------------------------------------------------- decode

DECODE_CASES = [
    # (num_heads, num_kv_heads, head_dim, block_size, dtype)
    (2, 2, 64, 16, torch.float32),  # GQA 1 (MHA)
    (8, 2, 64, 1, torch.float32),  # GQA 4, one token per block
    (8, 1, 64, 16, torch.float32),  # GQA 8
    (4, 1, 128, 16, torch.float32),  # head_dim 128
    (8, 2, 64, 16, torch.bfloat16),
]


def run_decode(q, paged, seq_lens, scale, split_tokens, max_splits):
    """Launch the decode kernels with a NaN-poisoned output; returns it."""
    from engine.attention.triton_kernels.decode import decode_attention, decode_workspace, num_splits_for
    from engine.attention.triton_kernels.launch import decode_tiles

    b, h, d = q.shape
    tiles = decode_tiles(d, h // paged.k_cache.shape[2], q.dtype)
    splits = num_splits_for(max(seq_lens), split_tokens, max_splits, tiles)
    mid_o, mid_lse = decode_workspace(b, h, splits, d, q.device)
    mid_o.fill_(float("nan"))
    mid_lse.fill_(float("nan"))
    out = torch.full_like(q, float("nan"))
    decode_attention(q, paged.k_cache, paged.v_cache, paged.block_tables, torch.tensor(seq_lens, dtype=torch.int32),
                     out, scale, num_splits=splits, split_tokens=split_tokens, max_splits=max_splits,
                     mid_o=mid_o, mid_lse=mid_lse, tiles=tiles)
    return out


@triton_test
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,block_size,dtype", DECODE_CASES,
                         ids=[case_id(c) for c in DECODE_CASES])
def test_decode_matches_dense_attention(gen, num_heads, num_kv_heads, head_dim, block_size, dtype):
    # Lengths: one token, inside one block, several blocks and splits, and one past
    # split_tokens * max_splits (longer splits).
    seq_lens = [1, int(torch.randint(2, 16, (1,), generator=gen)), int(torch.randint(40, 70, (1,), generator=gen)), 97]
    paged = make_paged(gen, seq_lens, seq_lens, num_kv_heads, head_dim, block_size, dtype)
    q = torch.randn((len(seq_lens), num_heads, head_dim), generator=gen).to(dtype)
    scale = head_dim ** -0.5
    out = run_decode(q, paged, seq_lens, scale, split_tokens=16, max_splits=4)
    assert not out.isnan().any(), "decode left elements unwritten or read a NaN slot"
    for b, n in enumerate(seq_lens):
        ref = dense_attention(q[b:b + 1], paged.keys[b], paged.values[b], [n - 1], scale)
        err = rel_err(out[b:b + 1], ref)
        assert err < TOL[dtype], f"request {b} (seq_len {n}): relative error {err:.2e}"


@triton_test
def test_decode_zero_length_row_is_zero_and_neighbours_unchanged(gen):
    # A CUDA-graph padding row has seq_len 0: its output must be 0 (not NaN), and a
    # request's output must be bit-identical with or without longer neighbours.
    seq_lens = [0, 23, 150]
    paged = make_paged(gen, seq_lens, seq_lens, 2, 64, 16, torch.float32)
    q = torch.randn((3, 8, 64), generator=gen)
    together = run_decode(q, paged, seq_lens, 0.125, split_tokens=16, max_splits=4)
    assert torch.equal(together[0], torch.zeros_like(together[0]))
    alone = Paged(paged.k_cache, paged.v_cache, paged.tables[1:2], paged.block_tables[1:2], [], [])
    solo = run_decode(q[1:2], alone, [23], 0.125, split_tokens=16, max_splits=4)
    assert torch.equal(solo[0], together[1])


# --------------------------------------------------------------------------- extend

EXTEND_CASES = [
    # (num_heads, num_kv_heads, head_dim, block_size, dtype)
    (2, 2, 64, 16, torch.float32),
    (8, 2, 64, 1, torch.float32),
    (8, 1, 64, 16, torch.float32),
    (4, 2, 128, 16, torch.float32),
    (4, 1, 64, 16, torch.bfloat16),
]


@triton_test
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,block_size,dtype", EXTEND_CASES,
                         ids=[case_id(c) for c in EXTEND_CASES])
def test_extend_matches_dense_attention(gen, num_heads, num_kv_heads, head_dim, block_size, dtype):
    from engine.attention.triton_kernels.extend import extend_attention

    # (prefix, new tokens): a fresh prompt longer than one query tile, a chunk after a
    # prefix of several blocks, a decode-like single token after a partial block.
    r = lambda lo, hi: int(torch.randint(lo, hi, (1,), generator=gen))  # noqa: E731
    shapes = [(0, r(17, 24)), (r(33, 60), r(2, 9)), (r(1, 15), 1)]
    totals = [p + n for p, n in shapes]
    paged = make_paged(gen, totals, totals, num_kv_heads, head_dim, block_size, dtype)
    qlens = [n for _, n in shapes]
    starts = [0]
    for n in qlens:
        starts.append(starts[-1] + n)
    q = torch.randn((starts[-1], num_heads, head_dim), generator=gen).to(dtype)
    out = torch.full_like(q, float("nan"))
    scale = head_dim ** -0.5
    extend_attention(q, paged.k_cache, paged.v_cache, paged.block_tables,
                     torch.tensor(starts, dtype=torch.int32), torch.tensor([p for p, _ in shapes], dtype=torch.int32),
                     out, scale, max_query_len=max(qlens))
    assert not out.isnan().any(), "extend left elements unwritten or read a NaN slot"
    for b, (prefix, n) in enumerate(shapes):
        rows = slice(starts[b], starts[b + 1])
        ref = dense_attention(q[rows], paged.keys[b], paged.values[b], list(range(prefix, prefix + n)), scale)
        err = rel_err(out[rows], ref)
        assert err < TOL[dtype], f"request {b} (prefix {prefix}, {n} new): relative error {err:.2e}"


# --------------------------------------------------------------------------- backend


def step_inputs(gen, shapes, num_heads, num_kv_heads, head_dim, block_size):
    """A ForwardBatch for requests ``shapes`` = [(prefix, new)], its q/k/v, and a cache
    holding the prefixes; plus the logical K/V for the reference."""
    totals = [p + n for p, n in shapes]
    paged = make_paged(gen, [p for p, _ in shapes], totals, num_kv_heads, head_dim, block_size, torch.float32)
    batch = ForwardBatch.build(token_chunks=[[0] * n for _, n in shapes], prefix_lens=[p for p, _ in shapes],
                               block_tables=paged.tables, sample_mask=[True] * len(shapes), block_size=block_size)
    q = torch.randn((batch.num_tokens, num_heads, head_dim), generator=gen)
    k = torch.cat([paged.keys[b][p:] for b, (p, _) in enumerate(shapes)])
    v = torch.cat([paged.values[b][p:] for b, (p, _) in enumerate(shapes)])
    return batch, q, k, v, paged


@triton_test
@pytest.mark.parametrize("kind", ["mixed", "decode"])
def test_triton_backend_matches_torch_backend(gen, kind):
    from engine.attention.torch_backend import TorchAttentionBackend
    from engine.attention.triton_backend import TritonAttentionBackend, TritonBackendConfig

    block_size, h, hkv, d = 16, 8, 2, 64
    if kind == "mixed":  # a fresh prompt, a chunk over a cached prefix, and two decodes
        shapes = [(0, 19), (21, 6), (40, 1), (0, 1)]
    else:
        shapes = [(5, 1), (16, 1), (70, 1)]
    batch, q, k, v, paged = step_inputs(gen, shapes, h, hkv, d, block_size)
    scale = d ** -0.5

    torch_kc, torch_vc = paged.k_cache.clone(), paged.v_cache.clone()
    ref_backend = TorchAttentionBackend()
    ref_backend.prepare(batch)
    ref = ref_backend.forward(q, k, v, torch_kc, torch_vc, batch, scale)

    backend = TritonAttentionBackend(TritonBackendConfig(split_tokens=16, max_splits=4))
    backend.prepare(batch)
    out = torch.full_like(q, float("nan"))
    got = backend.forward(q, k, v, paged.k_cache, paged.v_cache, batch, scale, out=out)
    assert got.data_ptr() == out.data_ptr()
    assert not out.isnan().any()
    err = rel_err(out, ref.double())
    assert err < 1e-5, f"triton vs torch backend: relative error {err:.2e}"
    # Both stored the step's K/V in the same slots and nothing else.
    torch.testing.assert_close(paged.k_cache, torch_kc, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(paged.v_cache, torch_vc, rtol=0, atol=0, equal_nan=True)
    # And against the float64 reference, request by request.
    start = 0
    for b, (p, n) in enumerate(shapes):
        want = dense_attention(q[start:start + n], paged.keys[b], paged.values[b], list(range(p, p + n)), scale)
        assert rel_err(out[start:start + n], want) < 1e-5
        start += n


@triton_test
def test_triton_backend_forward_without_prepare_raises(gen):
    from engine.attention.triton_backend import TritonAttentionBackend

    batch, q, k, v, paged = step_inputs(gen, [(0, 2)], 2, 2, 64, 16)
    with pytest.raises(RuntimeError, match="prepare"):
        TritonAttentionBackend().forward(q, k, v, paged.k_cache, paged.v_cache, batch, 0.125)


# --------------------------------------------------------------------------- CUDA-graph runner (CPU parts)


def test_capture_sizes_are_powers_of_two_then_the_maximum():
    assert capture_sizes(1) == [1]
    assert capture_sizes(16) == [1, 2, 4, 8, 16]
    assert capture_sizes(48) == [1, 2, 4, 8, 16, 32, 48]
    with pytest.raises(ValueError):
        capture_sizes(0)


def test_bucket_for_picks_the_smallest_bucket_that_holds_the_batch():
    sizes = capture_sizes(48)
    assert [bucket_for(n, sizes) for n in (1, 2, 3, 5, 16, 17, 33, 48)] == [1, 2, 4, 8, 16, 32, 48, 48]
    assert bucket_for(0, sizes) is None
    assert bucket_for(49, sizes) is None


def decode_batch(gen, seq_lens, block_size, num_blocks=64):
    """A decode ForwardBatch whose requests own random distinct blocks."""
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables, start = [], 0
    for n in seq_lens:
        need = -(-n // block_size)
        tables.append(order[start:start + need])
        start += need
    ids = torch.randint(0, 100, (len(seq_lens),), generator=gen).tolist()
    return ForwardBatch.build(token_chunks=[[i] for i in ids], prefix_lens=[n - 1 for n in seq_lens],
                              block_tables=tables, sample_mask=[True] * len(seq_lens), block_size=block_size)


def test_static_inputs_copy_live_rows_and_pad_the_rest(gen):
    static = StaticDecodeInputs.allocate(8, max_blocks=6, device="cpu")
    static.load(decode_batch(gen, [40, 3, 70, 17, 9], 16), bucket=8)  # dirty every row first
    batch = decode_batch(gen, [5, 33, 18], 16)
    static.load(batch, bucket=4)
    assert torch.equal(static.input_ids[:3], batch.input_ids)
    assert torch.equal(static.positions[:3], batch.positions)
    assert torch.equal(static.slot_mapping[:3], batch.slot_mapping)
    assert torch.equal(static.seq_lens[:3], batch.seq_lens)
    assert torch.equal(static.prefix_lens[:3], batch.prefix_lens)
    for b, n in enumerate(batch.seq_lens_cpu):
        live = -(-n // 16)
        assert torch.equal(static.block_tables[b, :live], batch.block_tables[b, :live])
    # Row 3 is padding: no KV slot, no context.
    assert static.slot_mapping[3].item() == -1
    assert static.seq_lens[3].item() == 0
    assert static.input_ids[3].item() == 0
    view = static.batch_view(4, block_size=16, max_seq_len=96)
    assert view.num_seqs == 4 and view.is_decode and view.max_seq_len == 96
    assert torch.equal(view.query_start_loc, torch.arange(5, dtype=torch.int32))
    assert torch.equal(view.logits_indices, torch.arange(4))
    with pytest.raises(ValueError):
        static.load(decode_batch(gen, [5] * 5, 16), bucket=4)


def tiny_model(dtype=torch.float32):
    """A 2-layer random Llama (4 heads, 2 KV heads, head_dim 16), our implementation."""
    from transformers import LlamaConfig

    from engine.config import ModelConfig
    from engine.models.llama import LlamaForCausalLM

    hf = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                     tie_word_embeddings=False)
    hf.architectures = ["LlamaForCausalLM"]
    cfg = ModelConfig.from_hf(hf)
    model = LlamaForCausalLM(cfg, dtype, "cpu")
    with torch.no_grad():
        for _, p in model.named_parameters():
            p.copy_(torch.ones_like(p) if p.dim() == 1 else torch.randn_like(p) / math.sqrt(p.shape[-1]))
    return model, cfg


@triton_test
def test_graph_runner_static_path_matches_eager_decode(gen):
    from engine.attention.triton_backend import TritonAttentionBackend, TritonBackendConfig
    from engine.kv_cache import KVCache

    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen)))
    model, cfg = tiny_model()
    block_size, max_len = 16, 128
    kv = KVCache.allocate(cfg, 40, block_size, torch.float32, "cpu")
    for t in kv.k_caches + kv.v_caches:
        t.normal_()  # a cache full of history: padding rows must not disturb it
    batch = decode_batch(gen, [9, 40, 17], block_size, num_blocks=40)
    eager_kv = KVCache([t.clone() for t in kv.k_caches], [t.clone() for t in kv.v_caches], 40, block_size)
    before = [t.clone() for t in kv.k_caches + kv.v_caches]

    # Small splits, so the eager step (3 splits) and the runner's bound (4) differ.
    config = TritonBackendConfig(split_tokens=16, max_splits=4)
    attn = TritonAttentionBackend(config)
    attn.prepare(batch)
    want = model.forward(batch, eager_kv, attn)

    runner = CudaGraphDecodeRunner(model, kv, TritonAttentionBackend(config), max_batch_size=6, max_model_len=max_len,
                                   block_size=block_size, device="cpu", use_graphs=False)
    assert runner.sizes == [1, 2, 4, 6]
    assert runner.can_run(batch)
    prefill = ForwardBatch.build(token_chunks=[[1, 2]], prefix_lens=[0], block_tables=[[0]], sample_mask=[True],
                                 block_size=block_size)
    assert not runner.can_run(prefill)
    assert not runner.can_run(decode_batch(gen, [3] * 7, block_size, num_blocks=40))  # above the largest bucket
    assert not runner.can_run(decode_batch(gen, [max_len + 1], block_size, num_blocks=40))
    got = runner.run(batch)  # bucket 4: one padding row
    assert runner.captured_sizes == [4]
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    for mine, theirs, old in zip(kv.k_caches + kv.v_caches, eager_kv.k_caches + eager_kv.v_caches, before):
        # The same slots written (a padding row writes nowhere), with the same values up to
        # rounding: a 4-row matmul may round differently from a 3-row one (seen with MKL).
        written_mine = (mine != old).flatten(2).any(-1)  # [num_blocks, block_size] slots
        written_theirs = (theirs != old).flatten(2).any(-1)
        assert torch.equal(written_mine, written_theirs), "the padded step wrote other KV slots than the eager step"
        assert int(written_mine.sum()) == len(batch.slot_mapping)
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-5)


def test_graph_runner_refuses_a_backend_that_cannot_be_captured():
    from engine.attention.torch_backend import TorchAttentionBackend

    with pytest.raises(ValueError, match="cannot be captured"):
        CudaGraphDecodeRunner(None, None, TorchAttentionBackend(), max_batch_size=4, max_model_len=64,
                              block_size=16, device="cpu", use_graphs=False)


# --------------------------------------------------------------------------- bench/gpu (CPU parts)

ROOT = str(Path(__file__).resolve().parents[2])


def test_bench_counts_bytes_and_flops_from_the_shapes():
    from bench.gpu.kernels import decode_bytes, extend_flops, kv_write_bytes

    h, hkv, d = 8, 2, 64
    k_row = torch.empty((hkv, d), dtype=torch.bfloat16)
    q_row = torch.empty((h, d), dtype=torch.bfloat16)
    seq_lens = [3, 10, 1]
    read_kv = sum(2 * n * k_row.numel() * k_row.element_size() for n in seq_lens)
    q_and_out = 2 * len(seq_lens) * q_row.numel() * q_row.element_size()
    assert decode_bytes(seq_lens, h, hkv, d, 2) == read_kv + q_and_out
    prefix, qlens = [0, 5, 17], [4, 1, 3]
    visible_pairs = sum(1 for p, q in zip(prefix, qlens) for i in range(q) for _ in range(p + i + 1))
    assert extend_flops(prefix, qlens, h, d) == 2 * 2 * d * h * visible_pairs
    assert kv_write_bytes(10, hkv, d, 2) == 2 * 2 * 10 * k_row.numel() * k_row.element_size()


def test_bench_engine_rows_flag_targets_and_tolerate_missing_fields():
    from bench.gpu.engine import rows_from_result

    result = {"mixed": {"requests": 64, "ours": {"output_tok_s": 9000.0, "ttft_ms_p50": 80.0, "tpot_ms_p50": 9.5},
                        "transformers": {"output_tok_s": 2000.0, "ttft_ms_p50": 300.0, "batch_size": 16}},
              "multiturn": {"ttft_turn1_ms": 40.0, "ttft_turn8_ms_cache": 70.0, "ttft_turn8_ms_nocache": 200.0,
                            "cache_hit_ratio": 0.93},
              "single": {"tpot_ms": 7.0, "tok_s": 142.0, "weight_bytes": 16e9}}
    rows = {r.case: r for r in rows_from_result(result)}
    speed = rows["mixed: ours / transformers"]
    assert speed.rate == "4.50x" and speed.check == "ok"
    turns = rows["multiturn: TTFT turn 8 / turn 1"]
    assert turns.rate == "1.75x" and turns.check == "above target"
    assert "2286 GB/s" in rows["single stream decode"].note  # 16 GB of weights every 7 ms
    sparse = {r.case: r for r in rows_from_result({"mixed": {"ours": {"output_tok_s": 10.0}}})}
    assert sparse["mixed: ours / transformers"].check == "n/a"
    assert sparse["mixed: transformers generate"].rate == "n/a tok/s"


@pytest.mark.parametrize("behaviour,expect", [
    ("missing", "missing"),
    ("import sys; print('boom', file=sys.stderr); sys.exit(3)", "error rc=3"),
    ("import time; time.sleep(30)", "timeout"),
    ("print('log line'); print('{\"mixed\": {\"ours\": {\"output_tok_s\": 5.0}}}')", ""),
])
def test_bench_engine_part_always_writes_rows(tmp_path, behaviour, expect):
    from bench.gpu.engine import main
    from bench.gpu.table import read_rows

    script = tmp_path / "engine_throughput.py"
    if behaviour != "missing":
        script.write_text(behaviour)
    rows_file = tmp_path / "rows.jsonl"
    assert main(["--rows", str(rows_file), "--script", str(script), "--timeout-s", "3"]) == 0
    rows = read_rows(rows_file)
    assert rows, "no row written"
    if expect:
        assert rows[0].check == expect
    else:
        assert rows[0].case.startswith("mixed") and rows[0].rate == "5 tok/s"


def test_bench_table_renders_every_row_even_unreadable_ones(tmp_path):
    from bench.gpu.table import Row, append_row, read_rows, render

    rows_file = tmp_path / "rows.jsonl"
    append_row(rows_file, Row("kernel", "decode", "rel 1.0e-03 ok", "0.100 ms", "3000 GB/s", "70% copy"))
    with open(rows_file, "a") as f:
        f.write("not json\n")
    rows = read_rows(rows_file)
    assert [r.check for r in rows] == ["rel 1.0e-03 ok", "error"]
    text = render(rows, "title")
    assert text.splitlines()[0] == "title" and len(text.splitlines()) == 2 + 1 + len(rows)
    assert read_rows(tmp_path / "absent.jsonl")[0].check == "missing"


@triton_test
def test_bench_run_sh_smoke_prints_the_table_last(tmp_path):
    import subprocess
    import sys

    env = dict(os.environ, BENCH_SMOKE="1", PYTHON=sys.executable, BENCH_OUT=str(tmp_path), BENCH_BUDGET_S="240")
    proc = subprocess.run(["bash", os.path.join(ROOT, "bench", "gpu", "run.sh")], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.strip().splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("part "))
    table = lines[header + 2:]
    assert table[-1].startswith("engine") and "skipped" in table[-1]  # the table is the end of the output
    kernel_rows = [line for line in table if line.startswith("kernel")]
    assert len(kernel_rows) == 4, table
    assert all(" ok " in line for line in kernel_rows), table
    assert (tmp_path / "table.txt").exists() and (tmp_path / "rows.jsonl").exists()


@triton_test
def test_kernels_compile_for_sm90_without_spills(tmp_path):
    # The interpreter accepts code the GPU compiler rejects; compile the real thing.
    import json
    import subprocess
    import sys

    if not os.path.exists(os.path.join(os.path.dirname(importlib.util.find_spec("triton").origin),
                                       "backends", "nvidia", "bin", "ptxas")):
        pytest.skip("this triton has no bundled ptxas")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=ROOT, TRITON_CACHE_DIR=str(tmp_path), TRITON_DEFAULT_FP_FUSION="1")
    proc = subprocess.run([sys.executable, "-m", "bench.gpu.compile_check", "--json", "--shapes", "llama3-8b-bf16"],
                          env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    assert {r["kernel"] for r in results} == {"_decode_split_kernel", "_decode_reduce_kernel", "_extend_kernel",
                                              "_store_kv_kernel"}
    for r in results:
        assert r["ok"], r["error"]
        assert r["spill_stack_bytes"] in (0, None), f"{r['kernel']} spills {r['spill_stack_bytes']} bytes"
    assert proc.returncode == 0
