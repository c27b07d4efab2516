#!/usr/bin/env bash
# GRPO groups (one prompt, G responses): prefix sharing vs the no-sharing baseline.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/example_grpo}
mkdir -p "$OUT"
python tools/make_synthetic_trace.py --workload grpo --num-tokens 40000 --vocab-size 1024 --out "$OUT/trace.jsonl"
python tools/analyze_trace.py --data "$OUT/trace.jsonl" --model tiny --out-json "$OUT/summary.json"
for mode in tree none; do
  python pretrain_agent_rl.py --model tiny-llama --data "$OUT/trace.jsonl" --global-batch-size 32 \
    --train-iters 3 --micro-batch-tokens 8192 --prefix-sharing "$mode" --loss-agg seq-mean-token-mean \
    --log-json "$OUT/log_$mode.jsonl"
done
python - "$OUT" <<'PY'
import json, sys
out = sys.argv[1]
logs = {m: [json.loads(l) for l in open(f"{out}/log_{m}.jsonl")] for m in ("tree", "none")}
for a, b in zip(logs["tree"], logs["none"]):
    print(f"iter {a['iter']}: loss {a['loss']:.6e} vs {b['loss']:.6e} | step {a['step_time_s']:.2f}s vs "
          f"{b['step_time_s']:.2f}s ({b['step_time_s'] / a['step_time_s']:.2f}x, ideal {a['ideal_speedup']:.2f}x)")
PY
