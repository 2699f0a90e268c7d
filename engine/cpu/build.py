"""Compile ``kernels.c`` once per machine and load it with ctypes.

The library is built with the system C compiler into
``$CHATSERVE_CACHE/kernels`` (default ``~/.cache/chatserve/kernels``), named by a hash
of the source, the compiler and the flags, so a later start loads it in milliseconds
and a changed source or CPU gets a new build (about 2 s on 2 cores). Several processes
starting at once build it once: they wait on a file lock.

Flags follow the CPU (``isa`` "auto"): AVX2 + FMA where ``/proc/cpuinfo`` lists them
(the kernels' fast paths), AVX-512 VNNI too where listed (one instruction for the int16
and byte dot products), else AVX-VNNI where listed (the byte dot products on 256-bit
vectors), plain ``-O3`` otherwise (portable C fallbacks). A lower level can be forced
(``ISAS``; ``--cpu-isa`` or ``CHATSERVE_CPU_ISA`` for the engine), so that the AVX2
paths of machines without AVX-512 are built and tested on one that has it. OpenMP comes from ``-fopenmp``;
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


# Instruction-set levels the kernels are built for, lowest first; "auto" is the highest
# the CPU lists. Never AMX: some machines advertise it without granting its tile state.
ISAS = ("portable", "avx2", "avxvnni", "avx512")
_NEEDS = {"portable": set(), "avx2": {"avx2", "fma", "f16c"}, "avxvnni": {"avx2", "fma", "f16c", "avx_vnni"},
          "avx512": {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni"}}
_FLAGS = {"portable": [], "avx2": ["-mavx2", "-mfma", "-mf16c"],
          "avxvnni": ["-mavx2", "-mfma", "-mf16c", "-mavxvnni"],
          # vpdpwssd/vpdpbusd on ymm registers; auto-vectorised loops stay 256 bits wide
          "avx512": ["-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni",
                     "-mprefer-vector-width=256"]}


def best_isa(flags: set[str] | None = None) -> str:
    """The highest of ``ISAS`` that a CPU with ``flags`` (default: this one's) supports."""
    flags = cpu_flags() if flags is None else flags
    if platform.machine() not in ("x86_64", "AMD64"):
        return "portable"
    return [isa for isa in ISAS if _NEEDS[isa] <= flags][-1]


def compile_flags(flags: set[str] | None = None, isa: str = "auto") -> list[str]:
    """gcc flags for ``isa`` ("auto": ``best_isa(flags)``): AVX2/FMA/F16C, plus AVX-VNNI,
    or AVX-512 (F, BW, VL, VNNI) on 256-bit vectors.

    Raises:
        ValueError: an unknown ``isa``, or one the CPU (``flags``) does not support.
    """
    flags = cpu_flags() if flags is None else flags
    if isa == "auto":
        isa = best_isa(flags)
    if isa not in ISAS:
        raise ValueError(f"unknown CPU instruction set {isa!r}; expected auto or one of {', '.join(ISAS)}")
    if isa != "portable" and (platform.machine() not in ("x86_64", "AMD64") or not _NEEDS[isa] <= flags):
        raise ValueError(f"this CPU cannot run the {isa} kernels (it lacks {', '.join(sorted(_NEEDS[isa] - flags))})")
    return ["-O3", "-std=c11", "-fPIC", "-shared", "-fopenmp", "-fvisibility=hidden", *_FLAGS[isa]]


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


def load_kernels(isa: str = "auto") -> ctypes.CDLL | None:
    """The kernel library built for ``isa`` (see ``compile_flags``), built if needed; None
    when it cannot be had (logged once per isa) or when ``CHATSERVE_CPU_KERNELS=0``. Each
    isa is its own library, so several can be loaded side by side (the tests compare them)."""
    if isa in _loaded:
        return _loaded[isa]
    lib: ctypes.CDLL | None = None
    if os.environ.get("CHATSERVE_CPU_KERNELS", "1") != "0":
        try:
            lib = ctypes.CDLL(str(build(flags=compile_flags(isa=isa))))
        except (RuntimeError, OSError, ValueError) as e:
            log.warning("CPU kernels (%s) unavailable, using the slower torch path: %s", isa, e)
    _loaded[isa] = lib
    return lib
