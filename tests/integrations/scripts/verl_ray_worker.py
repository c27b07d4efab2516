"""verl's TrainingWorker with the psrl engine in a one-worker Ray group on CPU (for
tests/integrations/test_verl_worker.py): a Ray node of 2 CPUs, verl's RayResourcePool of one
process with the CPU platform's bundle (one CPU), reset, infer_batch, set_loss_fn and
train_batch through verl's dispatch. Writes the log-probs, loss and gradient norm to --out."""

import argparse
import os
import time

# verl imports the modules named here when it is imported, in this driver and in every Ray
# worker (which inherit the variable through the runtime environment below)
MODULES = "megatron_psrl.integrations.verl_cpu_platform,megatron_psrl.integrations.verl"
os.environ["VERL_USE_EXTERNAL_MODULES"] = MODULES

from functools import partial  # noqa: E402

import ray  # noqa: E402
import torch  # noqa: E402
from helpers.verl_harness import multi_turn_samples, verl_batch, verl_loss_config  # noqa: E402
from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup  # noqa: E402
from verl.utils import tensordict_utils as tu  # noqa: E402
from verl.workers.config import HFModelConfig, McoreOptimizerConfig  # noqa: E402
from verl.workers.engine_workers import TrainingWorker, TrainingWorkerConfig  # noqa: E402
from verl.workers.utils.losses import ppo_loss  # noqa: E402

from megatron_psrl.integrations.verl import PsrlEngineConfig  # noqa: E402
from megatron_psrl.integrations.verl_cpu_platform import cpu_worker  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hf-dir", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    start = time.perf_counter()
    config = TrainingWorkerConfig(
        model_type="language_model", model_config=HFModelConfig(path=args.hf_dir, load_tokenizer=False),
        engine_config=PsrlEngineConfig(dtype="float32", device="cpu", micro_batch_tokens=48),
        optimizer_config=McoreOptimizerConfig(optimizer="sgd", lr=1.0, clip_grad=0.0, weight_decay=0.0),
        checkpoint_config=None)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"VERL_USE_EXTERNAL_MODULES": MODULES,
                                       "PYTHONPATH": os.environ.get("PYTHONPATH", "")}})
    try:
        pool = RayResourcePool(process_on_nodes=[1], use_gpu=False, max_colocate_count=1)
        group = RayWorkerGroup(resource_pool=pool, ray_cls_with_init=RayClassWithInitArgs(
            cls=ray.remote(cpu_worker(TrainingWorker)), config=config))
        group.reset()
        data = verl_batch(multi_turn_samples(), global_batch_size=6)
        tu.assign_non_tensor(data, global_token_num=data["input_ids"].offsets().diff().tolist(), compute_loss=False)
        inferred = group.infer_batch(data.clone()).get()
        group.set_loss_fn(partial(ppo_loss, verl_loss_config()))
        metrics = tu.get(group.train_batch(data.clone()).get(), "metrics")
    finally:
        ray.shutdown()
    torch.save({"log_probs": inferred["log_probs"].values().clone(), "loss": float(metrics["loss"]),
                "grad_norm": float(metrics["grad_norm"])}, args.out)
    print(f"one-worker Ray group: {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
