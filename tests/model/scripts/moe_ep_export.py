"""Under torchrun (2 ranks, gloo): the Hugging Face export and weight stream of a Qwen3-MoE
actor with expert parallelism (EP = DP = 2; each rank holds 4 of the 8 experts), or with TP = 2
(sequence parallelism) and EP = 2 over the same two ranks (each holds half of every dense
tensor and 4 whole experts).

1. ``export_hf`` before any step: written by rank 0 with the experts of both ranks, equal bit
   for bit to the Hugging Face folder the actor was loaded from (checked on both ranks);
2. ``iter_hf_weights`` (small buckets, so that one layer's experts span several) on both ranks:
   every name of the model exactly once, in the adapter's order, each tensor equal bit for bit
   to the export;
3. one SGD step, ``export_hf`` again into ``OUT/after``: every parameter of every rank (its
   experts at their global index ``ep_rank * 4 + j``; its tensor-parallel shard of the others)
   equal bit for bit to the export. The test compares that folder with an EP = 1 actor's after
   the same step.

Usage: moe_ep_export.py HF_DIR OUT_DIR [TP]
"""

import collections
import glob
import os
import sys
import warnings

import torch
import torch.distributed as dist
from helpers.batches import random_tree_records
from megatron.core import parallel_state
from safetensors.torch import load_file

from megatron_psrl import ActorConfig, LossConfig, OptimizerSettings, PolicyActor
from megatron_psrl.checkpoint.sharding import tp_shard
from megatron_psrl.model.adapters import get_adapter, unfuse_experts
from megatron_psrl.model.moe import expert_index

STEP_SEED, STEP_ROOTS, MICRO_BATCH = 7, 2, 32
"""The step's batch (the test repeats it at EP = 1)."""


def step_config(ep: int, tp: int = 1) -> ActorConfig:
    """The actor of the step (the test builds the EP = 1 one with the same settings)."""
    return ActorConfig(device="cpu", micro_batch_tokens=MICRO_BATCH, expert_model_parallel_size=ep,
                       tensor_model_parallel_size=tp, sequence_parallel=tp > 1,
                       moe_token_dispatcher_type="alltoall" if ep > 1 else "allgather",
                       loss=LossConfig(clip_eps=0.2, kl_coef=0.05, entropy_coef=0.01, loss_agg="seq-mean-token-mean"),
                       optimizer=OptimizerSettings(optimizer="sgd", lr=1.0, clip_grad=0.0))


def read_hf_folder(path: str):
    """Every tensor of a save_pretrained folder, experts named one by one."""
    tensors = {}
    for f in sorted(glob.glob(os.path.join(path, "*.safetensors"))):
        tensors.update(load_file(f))
    return unfuse_experts(tensors, "qwen3_moe")


def main() -> None:
    warnings.filterwarnings("ignore")
    hf_dir, out = sys.argv[1], sys.argv[2]
    tp = int(sys.argv[3]) if len(sys.argv) > 3 else 1
    actor = PolicyActor(hf_dir, step_config(2, tp))
    rank, ep_rank = dist.get_rank(), parallel_state.get_expert_model_parallel_rank()
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    assert parallel_state.get_expert_model_parallel_world_size() == 2
    assert (actor.layout.dp_rank if tp == 1 else tp_rank) == ep_rank  # the experts split over DP, or over TP
    adapter = get_adapter(actor.arch)
    per_rank = actor.arch.num_experts // 2
    held = sorted({expert_index(n)[1] for n, _ in actor.model.named_parameters() if expert_index(n)})
    assert held == list(range(per_rank)), held  # local numbering: 0..3 on both ranks

    # 1. the export before any step is the source folder, bit for bit
    before = actor.export_hf(os.path.join(out, "before"))
    source, exported = read_hf_folder(hf_dir), read_hf_folder(before)
    assert set(exported) == set(source) == set(adapter.hf_shapes()), sorted(set(source) ^ set(exported))[:5]
    for name, tensor in source.items():
        assert exported[name].dtype == tensor.dtype and torch.equal(exported[name], tensor), name

    # 2. the stream, in buckets of 16 kB (an expert's fc1 is 8 kB): every name once, in order
    names, counts = [], collections.Counter()
    for name, tensor in actor.iter_hf_weights(bucket_bytes=16 * 1024):
        assert torch.equal(tensor, exported[name]), name
        names.append(name)
        counts[name] += 1
    mcore_before = dict(adapter.hf_to_mcore(lambda n: exported[n]))
    assert names == [n for n, _ in adapter.mcore_to_hf(mcore_before)]  # the adapter's order
    assert set(counts) == set(exported) and set(counts.values()) == {1}, counts.most_common(3)
    expert_names = [n for n in names if ".mlp.experts." in n]
    assert len(expert_names) == actor.arch.num_layers * actor.arch.num_experts * 3
    for layer in range(actor.arch.num_layers):  # the adapter's order: expert by expert, global indices
        seen = [int(n.split(".")[5]) for n in expert_names if n.startswith(f"model.layers.{layer}.")]
        assert seen == [i for i in range(actor.arch.num_experts) for _ in range(3)], (layer, seen)

    # 3. one step, then every parameter of this rank is in the export (its experts at global indices)
    metrics = actor.train_step(random_tree_records(seed=STEP_SEED, num_roots=STEP_ROOTS))
    assert not metrics["skipped"]
    after = read_hf_folder(actor.export_hf(os.path.join(out, "after")))
    mcore = dict(adapter.hf_to_mcore(lambda n: after[n]))
    changed = 0
    for name, p in actor.model.named_parameters():
        parts = expert_index(name)
        full = name if parts is None else f"{parts[0]}{ep_rank * per_rank + parts[1]}{parts[2]}"
        assert torch.equal(p.detach(), tp_shard(full, mcore[full], actor.arch, tp, tp_rank)), (name, full)
        changed += parts is not None and not torch.equal(mcore[full], mcore_before[full])
    assert changed > 0  # the step moved experts of this rank
    print(f"rank {rank} tp {tp} ep_rank {ep_rank}: export and stream ok, {len(names)} tensors, "
          f"{len(expert_names)} expert tensors, loss {metrics['loss']:.6f}, experts changed {changed}", flush=True)
    actor.close()


if __name__ == "__main__":
    main()
