#!/usr/bin/env python
"""A whole GRPO loop of verl's, on CPU, with the psrl engine as actor and reference.

    python examples/verl_ppo_cpu.py [--iterations 3] [--prompts 2] [--group-size 4]

verl 0.9.1's own trainer (``verl.trainer.main_ppo``) cannot run on a CPU-only machine: its
rollouts are vLLM, SGLang or TensorRT-LLM servers (docs/integrations.md says where it stops
and why). This example runs the steps of verl's ``RayPPOTrainer.fit`` one iteration after
another, with verl's own pieces wherever verl has them, in one process:

1. rollout: a Hugging Face model samples ``--group-size`` responses per prompt (temperature 1;
   verl's ``get_response_mask`` cuts them at EOS), holding the weights the actor last sent;
2. reward: a rule (the share of a response's tokens that are even ids; a stand-in for a
   verifier), GRPO advantages from verl's ``compute_grpo_outcome_advantage``;
3. old and reference log-probs: verl's ``TrainingWorker.infer_batch`` on the actor and on the
   reference (both ``psrl`` engines), in verl's no-padding layout (``left_right_2_no_padding``),
   with the settings verl's trainer adds;
4. update: ``TrainingWorker.train_mini_batch`` with verl's ``ppo_loss`` (GRPO, KL in the loss
   against the reference, ``low_var_kl``), one optimizer step per mini-batch;
5. weights to the rollout: the actor engine's ``get_per_tensor_param`` streamed into the
   rollout model, tensor by tensor.

Everything runs on CPU through ``megatron_psrl.integrations.verl_cpu_platform`` (for testing and
development; see its docstring). Prints one line of verl's metrics per iteration.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import tempfile
from dataclasses import dataclass
from functools import partial
from typing import Any, Dict, List

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("VERL_USE_EXTERNAL_MODULES",
                      "megatron_psrl.integrations.verl_cpu_platform,megatron_psrl.integrations.verl")

import numpy as np  # noqa: E402
import torch  # noqa: E402

import megatron_psrl.integrations.verl_cpu_platform as cpu_platform  # noqa: E402  (verl's device: CPU)

EOS = 2
"""The tiny model's end-of-sequence id."""


def tiny_model(directory: str) -> str:
    """A tiny Llama with random weights, saved as a Hugging Face folder."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from megatron_psrl.model import tiny_config

    torch.manual_seed(0)
    config = AutoConfig.for_model(**dict(tiny_config("debug-llama"), vocab_size=64, eos_token_id=EOS, pad_token_id=0))
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    return directory


def workers(hf_dir: str, lr: float):
    """verl's TrainingWorkers for actor (Adam) and reference (forward only), both ``psrl``."""
    from verl.workers.config import HFModelConfig, McoreOptimizerConfig
    from verl.workers.engine_workers import TrainingWorker, TrainingWorkerConfig

    from megatron_psrl.integrations.verl import PsrlEngineConfig

    def config(forward_only: bool):
        return TrainingWorkerConfig(
            model_type="language_model", model_config=HFModelConfig(path=hf_dir, load_tokenizer=False),
            engine_config=PsrlEngineConfig(dtype="float32", device="cpu", micro_batch_tokens=256,
                                           forward_only=forward_only),
            optimizer_config=None if forward_only else McoreOptimizerConfig(optimizer="adam", lr=lr, clip_grad=1.0),
            checkpoint_config=None)

    worker_class = cpu_platform.cpu_worker(TrainingWorker)
    actor, ref = worker_class(config(False)), worker_class(config(True))
    actor.reset()
    ref.reset()
    return actor, ref


def rollout(model, prompts: List[np.ndarray], group_size: int, response_length: int, generator: torch.Generator):
    """verl's batch after generation (``DataProto``): left-padded prompts, right-padded
    responses cut at EOS, attention mask, position ids, ``uid`` per GRPO group."""
    from verl import DataProto
    from verl.utils.model import compute_position_id_with_mask
    from verl.utils.torch_functional import get_response_mask

    p_max = max(len(p) for p in prompts)
    rows = [p for p in prompts for _ in range(group_size)]
    input_ids = torch.zeros(len(rows), p_max, dtype=torch.int64)
    mask = torch.zeros_like(input_ids)
    for i, p in enumerate(rows):
        input_ids[i, p_max - len(p):] = torch.as_tensor(p)
        mask[i, p_max - len(p):] = 1
    with torch.no_grad():
        torch.manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=generator)))
        out = model.generate(input_ids=input_ids, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0,
                             top_p=1.0, max_new_tokens=response_length, min_new_tokens=1,
                             eos_token_id=EOS, pad_token_id=0)
    responses = out[:, p_max:]
    responses = torch.nn.functional.pad(responses, (0, response_length - responses.shape[1]))
    response_mask = get_response_mask(responses, eos_token=EOS, dtype=torch.int64)
    attention_mask = torch.cat([mask, response_mask], dim=1)
    batch = DataProto.from_dict(
        {"prompts": input_ids, "responses": responses, "response_mask": response_mask,
         "input_ids": torch.cat([input_ids, responses], dim=1), "attention_mask": attention_mask,
         "position_ids": compute_position_id_with_mask(attention_mask)},
        non_tensors={"uid": np.array([f"prompt{i // group_size}" for i in range(len(rows))], dtype=object)},
        meta_info={"temperature": 1.0})
    return batch


