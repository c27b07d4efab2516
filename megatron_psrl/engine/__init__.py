"""The engine: what one rank runs steps with, and how it is assembled.

- ``config``: :class:`ActorConfig`, the one config of every entry point;
- ``builder``: :func:`build_engine`, the engine assembled in named steps;
- ``engine``: :class:`Engine` and a step (plan, run, reduce, optimizer step);
- ``step`` / ``pipeline``: how this rank runs its micro-batches (without / with pipeline stages);
- ``planning``: the step plan and the KV memory plan together (cut differently when tight);
- ``optimizer``, ``calibration``, ``memory``, ``transfer``, ``logprobs``, ``checkpointing``:
  the engine's parts.

Import the modules themselves (``from megatron_psrl.engine.builder import build_engine``);
this package file imports nothing, so that importing one part does not load them all.
"""
