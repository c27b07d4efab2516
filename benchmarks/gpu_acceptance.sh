#!/usr/bin/env bash
# GPU acceptance: one command, under 8 minutes on one H200. Prints PASS / FAIL / SKIP per part
# and writes everything to runs/gpu_acceptance/summary.json (logs beside it).
#
#   bash benchmarks/gpu_acceptance.sh            (from the repository root, its venv active)
#
# 1. kernels:     flash and te tree attention against the torch backend in bf16 / fp16 on tree
#                 workloads (tests/attention, the tests marked gpu: outputs and gradients)
# 2. train-bf16:  3 bf16 training steps per kernel, mechanism 2 active, against an fp32 run
#                 (benchmarks/gpu_train_check.py: loss and gradient norm within its tolerances)
# 3. memory:      per kernel, a step's measured peak (torch.cuda.max_memory_allocated) against
#                 the memory plan's prediction, on the Qwen2.5-1.5B shape; and the host syncs of
#                 one step, counted under torch.cuda.set_sync_debug_mode("warn") and printed
# 4. bench:       the update step on the Qwen2.5-1.5B shape (random weights, bf16): prefix
#                 sharing vs --no-prefix-sharing vs one causal pass over the unique tokens
# A part with nothing passed is SKIP, never PASS. Exit status 1 if a part failed; without
# CUDA every part says SKIP and the exit status is 0. The logic: benchmarks/gpu_acceptance.py.
set -u
cd "$(dirname "$0")/.."
exec "${PYTHON:-python}" benchmarks/gpu_acceptance.py "$@"
