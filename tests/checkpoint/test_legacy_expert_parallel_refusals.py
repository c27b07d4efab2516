"""The legacy checkpoint format and expert parallelism, refused up front in one line each: a run
that would save legacy files at EP > 1 (its configuration), and a legacy checkpoint's optimizer
state loaded under another EP size than it was saved with (at the resume point, before any
weight is read)."""

from types import SimpleNamespace

import pytest
import torch

from megatron_psrl import ActorConfig
from megatron_psrl.checkpoint.layout import CheckpointInfo
from megatron_psrl.checkpoint.legacy_format import check_optimizer_expert_parallel, save_sharded_checkpoint
from megatron_psrl.checkpoint.sharding import shard_state_dict
from megatron_psrl.errors import CheckpointError, ConfigurationError
from megatron_psrl.model.architecture import ModelArchitecture
from megatron_psrl.model.tiny import tiny_config


def test_legacy_format_with_expert_parallelism_is_refused_by_the_config():
    with pytest.raises(ConfigurationError) as err:
        ActorConfig(ckpt_format="legacy", expert_model_parallel_size=2, moe_token_dispatcher_type="alltoall")
    text = str(err.value)
    assert "--ckpt-format legacy" in text and "--expert-model-parallel-size 2" in text and "torch_dist" in text
    assert "\n" not in text
    ActorConfig(ckpt_format="legacy")  # EP = 1: as before
    ActorConfig(expert_model_parallel_size=2, moe_token_dispatcher_type="alltoall")  # torch_dist (the default)


def test_legacy_optimizer_state_under_another_expert_parallel_size_is_refused(tmp_path, monkeypatch):
    from megatron_psrl.checkpoint.loading import ModelSource
    from megatron_psrl.engine.builder import resume_point
    from megatron_psrl.model import builder as model_builder
    from megatron_psrl.model.adapters import get_adapter

    arch = ModelArchitecture.from_hf_config(tiny_config("debug-qwen3-moe"))
    shapes = get_adapter(arch).hf_shapes()
    full = dict(get_adapter(arch).hf_to_mcore(lambda n: torch.zeros(shapes[n])))
    ckpt = str(tmp_path / "legacy")
    info = CheckpointInfo(arch, 1, 1, 3, "float32", has_optimizer_state=True)  # saved at EP = 1
    save_sharded_checkpoint(ckpt, info, shard_state_dict(full, arch, 1, 1), release=False)
    layout = SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1)

    monkeypatch.setattr(model_builder, "expert_parallel_layout", lambda: (0, 2))  # this run: EP = 2
    with pytest.raises(CheckpointError) as err:
        resume_point(ModelSource(checkpoint=ckpt), layout, 1, 1, with_optimizer=True)
    text = str(err.value)
    assert text.startswith(str(tmp_path / "legacy" / "iter_0000003")) and "\n" not in text
    assert "expert-parallel size 1" in text and "--expert-model-parallel-size 2" in text
    assert "--no-load-optim" in text and "torch_dist" in text
    assert resume_point(ModelSource(checkpoint=ckpt), layout, 1, 1, with_optimizer=False).iteration == 3

    monkeypatch.setattr(model_builder, "expert_parallel_layout", lambda: (0, 1))  # the size it was saved with
    assert resume_point(ModelSource(checkpoint=ckpt), layout, 1, 1, with_optimizer=True).iteration == 3
    # weights only (no optimizer state in the folder): nothing to refuse
    check_optimizer_expert_parallel("/ckpt", CheckpointInfo(arch, 1, 1, 0, "float32"), 2)
