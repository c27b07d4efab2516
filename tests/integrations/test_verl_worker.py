"""The psrl engine inside verl's worker layer: verl's ``TrainingWorker`` (verl/workers/
engine_workers.py) builds and drives it as verl's own engine test drives engines (``reset``,
``infer_batch``, ``set_loss_fn``, ``train_batch``, ``train_mini_batch``, checkpoints), on CPU
through the platform module megatron_psrl.integrations.verl_cpu_platform; in process, and in a
one-worker Ray group. Results against per-sample Hugging Face through verl's ``ppo_loss``."""

import os
import socket
import subprocess
import sys
from functools import partial

import pytest
import torch

pytest.importorskip("verl", reason="the verl extra is not installed (pip install -e \".[verl]\")")
pytest.importorskip("uvicorn", reason="verl's worker module imports uvicorn and fastapi")

# isort: off
import megatron_psrl.integrations.verl_cpu_platform as cpu_platform  # noqa: E402  (before verl looks up its device)
# isort: on
from helpers.hf_reference import load_hf_model, make_hf_checkpoint  # noqa: E402
from helpers.torchrun import REPO_ROOT  # noqa: E402
from helpers.verl_harness import VOCAB, multi_turn_samples, reference, response_positions, verl_batch, verl_loss_config  # noqa: E402
from verl.utils import tensordict_utils as tu  # noqa: E402
from verl.utils.device import get_device_name  # noqa: E402
from verl.workers.config import HFModelConfig, McoreOptimizerConfig  # noqa: E402
from verl.workers.engine import EngineRegistry  # noqa: E402
from verl.workers.engine_workers import TrainingWorker, TrainingWorkerConfig  # noqa: E402
from verl.workers.utils.losses import ppo_loss  # noqa: E402

from megatron_psrl.integrations.verl import BACKEND, PsrlEngineConfig  # noqa: E402
from megatron_psrl.model import tiny_config  # noqa: E402

RAY_SCRIPT = os.path.join(REPO_ROOT, "tests", "integrations", "scripts", "verl_ray_worker.py")


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return make_hf_checkpoint(dict(tiny_config("debug-llama"), vocab_size=VOCAB), seed=0,
                              directory=str(tmp_path_factory.mktemp("hf")))


def worker_config(hf_dir: str) -> TrainingWorkerConfig:
    return TrainingWorkerConfig(
        model_type="language_model", model_config=HFModelConfig(path=hf_dir, load_tokenizer=False),
        engine_config=PsrlEngineConfig(dtype="float32", device="cpu", micro_batch_tokens=48),
        optimizer_config=McoreOptimizerConfig(optimizer="sgd", lr=1.0, clip_grad=0.0, weight_decay=0.0),
        checkpoint_config=None)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_platform_module_makes_verl_see_a_cpu():
    assert get_device_name() == "cpu"
    platform = cpu_platform.use_cpu_platform()
    assert platform.communication_backend_name() == "gloo" and platform.ray_resource_name() == "CPU"
    module = platform.device_module
    current = module.memory_allocated()  # the resident set now; its high-water mark cannot be lower
    assert module.max_memory_allocated() >= current > 0
    module.manual_seed(3)
    state = module.get_rng_state()
    first = torch.rand(2)
    module.set_rng_state(state)
    assert torch.equal(torch.rand(2), first)


def test_the_engine_answers_verls_layout_questions_before_initialize(hf_dir):
    engine = EngineRegistry.new("language_model", backend=BACKEND,
                                model_config=HFModelConfig(path=hf_dir, load_tokenizer=False),
                                engine_config=PsrlEngineConfig(dtype="float32", device="cpu"),
                                optimizer_config=McoreOptimizerConfig(lr=1e-6), checkpoint_config=None)
    assert engine.actor is None  # nothing built yet
    assert (engine.get_data_parallel_rank(), engine.get_data_parallel_size()) == (0, 1)
    assert engine.is_mp_src_rank_with_outputs()
    assert torch.distributed.get_world_size(engine.get_data_parallel_group()) == 1


