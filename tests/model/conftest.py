"""Fixtures of the model tests: a one-rank (gloo) megatron parallel state, random HF checkpoints."""

import pytest


@pytest.fixture
def tp1():
    """megatron parallel_state with TP = PP = 1 in this process (kept if already set up)."""
    from megatron_psrl.distributed.setup import initialize_parallel

    return initialize_parallel(1, 1, seed=1234, device="cpu")


@pytest.fixture(scope="session")
def hf_checkpoints(tmp_path_factory):
    """``name -> HF save_pretrained folder`` of every test family (built once, lazily)."""
    from helpers.families import family_config, make_family_checkpoint

    cache = {}

    def get(name):
        if name not in cache:
            d = tmp_path_factory.mktemp(f"hf-{name}")
            cache[name] = make_family_checkpoint(family_config(name), str(d), seed=len(cache))
        return cache[name]

    return get
