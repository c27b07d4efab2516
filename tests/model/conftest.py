"""Fixtures of the model tests: random HF checkpoints of the test families."""

import pytest


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
