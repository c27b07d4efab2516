"""The prefix sharing check on 2 data-parallel ranks (gloo): both ranks check the same samples,
sum the subset's gradient over the ranks, and take the same verdict; a step with the check
trains as one without. Prints ``OK rank <r> ...`` per rank. Both actors plan with the same
start-up cost measurement (one cost profile): measured twice, on a busy machine, the plans (and
so the order of the sums compared bit for bit) could differ.

    torchrun --nproc_per_node 2 sharing_check_dp2.py
"""

import os
import tempfile

import torch
import torch.distributed as dist

from megatron_psrl.data import make_workload
from megatron_psrl.rl.actor import ActorConfig, PolicyActor

batch = make_workload("grpo", seed=1)
costs = os.path.join(tempfile.gettempdir(), f"psrl-sharing-check-dp2-{os.environ['MASTER_PORT']}.json")
checked = PolicyActor("tiny-llama", ActorConfig(device="cpu", micro_batch_tokens=256, check_sharing_every=1,
                                                check_sharing_samples=3, cost_profile=costs))
m = checked.train_step(batch)
check = m["sharing_check"]
rank = dist.get_rank()
views = [None, None]
dist.all_gather_object(views, check)
assert views[0] == views[1], views  # the same samples, figures and verdict on both ranks
assert check["passed"] and check["logprob_max_abs"] < 1e-5 and check["grad_norm_rel"] < 1e-5, check
after_checked = checked.state_dict_hf()
checked.close()
plain = PolicyActor("tiny-llama", ActorConfig(device="cpu", micro_batch_tokens=256, cost_profile=costs))
p = plain.train_step(batch)
assert p["loss"] == m["loss"] and all(torch.equal(a, b) for a, b in zip(plain.state_dict_hf().values(),
                                                                        after_checked.values()))
print(f"OK rank {rank} samples {check['samples']} gap {check['logprob_max_abs']:.2e}", flush=True)
plain.close()
if rank == 0:
    os.remove(costs)
