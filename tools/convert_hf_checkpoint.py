#!/usr/bin/env python
"""Convert checkpoints between Hugging Face and megatron_psrl (torch_dist or Megatron legacy) formats.

    python tools/convert_hf_checkpoint.py hf-to-mcore --hf-dir HF_DIR --out-dir CKPT_DIR [--ckpt-format F] [--tp N] [--pp M]
    python tools/convert_hf_checkpoint.py mcore-to-hf --load CKPT_DIR --out-dir HF_DIR [--hf-template HF_DIR]
    python tools/convert_hf_checkpoint.py mcore-to-mcore --load CKPT_DIR --out-dir CKPT_DIR [--ckpt-format F] [--tp N] [--pp M]

--ckpt-format torch_dist (the default, megatron-core's sharded format: one checkpoint that
loads under any TP/PP layout, so --tp/--pp are not needed) or legacy (per-rank files of a
TP x PP layout). The format of --load is detected (either is read, any layout).
Supported: every registered family (Llama, Mistral, Qwen2/Qwen2.5, Qwen3, the MoE families, gpt-oss,
Qwen3-Next and Qwen3.5; safetensors, sharded or not). A round trip reproduces every tensor bit
for bit; a Qwen3.5 wrapper's vision tower is carried through (mcore-to-hf of a checkpoint saved
by training takes it from --hf-template). hf-to-mcore refuses a weight holding NaN or inf (one
line naming the tensor and its file) unless --allow-non-finite is given. Outputs are written
atomically; a non-empty --out-dir is only replaced with --force.
"""

import argparse
import logging
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Only light modules before parsing: --help and a mistyped flag answer at once. The converter
# (torch, megatron-core, safetensors: seconds of imports) is imported once the arguments hold.
from megatron_psrl.cli import HelpFormatter, add_checksum_flag, apply_checksum_flag, call_cli, positive_int  # noqa: E402
from megatron_psrl.options import CKPT_FORMATS, DEFAULT_CKPT_FORMAT  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    """The command line (importing nothing heavy)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    sub = p.add_subparsers(dest="direction", required=True)
    a = sub.add_parser("hf-to-mcore", formatter_class=HelpFormatter, help="Hugging Face folder -> sharded megatron_psrl checkpoint")
    a.add_argument("--hf-dir", required=True, help="save_pretrained folder (config.json + safetensors)")
    a.add_argument("--out-dir", required=True, help="checkpoint directory to create")
    a.add_argument("--allow-non-finite", action="store_true",
                   help="convert weights holding NaN or inf (one warning per tensor) instead of refusing them")
    b = sub.add_parser("mcore-to-hf", formatter_class=HelpFormatter, help="megatron_psrl checkpoint (either format, any TP/PP) -> Hugging Face folder")
    b.add_argument("--load", required=True, help="checkpoint directory (as written by hf-to-mcore or --save)")
    b.add_argument("--out-dir", required=True, help="Hugging Face folder to create")
    b.add_argument("--hf-template", default=None, help="HF folder whose tokenizer/generation files are copied (default: none, config and weights only)")
    c = sub.add_parser("mcore-to-mcore", formatter_class=HelpFormatter, help="megatron_psrl checkpoint (either format) -> the other format / "
                                              "another legacy layout (weights only)")
    c.add_argument("--load", required=True, help="checkpoint directory (either format, any TP/PP)")
    c.add_argument("--out-dir", required=True, help="checkpoint directory to create")
    for s in (a, c):
        s.add_argument("--ckpt-format", default=DEFAULT_CKPT_FORMAT, choices=CKPT_FORMATS,
                       help="output format: torch_dist (default; loads under any layout) or legacy (per-rank "
                            "files of --tp x --pp)")
        s.add_argument("--tp", type=positive_int, default=1, help="legacy: tensor-parallel shards (default 1)")
        s.add_argument("--pp", type=positive_int, default=1, help="legacy: pipeline-parallel stages (default 1)")
    for s in (b, c):
        add_checksum_flag(s)
    for s in (a, b, c):
        s.add_argument("--force", action="store_true", help="replace a non-empty --out-dir")
        s.add_argument("--no-progress", action="store_true", help="no progress bars")
    return p


def parse_args(argv=None):
    return build_parser().parse_args(argv)


def main(argv=None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    args = parse_args(argv)
    apply_checksum_flag(args)
    return call_cli(lambda: _convert(args))


def _layout(args) -> str:
    if args.ckpt_format == "torch_dist":
        return "torch_dist (loads under any TP/PP)"
    return f"legacy TP={args.tp} PP={args.pp}"


def _convert(args) -> int:
    from megatron_psrl.checkpoint.convert import hf_to_mcore, mcore_to_hf, mcore_to_mcore

    if args.direction == "hf-to-mcore":
        info = hf_to_mcore(args.hf_dir, args.out_dir, args.tp, args.pp, overwrite=args.force,
                           progress=not args.no_progress, ckpt_format=args.ckpt_format,
                           allow_non_finite=args.allow_non_finite)
        print(f"converted {args.hf_dir} ({info.architecture.model_type}, {info.dtype}) -> {args.out_dir}, "
              f"{_layout(args)}")
    elif args.direction == "mcore-to-mcore":
        info = mcore_to_mcore(args.load, args.out_dir, args.tp, args.pp, overwrite=args.force,
                              ckpt_format=args.ckpt_format)
        print(f"converted {args.load} ({info.architecture.model_type}, {info.dtype}) -> {args.out_dir}, "
              f"{_layout(args)}")
    else:
        info = mcore_to_hf(args.load, args.out_dir, args.hf_template, overwrite=args.force, progress=not args.no_progress)
        print(f"converted {args.load} ({info.architecture.model_type}) -> {args.out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
