"""Run under torchrun with 2 ranks (TP = 2, gloo): log-probs, entropies and per-parameter
gradients of a tree-packed micro-batch, for the models and inputs the test wrote.

    torchrun --nproc_per_node 2 tp_equivalence.py --inputs IN.pt --out OUT.pt

IN.pt: {"cases": [{"name", "hf_dir", "ckpt"}], "pack": {"tokens", "positions", "seg_start",
"seg_end", "seg_parent", "samples": {name: rows}, "entropy_coef"}}. Rank 0 writes OUT.pt with, per
case: "logprobs"/"entropy" (per sample), "grads" (TP shards merged back to full tensors with
merge_state_dicts), "grad_shards" (per rank, for replicated parameters), "ckpt_logprobs"
(the same pack through a model loaded from the TP = 2 megatron checkpoint).
"""

import argparse

import torch
import torch.distributed as dist

from megatron_psrl.attention import TreeAttentionMetadata, tree_plan
from megatron_psrl.checkpoint import ModelSource, load_model
from megatron_psrl.checkpoint.sharding import merge_state_dicts
from megatron_psrl.distributed.setup import initialize_parallel, shutdown_parallel
from megatron_psrl.engine.optimizer import OptimizerSettings, TrainingOptimizer
from megatron_psrl.model import vocab_parallel_logprobs


def forward(model, arch, pack):
    plan = tree_plan(pack["seg_start"], pack["seg_end"], pack["seg_parent"])
    hidden = model(pack["tokens"], pack["positions"], TreeAttentionMetadata(plan=plan))[:, 0]
    out = {}
    for name, rows in pack["samples"].items():
        logits = model.output_logits(hidden[rows[:-1]])
        out[name] = vocab_parallel_logprobs(logits, pack["tokens"][rows[1:]], arch.vocab_size, with_entropy=True)
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--inputs", required=True)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    layout = initialize_parallel(2, 1, device="cpu")
    assert layout.tensor_parallel_size == 2 and layout.world_size == 2
    spec = torch.load(args.inputs)
    pack = spec["pack"]
    results = {}
    for case in spec["cases"]:
        arch, model, _ = load_model(ModelSource(hf_dir=case["hf_dir"]))
        # megatron's DDP before the backward: its hooks accumulate the gradients in main_grad.
        optimizer = TrainingOptimizer(model, OptimizerSettings(lr=0.0))
        out = forward(model, arch, pack)
        loss = sum(lp.sum() + pack["entropy_coef"] * ent.sum() for lp, ent in out.values())
        loss.backward()
        raw = {n: prm.main_grad.detach().clone() for n, prm in model.named_parameters()}
        # What the optimizer does before stepping (megatron's finalize_model_grads): sum the
        # TP-partial (q/k norm) gradients.
        optimizer.reduce_gradients()
        grads = {n: prm.main_grad.detach().clone() for n, prm in model.named_parameters()}
        gathered = [None, None]
        dist.all_gather_object(gathered, grads)
        merged = merge_state_dicts({(r, 0): gathered[r] for r in range(2)}, arch, 2, 1)
        raw_gathered = [None, None]
        dist.all_gather_object(raw_gathered, raw)

        _, ck_model, _ = load_model(ModelSource(checkpoint=case["ckpt"]))
        with torch.no_grad():
            ck_out = forward(ck_model, arch, pack)
        results[case["name"]] = dict(
            logprobs={k: v[0].detach() for k, v in out.items()},
            entropy={k: v[1].detach() for k, v in out.items()},
            grads=merged,
            grad_shards=gathered,
            raw_grad_shards=raw_gathered,
            ckpt_logprobs={k: v[0] for k, v in ck_out.items()},
            padded_vocab=model.embedding.word_embeddings.weight.shape[0] * 2,
        )
    if dist.get_rank() == 0:
        torch.save(results, args.out)
    shutdown_parallel()


if __name__ == "__main__":
    main()
