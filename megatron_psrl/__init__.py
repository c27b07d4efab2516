"""megatron_psrl: exact training-time prefix sharing for agentic RL on Megatron-core.

Subpackages, one per concern:

- ``data``: trajectory samples (loading, validation, synthetic workloads)
- ``tree``: the global prefix tree, cost model and planner
- ``kvcache``: the dynamic-block KV cache manager (mechanism 2)
- ``attention``: the prefix-sharing core attention (TE-compatible) and its backends
- ``model``: Megatron-core GPT models built from Hugging Face configs, HF adapters
- ``distributed``: process groups, gradient and prefix K/V exchange
- ``training``: RL losses, the update step, the training loop
- ``checkpoint``: checkpoint I/O
"""

__version__ = "0.1.0"
