"""Compile the attention kernels for a Hopper GPU (sm_90) on a machine without one.

The CPU tests run the kernels under Triton's interpreter, which accepts code the
GPU compiler rejects (``tl.dot`` shapes, types) and says nothing of registers.
This compiles each kernel ahead of time, with the launch configuration the
launchers pick for a GPU, through ``triton.compile`` (Triton's bundled ptxas;
no driver needed), and reports registers, spill stack and shared memory per
kernel from ``cuobjdump --dump-resource-usage``.

Arguments are specialised the way Triton's JIT does at launch (pointers and
16-divisible integers marked divisible by 16, except the ``do_not_specialize``
ones), so the code is the one a GPU would run, up to the Triton version.

    python3 -m bench.gpu.compile_check [--json] [--shapes NAME...]   (TRITON_INTERPRET must be unset)

Exit status 1 when a kernel fails to compile.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass

import torch

TRITON_DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


@dataclass
class CompileResult:
    """One kernel compiled for sm_90: its resource use (None when unknown) or its error."""

    kernel: str
    config: str
    ok: bool
    registers: int | None = None
    spill_stack_bytes: int | None = None
    shared_bytes: int | None = None
    error: str = ""


def _cuobjdump() -> str | None:
    """Triton's bundled cuobjdump, if present."""
    import triton

    path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    return path if os.path.exists(path) else None


def _resources(cubin: bytes) -> tuple[int | None, int | None]:
    """(registers, stack bytes) of a cubin, from cuobjdump; (None, None) without it."""
    tool = _cuobjdump()
    if tool is None:
        return None, None
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
        path = f.name
    try:
        out = subprocess.run([tool, "--dump-resource-usage", path], capture_output=True, text=True).stdout
    finally:
        os.unlink(path)
    m = re.search(r"REG:(\d+)\s+STACK:(\d+)", out)
    return (int(m.group(1)), int(m.group(2))) if m else (None, None)


def compile_kernel(fn, pointers: dict[str, str], constexprs: dict, num_warps: int, num_stages: int,
                   label: str) -> CompileResult:
    """Compile JIT function ``fn`` for sm_90. ``pointers`` maps pointer arguments to
    Triton element types ("bf16", "i32"...); the other non-constexpr arguments are
    int32 (``scale_log2`` float32)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = fn.arg_names
    no_spec = set(getattr(fn, "do_not_specialize", ()) or ())
    no_spec |= {names[i] for i in no_spec if isinstance(i, int)}
    signature, attrs = {}, {}
    for i, name in enumerate(names):
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in pointers:
            signature[name] = "*" + pointers[name]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name == "scale_log2":
            signature[name] = "fp32"
        else:
            signature[name] = "i32"
            if name not in no_spec:
                attrs[(i,)] = [["tt.divisibility", 16]]
    try:
        src = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
        k = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                           options=dict(num_warps=num_warps, num_stages=num_stages))
    except Exception as e:  # report, do not stop the other kernels
        return CompileResult(fn.__name__, label, False, error=f"{type(e).__name__}: {str(e)[:300]}")
    regs, stack = _resources(k.asm["cubin"])
    return CompileResult(fn.__name__, label, True, regs, stack, int(k.metadata.shared))


SHAPES = {
    "llama3-8b-bf16": (torch.bfloat16, (32, 8, 128)),
    "smollm2-bf16": (torch.bfloat16, (9, 3, 64)),
    "smollm2-fp32": (torch.float32, (9, 3, 64)),
    "llama3-8b-fp32": (torch.float32, (32, 8, 128)),
}


def check_all(shapes: list[str] | None = None) -> list[CompileResult]:
    """The kernels at the launchers' GPU configurations for the named ``SHAPES`` (all by
    default): (dtype, (heads, KV heads, head_dim)) of real models."""
    from engine.attention.triton_kernels import decode, extend, kv_write
    from engine.attention.triton_kernels.launch import (
        decode_tiles,
        dot_precision,
        extend_tiles,
        interpreting,
        next_pow2,
    )

    if interpreting():
        raise RuntimeError("unset TRITON_INTERPRET: the interpreter's jit functions cannot be compiled")
    results = []
    for name in shapes or list(SHAPES):
        dtype, (h, hkv, d) = SHAPES[name]
        t = TRITON_DTYPES[dtype]
        group = h // hkv
        common = dict(GROUP=group, HEAD_DIM=d, PAGE=16, BLOCK_D=next_pow2(d), PRECISION=dot_precision(dtype),
                      DOT_F32=False)
        dt = decode_tiles(d, group, dtype)
        results.append(compile_kernel(
            decode._decode_split_kernel,
            {"Q": t, "KCache": t, "VCache": t, "BlockTables": "i32", "SeqLens": "i32", "MidO": "fp32",
             "MidLse": "fp32"},
            dict(common, BLOCK_G=dt.block_m, BLOCK_N=dt.block_n), dt.num_warps, dt.num_stages,
            f"{t} h{h}/{hkv} d{d} g{dt.block_m} n{dt.block_n} w{dt.num_warps} s{dt.num_stages}"))
        results.append(compile_kernel(
            decode._decode_reduce_kernel, {"MidO": "fp32", "MidLse": "fp32", "Out": t},
            dict(HEAD_DIM=d, BLOCK_S=64, BLOCK_D=next_pow2(d)), 4, 1, f"{t} d{d} s64"))
        et = extend_tiles(d, dtype)
        results.append(compile_kernel(
            extend._extend_kernel,
            {"Q": t, "KCache": t, "VCache": t, "Out": t, "BlockTables": "i32", "QueryStart": "i32",
             "PrefixLens": "i32"},
            dict(common, BLOCK_M=et.block_m, BLOCK_N=et.block_n), et.num_warps, et.num_stages,
            f"{t} h{h}/{hkv} d{d} m{et.block_m} n{et.block_n} w{et.num_warps} s{et.num_stages}"))
        results.append(compile_kernel(
            kv_write._store_kv_kernel, {"K": t, "V": t, "KCache": t, "VCache": t, "SlotMapping": "i64"},
            dict(NUM_KV_HEADS=hkv, HEAD_DIM=d, PAGE=16, BLOCK_H=next_pow2(hkv), BLOCK_D=next_pow2(d)), 4, 1,
            f"{t} kv{hkv} d{d}"))
    return results


def main(argv: list[str] | None = None) -> int:
    """Print one line per kernel (or JSON with ``--json``); 1 if any failed to compile."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", action="store_true")
    p.add_argument("--shapes", nargs="*", choices=list(SHAPES), default=None, help="default: all")
    a = p.parse_args(argv)
    results = check_all(a.shapes)
    if a.json:
        print(json.dumps([asdict(r) for r in results]))
    else:
        for r in results:
            print(f"{r.kernel:24s} {r.config:44s} " + (
                f"regs {r.registers} spill {r.spill_stack_bytes} B smem {r.shared_bytes} B" if r.ok else r.error))
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
