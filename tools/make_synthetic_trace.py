#!/usr/bin/env python
"""Write a synthetic agentic-RL trace (JSONL or Parquet, by suffix) in the data format of
docs/data-format.md.

    python tools/make_synthetic_trace.py --workload stepwise --num-tokens 1000000 \\
        --turns 16,64 --obs-len 100,3000 --out runs/stepwise_1m.parquet

Lengths are ``N`` (constant) or ``LO,HI`` (log-uniform in [LO, HI]). Workload parameters that
are not given keep the defaults of megatron_psrl.data.synthetic.WORKLOAD_DEFAULTS; without
--num-tokens the trace has that (small) default size. The mixed workload only takes the
shared parameters (--system-len, --with-logprobs) and --num-tokens.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import List, Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_psrl.cli import call_cli  # noqa: E402
from megatron_psrl.data.loader import write_samples  # noqa: E402
from megatron_psrl.data.synthetic import DEFAULT_VOCAB_SIZE, WORKLOADS, make_workload  # noqa: E402


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


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--workload", required=True, choices=sorted(WORKLOADS))
    parser.add_argument("--out", required=True, help="output file (.jsonl or .parquet)")
    parser.add_argument("--num-tokens", type=int, default=None,
                        help="draw units until the trace holds at least this many tokens")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB_SIZE)
    parser.add_argument("--with-logprobs", action="store_true",
                        help="also write old_logprobs and ref_logprobs")
    for flag, dest, kind, help_text in WORKLOAD_FLAGS:
        parser.add_argument(flag, dest=dest, type=kind, default=None, help=help_text)
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
