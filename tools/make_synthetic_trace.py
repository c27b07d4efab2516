#!/usr/bin/env python
"""Write a synthetic agentic-RL trace (JSONL or Parquet, by suffix) in the data format of
docs/data-format.md.

    python tools/make_synthetic_trace.py --workload stepwise --num-tokens 1000000 \\
        --turns 16,64 --obs-len 100,3000 --out runs/stepwise_1m.parquet

Lengths are ``N`` (constant) or ``LO,HI`` (log-uniform in [LO, HI]). Parameters not given
keep the small defaults shown below (megatron_psrl.data.synthetic.WORKLOAD_DEFAULTS, the same
as ``pretrain_agent_rl.py --data stepwise``): a few thousand tokens, for a quick CPU run. For
SWE-agent-like step-wise trajectories pass ``--turns 16,64 --obs-len 100,3000 --action-len
10,100 --task-len 200,1000 --system-len 1000`` (the defaults of ``make_stepwise`` in Python).
The mixed workload only takes the shared parameters (--system-len, --with-logprobs) and
--num-tokens.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import List, Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_psrl.cli import HelpFormatter, call_cli  # noqa: E402
from megatron_psrl.data.loader import write_samples  # noqa: E402
from megatron_psrl.data.synthetic import (  # noqa: E402
    DEFAULT_VOCAB_SIZE,
    WORKLOAD_DEFAULTS,
    WORKLOADS,
    make_workload,
)


def length_spec(text: str):
    """``"N"`` -> N, ``"LO,HI"`` -> (LO, HI)."""
    parts = text.split(",")
    try:
        values = [int(p) for p in parts]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected N or LO,HI, got {text!r}") from None
    if len(values) == 1:
        return values[0]
    if len(values) == 2:
        return tuple(values)
    raise argparse.ArgumentTypeError(f"expected N or LO,HI, got {text!r}")


# (flag, generator keyword, type, help): only the flags given on the command line are passed.
WORKLOAD_FLAGS = [
    ("--num-prompts", "num_prompts", int, "grpo: prompt groups"),
    ("--group-size", "group_size", int, "grpo: responses per prompt"),
    ("--prompt-len", "prompt_len", length_spec, "grpo/tree: prompt tokens"),
    ("--response-len", "response_len", length_spec, "grpo: response tokens"),
    ("--num-trajectories", "num_trajectories", int, "stepwise: trajectories"),
    ("--turns", "turns", length_spec, "stepwise: turns per trajectory"),
    ("--obs-len", "obs_len", length_spec, "stepwise/tree: tool output (observation) tokens"),
    ("--action-len", "action_len", length_spec, "stepwise: action tokens"),
    ("--task-len", "task_len", length_spec, "stepwise: task description tokens"),
    ("--num-roots", "num_roots", int, "tree: rollout trees"),
    ("--branching", "branching", length_spec, "tree: continuations per turn"),
    ("--depth", "depth", int, "tree: turns (branching levels)"),
    ("--segment-len", "segment_len", length_spec, "tree: action tokens"),
    ("--system-len", "system_len", int, "all: shared system prompt tokens"),
]


def _defaults_of(dest: str) -> str:
    """``default: grpo 64,256, tree 64,256``: the value each workload uses when not given."""
    def text(value) -> str:
        return ",".join(map(str, value)) if isinstance(value, tuple) else str(value)

    used = [f"{name} {text(params[dest])}" for name, params in WORKLOAD_DEFAULTS.items() if dest in params]
    return "default: " + (", ".join(used) if used else "the generator's")


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=HelpFormatter
    )
    parser.add_argument("--workload", required=True, choices=sorted(WORKLOADS), help="the shape of the trace")
    parser.add_argument("--out", required=True, help="output file (.jsonl or .parquet)")
    parser.add_argument("--num-tokens", type=int, default=None,
                        help="draw units until the trace holds at least this many tokens")
    parser.add_argument("--seed", type=int, default=0, help="the same seed writes the same trace")
    parser.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB_SIZE,
                        help="token ids are drawn below it (use the model's vocabulary size)")
    parser.add_argument("--with-logprobs", action="store_true",
                        help="also write old_logprobs and ref_logprobs")
    for flag, dest, kind, help_text in WORKLOAD_FLAGS:
        parser.add_argument(flag, dest=dest, type=kind, default=None, help=f"{help_text} ({_defaults_of(dest)})")
    return parser.parse_args(argv)


def main(argv: Optional[List[str]] = None) -> int:
    return call_cli(lambda: _main(argv))


def _main(argv: Optional[List[str]]) -> int:
    args = parse_args(argv)
    overrides = {dest: getattr(args, dest) for _, dest, _, _ in WORKLOAD_FLAGS
                 if getattr(args, dest) is not None}
    if args.with_logprobs:
        overrides["with_logprobs"] = True
    batch = make_workload(args.workload, num_tokens_target=args.num_tokens,
                          vocab_size=args.vocab_size, seed=args.seed, **overrides)
    path = write_samples(batch, args.out)
    print(f"wrote {batch.num_samples} samples, {batch.num_tokens} tokens "
          f"({args.workload}, seed {args.seed}) to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
