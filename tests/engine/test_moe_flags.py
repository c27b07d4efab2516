"""The Megatron-LM MoE flags beyond EP: --moe-z-loss-coeff, --moe-aux-loss-coeff,
--moe-router-load-balancing-type, --expert-tensor-parallel-size reach ActorConfig; what cannot be
exact with prefix sharing (or is not built) is refused in one line saying why."""

import pytest

from megatron_psrl import ActorConfig
from megatron_psrl.errors import ConfigurationError
from megatron_psrl.model import ModelArchitecture, build_transformer_config, tiny_config
from megatron_psrl.model.gpt import moe_config_fields
from megatron_psrl.training.arguments import parse_args
from megatron_psrl.training.trainer import actor_config_from_args


def test_the_flags_reach_the_config():
    args = parse_args(["--model", "debug-qwen3-moe", "--data", "stepwise", "--moe-router-load-balancing-type",
                       "seq_aux_loss", "--moe-z-loss-coeff", "0", "--expert-tensor-parallel-size", "1"])
    config = actor_config_from_args(args, "float32")
    assert config.moe_router_load_balancing_type == "seq_aux_loss"
    assert config.moe_z_loss_coeff == 0.0 and config.expert_tensor_parallel_size == 1
    assert config.moe_overrides()["moe_router_load_balancing_type"] == "seq_aux_loss"


def test_the_load_balancing_type_reaches_megatron():
    arch = ModelArchitecture.from_hf_config(tiny_config("debug-qwen3-moe"))
    overrides = dict(moe_config_fields(arch), **ActorConfig(moe_router_load_balancing_type="none").moe_overrides())
    assert build_transformer_config(arch, **overrides).moe_router_load_balancing_type == "none"


@pytest.mark.parametrize("fields,words", [
    (dict(moe_z_loss_coeff=-1.0), ["moe_z_loss_coeff must be >= 0"]),
    (dict(moe_aux_loss_coeff=-1.0), ["moe_aux_loss_coeff must be >= 0"]),
    (dict(moe_aux_loss_coeff=1e-2, moe_router_load_balancing_type="seq_aux_loss"), ["seq_aux_loss", "packing"]),
    (dict(moe_aux_loss_coeff=1e-2, moe_router_load_balancing_type="global_aux_loss"), ["global_aux_loss", "packing"]),
    (dict(moe_z_loss_coeff=1e-3, pipeline_model_parallel_size=2, num_layers_per_virtual_pipeline_stage=1),
     ["virtual pipeline stages", "not supported"]),
    (dict(moe_aux_loss_coeff=1e-2, context_parallel_size=2), ["--context-parallel-size", "not supported"]),
    (dict(moe_router_load_balancing_type="sinkhorn"), ["sinkhorn", "change every route"]),
    (dict(moe_router_load_balancing_type="balanced"), ["must be one of", "balanced"]),
    (dict(expert_tensor_parallel_size=2), ["--expert-tensor-parallel-size 2", "not supported"]),
    (dict(moe_router_bias_update_rate=-1e-3), ["moe_router_bias_update_rate must be >= 0"]),
], ids=["negative-z-loss", "negative-aux-loss", "seq-aux-loss", "global-aux-loss", "router-losses-vpp",
        "router-losses-cp", "sinkhorn", "unknown-type", "expert-tp", "negative-bias-rate"])
def test_what_cannot_run_is_refused(fields, words):
    with pytest.raises(ConfigurationError) as err:
        ActorConfig(**fields)
    for word in words:
        assert word in str(err.value)


def test_router_losses_with_pipeline_parallelism_are_accepted():
    # exact: tests/model/test_moe_pipeline_routes.py
    ActorConfig(moe_z_loss_coeff=1e-3, moe_aux_loss_coeff=1e-2, pipeline_model_parallel_size=2)


@pytest.mark.parametrize("balancing", ["aux_loss", "none", "seq_aux_loss", "global_aux_loss"])
def test_the_router_losses_are_taken_and_megatron_computes_none(balancing):
    """z-loss with every load-balancing type, the aux loss with aux_loss (docs/moe.md "Router
    losses"); megatron's own (unweighted) router losses stay off: megatron_psrl computes them."""
    aux = 1e-2 if balancing == "aux_loss" else 0.0
    args = parse_args(["--model", "debug-qwen3-moe", "--data", "stepwise", "--moe-z-loss-coeff", "1e-3",
                       "--moe-aux-loss-coeff", str(aux), "--moe-router-load-balancing-type", balancing])
    config = actor_config_from_args(args, "float32")
    assert config.moe_z_loss_coeff == 1e-3 and config.moe_aux_loss_coeff == aux
    arch = ModelArchitecture.from_hf_config(tiny_config("debug-qwen3-moe"))
    megatron = build_transformer_config(arch, **dict(moe_config_fields(arch), **config.moe_overrides()))
    assert megatron.moe_aux_loss_coeff == 0.0 and not megatron.moe_z_loss_coeff


def test_sequence_parallel_and_expert_bias_flags_reach_the_config():
    base = ["--model", "debug-qwen3-moe", "--data", "stepwise"]
    config = actor_config_from_args(parse_args(base + ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
                                    "float32")
    assert config.sequence_parallel and config.parallel_overrides() == dict(sequence_parallel=True)
    config = actor_config_from_args(parse_args(base + ["--moe-router-enable-expert-bias"]), "float32")
    assert config.moe_router_enable_expert_bias and config.moe_router_bias_update_rate == 1e-3


def test_the_expert_bias_update_is_refused_for_routers_without_a_bias():
    """Qwen-MoE and Mixtral route by softmax, without an expert bias: refused in one line when
    the model is known; a dense model too."""
    from megatron_psrl.engine.builder import moe_overrides

    config = ActorConfig(moe_router_enable_expert_bias=True)
    for name, words in (("debug-qwen3-moe", ["--moe-router-enable-expert-bias", "qwen3_moe", "no expert bias",
                                             "softmax"]),
                        ("debug-llama", ["--moe-router-enable-expert-bias", "dense llama model"])):
        with pytest.raises(ConfigurationError) as err:
            moe_overrides(config, ModelArchitecture.from_hf_config(tiny_config(name)))
        assert all(word in str(err.value) for word in words) and "\n" not in str(err.value)


def test_the_expert_bias_update_reaches_megatron_for_a_biased_router():
    """glm4_moe: the bias is megatron's expert_bias, frozen (rate 0) unless the flag turns the
    update on at --moe-router-bias-update-rate."""
    from megatron_psrl.engine.builder import moe_overrides

    arch = ModelArchitecture.from_hf_config(tiny_config("debug-glm4-moe"))
    frozen = build_transformer_config(arch, **dict(moe_config_fields(arch), **moe_overrides(ActorConfig(), arch)))
    assert frozen.moe_router_enable_expert_bias and frozen.moe_router_bias_update_rate == 0.0
    args = parse_args(["--model", "debug-glm4-moe", "--data", "stepwise", "--moe-router-enable-expert-bias",
                       "--moe-router-bias-update-rate", "0.01"])
    config = actor_config_from_args(args, "float32")
    updated = build_transformer_config(arch, **dict(moe_config_fields(arch), **moe_overrides(config, arch)))
    assert updated.moe_router_enable_expert_bias and updated.moe_router_bias_update_rate == 0.01
