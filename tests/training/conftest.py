"""Fixtures: one tiny HF checkpoint, the HF reference model and our megatron model (TP=1); the
same for the debug gpt-oss model (sliding windows, sinks, clamped-SwiGLU experts)."""

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


@pytest.fixture
def psrl_model(hf_dir, _psrl_model_cache):
    """(arch, model), loaded once and loaded again only when the process groups it was built
    under are gone: megatron's layers keep their groups, and a test elsewhere in the session may
    end them (``PolicyActor.close()``), which would leave this model calling collectives on
    destroyed groups in whatever test runs next in random order."""
    initialize_parallel(1, 1, seed=0, device="cpu")  # a no-op while the state is alive
    group = parallel_state.get_tensor_model_parallel_group()
    if _psrl_model_cache.get("group") is not group:
        arch, model, _ = load_model(ModelSource(hf_dir=hf_dir), dtype=torch.float32)
        _psrl_model_cache.update(group=group, model=(arch, model))
    return _psrl_model_cache["model"]


@pytest.fixture(scope="session")
def _gpt_oss_checkpoint(tmp_path_factory):
    hf_dir = make_family_checkpoint(tiny_config("debug-gpt-oss"), str(tmp_path_factory.mktemp("hf-gpt-oss")), seed=2)
    return hf_dir, load_hf_model(hf_dir)


@pytest.fixture
def gpt_oss_model(_gpt_oss_checkpoint, _psrl_model_cache):
    """(arch, model, HF model) of the debug gpt-oss model (a window of 8 tokens on its first layer),
    loaded again only when its process groups are gone (as :func:`psrl_model`)."""
    hf_dir, hf = _gpt_oss_checkpoint
    initialize_parallel(1, 1, seed=0, device="cpu")
    group = parallel_state.get_tensor_model_parallel_group()
    if _psrl_model_cache.get("gpt-oss-group") is not group:
        arch, model, _ = load_model(ModelSource(hf_dir=hf_dir), dtype=torch.float32)
        _psrl_model_cache.update({"gpt-oss-group": group, "gpt-oss": (arch, model)})
    return (*_psrl_model_cache["gpt-oss"], hf)
