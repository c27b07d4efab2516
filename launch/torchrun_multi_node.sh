#!/usr/bin/env bash
# Multi node: run on every node with NNODES, NODE_RANK, MASTER_ADDR (and MASTER_PORT) set.
set -euo pipefail
cd "$(dirname "$0")/.."
source launch/common.sh
: "${NNODES:?set NNODES}" "${NODE_RANK:?set NODE_RANK}" "${MASTER_ADDR:?set MASTER_ADDR}"
NPROC=${NPROC:-$(python -c 'import torch; print(torch.cuda.device_count() or 1)')}
exec torchrun --nnodes "$NNODES" --node_rank "$NODE_RANK" --nproc_per_node "$NPROC" \
  --master_addr "$MASTER_ADDR" --master_port "${MASTER_PORT:-29500}" pretrain_agent_rl.py "${TRAIN_ARGS[@]}"
