"""megatron_psrl: exact training-time prefix sharing for agentic RL on Megatron-core.

Subpackages, one per concern:

- ``data``: trajectory samples (loading, validation, synthetic workloads)
- ``tree``: the global prefix tree of a batch (build, index, statistics, chunks)
- ``schedule``: planning a step over the tree: cost model, placement over ranks and groups,
  micro-batches, the KV memory plan, and the typed instructions a rank executes
- ``kvcache``: the dynamic-block KV cache manager (mechanism 2)
- ``attention``: the prefix-sharing core attention (TE-compatible) and its backends
- ``model``: Megatron-core GPT models built from Hugging Face configs, HF adapters
- ``distributed``: process groups, gradient and prefix K/V exchange
- ``engine``: the engine one rank runs steps with (its builder, the executor of the
  instructions and its participants, the pipeline runner, the optimizer, cost calibration)
- ``rl``: the RL-facing layer: policy losses and :class:`PolicyActor`, the in-memory API for
  RL frameworks (a thin layer over the engine)
- ``training``: the command line's training loop, its arguments, logging and start-up checks
- ``integrations``: adapters to RL frameworks' data (slime)
- ``checkpoint``: checkpoint formats, loading and saving
- ``host_copy``, ``dtypes``, ``errors``, ``options``, ``tempfiles``: small utilities every layer may
  use (host-to-device copies of a step, dtype names, error types, option names, temporaries that
  become outputs)
"""

__version__ = "0.1.0"

# Import-time warnings megatron-core emits on machines without apex / Transformer Engine:
# expected there and not actionable (the run's header line says which kernels run instead).
_EXPECTED_IMPORT_WARNINGS = (
    "Apex is not installed",
    "Transformer Engine and Apex are not installed",
    "Transformer Engine is not installed",
    "full scope is deprecated",  # TransformerConfig's cuda_graph_scope default (unused here)
)


def quiet_expected_import_warnings() -> None:
    """Silence megatron-core's not-actionable import warnings and its INFO chatter (done on
    ``import megatron_psrl``, before anything imports megatron-core)."""
    import logging
    import warnings

    for msg in _EXPECTED_IMPORT_WARNINGS:
        warnings.filterwarnings("ignore", message=f".*{msg}.*")
    logging.getLogger("megatron.core").setLevel(logging.WARNING)


quiet_expected_import_warnings()

_API = {
    "PolicyActor": "megatron_psrl.rl.actor",
    "ActorConfig": "megatron_psrl.engine.config",
    "StepResult": "megatron_psrl.engine.engine",
    "Engine": "megatron_psrl.engine.engine",
    "build_engine": "megatron_psrl.engine.builder",
    "LossConfig": "megatron_psrl.rl.loss",
    "ClaimView": "megatron_psrl.rl.loss",
    "PerClaimLoss": "megatron_psrl.rl.loss",
    "SequenceLoss": "megatron_psrl.rl.loss",
    "GSPOLoss": "megatron_psrl.rl.loss",
    "log_likelihood_loss": "megatron_psrl.rl.loss",
    "OptimizerSettings": "megatron_psrl.engine.optimizer",
}


def __getattr__(name):
    """The in-memory API (``from megatron_psrl import PolicyActor``), imported on first use so
    that ``import megatron_psrl`` (and ``pretrain_agent_rl.py --help``) stays light."""
    if name in _API:
        import importlib

        return getattr(importlib.import_module(_API[name]), name)
    raise AttributeError(f"module 'megatron_psrl' has no attribute {name!r}")


def __dir__():
    """The module's globals and the lazily imported API (``dir(megatron_psrl)``, completion)."""
    return sorted(set(globals()) | set(__all__))


__all__ = sorted(_API)
