#!/usr/bin/env python
"""Prefix-shared RL update steps (PPO / GRPO) on a megatron-core GPT model.

    torchrun --nproc_per_node N pretrain_agent_rl.py [Megatron-style arguments]

Without arguments: a few steps of a tiny random Llama on a synthetic agentic trace (CPU or
GPU). See README.md and ``--help`` for the flags.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from megatron_psrl.compat import quiet_expected_import_warnings  # noqa: E402

quiet_expected_import_warnings()

from megatron_psrl.data.validation import SampleValidationError  # noqa: E402
from megatron_psrl.distributed.setup import shutdown_parallel  # noqa: E402
from megatron_psrl.kvcache import CacheBudgetError  # noqa: E402
from megatron_psrl.model.architecture import UnsupportedModelError  # noqa: E402
from megatron_psrl.training.trainer import main  # noqa: E402
from megatron_psrl.tree.planner import PlanningError  # noqa: E402

if __name__ == "__main__":
    try:
        main()
    except (SampleValidationError, UnsupportedModelError, CacheBudgetError, PlanningError, FileNotFoundError,
            NotImplementedError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        sys.exit(2)
    finally:
        shutdown_parallel()
