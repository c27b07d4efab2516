#!/usr/bin/env python
"""Per-token log-probs of trajectory samples under a model (forward only, prefix-shared).

    python tools/compute_logprobs.py (--hf-dir DIR | --load CKPT_DIR) --data FILE --out OUT.jsonl [--no-prefix-sharing]

Writes one JSON line per input sample, in input order: {"id": ..., "logprobs": [...]} with
logprobs[i] = log p(tokens[i] | tokens[:i]) for i >= 1 and logprobs[0] = 0.0. Runs in fp32 on
CPU and in the checkpoint's dtype (or --dtype) on GPU; works under torchrun for TP, DP and CP, with
the same placement of trees over ranks as training (--placement).
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Only light imports before the arguments are parsed (``--help`` answers at once); the model
# stack (megatron-core, torch) is imported in main().
from megatron_psrl.cli import HelpFormatter, add_checksum_flag, apply_checksum_flag, positive_int, run_cli  # noqa: E402
from megatron_psrl.options import (  # noqa: E402
    ATTENTION_BACKENDS,
    CROSS_GROUP_PREFIX,
    DEFAULT_TIMEOUT_MINUTES,
    PLACEMENTS,
)
from megatron_psrl.training.arguments import parse_bytes  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--hf-dir", help="Hugging Face save_pretrained folder")
    src.add_argument("--load", help="megatron_psrl checkpoint directory (torch_dist or legacy, any TP/PP layout)")
    p.add_argument("--data", required=True, help="samples file (.jsonl or .parquet)")
    p.add_argument("--out", required=True, help="output JSONL file")
    p.add_argument("--no-prefix-sharing", action="store_true", help="pack samples back to back (no sharing)")
    p.add_argument("--micro-batch-tokens", type=positive_int, default=8192, help="token budget of one micro-batch")
    p.add_argument("--kv-cache-budget", type=parse_bytes, default="1GiB",
                   help="bytes for cached prefix K/V of trees longer than a micro-batch (e.g. 512MB, 2GiB)")
    p.add_argument("--tensor-model-parallel-size", type=positive_int, default=1, help="tensor-parallel ranks")
    p.add_argument("--pipeline-model-parallel-size", type=positive_int, default=1, help="pipeline stages")
    p.add_argument("--context-parallel-size", type=positive_int, default=1,
                   help="ranks of a CP group share the fragments of the same trees (prefix K/V exchanged)")
    p.add_argument("--placement", default="auto", choices=PLACEMENTS,
                   help="trees over an exchange group (CP group, else DP group): whole-tree, cross-rank or auto")
    p.add_argument("--cross-group-prefix", default="auto", choices=CROSS_GROUP_PREFIX,
                   help="the parts of a tree split between exchange groups: recompute the prefix they share, "
                        "transfer it from one rank, or auto (the cheaper by the start-up link measurement)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help="auto: CUDA when available")
    p.add_argument("--dtype", default=None, help="GPU compute dtype (default: the checkpoint's); CPU is always fp32")
    p.add_argument("--attention-backend", default=None, choices=ATTENTION_BACKENDS,
                   help="prefix-sharing attention kernel (default: flash on CUDA with flash-attn, else torch)")
    p.add_argument("--progress", action="store_true", help="progress bar while reading the data")
    p.add_argument("--allow-rope-extrapolation", action="store_true",
                   help="score samples longer than the model's max_position_embeddings (refused otherwise)")
    add_checksum_flag(p)
    p.add_argument("--distributed-timeout-minutes", type=float, default=DEFAULT_TIMEOUT_MINUTES,
                   help="timeout of every collective under torchrun")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    apply_checksum_flag(args)
    from megatron_psrl.checkpoint.atomic import atomic_write_text, check_writable_dir
    from megatron_psrl.checkpoint.layout import read_checkpoint_info
    from megatron_psrl.checkpoint.loading import ModelSource, source_architecture
    from megatron_psrl.data.loader import load_samples
    from megatron_psrl.distributed.setup import initialize_parallel
    from megatron_psrl.dtypes import parse_dtype
    from megatron_psrl.model.architecture import ModelArchitecture
    from megatron_psrl.rl.actor import ActorConfig, PolicyActor
    from megatron_psrl.training.preflight import on_logging_rank

    layout = initialize_parallel(args.tensor_model_parallel_size, args.pipeline_model_parallel_size, seed=0,
                                 device=args.device,
                                 timeout_minutes=args.distributed_timeout_minutes,
                                 context_parallel_size=args.context_parallel_size)
    # Before any work: an unwritable --out fails now (on every rank), not after the forward pass.
    with layout.monitor.phase("start-up checks"):
        on_logging_rank(lambda: check_writable_dir(os.path.dirname(os.path.abspath(args.out)), "the folder of --out"),
                        layout.rank == 0)
    source = ModelSource(hf_dir=args.hf_dir, checkpoint=args.load)
    # The data needs only the vocabulary: validate it before any weight is read.
    arch = source_architecture(source)
    batch = load_samples(args.data, vocab_size=arch.vocab_size, progress=args.progress and layout.rank == 0)
    if layout.device.type == "cpu":
        dtype = "float32"
    elif args.dtype:
        dtype = args.dtype
    elif args.hf_dir:
        dtype = ModelArchitecture.from_hf_dir(args.hf_dir).torch_dtype
    else:
        dtype = read_checkpoint_info(args.load)[1].dtype
    config = ActorConfig(
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size, context_parallel_size=args.context_parallel_size,
        device=args.device, dtype=str(parse_dtype(dtype)).replace("torch.", ""),
        attention_backend=args.attention_backend or "auto", micro_batch_tokens=args.micro_batch_tokens,
        kv_cache_budget=args.kv_cache_budget, prefix_sharing="none" if args.no_prefix_sharing else "tree",
        placement=args.placement, cross_group_prefix=args.cross_group_prefix,
        allow_rope_extrapolation=args.allow_rope_extrapolation,
        distributed_timeout_minutes=args.distributed_timeout_minutes,
    )
    actor = PolicyActor(source, config, for_training=False)
    if layout.rank == 0:
        print(actor.describe_kernels(), flush=True)
    logprobs = actor.compute_logprobs(batch)
    if layout.rank == 0:
        atomic_write_text(args.out, (json.dumps({"id": sid, "logprobs": [float(x) for x in lp]}) + "\n"
                                     for sid, lp in zip(batch.ids, logprobs)))
        print(f"wrote log-probs of {batch.num_samples} samples ({batch.num_tokens} tokens) to {args.out}")
    return 0


def _shutdown() -> None:
    setup = sys.modules.get("megatron_psrl.distributed.setup")  # imported only if main() got that far
    if setup is not None:
        setup.shutdown_parallel()


if __name__ == "__main__":
    run_cli(main, cleanup=_shutdown)
