"""Fixtures of the checkpoint tests: sharded random HF checkpoints of every family."""

import pytest
import torch

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


@pytest.fixture(scope="session")
def sharded_hf(tmp_path_factory):
    """``(family, dtype name) -> HF folder`` saved in several safetensors files (built once)."""
    from helpers.families import family_config, make_family_checkpoint

    cache = {}

    def get(family, dtype="fp32"):
        key = (family, dtype)
        if key not in cache:
            d = tmp_path_factory.mktemp(f"hf-{family}-{dtype}")
            cfg = family_config(family, torch_dtype="bfloat16" if dtype == "bf16" else "float32")
            cache[key] = make_family_checkpoint(cfg, str(d), seed=len(cache), dtype=DTYPES[dtype],
                                                max_shard_size="40KB")
        return cache[key]

    return get
