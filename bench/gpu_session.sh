#!/usr/bin/env bash
# One lent GPU session's measurements, as one command (the device tool's `run`):
#   bash bench/gpu_session.sh [budget seconds]
# Runs bench/gpu_calibrate.py (whole train steps first: the planner's step time and memory against
# the compiled program) with XLA's dumps of the train steps' compiled programs and buffer assignment,
# and leaves its results and the dumps (tar.xz) under $OUT.
set -u
budget=${1:-300}
out=${OUT:-/tmp/gpu_session}
mkdir -p "$out" /tmp/xla_dump /tmp/hlo
export PYTHONUNBUFFERED=1
export XLA_FLAGS="--xla_dump_to=/tmp/xla_dump --xla_dump_hlo_as_text --xla_dump_hlo_pass_re=^$ --xla_dump_hlo_module_re=.*step.*"
python3 -c "import jax, flax, optax; print('jax', jax.__version__, 'flax', flax.__version__, 'optax', optax.__version__, jax.devices())"
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,clocks.max.mem --format=csv
timeout $((budget + 120)) python3 bench/gpu_calibrate.py --out-dir "$out" --budget "$budget" \
    --sections copy,step,layer,launch,fused,attention,gemm --hlo-dir /tmp/hlo 2>&1 | grep -v '^[a-z]* {' | tail -60
(cd /tmp/xla_dump && ls | grep -E 'after_optimizations.txt$|buffer-assignment.txt$|memory-usage-report.txt$' \
    | tar cJf "$out/gpu_step_dumps.tar.xz" -T -)
tar cJf "$out/gpu_hlo.tar.xz" -C /tmp hlo
ls -la "$out"
