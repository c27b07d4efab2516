"""bf16 training on CPU equals an fp32 run on the same (bf16-rounded) weights within a stated
tolerance, whatever the number of micro-batches and cached-prefix readers: dK/dV, the
attention merges and the parameter gradients (megatron's main_grad) all accumulate in fp32.

Stated tolerance: gradient relative error (global L2) under 1.5e-2 and every tensor under
2.5e-2 (measured 6.0e-3 and 7.8e-3 with 1, 4 and 14 micro-batches); the error with mechanism 2
(14 micro-batches reading cached prefixes) stays within 1.5x of one micro-batch's."""

import pytest
import torch
from helpers.batches import random_tree_records
from helpers.families import PARALLEL_CONFIGS
from helpers.hf_reference import make_hf_checkpoint

from megatron_psrl import ActorConfig, LossConfig, OptimizerSettings, PolicyActor


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    hf = make_hf_checkpoint(dict(PARALLEL_CONFIGS["llama"], num_hidden_layers=2), seed=1,
                            directory=str(tmp_path_factory.mktemp("hf")))
    return hf, random_tree_records(seed=5, num_roots=4, vocab_size=251, max_len=200)


def _grad_error(hf, records, micro_batch_tokens):
    cfg = dict(device="cpu", micro_batch_tokens=micro_batch_tokens,
               optimizer=OptimizerSettings(optimizer="sgd", lr=0.0, clip_grad=0.0),
               loss=LossConfig(clip_eps=0.2, kl_coef=0.05, entropy_coef=0.01, loss_agg="seq-mean-token-mean"))
    bf16 = PolicyActor(hf, ActorConfig(dtype="bfloat16", **cfg))
    fp32 = PolicyActor(hf, ActorConfig(dtype="float32", **cfg))
    fp32.load_hf_state_dict({k: v.float() for k, v in bf16.state_dict_hf().items()})  # the same weights
    results = [actor.forward_backward(records) for actor in (bf16, fp32)]
    grads = [{n: actor.optimizer.main_grad(p).double() for n, p in actor.model.named_parameters()}
             for actor in (bf16, fp32)]
    for n, p in bf16.model.named_parameters():  # bf16 gradients live in DDP's fp32 main_grad
        assert p.grad is None and bf16.optimizer.main_grad(p).dtype == torch.float32, n
    diff = sum(float((grads[0][n] - g).norm()) ** 2 for n, g in grads[1].items()) ** 0.5
    total = sum(float(g.norm()) ** 2 for g in grads[1].values()) ** 0.5
    worst = max(float((grads[0][n] - g).norm() / g.norm()) for n, g in grads[1].items() if g.norm() > 0)
    loss_rel = abs(results[0].loss - results[1].loss) / abs(results[1].loss)
    return diff / total, worst, loss_rel, results[0].metrics


def test_bf16_gradients_match_fp32_and_do_not_degrade_with_readers(setup):
    hf, records = setup
    one, worst_one, loss_one, m_one = _grad_error(hf, records, 4096)
    many, worst_many, loss_many, m_many = _grad_error(hf, records, 16)
    assert m_one["micro_batches"] == 1 and m_many["micro_batches"] >= 10 and m_many["kv_hit_rate"] > 0
    for rel, worst, loss_rel in ((one, worst_one, loss_one), (many, worst_many, loss_many)):
        assert rel < 1.5e-2 and worst < 2.5e-2 and loss_rel < 1e-3, (rel, worst, loss_rel)
    assert many < 1.5 * one, (many, one)
