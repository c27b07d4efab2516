"""``cross_rank_step.py`` with the prefix K/V exchange overlapped (``--overlap on``, the default
of ``StepRunner``) or synchronous (``--overlap off``, ``--no-overlap-kv-exchange``): one training
step and the log-prob pass under torchrun; rank 0 saves the loss, the full gradients, the
log-probs, and how many all-to-alls ran asynchronously / synchronously on it.

    torchrun --nproc_per_node N cross_rank_overlap_step.py --overlap on|off --hf-dir DIR --batch KIND
        --out FILE [--tp T] [--cp C] [--budget N] [--kv-budget BYTES]
"""

import sys

import torch.distributed as dist

from megatron_psrl.engine.step import StepRunner

overlap = sys.argv[sys.argv.index("--overlap") + 1] == "on"
del sys.argv[sys.argv.index("--overlap"):sys.argv.index("--overlap") + 2]

_init = StepRunner.__init__


def _init_with_switch(self, *args, **kwargs):  # every runner of the run, the log-prob pass's included
    _init(self, *args, **kwargs)
    self.overlap_kv_exchange = overlap


StepRunner.__init__ = _init_with_switch

COUNTS = {"async": 0, "sync": 0}
_real = dist.all_to_all_single


def counting(output, input, output_split_sizes=None, input_split_sizes=None, **kwargs):
    COUNTS["async" if kwargs.get("async_op") else "sync"] += 1
    assert min(output_split_sizes) > 0 and min(input_split_sizes) > 0, "an empty split"
    return _real(output, input, output_split_sizes, input_split_sizes, **kwargs)


dist.all_to_all_single = counting

_save = None


def _save_with_counts(obj, path, *args, **kwargs):
    if isinstance(obj, dict) and "grads" in obj:
        obj = dict(obj, all_to_all=dict(COUNTS))
    return _save(obj, path, *args, **kwargs)


import torch  # noqa: E402

_save, torch.save = torch.save, _save_with_counts

import os  # noqa: E402
import runpy  # noqa: E402

runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "cross_rank_step.py"), run_name="__main__")
