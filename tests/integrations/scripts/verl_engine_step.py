"""One verl ``infer_batch`` and one ``train_batch`` (SGD, lr 1, no clipping) of the psrl verl
engine on every rank of a torchrun job, each data-parallel rank with its own share of a
multi-turn GRPO mini-batch (verl's split: every DP rank its samples, TP ranks the same ones);
rank 0 checks log-probs, entropies (``train_batch``'s at every position), the loss of every
share and every parameter's gradient
against the per-sample Hugging Face reference through verl's ppo_loss, and writes a summary.
Then every ``--cases`` entry (the harness's ppo_loss configurations): each rank checks its loss
and metrics against verl's ppo_loss on its own log-probs, rank 0 every gradient."""

import argparse
import json
import os
from functools import partial

os.environ.setdefault("VERL_ENGINE_DEVICE", "cpu")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from helpers.hf_reference import load_hf_model  # noqa: E402
from helpers.tolerance import assert_equal_up_to_rounding  # noqa: E402
from helpers.verl_harness import (  # noqa: E402
    ONE_PASS_CASES,
    TWO_PASS_CASES,
    assert_every_position,
    case_batch,
    case_config,
    metric_values,
    multi_turn_samples,
    reference,
    response_positions,
    trained_metric_values,
    verl_batch,
    verl_loss_config,
)
from verl.utils import tensordict_utils as tu  # noqa: E402
from verl.workers.config import HFModelConfig, McoreOptimizerConfig  # noqa: E402
from verl.workers.engine import EngineRegistry  # noqa: E402
from verl.workers.utils.losses import ppo_loss  # noqa: E402

from megatron_psrl.integrations.verl import BACKEND, PsrlEngineConfig  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--hf-dir", required=True)
parser.add_argument("--tp", type=int, default=1)
parser.add_argument("--entropy-coeff", type=float, default=0.0)
parser.add_argument("--loss-agg", default="token-mean")
parser.add_argument("--micro-batch-tokens", type=int, default=48)
parser.add_argument("--cases", default="", help="comma-separated ONE_PASS_CASES / TWO_PASS_CASES names")
parser.add_argument("--out", required=True)
args = parser.parse_args()

dist.init_process_group("gloo")  # as verl's worker does before it builds the engine
engine = EngineRegistry.new("language_model", backend=BACKEND,
                            model_config=HFModelConfig(path=args.hf_dir, load_tokenizer=False),
                            engine_config=PsrlEngineConfig(dtype="float32", device="cpu", tensor_model_parallel_size=args.tp,
                                                           micro_batch_tokens=args.micro_batch_tokens),
                            optimizer_config=McoreOptimizerConfig(optimizer="sgd", lr=1.0, clip_grad=0.0,
                                                                  weight_decay=0.0),
                            checkpoint_config=None)
engine.initialize()
dp, rank = engine.get_data_parallel_size(), engine.get_data_parallel_rank()
samples = multi_turn_samples()
entropy = args.entropy_coeff != 0.0
shards = [verl_batch(samples[r::dp], global_batch_size=len(samples), calculate_entropy=entropy, seed=r)
          for r in range(dp)]
config = verl_loss_config(args.loss_agg, args.entropy_coeff)

with engine.eval_mode():
    inferred = engine.infer_batch(shards[rank].clone())
before = engine.actor.state_dict_hf()
with engine.train_mode():
    trained = engine.train_batch(shards[rank].clone(), partial(ppo_loss, config))
after = engine.actor.state_dict_hf()
engine.actor.load_hf_state_dict(before)  # the cases below start from the checkpoint's weights too

mine = {"rank": dist.get_rank(), "dp_rank": rank, "src": engine.is_mp_src_rank_with_outputs(),
        "loss": trained["loss"][0], "grad_norm": trained["metrics"].get("grad_norm"),  # on reporting ranks
        "log_probs": inferred["model_output"]["log_probs"].values().tolist(),
        "entropy": inferred["model_output"]["entropy"].values().tolist() if entropy else None,
        "trained": {k: v.values().tolist() for k, v in trained["model_output"].items()}}
everyone = [None] * dist.get_world_size()
dist.all_gather_object(everyone, mine)

