"""One log-prob call and one SGD step of a PolicyActor on every rank of a torchrun job, with
what every rank got compared (for the multi-rank test scripts)."""

import numpy as np
import torch.distributed as dist


def logprobs_and_step(actor, records) -> dict:
    """Log-probs, one ``train_step`` (its log-probs and loss), the full HF weights before and
    after, and ``ranks_agree``: every rank returned the same log-probs, loss and weights."""
    logprobs = actor.compute_logprobs(records)
    before = actor.state_dict_hf()
    metrics = actor.train_step(records)
    after = actor.state_dict_hf()
    digest = [float(np.nansum(np.concatenate(logprobs))), float(np.nansum(np.concatenate(metrics["logprobs"]))),
              float(sum(v.double().sum() for v in after.values())), metrics["loss"]]
    digests = [None] * dist.get_world_size()
    dist.all_gather_object(digests, digest)
    return {"logprobs": logprobs, "step_logprobs": metrics["logprobs"], "loss": metrics["loss"], "before": before,
            "after": after, "ranks_agree": all(d == digests[0] for d in digests), "metrics": metrics}
