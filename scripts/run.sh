#!/usr/bin/env bash
# The one-command local default (README): install what is missing, then serve the chat
# on http://127.0.0.1:8000 with the bundled SmolLM2 and a local Redis.
set -euo pipefail
cd "$(dirname "$0")/.."
EXTRAS=${EXTRAS-} bash scripts/bootstrap.sh
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec .venv/bin/python -m gateway "$@"
