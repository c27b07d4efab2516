"""``--deterministic`` reaches the GPU kernels: megatron's ``deterministic_mode`` on the model's
config, which the core attention hands to flash-attn's varlen call (``deterministic=True``) and
to Transformer Engine (``NVTE_ALLOW_NONDETERMINISTIC_ALGO=0``). Checked without a GPU: the
config field, and the arguments a stand-in flash-attn receives."""

import sys
import types

import pytest
import torch

from megatron_psrl.attention.backends import varlen
from megatron_psrl.attention.plan import causal_plan
from megatron_psrl.engine.config import ActorConfig
from megatron_psrl.training.arguments import build_parser
from megatron_psrl.training.trainer import actor_config_from_args


def test_the_flag_sets_megatrons_deterministic_mode():
    args = build_parser().parse_args(["--deterministic"])
    config = actor_config_from_args(args, "float32")
    assert config.deterministic and config.parallel_overrides()["deterministic_mode"] is True
    assert "deterministic_mode" not in ActorConfig().parallel_overrides()


@pytest.mark.parametrize("deterministic", [False, True])
def test_flash_attn_gets_the_setting(monkeypatch, deterministic):
    seen = {}

    def flash_attn_varlen_func(q, k, v, *args, **kwargs):
        seen.update(kwargs)
        return q

    monkeypatch.setitem(sys.modules, "flash_attn", types.SimpleNamespace(flash_attn_varlen_func=flash_attn_varlen_func))
    monkeypatch.setattr(varlen, "require_cuda", lambda name, q: None)  # (no GPU here: the call is what is checked)
    q = torch.zeros(4, 2, 8)
    varlen.flash_tree_attention(q, q[:, :1], q[:, :1], causal_plan([4]), (), 0.5, deterministic=deterministic)
    assert seen["deterministic"] is deterministic and seen["causal"] is True


def test_te_is_told_to_avoid_nondeterministic_algorithms(monkeypatch):
    """A model built for ``te`` in deterministic mode sets TE's switch before building it."""
    import os

    from megatron_psrl.attention import core_attention

    monkeypatch.delenv("NVTE_ALLOW_NONDETERMINISTIC_ALGO", raising=False)
    built = []
    monkeypatch.setattr(core_attention, "TETreeAttention", lambda *args: built.append(args))
    attention = core_attention.PrefixSharingAttention.__new__(core_attention.PrefixSharingAttention)
    attention.softmax_scale, attention.deterministic = 0.5, False
    attention._build_te(2, 1, 8, 1)
    assert "NVTE_ALLOW_NONDETERMINISTIC_ALGO" not in os.environ and built == [(2, 1, 8, 0.5, 1)]
    attention.deterministic = True
    attention._build_te(2, 1, 8, 1)
    assert os.environ["NVTE_ALLOW_NONDETERMINISTIC_ALGO"] == "0"
