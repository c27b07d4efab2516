"""One verl ``infer_batch`` and one ``train_batch`` (SGD, lr 1, no clipping) of the psrl verl
engine on every rank of a torchrun job, each data-parallel rank with its own share of a
multi-turn GRPO mini-batch (verl's split: every DP rank its samples, TP ranks the same ones);
rank 0 checks log-probs, entropies, the loss of every share and every parameter's gradient
against the per-sample Hugging Face reference through verl's ppo_loss, and writes a summary."""

import argparse
import json
import os
from functools import partial

os.environ.setdefault("VERL_ENGINE_DEVICE", "cpu")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from helpers.hf_reference import load_hf_model  # noqa: E402
from helpers.verl_harness import multi_turn_samples, reference, response_positions, verl_batch, verl_loss_config  # noqa: E402
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

mine = {"rank": dist.get_rank(), "dp_rank": rank, "src": engine.is_mp_src_rank_with_outputs(),
        "loss": trained["loss"][0], "grad_norm": trained["metrics"].get("grad_norm"),  # on reporting ranks
        "log_probs": inferred["model_output"]["log_probs"].values().tolist(),
        "entropy": inferred["model_output"]["entropy"].values().tolist() if entropy else None}
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
        assert abs(got["loss"] - ref["losses"][r]) <= 1e-5 * max(1.0, abs(ref["losses"][r])), (got, ref["losses"])
        summary["losses"][str(got["rank"])] = got["loss"]
    assert sorted(g["src"] for g in everyone).count(True) == dp  # one reporting rank per DP replica
    for name, grad in ref["grads"].items():
        step = before[name] - after[name]  # SGD with lr 1: the gradient
        torch.testing.assert_close(step, grad, rtol=1e-4, atol=2e-6, msg=lambda m: f"{name}: {m}")
        summary["worst_grad"] = max(summary["worst_grad"], float((step - grad).abs().max()))
    summary["parameters"] = len(ref["grads"])
    with open(args.out, "w") as f:
        json.dump(summary, f)
dist.barrier()
dist.destroy_process_group()
