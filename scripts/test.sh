#!/usr/bin/env bash
# The project's test command (README, .ci/run): install what is missing, make sure a
# Redis answers on 127.0.0.1:6379 and Chromium is there for the browser tests, run pytest
# with the lint and type gate (scripts/check.sh) beside it: a cold mypy takes about 2
# minutes, which in parallel hides inside pytest's run instead of adding to CI's wall
# time. The command fails if either fails; the gate's output is printed after pytest's.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
CHECK_LOG="$(mktemp)"
bash scripts/check.sh >"$CHECK_LOG" 2>&1 &
CHECK_PID=$!
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
if ! .venv/bin/python -c "import redis,sys; redis.Redis(socket_timeout=1).ping()" 2>/dev/null; then
  if command -v redis-server >/dev/null 2>&1; then
    echo "test: starting redis-server on 127.0.0.1:6379"
    redis-server --daemonize yes --bind 127.0.0.1 --port 6379 --save "" --appendonly no >/dev/null
    for _ in $(seq 50); do .venv/bin/python -c "import redis; redis.Redis().ping()" 2>/dev/null && break; sleep 0.1; done
  else
    echo "test: no Redis on 127.0.0.1:6379 and no redis-server; install it (apt-get install redis-server)" >&2
    exit 1
  fi
fi
if [ ! -x /usr/bin/chromium ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  echo "test: installing Debian's chromium for the browser tests"
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) \
    || echo "test: chromium install failed; browser tests will be skipped" >&2
fi
set +e
.venv/bin/python -m pytest "$@"
TEST_RC=$?
wait "$CHECK_PID"
CHECK_RC=$?
set -e
cat "$CHECK_LOG"
rm -f "$CHECK_LOG"
if [ "$CHECK_RC" != 0 ]; then echo "test: the lint and type gate (scripts/check.sh) failed" >&2; fi
if [ "$TEST_RC" != 0 ]; then exit "$TEST_RC"; fi
exit "$CHECK_RC"
