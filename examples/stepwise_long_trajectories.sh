#!/usr/bin/env bash
# Step-wise RL on SWE-agent-like trajectories: samples far longer than a micro-batch. Prefix K/V
# stay in the KV cache across micro-batches (mechanism 2); a small budget forces recomputation.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/example_stepwise}
mkdir -p "$OUT"
for budget in 1GiB 24MB; do
  python pretrain_agent_rl.py --model tiny-llama --data stepwise --synthetic-tokens 30000 \
    --micro-batch-tokens 2048 --kv-cache-budget "$budget" --train-iters 2 --log-json "$OUT/log_$budget.jsonl"
done
