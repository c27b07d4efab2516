#!/usr/bin/env bash
# Single node: NPROC processes (default: all GPUs, or 2 CPU processes). MAX_RESTARTS > 0 lets
# torchrun restart the group after a failure; with SAVE set the run resumes from its checkpoint.
set -euo pipefail
cd "$(dirname "$0")/.."
source launch/common.sh
NPROC=${NPROC:-$(python -c 'import torch; print(torch.cuda.device_count() or 2)')}
exec torchrun --standalone --nproc_per_node "$NPROC" --max-restarts "${MAX_RESTARTS:-0}" \
  pretrain_agent_rl.py "${TRAIN_ARGS[@]}"
