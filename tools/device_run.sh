#!/usr/bin/env bash
# The big-server measurements of docs/performance.md, prepared to run in one call on a lent
# machine of 8 or more cores (the `device` tool's nvidia-h100-x1: 16 cores, 128 GiB), in about
# 9 minutes; every result lands in $OUT as JSON, with the console log.
#
# The machine's image has torch, numpy, msgpack and safetensors but not pyzmq, pyhocon or
# jsonschema: fetch their wheels for its Python (3.12) here first, into .whl/ (ignored by git):
#
#   echo /.whl/ >> .git/info/exclude
#   for p in pyzmq==27.3.0 pyhocon==0.3.61 jsonschema==4.26.0 jsonschema-specifications==2025.9.1 \
#            referencing==0.37.0 rpds-py==2026.9.1; do
#     python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_28_x86_64 --platform manylinux_2_26_x86_64 --platform manylinux_2_17_x86_64 \
#       --platform manylinux2014_x86_64 -d .whl "$p"; done
#
# then call the tool with: command "bash tools/device_run.sh", carry [".whl"], timeout_s 590.
# Locally (a dry run of the commands at small sizes): SMALL=1 OUT=/tmp/out bash tools/device_run.sh
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/device-out}
mkdir -p "$OUT"
if ! python3 -c "import zmq, pyhocon, jsonschema" 2>/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || { echo "wheels not installed: fetch them into .whl/ (see the header)"; exit 1; }
    export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD" PYTHONUNBUFFERED=1
exec > >(tee "$OUT/log.txt") 2>&1

if [ -n "${SMALL:-}" ]; then
    FOLD_MB=16 FOLD_THREADS="1 2" CELLS_MIB=64 MODEL_MB=16 CLIENTS="2 4" CONNECTIONS="1 2"
else
    FOLD_MB=512 FOLD_THREADS="1 2 4 8" CELLS_MIB=1024 MODEL_MB=1024 CLIENTS="2 4 8" CONNECTIONS="1 2 4"
fi

echo "== host: $(nproc) cores, $(free -g | awk '/Mem:/ {print $2}') GiB; $(date -u +%FT%TZ)"
python3 -c "import sys, torch, zmq; print('python', sys.version.split()[0], 'torch', torch.__version__, 'libzmq', zmq.zmq_version())"

step() {  # step NAME LIMIT_S COMMAND...: run one measurement, bounded; a failure does not stop the others
    local name=$1 limit=$2
    shift 2
    echo "== $name (at most ${limit} s): $*"
    local started=$SECONDS
    timeout "$limit" "$@" || echo "== $name: exit $? after $((SECONDS - started)) s"
    echo "== $name took $((SECONDS - started)) s"
}

# 1. Whole rounds: BenchNet at 2, 4 and 8 clients, CURVE and plain TCP, 3 rounds each (the goals:
#    the 8-client round <= 1.6x the 2-client round; CURVE <= 1.4x plain TCP at 2 clients).
step rounds 300 python3 tools/bench.py --size-mb "$MODEL_MB" --clients $CLIENTS --disk off --rounds 3 \
    --security curve insecure --out "$OUT/rounds.json"
# 2. Folding on every core: 8 results folded by 1..8 threads, against plain add_ (goal: 2 threads
#    >= 1.7x one).
step fold 80 python3 tools/bench_fold.py --size-mb "$FOLD_MB" --results 8 --threads $FOLD_THREADS \
    --check one-pass raw --repeats 3 --out "$OUT/fold.json"
# 3. CURVE on one connection and spread over several (raw pyzmq: the ceiling), then cells.
for k in $CONNECTIONS; do
    step "raw curve x$k" 30 python3 tools/bench_cells.py --raw --connections "$k" --repeat 2 \
        --total-mib "$CELLS_MIB" --rtt-count 500 --out "$OUT/cells_raw_$k.json"
done
step "cells curve" 40 python3 tools/bench_cells.py --repeat 2 --total-mib "$CELLS_MIB" --rtt-count 500 \
    --out "$OUT/cells.json"
echo "== done in $SECONDS s"
