#!/usr/bin/env python
"""Prefix-shared RL update steps (PPO / GRPO) on a megatron-core GPT model.

    torchrun --nproc_per_node N pretrain_agent_rl.py [Megatron-style arguments]

Without arguments: a few steps of a tiny random Llama on a synthetic agentic trace (CPU or
GPU). See README.md and ``--help`` for the flags. Errors in the input, the configuration or
the environment print one line and exit with status 2; bugs print their traceback (status 1).
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# The flags first: --help and a wrong flag answer before torch and megatron-core load.
from megatron_psrl.training.arguments import parse_args  # noqa: E402

ARGS = parse_args() if __name__ == "__main__" else None

from megatron_psrl.compat import quiet_expected_import_warnings  # noqa: E402

quiet_expected_import_warnings()

from megatron_psrl.cli import run_cli  # noqa: E402
from megatron_psrl.distributed.setup import shutdown_parallel  # noqa: E402
from megatron_psrl.training.trainer import train  # noqa: E402


def _train() -> int:
    train(ARGS)
    return 0


if __name__ == "__main__":
    run_cli(_train, cleanup=shutdown_parallel)
