#!/usr/bin/env bash
# One-command GPU check, under 8 minutes on an H200; prints a short table last.
#
#   bash bench/gpu/run.sh
#
# 1. kernels (python3 -m bench.gpu.kernels): the device's copy bandwidth and bf16
#    matmul rate, then each Triton attention kernel's relative error against torch
#    and its time and rate as a fraction of those ceilings (Llama-3-8B shapes, bf16);
# 2. host tier (python3 -m bench.gpu.host_tier): the host-memory KV tier's copies
#    between a pool of Llama-3-8B's KV shape and pinned host memory, both ways;
# 3. engine (python3 -m bench.gpu.engine): bench/engine_throughput.py on a
#    random-weight Llama-3-8B in bf16, ours against transformers' generate.
# Each part runs in its own process under a time limit and writes its rows, or an
# error row, to rows.jsonl; the table is printed whatever happened.
#
# Needs only python3 with torch, triton and transformers (no .venv, no network, no
# weights). Environment knobs:
#   PYTHON=python3            the interpreter
#   BENCH_OUT=DIR             where rows.jsonl, the logs and table.txt go ($OUT/gpu-bench, else /tmp/gpu-bench)
#   BENCH_BUDGET_S=450        the whole run's time budget in seconds
#   ENGINE_BENCH_ARGS="..."   extra arguments for engine_throughput.py (e.g. --quick)
#   BENCH_SMOKE=1             CPU smoke run: tiny kernel shapes under TRITON_INTERPRET=1, engine skipped
set -u

cd "$(dirname "${BASH_SOURCE[0]}")/../.." || exit 1
ROOT="$(pwd)"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
PY="${PYTHON:-python3}"
BUDGET_S="${BENCH_BUDGET_S:-450}"
SMOKE="${BENCH_SMOKE:-0}"
OUTDIR="${BENCH_OUT:-${OUT:-/tmp}/gpu-bench}"
mkdir -p "$OUTDIR"
ROWS="$OUTDIR/rows.jsonl"
: > "$ROWS"
START=$SECONDS

remaining() { echo $(( BUDGET_S - (SECONDS - START) )); }

# A row written from bash, for a part whose process could not write its own.
error_row() { # part case check note
    printf '{"part": "%s", "case": "%s", "check": "%s", "time": "", "rate": "", "of_ceiling": "", "note": "%s"}\n' \
        "$1" "$2" "$3" "$4" >> "$ROWS"
}

# run_limited SECONDS CMD...: CMD under a time limit (exit status 124 when cut off).
run_limited() {
    local limit=$1
    shift
    if command -v timeout > /dev/null 2>&1; then
        timeout -k 10 "$limit" "$@"
    else
        "$@"
    fi
}

echo "== gpu bench: budget ${BUDGET_S}s, rows in $ROWS"

# 1. kernels
limit=$(remaining)
[ "$limit" -gt 200 ] && limit=200
if [ "$SMOKE" = 1 ]; then
    TRITON_INTERPRET=1 run_limited "$limit" "$PY" -m bench.gpu.kernels --smoke --rows "$ROWS" 2>&1 | tee "$OUTDIR/kernels.log"
else
    run_limited "$limit" "$PY" -m bench.gpu.kernels --rows "$ROWS" 2>&1 | tee "$OUTDIR/kernels.log"
fi
rc=${PIPESTATUS[0]}
if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then
    error_row kernel "kernels part" timeout "cut off after ${limit}s; rows above are the cases that finished"
elif [ "$rc" != 0 ]; then
    error_row kernel "kernels part" "error rc=$rc" "see kernels.log"
fi

# 2. the host-memory KV tier: copy bandwidth both ways, exactness, overlap with compute
limit=$(remaining)
[ "$limit" -gt 60 ] && limit=60
if [ "$limit" -lt 20 ]; then
    error_row "host tier" "host tier part" skipped "only ${limit}s of the budget left"
else
    if [ "$SMOKE" = 1 ]; then
        run_limited "$limit" "$PY" -m bench.gpu.host_tier --smoke --rows "$ROWS" 2>&1 | tee "$OUTDIR/host_tier.log"
    else
        run_limited "$limit" "$PY" -m bench.gpu.host_tier --rows "$ROWS" 2>&1 | tee "$OUTDIR/host_tier.log"
    fi
    rc=${PIPESTATUS[0]}
    if [ "$rc" != 0 ]; then
        error_row "host tier" "host tier part" "error rc=$rc" "see host_tier.log"
    fi
fi

# 3. engine throughput
if [ "$SMOKE" = 1 ]; then
    error_row engine "engine throughput" skipped "smoke run (CPU)"
else
    limit=$(( $(remaining) - 20 ))
    if [ "$limit" -lt 60 ]; then
        error_row engine "engine throughput" skipped "only ${limit}s of the budget left"
    else
        run_limited $(( limit + 15 )) "$PY" -m bench.gpu.engine --rows "$ROWS" --timeout-s "$limit" \
            --extra-args "${ENGINE_BENCH_ARGS:-}" --log "$OUTDIR/engine.log" 2>&1 | tee "$OUTDIR/engine_part.log"
        rc=${PIPESTATUS[0]}
        if [ "$rc" != 0 ]; then
            error_row engine "engine part" "error rc=$rc" "see engine_part.log"
        fi
    fi
fi

# 4. the table, last
echo
title="gpu bench, $(( SECONDS - START ))s: kernels on Llama-3-8B attention shapes (bf16), host KV tier on its KV shape, engine on random-weight Llama-3-8B (bf16)"
if "$PY" -m bench.gpu.table "$ROWS" --title "$title" > "$OUTDIR/table.txt" 2>&1; then
    cat "$OUTDIR/table.txt"
else
    echo "$title (raw rows: the table printer failed)"
    cat "$ROWS"
fi
exit 0