def test_training_worker_runs_the_engine_in_process(hf_dir, tmp_path, monkeypatch):
    """verl's TrainingWorker, one gloo rank in this process (the environment a Ray worker group
    sets): its infer_batch log-probs, its train_batch loss and update (SGD, lr 1) equal the
    per-sample reference; train_mini_batch steps and advances the schedule; a checkpoint saved
    by the worker and loaded back restores the weights."""
    for key, value in dict(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port())).items():
        monkeypatch.setenv(key, value)
    worker = cpu_platform.cpu_worker(TrainingWorker)(worker_config(hf_dir))
    assert worker._query_dispatch_info("train") == 0 and worker._query_collect_info("train")
    worker.reset()
    engine = worker.engine

    data = verl_batch(multi_turn_samples(), global_batch_size=6)
    tu.assign_non_tensor(data, global_token_num=data["input_ids"].offsets().diff().tolist(), compute_loss=False)
    loss_config = verl_loss_config()
    ref = reference(load_hf_model(hf_dir), [data], loss_config, False)

    inferred = worker.infer_batch(data.clone())
    keep = response_positions(data)
    torch.testing.assert_close(inferred["log_probs"].values()[keep], ref["log_probs"][0][keep], rtol=0, atol=1e-5)

    worker.set_loss_fn(partial(ppo_loss, loss_config))
    before = engine.actor.state_dict_hf()
    metrics = tu.get(worker.train_batch(data.clone()), "metrics")
    after = engine.actor.state_dict_hf()
    assert metrics["loss"] == pytest.approx(ref["losses"][0], rel=1e-5) and metrics["grad_norm"] > 0
    assert len(ref["grads"]) == len(before)
    for name, grad in ref["grads"].items():
        torch.testing.assert_close(before[name] - after[name], grad, rtol=1e-4, atol=2e-6, msg=lambda m: f"{name}: {m}")

    ckpt = str(tmp_path / "ckpt")
    worker.save_checkpoint(ckpt)
    mini = data.clone()
    tu.assign_non_tensor(mini, mini_batch_size=3, epochs=1)  # two mini-batches, two optimizer steps
    out = tu.get(worker.train_mini_batch(mini), "metrics")
    assert len(out["grad_norm"]) == 2 and out["lr"] == [1.0]  # the schedule advanced after the last one
    moved = engine.actor.state_dict_hf()
    assert any(not torch.equal(moved[k], after[k]) for k in after)
    worker.load_checkpoint(ckpt)
    restored = engine.actor.state_dict_hf()
    assert all(torch.equal(restored[k], after[k]) for k in after)


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("PSRL_RAY_TESTS") == "0",
                    reason="PSRL_RAY_TESTS=0: Ray's node start-up (about 20 s on 2 quiet cores, minutes under "
                           "heavy load) left out")
def test_training_worker_runs_in_a_one_worker_ray_group(hf_dir, tmp_path):
    """verl's RayWorkerGroup of one TrainingWorker on a 2-CPU Ray node (the platform module's
    bundle: one CPU): reset, infer_batch and train_batch through Ray's dispatch; the log-probs
    equal the per-sample reference."""
    pytest.importorskip("ray")
    out = tmp_path / "log_probs.pt"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO_ROOT, os.path.join(REPO_ROOT, "tests")]))
    proc = subprocess.run([sys.executable, RAY_SCRIPT, "--hf-dir", hf_dir, "--out", str(out)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = torch.load(out)
    data = verl_batch(multi_turn_samples(), global_batch_size=6)
    ref = reference(load_hf_model(hf_dir), [data], verl_loss_config(), False)
    keep = response_positions(data)
    torch.testing.assert_close(result["log_probs"][keep], ref["log_probs"][0][keep], rtol=0, atol=1e-5)
    assert result["loss"] == pytest.approx(ref["losses"][0], rel=1e-5) and result["grad_norm"] > 0
