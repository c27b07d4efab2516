#!/usr/bin/env bash
# GPU acceptance for 1 to 8 GPUs: one command (never run on a GPU yet; part limits 470 s on one
# GPU, 1,130 s with two or more). Prints PASS / FAIL / SKIP per part and one summary line, and
# writes everything to runs/gpu_acceptance/summary.json (logs beside it).
#
#   bash benchmarks/gpu_acceptance.sh            (from the repository root, its venv active)
#   bash benchmarks/gpu_acceptance.sh --dry-run --gpus 8    (the plan: PLAN / SKIP, nothing run)
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
# 5-9. with 2+ GPUs, NCCL parts (2 GPUs each, torchrun of pretrain_agent_rl.py, bf16): nccl-tp2,
#                 nccl-dp2-cross-rank (K/V exchange, head transfer), nccl-pp2, nccl-ep2,
#                 nccl-dist-ckpt (torch_dist saved with TP = 2, loaded with PP = 2)
# A part with nothing passed is SKIP, never PASS; one needing more GPUs than there are, SKIP. Exit status 1 if a part failed; without
# CUDA every part says SKIP and the exit status is 0. The logic: benchmarks/gpu_acceptance.py.
set -u
cd "$(dirname "$0")/.."
exec "${PYTHON:-python}" benchmarks/gpu_acceptance.py "$@"
