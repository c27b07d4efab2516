#!/usr/bin/env bash
# GPU acceptance: one command, at most 8 minutes on one GPU. Prints PASS / FAIL / SKIP per part.
#
#   bash benchmarks/gpu_acceptance.sh            (from the repository root, its venv active)
#
# 1. kernels:     flash and te tree attention against the torch backend in bf16 / fp16
#                 (tests/attention, the CUDA tests: outputs and gradients, cached prefixes included)
# 2. train-bf16:  3 bf16 training steps with each kernel, mechanism 2 active, against an fp32 run
#                 (benchmarks/gpu_train_check.py: loss and gradient norm within its tolerances)
# 3. bench:       the update-step benchmark with and without prefix sharing on CUDA
#                 (benchmarks/bench_update_step.py, grpo and stepwise)
# Exit status 1 if a part failed. Without CUDA every part says SKIP.
set -u
cd "$(dirname "$0")/.."
PY="${PYTHON:-python}"
LOG_DIR="${GPU_ACCEPTANCE_LOGS:-runs/gpu_acceptance}"
mkdir -p "$LOG_DIR"
status=0

if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "SKIP kernels: no CUDA device"
    echo "SKIP train-bf16: no CUDA device"
    echo "SKIP bench: no CUDA device"
    exit 0
fi
"$PY" -c "import torch; print('device:', torch.cuda.get_device_name(0), '| torch', torch.__version__)"

part() {  # part NAME TIMEOUT_S COMMAND...
    local name=$1 limit=$2; shift 2
    local start=$SECONDS
    if timeout "$limit" "$@" > "$LOG_DIR/$name.log" 2>&1; then
        echo "PASS $name ($((SECONDS - start)) s)"
    else
        echo "FAIL $name ($((SECONDS - start)) s; log: $LOG_DIR/$name.log)"
        tail -n 15 "$LOG_DIR/$name.log" | sed 's/^/    /'
        status=1
    fi
}

part kernels 120 "$PY" -m pytest -q -p no:cacheprovider tests/attention/test_core_attention.py -k gpu_backend_matches
grep -E "passed|skipped|failed" "$LOG_DIR/kernels.log" | tail -n 1 | sed 's/^/    /'
part train-bf16 180 "$PY" benchmarks/gpu_train_check.py --device cuda
grep -E "^(PASS|FAIL|SKIP)" "$LOG_DIR/train-bf16.log" | sed 's/^/    /'
part bench 180 "$PY" benchmarks/bench_update_step.py --device cuda --repeats 2 --micro-batch-tokens 4096 \
    --workloads grpo stepwise --out-dir "$LOG_DIR/bench"
grep -E "^\|" "$LOG_DIR/bench.log" | sed 's/^/    /'
exit $status