def rule_reward(batch) -> torch.Tensor:
    """``[B, R]`` token-level rewards: the response's share of even token ids, on its last token."""
    responses, mask = batch.batch["responses"], batch.batch["response_mask"]
    score = ((responses % 2 == 0) & (mask == 1)).sum(1).float() / mask.sum(1).clamp(min=1).float()
    rewards = torch.zeros(responses.shape, dtype=torch.float32)
    last = (mask.sum(1) - 1).clamp(min=0)
    rewards[torch.arange(len(rewards)), last] = score
    return rewards


def log_probs(worker, batch, entropy: bool):
    """verl's ``_compute_old_log_prob`` / ``_compute_ref_log_prob``: ``[B, R]`` log-probs."""
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import left_right_2_no_padding, no_padding_2_padding

    data = left_right_2_no_padding(batch.to_tensordict())
    tu.assign_non_tensor(data, calculate_entropy=entropy, compute_loss=False)
    output = worker.infer_batch(data)
    return no_padding_2_padding(tu.get(output, "log_probs"), data).float()


def update_actor(actor, batch, mini_batch_size: int, loss_config) -> Dict[str, object]:
    """verl's ``_update_actor``: one ``train_mini_batch`` over the batch."""
    from verl.utils import tensordict_utils as tu
    from verl.utils.metric import reduce_metrics
    from verl.workers.utils.padding import left_right_2_no_padding

    batch.meta_info["multi_turn"] = False
    data = left_right_2_no_padding(batch.to_tensordict())
    tu.assign_non_tensor(data, calculate_entropy=loss_config.entropy_coeff != 0.0, global_batch_size=mini_batch_size,
                         mini_batch_size=mini_batch_size, epochs=1, seed=0, dataloader_kwargs={"shuffle": False},
                         compute_loss=True)
    return reduce_metrics(tu.get(actor.train_mini_batch(data), "metrics"))


def sync_weights(actor, model) -> int:
    """The actor's weights into the rollout model, streamed (verl's ``get_per_tensor_param``)."""
    params = dict(model.named_parameters())
    count = 0
    stream, _ = actor.engine.get_per_tensor_param()
    with torch.no_grad():
        for name, tensor in stream:
            if name in params:  # a tied lm_head arrives under both names
                params[name].copy_(tensor)
                count += 1
    return count


@dataclass
class Loop:
    """What :func:`run` leaves: one dict of metrics per iteration, and the loop's parts."""

    history: List[Dict[str, float]]
    actor: Any
    ref: Any
    rollout_model: Any


def run(iterations: int = 3, prompts: int = 2, group_size: int = 4, response_length: int = 12, lr: float = 1e-3,
        seed: int = 0, workdir: str = None, log=print) -> Loop:
    """The loop (see the module docstring)."""
    from transformers import AutoModelForCausalLM
    from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage
    from verl.workers.config import ActorConfig as VerlActorConfig
    from verl.workers.utils.losses import ppo_loss

    workdir = workdir or tempfile.mkdtemp(prefix="verl-ppo-cpu-")
    hf_dir = tiny_model(os.path.join(workdir, "model"))
    cpu_platform.open_process_group()
    actor, ref = workers(hf_dir, lr)
    loss_config = VerlActorConfig(strategy="psrl", rollout_n=group_size, ppo_mini_batch_size=prompts,
                                  ppo_micro_batch_size_per_gpu=1, use_dynamic_bsz=False, use_kl_loss=True,
                                  kl_loss_coef=0.01, kl_loss_type="low_var_kl", loss_agg_mode="token-mean")
    actor.set_loss_fn(partial(ppo_loss, loss_config))
    model = AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    rng = np.random.default_rng(seed)
    generator = torch.Generator().manual_seed(seed)
    history = []
    for it in range(1, iterations + 1):
        questions = [rng.integers(3, 64, int(rng.integers(6, 11))) for _ in range(prompts)]
        batch = rollout(model, questions, group_size, response_length, generator)
        batch.meta_info["global_token_num"] = batch.batch["attention_mask"].sum(-1).tolist()
        rewards = rule_reward(batch)
        batch.batch["old_log_probs"] = log_probs(actor, batch, entropy=True)
        batch.batch["ref_log_prob"] = log_probs(ref, batch, entropy=False)
        advantages, _ = compute_grpo_outcome_advantage(rewards, batch.batch["response_mask"],
                                                       index=batch.non_tensor_batch["uid"])
        batch.batch["advantages"] = advantages
        metrics = update_actor(actor, batch, prompts * group_size, loss_config)
        synced = sync_weights(actor, model)
        row = dict(iteration=it, reward=float(rewards.sum(1).mean()), loss=float(metrics["loss"]),
                   grad_norm=float(metrics["grad_norm"]), kl_loss=float(metrics["kl_loss"]),
                   tensors_synced=synced, response_tokens=int(batch.batch["response_mask"].sum()))
        history.append(row)
        log("iteration {iteration}: reward {reward:.3f}, loss {loss:.4f}, grad norm {grad_norm:.3f}, "
            "kl {kl_loss:.2e}, {response_tokens} response tokens, {tensors_synced} tensors to the rollout".format(**row))
    return Loop(history, actor, ref, model)


def _free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iterations", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--response-length", type=int, default=12)
    parser.add_argument("--lr", type=float, default=1e-3)
    args = parser.parse_args(argv)
    # the environment verl's Ray worker group gives each worker (here: the one process)
    for key, value in dict(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=_free_port()).items():
        os.environ.setdefault(key, value)
    run(args.iterations, args.prompts, args.group_size, args.response_length, args.lr)


if __name__ == "__main__":
    main()
