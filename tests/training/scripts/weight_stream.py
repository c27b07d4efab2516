"""Weight streaming under torchrun: every rank streams every model's weights and saves what it
received; the test compares it with the Hugging Face checkpoint the actor was built from.

    torchrun --nproc_per_node 2 weight_stream.py --hf-dir llama=DIR [--hf-dir ...] --tp 2 --pp 1 \\
        --bucket-bytes 20000 --out DIR [--vpp-layers 1] [--memory-hf-dir DIR]

Per model and rank, ``DIR/NAME-rank{r}.pt`` holds the stream (names in order, tensors), the
buckets' names, ``full_state_dict()``, and ``export_hf`` writes ``DIR/NAME-export``. With
``--memory-hf-dir``, ``DIR/memory-rank{r}.pt`` holds the heap peak of streaming that model
(each tensor dropped once received) and of ``state_dict_hf()`` (the whole model kept).
"""

import argparse
import os

import torch
import torch.distributed as dist

from megatron_psrl import ActorConfig, PolicyActor
from megatron_psrl.engine.memory import PeakMemory, heap_bytes_in_use
from megatron_psrl.engine.weights import WeightStream, iter_hf_weight_buckets

p = argparse.ArgumentParser()
p.add_argument("--hf-dir", action="append", default=[], help="NAME=DIR")
p.add_argument("--tp", type=int, default=1)
p.add_argument("--pp", type=int, default=1)
p.add_argument("--vpp-layers", type=int, default=None, help="--num-layers-per-virtual-pipeline-stage")
p.add_argument("--bucket-bytes", type=int, required=True)
p.add_argument("--memory-hf-dir", default=None)
p.add_argument("--memory-bucket-bytes", type=int, default=1 << 20)
p.add_argument("--out", required=True)
args = p.parse_args()


def build(hf_dir, vpp_layers=None):
    return PolicyActor(hf_dir, ActorConfig(tensor_model_parallel_size=args.tp, pipeline_model_parallel_size=args.pp,
                                           num_layers_per_virtual_pipeline_stage=vpp_layers, device="cpu",
                                           memory_tracking="off"), for_training=False)


actor = None
for spec in args.hf_dir:
    name, hf_dir = spec.split("=", 1)
    actor = build(hf_dir, args.vpp_layers)
    rank = actor.layout.rank
    streamed = list(actor.iter_hf_weights(bucket_bytes=args.bucket_bytes))
    buckets = list(iter_hf_weight_buckets(actor.engine, args.bucket_bytes))
    full = actor.full_state_dict()
    actor.export_hf(os.path.join(args.out, f"{name}-export"))
    torch.save(dict(names=[n for n, _ in streamed], tensors=dict(streamed), full=full,
                    buckets=[[(n, t) for n, t in b] for b in buckets], chunks=len(actor.engine.stage_chunks())),
               os.path.join(args.out, f"{name}-rank{rank}.pt"))

if args.memory_hf_dir and heap_bytes_in_use() is not None:
    actor = build(args.memory_hf_dir)
    rank = actor.layout.rank
    own = sum(p.numel() * p.element_size() for p in actor.model.parameters())
    largest = max(e.nbytes for e in WeightStream(actor.engine).entries.values())  # a full megatron tensor
    dist.barrier()
    with PeakMemory(torch.device("cpu"), mode="ops") as streaming:
        for _, tensor in actor.iter_hf_weights(bucket_bytes=args.memory_bucket_bytes):
            del tensor  # a rollout engine copies it into its own weights and drops it
    dist.barrier()
    with PeakMemory(torch.device("cpu"), mode="ops") as whole:
        weights = actor.state_dict_hf()
    model_bytes = sum(t.numel() * t.element_size() for t in weights.values())
    del weights
    torch.save(dict(stream_peak=streaming.peak_bytes - streaming.start_bytes,
                    whole_peak=whole.peak_bytes - whole.start_bytes, model_bytes=model_bytes,
                    largest=largest, own_bytes=own, bucket_bytes=args.memory_bucket_bytes),
               os.path.join(args.out, f"memory-rank{rank}.pt"))
actor.close()
