"""The names of the choices that the command lines, the configs and the library share.

Only strings and numbers, importable without torch or megatron-core, so that a command line
can parse (and print ``--help``) before loading anything heavy. Each owning module imports its
names from here, so every list exists once.
"""

ATTENTION_BACKENDS = ("torch", "dense", "flash", "te")
"""Prefix-sharing attention kernels (``megatron_psrl.attention.backends``)."""

LATENT_CACHE_CHOICES = ("latent", "per-head")
"""What a latent-attention layer's cached prefix keeps (``--latent-cache``;
``ModelArchitecture.latent_cache``): its latent and RoPE key, or every head's key and value."""

SHARING_MODES = ("tree", "tree-dup", "none")
"""Prefix sharing: mechanisms 1 + 2, mechanism 1 with prefix duplication, none (the baseline)."""

PLACEMENTS = ("auto", "whole-tree", "cross-rank")
"""Trees over the ranks of an exchange group (``megatron_psrl.schedule.planner``)."""

CROSS_GROUP_PREFIX = ("auto", "transfer", "recompute")
"""How the parts of a tree split between exchange groups get the path they share: the
cheaper per part, sent from one rank, or recomputed by every part (``megatron_psrl.schedule.group_split``)."""

LOSS_AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")
"""Aggregations of the per-claim loss over the global batch (docs/loss.md)."""

OPTIMIZERS = ("adam", "sgd")
"""Optimizers (``megatron_psrl.engine.optimizer``)."""

MEMORY_TRACKING = ("sampled", "ops", "off")
"""CPU peak-memory measurement modes (``megatron_psrl.engine.memory``)."""

WORKLOAD_NAMES = ("grpo", "stepwise", "tree", "mixed")
"""Synthetic workloads (``megatron_psrl.data.synthetic``)."""

TINY_MODEL_NAMES = ("debug-deepseek-v3", "debug-llama", "tiny-llama", "tiny-mistral", "tiny-qwen2", "tiny-qwen3")
"""Debug-size model configs with random weights (``megatron_psrl.model.tiny``)."""
MOE_MODEL_NAMES = ("debug-deepseek-v3-moe", "debug-glm4-moe", "debug-gpt-oss", "debug-mixtral", "debug-qwen2-moe",
                   "debug-qwen3-moe")
"""Debug-size mixture-of-experts configs that ``--model`` takes besides the dense tiny ones
(``megatron_psrl.model.tiny.MOE_CONFIGS``; named here so that parsing imports no model code)."""
HYBRID_MODEL_NAMES = ("debug-qwen3-next", "debug-qwen3.5", "debug-qwen3.5-moe", "debug-qwen3.5-moe-text",
                      "debug-qwen3.5-text")
"""Debug-size Qwen3-Next / Qwen3.5 configs, Gated DeltaNet and softmax layers
(``megatron_psrl.model.tiny.HYBRID_CONFIGS``)."""

MOE_TOKEN_DISPATCHERS = ("allgather", "alltoall")
"""megatron's MoE token dispatchers (``--moe-token-dispatcher-type``; ``megatron_psrl.model.moe``)."""

MOE_LOAD_BALANCING_TYPES = ("aux_loss", "seq_aux_loss", "global_aux_loss", "none")
"""megatron's load-balancing types accepted (``--moe-router-load-balancing-type``; its
``sinkhorn`` is refused: it balances a batch's routes together)."""

DEFAULT_TIMEOUT_MINUTES = 10.0
"""Megatron-LM's default for ``--distributed-timeout-minutes``."""

CKPT_FORMATS = ("torch_dist", "legacy")
"""Checkpoint formats ``--save`` writes (``megatron_psrl.checkpoint.dist_format``); Megatron-LM's names."""

DEFAULT_CKPT_FORMAT = "torch_dist"
"""Megatron-LM's default: megatron-core's sharded checkpoint, loadable under any layout."""

VERIFY_CHECKSUMS_ENV = "PSRL_VERIFY_CHECKSUMS"
"""``0`` skips verifying a checkpoint's checksums when it is read (``--no-verify-checksums``;
:mod:`megatron_psrl.checkpoint.checksums`)."""
