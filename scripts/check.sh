#!/usr/bin/env bash
# The lint and type gate (`make check`; scripts/test.sh runs it first): ruff (pyflakes,
# pycodestyle, isort, pyupgrade, bugbear), then mypy (check_untyped_defs everywhere,
# strict on gateway/). Both are configured in pyproject.toml and installed by
# scripts/bootstrap.sh (the `test` extra).
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/ruff ] && [ -x .venv/bin/mypy ] || bash scripts/bootstrap.sh
echo "check: ruff"
.venv/bin/ruff check .
echo "check: mypy"
.venv/bin/mypy
