"""Compile ``kernels.c`` once per machine and load it with ctypes.

The library is built with the system C compiler into
``$CHATSERVE_CACHE/kernels`` (default ``~/.cache/chatserve/kernels``), named by a hash
of the source, the compiler and the flags, so a later start loads it in milliseconds
and a changed source or CPU gets a new build (about 2 s on 2 cores). Several processes
starting at once build it once: they wait on a file lock.

Flags follow the CPU: AVX2 + FMA where ``/proc/cpuinfo`` lists them (the kernels' fast
paths), AVX-512 VNNI too where listed (one instruction for the int16 dot products),
plain ``-O3`` otherwise (portable C fallbacks). OpenMP comes from ``-fopenmp``;
at load time the library's ``libgomp.so.1`` resolves to the one torch has already
loaded, so torch's ops and these kernels share one thread pool.

No compiler, or a failed build, is not an error: ``load_kernels`` returns None and the
engine runs its torch path (slower). ``CHATSERVE_CPU_KERNELS=0`` turns the kernels off.
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch  # noqa: F401  (loaded first: its libgomp serves the kernels' OpenMP)

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("kernels.c")
_loaded: dict[str, ctypes.CDLL | None] = {}


def cache_dir() -> Path:
    """Where built kernel libraries live: ``$CHATSERVE_CACHE/kernels`` or ``~/.cache/chatserve/kernels``."""
    base = os.environ.get("CHATSERVE_CACHE")
    return (Path(base) if base else Path.home() / ".cache" / "chatserve") / "kernels"


def cpu_flags() -> set[str]:
    """The CPU feature flags of ``/proc/cpuinfo`` (empty where there is none)."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def compile_flags(flags: set[str] | None = None) -> list[str]:
    """gcc flags for this CPU: AVX2/FMA/F16C when all three are present, plus AVX-512
    (F, BW, VL, VNNI) on 256-bit vectors where the CPU lists all four."""
    flags = cpu_flags() if flags is None else flags
    out = ["-O3", "-std=c11", "-fPIC", "-shared", "-fopenmp", "-fvisibility=hidden"]
    if platform.machine() in ("x86_64", "AMD64") and {"avx2", "fma", "f16c"} <= flags:
        out += ["-mavx2", "-mfma", "-mf16c"]
        if {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"} <= flags:
            # vpdpwssd on ymm registers; auto-vectorised loops stay 256 bits wide
            out += ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-mprefer-vector-width=256"]
    return out


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")


def build(dest_dir: Path | None = None, flags: list[str] | None = None) -> Path:
    """Compile ``kernels.c`` (if not already built) and return the library's path.
    ``flags``: the compiler flags (default ``compile_flags()``, this CPU's).

    Raises:
        RuntimeError: no C compiler, or the compiler failed (its message included).
    """
    cc = _compiler()
    if cc is None:
        raise RuntimeError("no C compiler (gcc or cc) on PATH")
    flags = compile_flags() if flags is None else flags
    source = SOURCE.read_bytes()
    digest = hashlib.sha256(source + cc.encode() + " ".join(flags).encode()).hexdigest()[:16]
    dest_dir = dest_dir or cache_dir()
    dest_dir.mkdir(parents=True, exist_ok=True)
    lib = dest_dir / f"chatserve_kernels-{digest}.so"
    if lib.exists():
        return lib
    with open(dest_dir / ".build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be building the same file
        if lib.exists():
            return lib
        with tempfile.TemporaryDirectory(dir=dest_dir) as tmp:
            out = Path(tmp) / lib.name
            proc = subprocess.run([cc, *flags, str(SOURCE), "-o", str(out), "-lm"],
                                  capture_output=True, text=True)
            if proc.returncode != 0:
                raise RuntimeError(f"building the CPU kernels failed: {proc.stderr.strip()[-2000:]}")
            os.replace(out, lib)  # atomic: a reader sees no half-written library
    return lib


def load_kernels() -> ctypes.CDLL | None:
    """The kernel library, built if needed; None when it cannot be had (logged once) or
    when ``CHATSERVE_CPU_KERNELS=0``."""
    if "lib" in _loaded:
        return _loaded["lib"]
    lib: ctypes.CDLL | None = None
    if os.environ.get("CHATSERVE_CPU_KERNELS", "1") != "0":
        try:
            lib = ctypes.CDLL(str(build()))
        except (RuntimeError, OSError) as e:
            log.warning("CPU kernels unavailable, using the slower torch path: %s", e)
    _loaded["lib"] = lib
    return lib
