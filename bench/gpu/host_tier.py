"""The host-memory KV tier on a GPU: copy bandwidth both ways, exactness, and what the step
loop pays.

    python3 -m bench.gpu.host_tier --rows ROWS.jsonl            (on a CUDA machine)
    python3 -m bench.gpu.host_tier --smoke --rows ROWS.jsonl    (CPU, tiny shapes: the script runs)

A pool of Llama-3-8B's KV shape (32 layers, 8 KV heads of 128, block 16, bfloat16: 2 MiB a
page) filled with random values, and an ``engine.tiers.manager.KVTiers`` with the host tier
alone (its slab pinned). Rows:

- store: ``store_pages`` of 512 pages (write-through of a 8,192-token prompt): the time the
  call holds the step loop, then the time until the copies land (device to host, on the
  side stream), as a rate;
- restore: ``load`` of the same pages into other blocks: the call's time, the time until
  they land (host to device), and a byte-exact comparison with the source blocks;
- overlap: a chain of bf16 matmuls on the current stream alone, then with a store of 512
  pages issued alongside: the second's time over the first (1.0: the copies cost the
  compute nothing).
"""

from __future__ import annotations

import argparse
import time
import traceback

import torch

from bench.gpu.table import Row, append_row
from engine.kv_page import PageKey
from engine.radix_cache import CacheScope
from engine.tiers.manager import KVTiers, TierConfig, page_refs


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _ms(s: float) -> str:
    return f"{s * 1000:.2f} ms"


def run(rows: str, smoke: bool) -> None:
    """Measure and append the rows (see the module doc)."""
    device = torch.device("cuda" if torch.cuda.is_available() and not smoke else "cpu")
    layers, heads, dim, bs = (32, 8, 128, 16) if not smoke else (2, 1, 8, 4)
    n_pages = 512 if not smoke else 16
    blocks = 2 * n_pages + 8
    key = PageKey("bench", "bfloat16", "bfloat16", bs, layers, heads, dim)
    k = [torch.randn((blocks, bs, heads, dim), device=device).to(torch.bfloat16) for _ in range(layers)]
    v = [torch.randn((blocks, bs, heads, dim), device=device).to(torch.bfloat16) for _ in range(layers)]
    t0 = time.perf_counter()
    tiers = KVTiers(key, TierConfig(None, 0, host_bytes=(n_pages + 8) * key.payload_bytes), k, v)
    assert tiers.host is not None
    alloc_s = time.perf_counter() - t0
    nbytes = n_pages * key.payload_bytes
    case = f"{n_pages} pages of {key.payload_bytes / 2**20:.1f} MiB ({'pinned' if tiers.host.pinned else 'plain'})"
    append_row(rows, Row("host tier", "slab allocation", time=_ms(alloc_s),
                         note=f"{(n_pages + 8) * key.payload_bytes / 2**30:.2f} GiB"))
    refs = page_refs(list(range(1, n_pages * bs + 2)), CacheScope("bench|"), bs, 0, n_pages)
    src = list(range(n_pages))
    _sync(device)

    # store: pool -> host
    t0 = time.perf_counter()
    pinned = tiers.store_pages(refs, src)
    call_s = time.perf_counter() - t0
    while tiers.copies_in_flight:
        tiers.settle()
    land_s = time.perf_counter() - t0
    append_row(rows, Row("host tier", f"store {case}", "ok" if len(pinned) in (0, n_pages) else "FAIL pins",
                         time=_ms(land_s), rate=f"{nbytes / land_s / 1e9:.1f} GB/s",
                         note=f"step loop held {_ms(call_s)}"))

    # restore: host -> fresh blocks
    dst = list(range(n_pages, 2 * n_pages))
    t0 = time.perf_counter()
    job = tiers.load(None, refs, dst)
    call_s = time.perf_counter() - t0
    while not tiers.poll():
        pass
    land_s = time.perf_counter() - t0
    tiers.scatter(job)
    _sync(device)
    exact = all(torch.equal(k[i][dst], k[i][src]) and torch.equal(v[i][dst], v[i][src]) for i in range(layers))
    append_row(rows, Row("host tier", f"restore {case}", "exact ok" if exact and job.served == n_pages else "FAIL",
                         time=_ms(land_s), rate=f"{nbytes / land_s / 1e9:.1f} GB/s",
                         note=f"step loop held {_ms(call_s)}"))

    # overlap: compute alone, then with a store of fresh pages alongside
    if device.type == "cuda":
        a = torch.randn((8192, 8192), device=device, dtype=torch.bfloat16)

        def chain() -> None:
            x = a
            for _ in range(40):
                x = torch.mm(x, a).mul_(1e-4)

        chain()
        _sync(device)
        t0 = time.perf_counter()
        chain()
        _sync(device)
        alone = time.perf_counter() - t0
        refs2 = page_refs(list(range(7, n_pages * bs + 8)), CacheScope("bench2|"), bs, 0, n_pages)
        t0 = time.perf_counter()
        tiers.store_pages(refs2, dst)
        chain()
        _sync(device)
        both = time.perf_counter() - t0
        while tiers.copies_in_flight:
            tiers.settle()
        append_row(rows, Row("host tier", "overlap: matmul chain with a 512-page store", f"{both / alone:.2f}x",
                             time=_ms(both), note=f"alone {_ms(alone)}; 1.00x = the copies cost compute nothing"))
    tiers.close()


def main() -> int:
    """Run the check, appending rows to ``--rows``; an error becomes a row (exit 0)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", required=True, help="JSON-lines file the rows are appended to")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (checks the script runs)")
    a = p.parse_args()
    try:
        run(a.rows, a.smoke)
    except Exception as e:  # the table shows the error instead of the run stopping
        traceback.print_exc()
        append_row(a.rows, Row("host tier", "host tier part", "error", note=f"{type(e).__name__}: {e}"[:120]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
