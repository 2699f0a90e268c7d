"""Attention kernels on the GPU: correctness against torch, time, and rate against the device.

For each kernel and shape (Llama-3-8B attention: 32 query heads, 8 KV heads,
head_dim 128, bfloat16, 16-token blocks in shuffled order):

- correctness: relative error ``||out - ref|| / ||ref||`` against a float32 torch
  reference over the same paged cache, on random inputs, output NaN-poisoned first;
- time: median of ``triton.testing.do_bench`` (CUDA events), the best of a few tile
  configurations (the default one is reported beside it);
- rate: bytes moved per second for decode and the KV store (each K/V byte read
  once, outputs written once), FLOP/s for extend (causal: each query row against
  its visible keys, 4 * head_dim FLOPs per query-key pair per head), as a fraction
  of the device's measured ceilings: a large device-to-device copy (bytes read +
  written) and a large bfloat16 matmul.

    python3 -m bench.gpu.kernels --rows ROWS.jsonl            (on a CUDA machine)
    TRITON_INTERPRET=1 python3 -m bench.gpu.kernels --smoke --rows ROWS.jsonl   (CPU, tiny shapes)
"""

from __future__ import annotations

import argparse
import os
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from bench.gpu.table import Row, append_row

REL_TOL = {torch.bfloat16: 2e-2, torch.float16: 5e-3, torch.float32: 1e-4}


@dataclass(frozen=True)
class Ceilings:
    """The device's measured limits: copy bandwidth (GB/s, read + write) and matmul rate (TFLOP/s)."""

    copy_gbs: float
    matmul_tflops: float


@dataclass
class PagedKV:
    """A shuffled paged cache holding ``seq_lens`` tokens per request."""

    k_cache: torch.Tensor  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # [B, max_blocks] int32
    seq_lens: list[int]


def decode_bytes(seq_lens: list[int], num_heads: int, num_kv_heads: int, head_dim: int, elem: int) -> int:
    """Fewest bytes one decode step moves: every cached K and V row read once, q read
    and the output written once (block tables and workspace ignored)."""
    kv = sum(seq_lens) * num_kv_heads * head_dim * elem * 2
    return kv + 2 * len(seq_lens) * num_heads * head_dim * elem


def extend_flops(prefix_lens: list[int], query_lens: list[int], num_heads: int, head_dim: int) -> int:
    """FLOPs of causal extend attention: query i of a request (position prefix + i)
    sees prefix + i + 1 keys; each query-key pair costs 2 * head_dim for QK^T and
    2 * head_dim for PV, per head."""
    pairs = sum(q * p + q * (q + 1) // 2 for p, q in zip(prefix_lens, query_lens))
    return 4 * head_dim * num_heads * pairs


def kv_write_bytes(num_tokens: int, num_kv_heads: int, head_dim: int, elem: int) -> int:
    """Bytes the KV store moves: K and V rows read once and written once."""
    return 4 * num_tokens * num_kv_heads * head_dim * elem


def num(v: float) -> str:
    """A rate with about three significant digits, without exponents for large values."""
    if v != v:  # NaN
        return "nan"
    return f"{v:.0f}" if abs(v) >= 100 else f"{v:.1f}" if abs(v) >= 1 else f"{v:.3g}"


def time_ms(fn: Callable[[], object], device: torch.device) -> float:
    """Median time of ``fn`` in ms: CUDA events through ``triton.testing.do_bench`` on a
    GPU; on the CPU (smoke runs, where only the code path matters) one wall-clock run."""
    if device.type == "cuda":
        import triton.testing

        try:
            return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))
        except TypeError:  # older do_bench without return_mode
            return float(triton.testing.do_bench(fn, warmup=25, rep=100, quantiles=[0.5]))
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1000


def measure_ceilings(device: torch.device, smoke: bool) -> Ceilings:
    """Time a device-to-device copy of random data (1 GiB; 4 MiB in smoke runs) and a
    bfloat16 matmul of random data (8192^3; 256^3 in smoke runs)."""
    n = (1 << 20) if smoke else (1 << 28)
    x = torch.randn(n, device=device)
    y = torch.empty_like(x)
    ms = time_ms(lambda: y.copy_(x), device)
    copy_gbs = 2 * x.numel() * x.element_size() / (ms * 1e-3) / 1e9
    m = 256 if smoke else 8192
    a = torch.randn(m, m, device=device, dtype=torch.bfloat16)
    b = torch.randn(m, m, device=device, dtype=torch.bfloat16)
    ms = time_ms(lambda: a @ b, device)
    return Ceilings(copy_gbs=copy_gbs, matmul_tflops=2 * m**3 / (ms * 1e-3) / 1e12)


