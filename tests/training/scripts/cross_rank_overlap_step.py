"""``cross_rank_step.py`` with the prefix K/V exchange overlapped (``--overlap on``, the default
of ``StepRunner``) or synchronous (``--overlap off``, ``--no-overlap-kv-exchange``): one training
step and the log-prob pass under torchrun; rank 0 saves the loss, the full gradients, the
log-probs, and how many all-to-alls ran asynchronously / synchronously on it (the switch and
the counts: tests/helpers/exchange_switch.py).

    torchrun --nproc_per_node N cross_rank_overlap_step.py --overlap on|off --hf-dir DIR --batch KIND
        --out FILE [--tp T] [--cp C] [--budget N] [--kv-budget BYTES]
"""

import os
import runpy
import sys

from helpers.exchange_switch import start

overlap = sys.argv[sys.argv.index("--overlap") + 1] == "on"
del sys.argv[sys.argv.index("--overlap"):sys.argv.index("--overlap") + 2]
start(overlap)
runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "cross_rank_step.py"), run_name="__main__")
