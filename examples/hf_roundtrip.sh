#!/usr/bin/env bash
# A Hugging Face checkpoint through megatron_psrl and back. Uses a tiny random Qwen3 made with
# transformers (no download); replace HF with a real save_pretrained folder.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/example_roundtrip}
mkdir -p "$OUT"
python - "$OUT" <<'PY'
import sys
from transformers import AutoConfig, AutoModelForCausalLM
from megatron_psrl.model import tiny_config
cfg = AutoConfig.for_model(**tiny_config("tiny-qwen3"))
AutoModelForCausalLM.from_config(cfg).save_pretrained(f"{sys.argv[1]}/hf")
PY
python tools/make_synthetic_trace.py --workload tree --vocab-size 1024 --out "$OUT/trace.jsonl"
python tools/convert_hf_checkpoint.py hf-to-mcore --hf-dir "$OUT/hf" --out-dir "$OUT/mcore" --tp 2 --force
python tools/compute_logprobs.py --load "$OUT/mcore" --data "$OUT/trace.jsonl" --out "$OUT/logprobs_before.jsonl"
torchrun --nproc_per_node 2 pretrain_agent_rl.py --load "$OUT/mcore" --finetune --data "$OUT/trace.jsonl" \
  --tensor-model-parallel-size 2 --train-iters 2 --lr 1e-4 --save "$OUT/trained"
python tools/convert_hf_checkpoint.py mcore-to-hf --load "$OUT/trained" --out-dir "$OUT/hf_trained" \
  --hf-template "$OUT/hf" --force
python tools/compute_logprobs.py --hf-dir "$OUT/hf_trained" --data "$OUT/trace.jsonl" --out "$OUT/logprobs_after.jsonl"
