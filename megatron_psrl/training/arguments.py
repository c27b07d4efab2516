"""Command-line arguments of pretrain_agent_rl.py (Megatron-style names, see README)."""

from __future__ import annotations

import argparse
import re
from typing import List, Optional

from megatron_psrl.cli import HelpFormatter, add_checksum_flag
from megatron_psrl.options import (
    ATTENTION_BACKENDS,
    CKPT_FORMATS,
    CROSS_GROUP_PREFIX,
    DEFAULT_CKPT_FORMAT,
    DEFAULT_TIMEOUT_MINUTES,
    HYBRID_MODEL_NAMES,
    LATENT_CACHE_CHOICES,
    LOSS_AGGREGATIONS,
    MEMORY_TRACKING,
    MOE_LOAD_BALANCING_TYPES,
    MOE_MODEL_NAMES,
    MOE_TOKEN_DISPATCHERS,
    OPTIMIZERS,
    PLACEMENTS,
    SHARING_MODES,
    TINY_MODEL_NAMES,
    WORKLOAD_NAMES,
)

DEFAULT_MODEL = "tiny-llama"
DEFAULT_WORKLOAD = "mixed"
MIN_MICRO_BATCH_TOKENS = 64
"""Smallest ``--micro-batch-tokens`` accepted: below it a step is thousands of tiny
micro-batches whose per-call overhead dwarfs the work (``1`` ran for minutes on 8k tokens)."""
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "kib": 2**10, "m": 1e6, "mb": 1e6, "mib": 2**20,
          "g": 1e9, "gb": 1e9, "gib": 2**30, "t": 1e12, "tb": 1e12, "tib": 2**40}


def parse_bytes(text: str) -> int:
    """``"512MB"``, ``"2GiB"``, ``"1048576"`` -> bytes."""
    m = _SIZE.match(str(text))
    unit = (m.group(2) or "").lower() if m else None
    if not m or unit not in _UNITS:
        raise argparse.ArgumentTypeError(f"not a byte size: {text!r} (examples: 512MB, 2GiB, 1048576)")
    return int(float(m.group(1)) * _UNITS[unit])


