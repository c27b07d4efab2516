"""The engine: what one rank runs steps with, and how it is assembled.

- ``config``: :class:`ActorConfig`, the one config of every entry point;
- ``builder``: :func:`build_engine`, the engine assembled in named steps;
- ``engine``: :class:`Engine` and a step (plan, run, reduce, optimizer step);
- ``step``: the executor of a rank's instructions (:mod:`megatron_psrl.schedule.instructions`),
  one method per kind; ``participants``: what spans a step (expert lockstep, router replay and
  losses, head sends, the KV cache's pool); ``prefix_kv``: the attention hook of one forward;
- ``pipeline``: the same with pipeline stages (1F1B or interleaved order where the micro-batches
  are independent; ``stage_links``: the transfers between stages);
- ``head_sends``: split trees' heads sent between exchange groups (point to point);
- ``optimizer``, ``calibration``, ``memory``, ``logprobs``, ``runners``,
  ``weights``: the engine's parts.

Planning lives in :mod:`megatron_psrl.schedule`, checkpoint saving in
:mod:`megatron_psrl.checkpoint.saving`: the engine executes plans and owns nothing of planning.

Import the modules themselves (``from megatron_psrl.engine.builder import build_engine``);
this package file imports nothing, so that importing one part does not load them all.
"""