def make_paged(seq_lens: list[int], num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype,
               device: torch.device, gen: torch.Generator) -> PagedKV:
    """Random K/V for ``seq_lens`` tokens per request in shuffled blocks (a few spare
    blocks hold NaN, so a stray read shows)."""
    need = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(need) + 4
    order = torch.randperm(num_blocks, generator=gen).tolist()
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    dev_gen = device_generator(gen, device)  # draw the large tensors where they live
    k_cache = torch.randn(shape, generator=dev_gen, device=device).to(dtype)
    v_cache = torch.randn(shape, generator=dev_gen, device=device).to(dtype)
    spare = order[sum(need):]
    k_cache[spare] = float("nan")
    v_cache[spare] = float("nan")
    tables, start = [], 0
    for n in need:
        tables.append(order[start:start + n])
        start += n
    width = max(need)
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=device)
    return PagedKV(k_cache, v_cache, bt, list(seq_lens))


def device_generator(gen: torch.Generator, device: torch.device) -> torch.Generator:
    """A generator on ``device`` seeded from ``gen`` (so one seed replays a whole run)."""
    g = torch.Generator(device=device)
    g.manual_seed(int(torch.randint(0, 2**62, (1,), generator=gen)))
    return g


def gather_request(paged: PagedKV, b: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values 0..length-1 of request b, each [length, Hkv, D] float32."""
    bs = paged.k_cache.shape[1]
    pos = torch.arange(length, device=paged.k_cache.device)
    blocks = paged.block_tables[b].long()[pos // bs]
    return paged.k_cache[blocks, pos % bs].float(), paged.v_cache[blocks, pos % bs].float()


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, first_pos: int,
                        scale: float) -> torch.Tensor:
    """float32 torch attention: q [n, H, D] at positions first_pos.. over k/v [L, Hkv, D], causal."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("nhd,lhd->hnl", q.float(), k) * scale
    qpos = first_pos + torch.arange(q.shape[0], device=q.device)
    hidden = torch.arange(k.shape[0], device=q.device)[None, :] > qpos[:, None]
    scores = scores.masked_fill(hidden[None], float("-inf"))
    return torch.einsum("hnl,lhd->nhd", scores.softmax(-1), v)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| (NaN when out holds NaN)."""
    return float((out.double() - ref.double()).norm() / ref.double().norm())


def check_text(err: float, dtype: torch.dtype) -> str:
    """"rel 3.1e-03 ok" or "rel ... FAIL" against the dtype's tolerance."""
    return f"rel {err:.1e} {'ok' if err < REL_TOL[dtype] else 'FAIL'}"


def best_of(configs: list, run: Callable, device: torch.device) -> tuple[float, Any, float]:
    """Time ``run(config)`` for each config; returns (best ms, best config, first config's ms).
    A config that fails to compile or run is skipped (all failing re-raises the last error)."""
    best, best_cfg, first, last_err = float("inf"), None, float("nan"), None
    for i, cfg in enumerate(configs):
        try:
            ms = time_ms(partial(run, cfg), device)
        except Exception as e:  # a tile that does not fit (shared memory, registers)
            last_err = e
            continue
        if i == 0:
            first = ms
        if ms < best:
            best, best_cfg = ms, cfg
    if best_cfg is None:
        raise last_err if last_err else RuntimeError("no configuration ran")
    return best, best_cfg, first


def tiles_text(t: Any) -> str:
    """A tile configuration in a few characters."""
    return f"m{t.block_m} n{t.block_n} w{t.num_warps} s{t.num_stages}"


def decode_case(name: str, seq_lens: list[int], heads: tuple[int, int, int], dtype: torch.dtype,
                device: torch.device, ceil: Ceilings, gen: torch.Generator, smoke: bool) -> Row:
    """Check and time the decode kernels on one batch; returns its row."""
    from engine.attention.triton_kernels.decode import decode_attention, decode_workspace, num_splits_for
    from engine.attention.triton_kernels.launch import TileConfig, decode_tiles

    num_heads, num_kv_heads, head_dim = heads
    split_tokens, max_splits = (16, 4) if smoke else (256, 64)
    paged = make_paged(seq_lens, num_kv_heads, head_dim, 16, dtype, device, gen)
    q = torch.randn((len(seq_lens), num_heads, head_dim), generator=gen).to(device=device, dtype=dtype)
    scale = head_dim ** -0.5
    default = decode_tiles(head_dim, num_heads // num_kv_heads, dtype)
    configs = [default] if smoke else [default] + [
        TileConfig(default.block_m, n, w, s) for n, w, s in ((32, 4, 2), (64, 8, 2), (128, 8, 3), (64, 4, 3))
        if (n, w, s) != (default.block_n, default.num_warps, default.num_stages)]
    seq_t = torch.tensor(seq_lens, dtype=torch.int32, device=device)

    scratch = torch.empty_like(q)
    workspaces: dict = {}  # per tile config, allocated outside the timed calls

    def run(tiles, out=None):
        splits = num_splits_for(max(seq_lens), split_tokens, max_splits, tiles)
        if splits not in workspaces:
            workspaces[splits] = decode_workspace(len(seq_lens), num_heads, splits, head_dim, device)
        mid_o, mid_lse = workspaces[splits]
        return decode_attention(q, paged.k_cache, paged.v_cache, paged.block_tables, seq_t,
                                scratch if out is None else out, scale, num_splits=splits,
                                split_tokens=split_tokens, max_splits=max_splits, mid_o=mid_o, mid_lse=mid_lse,
                                tiles=tiles)

    out = run(default, torch.full_like(q, float("nan")))
    ref = torch.cat([reference_attention(q[b:b + 1], *gather_request(paged, b, n), n - 1, scale)
                     for b, n in enumerate(seq_lens)])
    err = rel_err(out, ref)
    ms, cfg, default_ms = best_of(configs, run, device)
    gbs = decode_bytes(seq_lens, num_heads, num_kv_heads, head_dim, q.element_size()) / (ms * 1e-3) / 1e9
    return Row("kernel", name, check_text(err, dtype), f"{ms:.3f} ms", f"{num(gbs)} GB/s",
               f"{100 * gbs / ceil.copy_gbs:.0f}% copy", f"{tiles_text(cfg)}; default {default_ms:.3f} ms")


def extend_case(name: str, shapes: list[tuple[int, int]], heads: tuple[int, int, int], dtype: torch.dtype,
                device: torch.device, ceil: Ceilings, gen: torch.Generator, smoke: bool) -> Row:
    """Check and time the extend kernel on requests ``shapes`` = [(prefix, new)]; returns its row."""
    from engine.attention.triton_kernels.extend import extend_attention
    from engine.attention.triton_kernels.launch import TileConfig, extend_tiles

    num_heads, num_kv_heads, head_dim = heads
    totals = [p + n for p, n in shapes]
    paged = make_paged(totals, num_kv_heads, head_dim, 16, dtype, device, gen)
    qlens = [n for _, n in shapes]
    starts = [0]
    for n in qlens:
        starts.append(starts[-1] + n)
    q = torch.randn((starts[-1], num_heads, head_dim), generator=gen).to(device=device, dtype=dtype)
    qsl = torch.tensor(starts, dtype=torch.int32, device=device)
    prefix = torch.tensor([p for p, _ in shapes], dtype=torch.int32, device=device)
    scale = head_dim ** -0.5
    default = extend_tiles(head_dim, dtype)
    configs = [default] if smoke else [default] + [
        TileConfig(m, n, w, s) for m, n, w, s in ((128, 64, 4, 3), (64, 64, 4, 3), (128, 32, 4, 2), (128, 128, 8, 2))
        if (m, n, w, s) != (default.block_m, default.block_n, default.num_warps, default.num_stages)]

    scratch = torch.empty_like(q)

    def run(tiles, out=None):
        return extend_attention(q, paged.k_cache, paged.v_cache, paged.block_tables, qsl, prefix,
                                scratch if out is None else out, scale, max_query_len=max(qlens), tiles=tiles)

    out = run(default, torch.full_like(q, float("nan")))
    ref = torch.cat([reference_attention(q[starts[b]:starts[b + 1]], *gather_request(paged, b, p + n), p, scale)
                     for b, (p, n) in enumerate(shapes)])
    err = rel_err(out, ref)
    ms, cfg, default_ms = best_of(configs, run, device)
    tflops = extend_flops([p for p, _ in shapes], qlens, num_heads, head_dim) / (ms * 1e-3) / 1e12
    return Row("kernel", name, check_text(err, dtype), f"{ms:.3f} ms", f"{num(tflops)} TFLOP/s",
               f"{100 * tflops / ceil.matmul_tflops:.0f}% matmul", f"{tiles_text(cfg)}; default {default_ms:.3f} ms")


def kv_write_case(name: str, num_tokens: int, heads: tuple[int, int, int], dtype: torch.dtype,
                  device: torch.device, ceil: Ceilings, gen: torch.Generator) -> Row:
    """Check (exact) and time the KV store of ``num_tokens`` rows to shuffled slots."""
    from engine.attention.triton_kernels.kv_write import store_kv

    _, num_kv_heads, head_dim = heads
    block_size = 16
    num_blocks = -(-num_tokens // block_size) + 4
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.zeros(shape, device=device, dtype=dtype)
    v_cache = torch.zeros(shape, device=device, dtype=dtype)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens].to(device)
    k = torch.randn((num_tokens, num_kv_heads, head_dim), generator=gen).to(device=device, dtype=dtype)
    v = torch.randn((num_tokens, num_kv_heads, head_dim), generator=gen).to(device=device, dtype=dtype)
    store_kv(k, v, k_cache, v_cache, slots)
    exact = bool(torch.equal(k_cache.view(-1, num_kv_heads, head_dim)[slots], k)
                 and torch.equal(v_cache.view(-1, num_kv_heads, head_dim)[slots], v))
    ms = time_ms(lambda: store_kv(k, v, k_cache, v_cache, slots), device)
    gbs = kv_write_bytes(num_tokens, num_kv_heads, head_dim, k.element_size()) / (ms * 1e-3) / 1e9
    return Row("kernel", name, "exact ok" if exact else "exact FAIL", f"{ms:.3f} ms", f"{num(gbs)} GB/s",
               f"{100 * gbs / ceil.copy_gbs:.0f}% copy")


def backend_case(name: str, shapes: list[tuple[int, int]], heads: tuple[int, int, int], dtype: torch.dtype,
                 device: torch.device, gen: torch.Generator) -> Row:
    """TritonAttentionBackend against TorchAttentionBackend on one mixed step (KV store
    included): relative error of the outputs, and whether both caches agree exactly."""
    from engine.attention.torch_backend import TorchAttentionBackend
    from engine.attention.triton_backend import TritonAttentionBackend
    from engine.forward_batch import ForwardBatch

    num_heads, num_kv_heads, head_dim = heads
    totals = [p + n for p, n in shapes]
    paged = make_paged(totals, num_kv_heads, head_dim, 16, dtype, device, gen)
    tables = [[int(x) for x in row[: -(-t // 16)]] for row, t in zip(paged.block_tables.tolist(), totals)]
    batch = ForwardBatch.build(token_chunks=[[0] * n for _, n in shapes], prefix_lens=[p for p, _ in shapes],
                               block_tables=tables, sample_mask=[True] * len(shapes), block_size=16, device=device)
    t = batch.num_tokens
    q = torch.randn((t, num_heads, head_dim), generator=gen).to(device=device, dtype=dtype)
    k = torch.randn((t, num_kv_heads, head_dim), generator=gen).to(device=device, dtype=dtype)
    v = torch.randn((t, num_kv_heads, head_dim), generator=gen).to(device=device, dtype=dtype)
    kc2, vc2 = paged.k_cache.clone(), paged.v_cache.clone()
    ref_backend, backend = TorchAttentionBackend(), TritonAttentionBackend()
    ref_backend.prepare(batch)
    ref = ref_backend.forward(q, k, v, kc2, vc2, batch, head_dim ** -0.5)
    backend.prepare(batch)
    out = backend.forward(q, k, v, paged.k_cache, paged.v_cache, batch, head_dim ** -0.5,
                          out=torch.full_like(q, float("nan")))
    same_cache = bool(torch.equal(paged.k_cache.nan_to_num(7.0), kc2.nan_to_num(7.0))
                      and torch.equal(paged.v_cache.nan_to_num(7.0), vc2.nan_to_num(7.0)))
    return Row("kernel", name, check_text(rel_err(out, ref), dtype), note="caches equal" if same_cache
               else "caches DIFFER")


def environment_row(device: torch.device) -> Row:
    """The device's name and the versions of torch, triton and transformers."""
    import importlib.metadata as md

    def version(pkg: str) -> str:
        try:
            return md.version(pkg)
        except md.PackageNotFoundError:
            return "missing"

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return Row("env", name, note=f"torch {torch.__version__}, triton {version('triton')}, "
                                 f"transformers {version('transformers')}, cuda {torch.version.cuda}")


def guarded(rows_path: str, part: str, case: str, fn: Callable[[], Row]) -> None:
    """Run one case; append its row, or an error row naming the exception."""
    try:
        row = fn()
    except Exception as e:  # fail soft: one broken case must not hide the others
        traceback.print_exc()
        row = Row(part, case, "error", note=f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}")
    append_row(rows_path, row)


def main(argv: list[str] | None = None) -> int:
    """Run every kernel case, appending rows to ``--rows``; returns 0 even when cases fail."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", required=True, help="JSON-lines file the rows are appended to")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on any device (CPU: TRITON_INTERPRET=1)")
    p.add_argument("--seed", type=int, default=None)
    a = p.parse_args(argv)
    smoke = a.smoke
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type != "cuda" and not smoke:
        append_row(a.rows, Row("kernel", "all kernels", "skipped", note="no CUDA device (use --smoke on the CPU)"))
        return 0
    append_row(a.rows, environment_row(device))
    seed = a.seed if a.seed is not None else int.from_bytes(os.urandom(4), "little")
    gen = torch.Generator().manual_seed(seed)
    print(f"kernels: device {device}, seed {seed}", flush=True)
    ceil = Ceilings(float("nan"), float("nan"))
    try:
        ceil = measure_ceilings(device, smoke)
        append_row(a.rows, Row("device", "copy bandwidth (read+write)", rate=f"{num(ceil.copy_gbs)} GB/s",
                               note="1 GiB device-to-device copy" if not smoke else "smoke"))
        append_row(a.rows, Row("device", "bf16 matmul", rate=f"{num(ceil.matmul_tflops)} TFLOP/s",
                               note="8192^3 random operands" if not smoke else "smoke"))
    except Exception as e:
        append_row(a.rows, Row("device", "ceilings", "error", note=f"{type(e).__name__}: {e}"[:120]))

    bf16 = torch.bfloat16
    if smoke:
        heads = (8, 2, 64)
        decode_cases = [("decode B=3 L<=70", [1, 33, 70])]
        extend_cases = [("extend B=2 mixed", [(0, 20), (37, 5)])]
        kv_tokens, mixed = 40, [(0, 18), (20, 3), (33, 1)]
    else:
        heads = (32, 8, 128)  # Llama-3-8B
        r = torch.Generator().manual_seed(seed + 1)
        decode_cases = [
            ("decode B=1 L=32768", [32768]),
            ("decode B=16 L=4096", [4096] * 16),
            ("decode B=64 L=1024..2048", torch.randint(1024, 2049, (64,), generator=r).tolist()),
        ]
        extend_cases = [
            ("prefill B=1 Q=4096 P=0", [(0, 4096)]),
            ("extend B=4 Q=512 P=3584", [(3584, 512)] * 4),
            ("extend B=16 Q=128..512 P=0..2048", list(zip(torch.randint(0, 2049, (16,), generator=r).tolist(),
                                                          torch.randint(128, 513, (16,), generator=r).tolist()))),
        ]
        kv_tokens, mixed = 8192, [(0, 700), (1500, 300), (4000, 1), (900, 1), (0, 1)]
    for name, lens in decode_cases:
        guarded(a.rows, "kernel", name, partial(decode_case, name, lens, heads, bf16, device, ceil, gen, smoke))
    for name, shapes in extend_cases:
        guarded(a.rows, "kernel", name, partial(extend_case, name, shapes, heads, bf16, device, ceil, gen, smoke))
    name = f"kv store T={kv_tokens}"
    guarded(a.rows, "kernel", name, lambda: kv_write_case(name, kv_tokens, heads, bf16, device, ceil, gen))
    name = "backend mixed step vs torch backend"
    guarded(a.rows, "kernel", name, lambda: backend_case(name, mixed, heads, bf16, device, gen))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