def parse_memory_budget(text: str) -> Optional[int]:
    """``--memory-budget``: ``auto`` (None: the CUDA default, none on CPU), ``off`` (0) or a byte size."""
    word = str(text).strip().lower()
    if word == "auto":
        return None
    return 0 if word == "off" else parse_bytes(text)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pretrain_agent_rl.py",
        description="Prefix-shared RL update steps (PPO/GRPO) on a megatron-core GPT model.",
        formatter_class=HelpFormatter,
    )
    g = p.add_argument_group("model")
    g.add_argument("--hf-dir", default=None, help="Hugging Face save_pretrained folder (converted in memory; default: none, see --model)")
    g.add_argument("--model", default=None, choices=TINY_MODEL_NAMES + MOE_MODEL_NAMES + HYBRID_MODEL_NAMES,
                   help=f"named tiny config with random weights (default {DEFAULT_MODEL} when no --hf-dir/--load)")
    g.add_argument("--transformer-impl", default="auto", choices=["auto", "local", "transformer_engine"],
                   help="megatron layer spec (auto: transformer_engine on CUDA when installed)")
    g.add_argument("--attention-backend", default="auto", choices=["auto", *ATTENTION_BACKENDS],
                   help="prefix-sharing attention kernel (auto: flash on CUDA when installed, else torch)")
    g.add_argument("--latent-cache", default="auto", choices=["auto", *LATENT_CACHE_CHOICES],
                   help="latent attention (DeepSeek-V3, Kimi K2): what a cached shared prefix keeps, its K/V latent "
                        "and RoPE key (latent: every reader projects them up again) or every head's key and value "
                        "(per-head); auto: latent, per-head under --sequence-parallel")
    g.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                   help="auto: CUDA when available (one GPU per local rank), else CPU with gloo")
    g.add_argument("--seed", type=int, default=1234, help="random init of tiny models, synthetic data, RNG tracker")

    g = p.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1, help="tensor-parallel ranks (megatron-core)")
    g.add_argument("--sequence-parallel", action="store_true",
                   help="with TP > 1: split the rows of every micro-batch over the tensor-parallel ranks outside "
                        "attention (megatron's sequence parallelism: less activation memory; mixture-of-experts "
                        "models need it under TP). Turns the last-layer row skip off")
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1,
                   help="pipeline stages (1F1B order, interleaved with virtual stages; with cached prefixes the "
                        "plan's order on every stage); a pipeline is one rank for tree placement (--placement cross-rank spreads a tree "
                        "over pipelines, each stage exchanging prefix K/V with the same stage of the others)")
    g.add_argument("--decoder-first-pipeline-num-layers", type=int, default=None,
                   help="layers of the first pipeline stage (the rest split evenly): fewer to balance the embedding "
                        "(default: none, an even split)")
    g.add_argument("--decoder-last-pipeline-num-layers", type=int, default=None,
                   help="layers of the last pipeline stage (the rest split evenly): fewer to balance the output "
                        "layer and the loss (default: none, an even split)")
    g.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None,
                   help="interleaved pipeline: each rank holds layers / (PP x this) model chunks (megatron's "
                        "interleaved 1F1B schedule), a smaller bubble (default: none, one chunk per rank)")
    g.add_argument("--context-parallel-size", type=int, default=1,
                   help="ranks of one CP group share the fragments of the same trees (a sample longer than a "
                        "micro-batch runs on all of them at once), exchanging prefix K/V; gradients sum over DP x CP")

    g = p.add_argument_group("mixture of experts")
    g.add_argument("--expert-model-parallel-size", type=int, default=1,
                   help="mixture-of-experts models: experts split over this many ranks of a pipeline stage "
                        "(tensor-, then data-parallel ranks; docs/moe.md)")
    g.add_argument("--expert-tensor-parallel-size", type=int, default=1,
                   help="mixture-of-experts models: tensor parallelism inside the experts (only 1 yet)")
    g.add_argument("--moe-token-dispatcher-type", default="allgather", choices=list(MOE_TOKEN_DISPATCHERS),
                   help="mixture-of-experts models: megatron's token dispatcher")
    g.add_argument("--moe-aux-loss-coeff", type=float, default=0.0,
                   help="mixture-of-experts models: load-balancing loss coefficient (aux_loss over the whole global "
                        "batch, a shared token counted once per sample; without router replay a forward-only "
                        "pre-pass counts the routes; docs/moe.md)")
    g.add_argument("--moe-z-loss-coeff", type=float, default=0.0,
                   help="mixture-of-experts models: router z-loss coefficient (over the whole global batch, a shared "
                        "token counted once per sample)")
    g.add_argument("--moe-router-load-balancing-type", default="aux_loss",
                   help=f"mixture-of-experts models: megatron's load-balancing type, one of {MOE_LOAD_BALANCING_TYPES} "
                        "(aux_loss takes effect with --moe-aux-loss-coeff > 0; seq_aux_loss / global_aux_loss with it "
                        "and sinkhorn are refused)")
    g.add_argument("--moe-router-enable-expert-bias", action="store_true",
                   help="mixture-of-experts models whose sigmoid router has an expert bias (glm4_moe): update it "
                        "every step by megatron's aux-loss-free balancing rule, tokens counted once per sample "
                        "(without the flag the bias stays as loaded; refused for softmax routers)")
    g.add_argument("--moe-router-bias-update-rate", type=float, default=1e-3,
                   help="the expert bias's step with --moe-router-enable-expert-bias (Megatron-LM's default)")
    g.add_argument("--moe-grouped-gemm", action="store_true",
                   help="mixture-of-experts models: megatron's grouped-GEMM experts (CUDA only)")

    g = p.add_argument_group("mixed precision")
    g.add_argument("--bf16", action="store_true", help="bfloat16 parameters and compute")
    g.add_argument("--fp16", action="store_true", help="float16 parameters and compute")

    g = p.add_argument_group("activation memory")
    g.add_argument("--recompute-granularity", default=None, choices=["full", "selective"],
                   help="activation recomputation as in Megatron-LM: full layers or selective (core attention); "
                        "exact with prefix sharing (default: none, every activation kept)")
    g.add_argument("--recompute-method", default=None, choices=["uniform", "block"],
                   help="with full: uniform (every --recompute-num-layers layers one unit) or block (the first "
                        "--recompute-num-layers layers of each stage; default: none)")
    g.add_argument("--recompute-num-layers", type=int, default=None, help="with full: see --recompute-method (default: none)")
    g.add_argument("--loss-head-chunk-mb", type=float, default=64.0,
                   help="claimed rows become fp32 logits / log-probs / entropies in chunks of at most this many MiB "
                        "(2^20 bytes) of logits, recomputed in backward: the loss head peaks at about six times "
                        "this whatever the batch, and the --kv-cache-budget memory plan counts those six chunks")
    g.add_argument("--memory-budget", type=parse_memory_budget, default=None, metavar="BYTES|auto|off",
                   help="bytes the step may hold on the device, everything counted (weights, gradients, optimizer "
                        "state, kept graphs, cached K/V and their gradients, the loss head, attention temporaries); "
                        "each step the planner picks the fastest plan under it (micro-batch budget up to "
                        "--micro-batch-tokens, keep or recompute per prefix, full recomputation per layer, "
                        "--memory-offload) and logs its choice and predicted peak; a budget no plan fits is "
                        "refused naming the smallest that would; replaces --kv-cache-budget (default: auto, the "
                        "device's free memory at start-up less 10%% of its total on CUDA, off on CPU)")
    g.add_argument("--memory-offload", action="store_true",
                   help="with --memory-budget: host offload is one of the planner's choices: kept graphs' saved "
                        "tensors and cached K/V blocks that neither the running nor the next micro-batch step uses "
                        "go to pinned host memory and come back on a side stream ahead of their reader, priced as "
                        "the bytes moved over the host link less the compute they overlap; exact (copies). Not with "
                        "pipeline stages or cross-rank placement; on CPU the same copies into host buffers outside "
                        "the heap; the CUDA path has not run on a GPU yet")
    g.add_argument("--no-last-layer-row-skip", dest="last_layer_row_skip", action="store_false",
                   help="run the last layer in full for every row (by default it computes queries, attention "
                        "output and MLP only for the rows whose log-prob is trained or asked for; exact either way)")

    g = p.add_argument_group("distributed")
    g.add_argument("--distributed-timeout-minutes", type=float, default=DEFAULT_TIMEOUT_MINUTES,
                   help="timeout of every collective (fractions allowed); a rank stuck longer ends the job with an "
                        "error naming the operation and the rank it waited on")
    g.add_argument("--use-distributed-optimizer", action="store_true", help="megatron distributed optimizer (optimizer state sharded over data-parallel ranks)")
    g.add_argument("--overlap-grad-reduce", action=argparse.BooleanOptionalAction, default=True,
                   help="megatron DDP's asynchronous bucketed gradient reduce, each bucket's reduce started during "
                        "the step's last backward pass once its gradients are in (the same sums as after it); "
                        "--no-overlap-grad-reduce: one bucket, reduced at the optimizer step")
    g.add_argument("--ddp-bucket-size", type=int, default=None,
                   help="parameters per gradient bucket with --overlap-grad-reduce (default: megatron's, "
                        "max(40M, 1M x data-parallel size))")
    g.add_argument("--overlap-param-gather", action="store_true",
                   help="with --use-distributed-optimizer: overlap the parameter all-gather, launched after the "
                        "optimizer step, with what follows it (each module waits for its parameters)")

    g = p.add_argument_group("data")
    g.add_argument("--data", default=DEFAULT_WORKLOAD,
                   help=f"samples file (.jsonl/.parquet) or a synthetic workload: {', '.join(sorted(WORKLOAD_NAMES))}")
    g.add_argument("--synthetic-tokens", type=int, default=None,
                   help="tokens per iteration of a synthetic workload (default: its small default size)")
    g.add_argument("--global-batch-size", type=int, default=None,
                   help="samples per iteration from a file (default: the whole file every iteration)")
    g.add_argument("--allow-unknown-fields", action="store_true",
                   help="accept sample fields that look like typos of known ones (lossmask, advantages)")
    g.add_argument("--micro-batch-tokens", type=int, default=4096,
                   help=f"token budget of one micro-batch (at least {MIN_MICRO_BATCH_TOKENS})")
    g.add_argument("--allow-rope-extrapolation", action="store_true",
                   help="train samples longer than the model's max_position_embeddings (warned); refused otherwise")

    g = p.add_argument_group("prefix sharing")
    g.add_argument("--prefix-sharing", default="tree", choices=SHARING_MODES,
                   help="tree: mechanisms 1+2; tree-dup: mechanism 1, oversized trees duplicate their "
                        "prefix; none: no sharing (baseline)")
    g.add_argument("--no-prefix-sharing", action="store_true", help="same as --prefix-sharing none (the baseline)")
    g.add_argument("--kv-cache-budget", type=parse_bytes, default="1GiB",
                   help="bytes for cached prefix K/V, their gradients, retained prefix graphs and the running "
                        "micro-batch's gathered K/V and loss head (mechanism 2); below what a step needs, graphs "
                        "are dropped and recomputed, then prefixes duplicated")
    g.add_argument("--placement", default="auto", choices=PLACEMENTS,
                   help="trees over the ranks of an exchange group (the CP group, else the DP group): whole-tree "
                        "(each tree on one rank), cross-rank (equal-cost fragments exchanging prefix K/V) or auto "
                        "(the smaller predicted step time, from a start-up measurement; whole-tree with pipeline "
                        "stages)")
    g.add_argument("--no-split-trees-across-groups", dest="split_trees_across_groups", action="store_false",
                   help="keep every tree inside one exchange group (by default a tree larger than a group's share "
                        "is split between groups, each part recomputing the prefix it shares)")
    g.add_argument("--cross-group-prefix", default="auto", choices=CROSS_GROUP_PREFIX,
                   help="how the parts of a tree split between exchange groups get the prefix they share: "
                        "recompute (each part computes it), transfer (one rank computes it and sends its K/V) or "
                        "auto (per part, the cheaper by the start-up link measurement; recompute without one)")
    g.add_argument("--no-overlap-kv-exchange", dest="overlap_kv_exchange", action="store_false",
                   help="cross-rank placement: run every layer's prefix K/V exchange synchronously (by default it "
                        "overlaps with the attention over the keys the rank has; exact either way)")
    g.add_argument("--deterministic", action="store_true",
                   help="GPU: deterministic attention kernels (flash-attn's deterministic backward, Transformer "
                        "Engine's deterministic algorithms, megatron's deterministic_mode); slower. What stays "
                        "nondeterministic on a GPU: docs/installation.md. CPU runs are deterministic anyway")
    g.add_argument("--check-sharing-every", type=int, default=0, metavar="N",
                   help="every N steps, before the update, compute a few of the step's samples again without "
                        "sharing and compare log-probs and their gradient (norm, cosine) with the shared "
                        "computation; stop the run above the dtype's tolerance (costs two forward-backward "
                        "passes over those samples per checked step; 0: never)")
    g.add_argument("--check-sharing-samples", type=int, default=2, metavar="K",
                   help="samples the prefix sharing check computes again")
    g.add_argument("--check-sharing-warn-only", action="store_true",
                   help="a failed prefix sharing check logs a warning instead of stopping the run (default: stop)")
    g.add_argument("--cost-profile", default=None,
                   help="file keeping the start-up cost measurement of this model/device/layout for later runs "
                        "(default: none, measured at every start)")
    g.add_argument("--recalibrate", action="store_true",
                   help="measure the planner's costs at start-up even when --load's checkpoint recorded those its "
                        "run planned with (by default a resumed run plans with them: the same plans and losses as "
                        "an uninterrupted run); also measures anew instead of reading --cost-profile")

    g = p.add_argument_group("optimization")
    g.add_argument("--train-iters", type=int, default=5, help="iterations (optimizer steps, skipped ones included)")
    g.add_argument("--optimizer", default="adam", choices=OPTIMIZERS,
                   help="adam (AdamW, decoupled weight decay) or sgd; no weight decay on biases and norms")
    g.add_argument("--lr", type=float, default=1e-5, help="peak learning rate")
    g.add_argument("--min-lr", type=float, default=0.0, help="final learning rate of a decaying schedule")
    g.add_argument("--lr-warmup-iters", type=int, default=0, help="linear warm-up iterations")
    g.add_argument("--lr-decay-style", default="constant", choices=["constant", "linear", "cosine"],
                   help="learning-rate schedule after the warm-up")
    g.add_argument("--lr-decay-iters", type=int, default=None, help="default: --train-iters")
    g.add_argument("--weight-decay", type=float, default=0.0, help="decoupled weight decay")
    g.add_argument("--adam-beta1", type=float, default=0.9, help="Adam beta1")
    g.add_argument("--adam-beta2", type=float, default=0.999, help="Adam beta2")
    g.add_argument("--adam-eps", type=float, default=1e-8, help="Adam epsilon")
    g.add_argument("--sgd-momentum", type=float, default=0.0, help="SGD momentum")
    g.add_argument("--clip-grad", type=float, default=1.0, help="gradient-norm clip; 0 disables")
    g.add_argument("--max-skipped-iters", type=int, default=3,
                   help="a step whose loss or gradient norm is not finite is skipped (no change at all); this many "
                        "consecutive skipped steps stop the run with an error")

    g = p.add_argument_group("loss")
    g.add_argument("--clip-eps", type=float, default=0.2, help="PPO clip range of the ratio (docs/loss.md)")
    g.add_argument("--kl-coef", type=float, default=0.0,
                   help="weight of the k3 KL penalty to ref_logprobs (every sample needs them)")
    g.add_argument("--entropy-coef", type=float, default=0.0, help="weight of the entropy bonus")
    g.add_argument("--loss-agg", default="token-mean", choices=LOSS_AGGREGATIONS,
                   help="aggregation of the per-claim loss over the global batch (docs/loss.md)")

    g = p.add_argument_group("checkpointing")
    g.add_argument("--load", default=None,
                   help="megatron_psrl checkpoint directory (any TP/PP layout) to resume from; together with "
                        "--hf-dir/--model (Megatron's convention, usually the same folder as --save): resume when "
                        "it holds a checkpoint, else start from --hf-dir/--model (default: none)")
    g.add_argument("--finetune", action="store_true", help="with --load: start at iteration 0, no optimizer state")
    g.add_argument("--no-load-optim", action="store_true", help="with --load: do not restore the optimizer state")
    add_checksum_flag(g)
    g.add_argument("--save", default=None, help="checkpoint directory to write (default: none, nothing saved)")
    g.add_argument("--save-interval", type=int, default=None, help="also save every N iterations (default: none, only at the end)")
    g.add_argument("--ckpt-format", default=DEFAULT_CKPT_FORMAT, choices=CKPT_FORMATS,
                   help="format --save writes: torch_dist (megatron-core's sharded checkpoint; resumes under any "
                        "TP/PP/DP layout, optimizer state included) or legacy (Megatron's per-rank files); --load "
                        "reads either")

    g = p.add_argument_group("logging")
    g.add_argument("--log-interval", type=int, default=1, help="print an iteration line every N iterations")
    g.add_argument("--log-json", default=None, help="append one JSON object per iteration to this file (default: none)")
    g.add_argument("--tensorboard-dir", default=None, help="write every --log-json metric as TensorBoard scalars (default: none)")
    g.add_argument("--wandb-project", default=None, help="log every metric to this W&B project (offline without "
                                                          "WANDB_API_KEY; needs the wandb package; default: none)")
    g.add_argument("--wandb-exp-name", default=None, help="name of the W&B run (default: none, W&B picks one)")
    g.add_argument("--wandb-save-dir", default=None,
                   help="folder of the W&B run files (default: <--save>/wandb, else ./wandb)")
    g.add_argument("--memory-tracking", default="sampled", choices=MEMORY_TRACKING,
                   help="CPU peak memory: heap sampled every ms (cheap), read after every torch op (exact), or off")
    g.add_argument("--no-memory-tracking", action="store_true", help="same as --memory-tracking off")
    g.add_argument("--quiet", action="store_true", help="only errors on stdout")

    return p


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.no_prefix_sharing:
        args.prefix_sharing = "none"
    if args.no_memory_tracking:
        args.memory_tracking = "off"
    if args.hf_dir and args.model:
        parser.error("give at most one of --hf-dir and --model")
    if not (args.hf_dir or args.load or args.model):
        args.model = DEFAULT_MODEL
    if args.bf16 and args.fp16:
        parser.error("--bf16 and --fp16 are exclusive")
    for name in ("train_iters", "micro_batch_tokens", "tensor_model_parallel_size", "pipeline_model_parallel_size",
                 "context_parallel_size", "expert_model_parallel_size", "log_interval", "max_skipped_iters"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.micro_batch_tokens < MIN_MICRO_BATCH_TOKENS:
        parser.error(f"--micro-batch-tokens {args.micro_batch_tokens} is below the floor of {MIN_MICRO_BATCH_TOKENS} "
                     "tokens (a step would be thousands of tiny micro-batches)")
    if args.placement == "cross-rank" and args.prefix_sharing != "tree":
        parser.error("--placement cross-rank needs --prefix-sharing tree (fragments exchange cached prefix K/V)")
    if not args.distributed_timeout_minutes > 0:
        parser.error("--distributed-timeout-minutes must be > 0")
    if args.global_batch_size is not None and args.global_batch_size < 1:
        parser.error("--global-batch-size must be >= 1")
    if args.save_interval is not None and args.save_interval < 1:
        parser.error("--save-interval must be >= 1")
    if args.overlap_param_gather and not args.use_distributed_optimizer:
        parser.error("--overlap-param-gather needs --use-distributed-optimizer (as in Megatron-LM: the parameters "
                     "are all-gathered only when the optimizer state is sharded)")
    if args.lr_decay_iters is None:
        args.lr_decay_iters = args.train_iters
    return args
