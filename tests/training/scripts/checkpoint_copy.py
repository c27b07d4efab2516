"""Make ``--dest`` a checkpoint folder whose latest iteration is ``--iteration`` of ``--src``
(a run's earlier save, which ``--load`` alone cannot pick): rank 0 copies the iteration folder
and writes the tracker last; every other rank waits for the tracker, so the case that follows
finds the folder complete on every rank.

``--without-cost-record``: drop ``psrl_cost_calibration.json`` and its checksum line, as in a
checkpoint saved before checkpoints recorded the cost calibration.

    torchrun --nproc_per_node N checkpoint_copy.py --src U --iteration 2 --dest R [--without-cost-record]
"""

import argparse
import os
import shutil
import time

from megatron_psrl.checkpoint.checksums import MANIFEST
from megatron_psrl.checkpoint.layout import COST_JSON, TRACKER, iteration_dir_name

p = argparse.ArgumentParser()
p.add_argument("--src", required=True)
p.add_argument("--iteration", type=int, required=True)
p.add_argument("--dest", required=True)
p.add_argument("--without-cost-record", action="store_true")
args = p.parse_args()
name = iteration_dir_name(args.iteration)
tracker = os.path.join(args.dest, TRACKER)
if os.environ.get("RANK", "0") == "0":
    shutil.copytree(os.path.join(args.src, name), os.path.join(args.dest, name))
    if args.without_cost_record:
        it_dir = os.path.join(args.dest, name)
        os.remove(os.path.join(it_dir, COST_JSON))
        with open(os.path.join(it_dir, MANIFEST)) as f:
            lines = [line for line in f if not line.rstrip("\n").endswith(f"  {COST_JSON}")]
        with open(os.path.join(it_dir, MANIFEST), "w") as f:
            f.writelines(lines)
    with open(tracker + ".tmp", "w") as f:
        f.write(str(args.iteration))
    os.replace(tracker + ".tmp", tracker)
else:
    deadline = time.monotonic() + 120
    while not os.path.exists(tracker):
        if time.monotonic() > deadline:
            raise SystemExit(f"{tracker}: rank 0 did not write it within 120 s")
        time.sleep(0.05)
