"""For ``tests/training/scripts/cross_rank_overlap_step.py``: every ``StepRunner`` of this process
(the log-prob pass's included) overlaps its prefix K/V exchange or not, as :func:`start` says;
every ``all_to_all_single`` is counted as asynchronous or synchronous, and a result dict that
``torch.save`` writes (one holding ``"grads"``) gets the counts as ``"all_to_all"``.

The patches are installed once per process (at import), so importing this module again does not
stack them; :func:`start` resets the counts."""

import torch
import torch.distributed as dist

from megatron_psrl.engine.step import StepRunner

SWITCH = {"overlap": True}
COUNTS = {"async": 0, "sync": 0}


def start(overlap: bool) -> None:
    """Runners made from now on overlap (or not); the counts start from zero."""
    SWITCH["overlap"] = overlap
    COUNTS.update({"async": 0, "sync": 0})


_init = StepRunner.__init__


def _init_with_switch(self, *args, **kwargs):
    _init(self, *args, **kwargs)
    self.overlap_kv_exchange = SWITCH["overlap"]


StepRunner.__init__ = _init_with_switch

_real = dist.all_to_all_single


def counting(output, input, output_split_sizes=None, input_split_sizes=None, **kwargs):
    COUNTS["async" if kwargs.get("async_op") else "sync"] += 1
    assert min(output_split_sizes) > 0 and min(input_split_sizes) > 0, "an empty split"
    return _real(output, input, output_split_sizes, input_split_sizes, **kwargs)


dist.all_to_all_single = counting

_save = torch.save


def _save_with_counts(obj, path, *args, **kwargs):
    if isinstance(obj, dict) and "grads" in obj:
        obj = dict(obj, all_to_all=dict(COUNTS))
    return _save(obj, path, *args, **kwargs)


torch.save = _save_with_counts
