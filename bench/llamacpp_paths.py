"""Where ``bench/build_llamacpp.sh`` puts llama.cpp: one definition for every bench script.

The build script builds into ``$LLAMACPP_DIR`` (default ``~/.cache/chatserve/llama.cpp``)
and ``--models`` writes the peer's GGUFs into its ``models/``; the scripts that run the
peer (``bench/decode_step.py``, ``bench/prefill.py``, ``bench/serving.py``,
``bench/returning_chats.py``, ``bench/llamacpp_suite.py``) read the same variable with
the same default, so a second build (say one with AVX-512 off) is measured by setting
it for both:

    LLAMACPP_DIR=~/.cache/chatserve/llama.cpp-avx2 bash bench/build_llamacpp.sh
    LLAMACPP_DIR=~/.cache/chatserve/llama.cpp-avx2 python bench/decode_step.py --llama-bench

The module-level paths are read once, at import, from the environment of the process.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

DEFAULT_DIR = Path.home() / ".cache/chatserve/llama.cpp"


def llamacpp_dir(environ: Mapping[str, str] | None = None) -> Path:
    """The build folder: ``LLAMACPP_DIR`` of ``environ`` (default ``os.environ``), ``~``
    expanded, or ``DEFAULT_DIR`` when it is unset or empty (as the build script reads it)."""
    value = (os.environ if environ is None else environ).get("LLAMACPP_DIR", "")
    return Path(value).expanduser() if value else DEFAULT_DIR


def source_dir(base: Path) -> Path:
    """llama.cpp's source tree inside a build folder ``base`` (vendored in llama-cpp-python's sdist)."""
    return base / "src/vendor/llama.cpp"


def binary(base: Path, name: str) -> Path:
    """A built llama.cpp program (``llama-server``, ``llama-bench``, ``llama-quantize``) of ``base``."""
    return source_dir(base) / "build/bin" / name


def peer_gguf(base: Path, quant: str) -> Path:
    """The peer's SmolLM2-135M-Instruct file in ``quant`` ("Q4_0", "Q4_1", "f32") that
    ``build_llamacpp.sh --models`` makes in ``base``."""
    return base / "models" / f"smollm2-135m-instruct-{quant}.gguf"


LLAMACPP_DIR = llamacpp_dir()
LLAMA_SRC = source_dir(LLAMACPP_DIR)
LLAMA_SERVER = binary(LLAMACPP_DIR, "llama-server")
LLAMA_BENCH = binary(LLAMACPP_DIR, "llama-bench")
# llama.cpp's fastest CPU format (Q4_0, repacked to interleaved tiles at load) and its Q4_1,
# made from the same weights by its own tools (bench/build_llamacpp.sh --models)
PEER_Q4_0 = peer_gguf(LLAMACPP_DIR, "Q4_0")
PEER_Q4_1 = peer_gguf(LLAMACPP_DIR, "Q4_1")
