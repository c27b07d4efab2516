"""``--help`` of the command lines reads as Megatron-LM's: flags in groups of a size one can scan
(none over 20), every flag's default in its help (a switch is off unless given; a flag without a
default says what happens without it), and the converter answers ``--help`` without importing
torch."""

import argparse
import importlib.util
import os
import subprocess
import sys

import pytest
from helpers.torchrun import REPO_ROOT

from megatron_psrl.training.arguments import build_parser

MAX_GROUP = 20
CONVERTER = os.path.join(REPO_ROOT, "tools", "convert_hf_checkpoint.py")


def _converter_parser() -> argparse.ArgumentParser:
    spec = importlib.util.spec_from_file_location("convert_hf_checkpoint", CONVERTER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.build_parser()


def _parsers():
    yield "pretrain_agent_rl.py", build_parser()
    for name, sub in _subparsers(_converter_parser()).items():
        yield f"convert_hf_checkpoint.py {name}", sub


def _subparsers(parser):
    return next((a.choices for a in parser._actions if isinstance(a, argparse._SubParsersAction)), {})


def _switch(action: argparse.Action) -> bool:
    """Off unless given (or on unless its --no- form is): nothing to show as a default."""
    return isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction, argparse._HelpAction))


@pytest.mark.parametrize("name,parser", list(_parsers()), ids=lambda x: x if isinstance(x, str) else "")
def test_every_flag_shows_its_default_or_what_happens_without_it(name, parser):
    formatter = parser._get_formatter()
    missing = []
    for action in parser._actions:
        if not action.option_strings or _switch(action) or action.required:
            continue
        text = formatter._expand_help(action) if action.help else ""
        if "default" not in text.lower():
            missing.append(f"{action.option_strings[-1]} (default {action.default!r}): {text!r}")
    assert not missing, f"{name}: flags whose --help does not show the default:\n" + "\n".join(missing)


def test_a_zero_default_is_shown():
    # 0 and 0.0 compare equal to False: they were taken for "off" and left out.
    parser = build_parser()
    formatter = parser._get_formatter()
    actions = {a.option_strings[-1]: a for a in parser._actions if a.option_strings}
    for flag, shown in (("--min-lr", "0.0"), ("--weight-decay", "0.0"), ("--kl-coef", "0.0"),
                        ("--entropy-coef", "0.0"), ("--sgd-momentum", "0.0"), ("--lr-warmup-iters", "0"),
                        ("--moe-aux-loss-coeff", "0.0")):
        assert formatter._expand_help(actions[flag]).endswith(f"(default: {shown})"), flag
    assert "(default: 0.0)" in parser.format_help()


def test_groups_are_small_enough_to_scan():
    parser = build_parser()
    sizes = {g.title: len(g._group_actions) for g in parser._action_groups}
    assert all(n <= MAX_GROUP for n in sizes.values()), sizes
    assert {"model", "parallelism", "mixture of experts", "mixed precision", "distributed"} <= set(sizes), sizes


def test_help_texts_agree_with_what_the_code_does():
    actions = {a.option_strings[-1]: a for a in build_parser()._actions if a.option_strings}
    # The memory plan charges the loss head about LOSS_HEAD_PEAK_FACTOR chunks against the KV budget.
    from megatron_psrl.model.logits import LOSS_HEAD_PEAK_FACTOR

    assert LOSS_HEAD_PEAK_FACTOR == 6 and "six times" in actions["--loss-head-chunk-mb"].help
    assert "MiB" in actions["--loss-head-chunk-mb"].help  # chunk bytes are mb * 2**20
    budget = actions["--kv-cache-budget"].help
    for counted in ("gathered K/V", "loss head", "retained prefix graphs"):
        assert counted in budget, counted


def test_converter_help_imports_no_torch():
    proc = subprocess.run([sys.executable, "-X", "importtime", CONVERTER, "--help"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0 and "hf-to-mcore" in proc.stdout, proc.stderr[-2000:]
    imported = {line.split("|")[-1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")}
    assert "torch" not in imported and "megatron.core" not in imported, sorted(imported)[-20:]
    # a mistyped command line is answered before the heavy imports too
    proc = subprocess.run([sys.executable, "-X", "importtime", CONVERTER, "hf-to-mcore", "--out-dir", "x"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--hf-dir" in proc.stderr
    assert " torch\n" not in proc.stderr and "| torch\n" not in proc.stderr
