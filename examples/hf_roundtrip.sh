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
# torch_dist (the default) loads under any layout: the TP=2 training below reads it as it is.
python tools/convert_hf_checkpoint.py hf-to-mcore --hf-dir "$OUT/hf" --out-dir "$OUT/mcore" --force
python tools/compute_logprobs.py --load "$OUT/mcore" --data "$OUT/trace.jsonl" --out "$OUT/logprobs_before.jsonl"
torchrun --nproc_per_node 2 pretrain_agent_rl.py --load "$OUT/mcore" --finetune --data "$OUT/trace.jsonl" \
  --tensor-model-parallel-size 2 --train-iters 2 --lr 1e-4 --save "$OUT/trained"
python tools/convert_hf_checkpoint.py mcore-to-hf --load "$OUT/trained" --out-dir "$OUT/hf_trained" \
  --hf-template "$OUT/hf" --force
python tools/compute_logprobs.py --hf-dir "$OUT/hf_trained" --data "$OUT/trace.jsonl" --out "$OUT/logprobs_after.jsonl"
python - "$OUT" <<'PY'
import json, sys
import numpy as np
import torch
from transformers import AutoModelForCausalLM
out = sys.argv[1]
samples = [json.loads(l) for l in open(f"{out}/trace.jsonl")]
def ours(name):
    return [np.array(json.loads(l)["logprobs"]) for l in open(f"{out}/{name}")]
def transformers_logprobs(folder):
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    res = []
    with torch.no_grad():
        for s in samples:
            t = torch.tensor(s["tokens"])[None]
            lp = torch.log_softmax(model(t).logits[0, :-1].float(), -1).gather(1, t[0, 1:, None])[:, 0]
            res.append(np.concatenate([[0.0], lp.numpy()]))
    return res
before, after = ours("logprobs_before.jsonl"), ours("logprobs_after.jsonl")
ref_before, ref_after = transformers_logprobs(f"{out}/hf"), transformers_logprobs(f"{out}/hf_trained")
diff = lambda a, b: max(float(np.abs(x - y).max()) for x, y in zip(a, b))
print(f"HF -> megatron_psrl checkpoint: log-probs equal transformers' on the original model within {diff(before, ref_before):.1e}")
print(f"trained with TP=2, back to HF: log-probs equal transformers' on the exported model within {diff(after, ref_after):.1e}")
print(f"training changed the log-probs by up to {diff(before, after):.1e} (lr 1e-4, 2 steps)")
PY
