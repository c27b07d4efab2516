"""pretrain_agent_rl's Trainer under torchrun; afterwards every rank reports a checksum of its
parameters and whether each step was skipped, so a test can check that all data-parallel
ranks skipped the same steps and still hold identical weights.

    torchrun --nproc_per_node 2 train_and_compare_ranks.py --out FILE -- [pretrain_agent_rl args]
"""

import json
import sys

import torch
import torch.distributed as dist

from megatron_psrl.distributed.setup import shutdown_parallel
from megatron_psrl.training.arguments import parse_args
from megatron_psrl.training.trainer import Trainer

split = sys.argv.index("--")
out = sys.argv[sys.argv.index("--out") + 1]
trainer = Trainer(parse_args(sys.argv[split + 1:]))
records = trainer.run()
checksum = float(sum(p.detach().double().sum() for p in trainer.model.parameters()))
finite = all(bool(torch.isfinite(p).all()) for p in trainer.model.parameters())
report = {"rank": dist.get_rank(), "skipped": [bool(r.extra["skipped"]) for r in records],
          "checksum": checksum, "finite": finite}
reports = [None] * dist.get_world_size()
dist.all_gather_object(reports, report)
if dist.get_rank() == 0:
    with open(out, "w") as f:
        json.dump(reports, f)
shutdown_parallel()
