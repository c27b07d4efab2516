"""Train a tiny MoE model with expert parallelism (or without), from a Hugging Face folder or a
torch_dist checkpoint, and save; under torchrun (gloo) or in one process (tests import
:func:`run`).

    [torchrun --nproc_per_node 2] moe_ep_checkpoint.py --source DIR --ep E --steps N
        [--check] [--save CKPT] [--legacy-probe DIR] [--dtype bfloat16]
        [--use-distributed-optimizer] --out FILE.json

``--check``: the source is a torch_dist checkpoint; every rank compares, bit for bit, its
weights and Adam state with their slices of the checkpoint's global tensors (asserted) before
training. Step i trains on the records of seed ``20 + i`` (i: the global iteration), so a
resumed run sees the same data as a straight one. ``--save`` saves after every step (the last
one into CKPT, earlier ones into CKPT-<iteration>). ``--legacy-probe``: a legacy-format save
into DIR must be refused (EP > 1). Rank 0 writes the losses, the iteration and what each rank
compared.
"""

import argparse
import json
import warnings
from typing import Optional

import torch.distributed as dist
from helpers.batches import random_tree_records
from helpers.dist_ckpt import check_rank_against_checkpoint

from megatron_psrl import ActorConfig, LossConfig, OptimizerSettings, PolicyActor
from megatron_psrl.checkpoint.layout import read_checkpoint_info

LOSS = LossConfig(clip_eps=0.2, kl_coef=0.05, entropy_coef=0.01, loss_agg="seq-mean-token-mean")


def run(source: str, ep: int, steps: int, save: Optional[str] = None, check: bool = False,
        legacy_probe: Optional[str] = None, hf_weights: bool = False, dtype: str = "float32",
        distributed_optimizer: bool = False) -> dict:
    """Every rank: the run described in the module docstring; returns this rank's report
    (``counts``: every rank's; ``hf``: the loaded model's Hugging Face weights before training,
    with ``hf_weights``)."""
    from megatron.core import parallel_state

    config = ActorConfig(device="cpu", micro_batch_tokens=32, loss=LOSS, expert_model_parallel_size=ep,
                         moe_token_dispatcher_type="alltoall", dtype=dtype,
                         optimizer=OptimizerSettings(optimizer="adam", lr=1e-3, lr_decay_iters=4,
                                                     use_distributed_optimizer=distributed_optimizer))
    actor = PolicyActor(source, config)
    report = {"counts": None, "start": actor.iteration, "losses": [], "grad_norms": [],
              "world": dist.get_world_size(), "ep": parallel_state.get_expert_model_parallel_world_size()}
    if check:
        report["counts"] = check_rank_against_checkpoint(actor, read_checkpoint_info(source)[0])
    if hf_weights:
        report["hf"] = actor.state_dict_hf()
    for step in range(steps):
        metrics = actor.train_step(random_tree_records(seed=20 + actor.iteration, num_roots=2), return_logprobs=False)
        assert not metrics["skipped"]
        report["losses"].append(float(metrics["loss"]))
        report["grad_norms"].append(float(metrics["grad_norm"]))
        if save:
            actor.save(save if step == steps - 1 else f"{save}-{actor.iteration}")
    if legacy_probe:
        from megatron_psrl.checkpoint.saving import save_training_checkpoint
        from megatron_psrl.errors import CheckpointWriteError

        try:
            save_training_checkpoint(legacy_probe, actor.iteration, actor.model, actor.optimizer, actor.arch,
                                     actor.layout, ckpt_format="legacy")
        except CheckpointWriteError as exc:
            report["legacy_refusal"] = str(exc)
        else:
            raise AssertionError("a legacy save with expert parallelism was not refused")
    report["iteration"], report["rank"] = actor.iteration, dist.get_rank()
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, report["counts"])
    report["counts"] = everyone  # every rank's
    actor.close()
    return report


def main() -> None:
    warnings.filterwarnings("ignore")
    p = argparse.ArgumentParser()
    p.add_argument("--source", required=True)
    p.add_argument("--ep", type=int, default=1)
    p.add_argument("--steps", type=int, default=1)
    p.add_argument("--check", action="store_true")
    p.add_argument("--save")
    p.add_argument("--legacy-probe")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--use-distributed-optimizer", action="store_true")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    report = run(args.source, args.ep, args.steps, args.save, args.check, args.legacy_probe, dtype=args.dtype,
                 distributed_optimizer=args.use_distributed_optimizer)
    if report["rank"] == 0:
        with open(args.out, "w") as f:
            json.dump(report, f)


if __name__ == "__main__":
    main()