if dist.get_rank() == 0:
    hf = load_hf_model(args.hf_dir)
    ref = reference(hf, shards, config, entropy)
    summary = {"dp": dp, "tp": args.tp, "worst_logprob": 0.0, "worst_entropy": 0.0, "worst_grad": 0.0, "losses": {},
               "reference_losses": ref["losses"]}
    for got in everyone:
        r = got["dp_rank"]
        keep = response_positions(shards[r])
        lp = torch.tensor(got["log_probs"])
        torch.testing.assert_close(lp[keep], ref["log_probs"][r][keep], rtol=0, atol=1e-5)
        summary["worst_logprob"] = max(summary["worst_logprob"], float((lp[keep] - ref["log_probs"][r][keep]).abs().max()))
        if entropy:
            ent = torch.tensor(got["entropy"])
            torch.testing.assert_close(ent[keep], ref["entropy"][r][keep], rtol=0, atol=1e-5)
            summary["worst_entropy"] = max(summary["worst_entropy"],
                                           float((ent[keep] - ref["entropy"][r][keep]).abs().max()))
        for key, values in got["trained"].items():  # train_batch's own, at every position
            assert_every_position(torch.nested.nested_tensor_from_jagged(torch.tensor(values),
                                                                         shards[r]["input_ids"].offsets()),
                                  ref[key][r], shards[r], key)
        assert abs(got["loss"] - ref["losses"][r]) <= 1e-5 * max(1.0, abs(ref["losses"][r])), (got, ref["losses"])
        summary["losses"][str(got["rank"])] = got["loss"]
    assert sorted(g["src"] for g in everyone).count(True) == dp  # one reporting rank per DP replica
    for name, grad in ref["grads"].items():
        step = before[name] - after[name]  # SGD with lr 1: the gradient
        torch.testing.assert_close(step, grad, rtol=1e-4, atol=2e-6, msg=lambda m: f"{name}: {m}")
        summary["worst_grad"] = max(summary["worst_grad"], float((step - grad).abs().max()))
    summary["parameters"] = len(ref["grads"])


def check_case(name: str) -> float:
    """One ppo_loss configuration on every rank; the worst gradient error (rank 0, else 0)."""
    case = {**ONE_PASS_CASES, **TWO_PASS_CASES}[name]
    shards = [case_batch(samples[r::dp], case, global_batch_size=len(samples), seed=r) for r in range(dp)]
    with engine.eval_mode():
        inferred = engine.infer_batch(shards[rank].clone())
    own = shards[rank].clone()
    tu.assign_non_tensor(own, batch_num_tokens=sum(int(s["response_mask"].sum()) for s in shards), dp_size=dp)
    want_loss, want = ppo_loss(case_config(case), inferred["model_output"], own)
    before = engine.actor.state_dict_hf()
    with engine.train_mode():
        trained = engine.train_batch(shards[rank].clone(), partial(ppo_loss, case_config(case)))
    after = engine.actor.state_dict_hf()
    engine.actor.load_hf_state_dict(before)
    assert_equal_up_to_rounding(torch.tensor(trained["loss"][0]), torch.tensor(float(want_loss)), abs(float(want_loss)))
    got, want = trained_metric_values(trained), metric_values(want)
    assert sorted(got) == sorted(want), (name, sorted(got), sorted(want))
    for key, value in want.items():
        assert_equal_up_to_rounding(torch.tensor(got[key]), torch.tensor(value), abs(value))
    worst = 0.0
    if dist.get_rank() == 0:
        ref = reference(load_hf_model(args.hf_dir), shards, case_config(case), "entropy" in inferred["model_output"])
        for param, grad in ref["grads"].items():
            step = before[param] - after[param]
            torch.testing.assert_close(step, grad, rtol=1e-4, atol=2e-6, msg=lambda m: f"{name} {param}: {m}")
            worst = max(worst, float((step - grad).abs().max()))
    return worst


worst_by_case = {name: check_case(name) for name in filter(None, args.cases.split(","))}
if dist.get_rank() == 0:
    summary["cases"] = worst_by_case
    with open(args.out, "w") as f:
        json.dump(summary, f)
dist.barrier()
dist.destroy_process_group()
