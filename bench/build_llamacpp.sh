#!/usr/bin/env bash
# Build llama.cpp's C++ `llama-server` from the sources vendored in the
# llama-cpp-python sdist, once, into a cache folder outside the repository.
# It is a benchmark peer for bench/serving.py, not part of the product.
#
#   bash bench/build_llamacpp.sh            # prints the path of llama-server
#   LLAMACPP_DIR=/some/dir bash bench/build_llamacpp.sh
#
# About 8-15 minutes on 2 cores; re-running rebuilds only what changed.
#
# CPU flags: not -march=native. Some of this project's machines report AMX and
# AVX512-FP16, and a native build dies with SIGILL ("Illegal instruction") at its first
# matmul (the sandbox does not grant the AMX tile state); others have AVX2 only. So the
# flags come from /proc/cpuinfo: AVX2/FMA/F16C, AVX-512 (F/BW/DQ/VL, VNNI, BF16) where
# all are listed, never AMX. Override with LLAMACPP_CPU_FLAGS.
set -euo pipefail

VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
DIR="${LLAMACPP_DIR:-$HOME/.cache/chatserve/llama.cpp}"
PIP="${PIP:-$(dirname "$0")/../.venv/bin/pip}"
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
cmake --build build --target llama-server -j"$JOBS" >&2
echo "$BIN"
