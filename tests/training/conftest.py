"""Fixtures: one tiny HF checkpoint, the HF reference model and our megatron model (TP=1); the same
for the debug gpt-oss model (sliding windows, sinks, clamped-SwiGLU experts: ``gpt_oss_model``),
for DeepSeek-V3's latent attention (``latent_*``) and with its MoE layers (``latent_moe_*``)."""

import pytest
import torch
from helpers.families import make_family_checkpoint
from helpers.hf_reference import load_hf_model, make_hf_checkpoint
from megatron.core import parallel_state

from megatron_psrl.checkpoint import ModelSource, load_model
from megatron_psrl.distributed.setup import initialize_parallel
from megatron_psrl.model import tiny_config

TEST_CONFIG = dict(tiny_config("debug-llama"), vocab_size=256)


@pytest.fixture(scope="session")
def hf_dir(tmp_path_factory):
    return make_hf_checkpoint(TEST_CONFIG, seed=0, directory=str(tmp_path_factory.mktemp("hf")))


@pytest.fixture(scope="session")
def hf_model(hf_dir):
    return load_hf_model(hf_dir)


@pytest.fixture(scope="session")
def _psrl_model_cache():
    return {}


def _loaded(cache: dict, key: str, hf_dir: str):
    """(arch, model) of ``hf_dir``, loaded once and loaded again only when the process groups it
    was built under are gone: megatron's layers keep their groups, and a test elsewhere in the
    session may end them (``PolicyActor.close()``), which would leave this model calling
    collectives on destroyed groups in whatever test runs next in random order."""
    initialize_parallel(1, 1, seed=0, device="cpu")  # a no-op while the state is alive
    group = parallel_state.get_tensor_model_parallel_group()
    if cache.get((key, "group")) is not group:
        arch, model, _ = load_model(ModelSource(hf_dir=hf_dir), dtype=torch.float32)
        cache.update({(key, "group"): group, key: (arch, model)})
    return cache[key]


@pytest.fixture
def psrl_model(hf_dir, _psrl_model_cache):
    """(arch, model) of the Llama checkpoint (:func:`_loaded`)."""
    return _loaded(_psrl_model_cache, "llama", hf_dir)


@pytest.fixture(scope="session")
def latent_hf_dir(tmp_path_factory):
    """DeepSeek-V3's latent attention (``debug-deepseek-v3``), attention sharpened for the tests."""
    from helpers.families import family_config, make_family_checkpoint

    return make_family_checkpoint(family_config("deepseek-v3"), str(tmp_path_factory.mktemp("hf-latent")), seed=2)


@pytest.fixture(scope="session")
def latent_hf_model(latent_hf_dir):
    return load_hf_model(latent_hf_dir)


@pytest.fixture
def latent_model(latent_hf_dir, _psrl_model_cache):
    """(arch, model) of the latent-attention checkpoint (:func:`_loaded`)."""
    return _loaded(_psrl_model_cache, "latent", latent_hf_dir)


@pytest.fixture(scope="session")
def latent_moe_hf_dir(tmp_path_factory):
    """DeepSeek-V3 with its MoE layers (``debug-deepseek-v3-moe``: a dense layer, then two of
    grouped sigmoid routing), attention sharpened for the tests."""
    from helpers.families import family_config, make_family_checkpoint

    return make_family_checkpoint(family_config("deepseek-v3-moe"), str(tmp_path_factory.mktemp("hf-latent-moe")),
                                  seed=2)


@pytest.fixture(scope="session")
def latent_moe_hf_model(latent_moe_hf_dir):
    return load_hf_model(latent_moe_hf_dir)


@pytest.fixture
def latent_moe_model(latent_moe_hf_dir, _psrl_model_cache):
    """(arch, model) of the latent-attention MoE checkpoint (:func:`_loaded`)."""
    return _loaded(_psrl_model_cache, "latent-moe", latent_moe_hf_dir)


@pytest.fixture(scope="session")
def _gpt_oss_checkpoint(tmp_path_factory):
    hf_dir = make_family_checkpoint(tiny_config("debug-gpt-oss"), str(tmp_path_factory.mktemp("hf-gpt-oss")), seed=2)
    return hf_dir, load_hf_model(hf_dir)


@pytest.fixture
def gpt_oss_model(_gpt_oss_checkpoint, _psrl_model_cache):
    """(arch, model, HF model) of the debug gpt-oss model (a window of 8 tokens on its first layer;
    :func:`_loaded`)."""
    hf_dir, hf = _gpt_oss_checkpoint
    return (*_loaded(_psrl_model_cache, "gpt-oss", hf_dir), hf)
