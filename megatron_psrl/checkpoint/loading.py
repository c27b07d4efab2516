"""Load this rank's model from a HF folder, a megatron_psrl checkpoint or a tiny config."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Sequence, Tuple

import torch

from megatron_psrl.checkpoint.hf_io import HFCheckpointReader
from megatron_psrl.checkpoint.mcore_format import load_rank_state, read_checkpoint_info
from megatron_psrl.checkpoint.sharding import shard_state_dict
from megatron_psrl.errors import CheckpointError, ConfigurationError
from megatron_psrl.model.adapters import get_adapter
from megatron_psrl.model.architecture import ModelArchitecture
from megatron_psrl.model.builder import build_model, parallel_layout
from megatron_psrl.model.gpt import PsrlGPTModel, model_chunks
from megatron_psrl.model.tiny import tiny_config

Tensor = torch.Tensor


@dataclass
class ModelSource:
    """Where the weights come from: exactly one of the three."""

    hf_dir: Optional[str] = None
    """A Hugging Face save_pretrained folder (converted in memory)."""

    checkpoint: Optional[str] = None
    """A megatron_psrl / Megatron legacy checkpoint directory (any TP/PP layout)."""

    tiny: Optional[str] = None
    """A named tiny config (``megatron_psrl.model.tiny``), randomly initialised."""

    hf_config: Optional[Dict] = None
    """A Hugging Face config dict, with ``hf_state_dict``: a model held in memory."""

    hf_state_dict: Optional[Dict[str, Tensor]] = None
    """Hugging Face-named tensors of the in-memory model (with ``hf_config``)."""

    def __post_init__(self) -> None:
        given = [x for x in (self.hf_dir, self.checkpoint, self.tiny, self.hf_config) if x]
        if len(given) != 1:
            raise ConfigurationError("give exactly one model source: --hf-dir, --load or --model")
        if (self.hf_config is None) != (self.hf_state_dict is None):
            raise ConfigurationError("an in-memory model needs both hf_config and hf_state_dict")


# Transformer Engine's layer spec fuses the pre-attention / pre-MLP norms into the following
# linear layer, so their parameters have other names than in the local spec. Checkpoints always
# use the local names (Megatron-LM's convention for converted checkpoints).
_TE_NORM_NAMES = (
    (".self_attention.linear_qkv.layer_norm_weight", ".input_layernorm.weight"),
    (".mlp.linear_fc1.layer_norm_weight", ".pre_mlp_layernorm.weight"),
)


def canonical_name(name: str) -> str:
    """The checkpoint (local-spec) name of a model parameter of either layer spec."""
    for te, local in _TE_NORM_NAMES:
        if name.endswith(te):
            return name[: -len(te)] + local
    return name


def canonical_state_dict(model: torch.nn.Module) -> Dict[str, Tensor]:
    """The model's state dict with local-spec names and without TE's ``_extra_state`` entries."""
    return {canonical_name(k): v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}


def load_state_into(model: PsrlGPTModel, shard: Dict[str, Tensor]) -> None:
    """Load a rank shard (any dtype, local-spec names) strictly into a model of either layer
    spec: every parameter must be present and match."""
    own = {canonical_name(k): v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    missing = sorted(set(own) - set(shard))
    unexpected = sorted(k for k in set(shard) - set(own) if not k.endswith("_extra_state"))
    if missing or unexpected:
        raise ConfigurationError(f"checkpoint does not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}")
    with torch.no_grad():
        for name, target in own.items():
            src = shard[name]
            if tuple(src.shape) != tuple(target.shape):
                raise ConfigurationError(f"{name}: checkpoint shape {tuple(src.shape)} != model shape {tuple(target.shape)}")
            target.copy_(src.to(dtype=target.dtype, device=target.device))


def hf_full_state_dict(hf_dir: str, arch: Optional[ModelArchitecture] = None, progress=None,
                       strict: bool = False) -> Dict[str, Tensor]:
    """Full (unsharded) megatron state dict of a HF folder.

    Every tensor is checked against the shape config.json implies before it is used (a wrong
    one names the file and the tensor). ``strict`` also refuses tensors the layout does not
    know (the converter: a round trip must not drop anything). ``progress(hf_name)`` is
    called for every HF tensor read."""
    arch = arch or ModelArchitecture.from_hf_dir(hf_dir)
    reader = HFCheckpointReader(hf_dir)
    adapter = get_adapter(arch)
    shapes = adapter.hf_shapes()
    missing = [k for k in shapes if k not in reader.weight_map]
    if missing:
        raise CheckpointError(hf_dir, f"missing tensors for a {arch.model_type} model: {missing[:5]}")
    if strict:
        extra = sorted(set(reader.weight_map) - set(shapes) - {"lm_head.weight"})
        extra = [k for k in extra if not k.endswith("rotary_emb.inv_freq")]
        if extra:
            raise CheckpointError(hf_dir, f"unexpected tensors (not a plain {arch.model_type} model?): {extra[:5]}")

    def get(name: str) -> Tensor:
        tensor = reader.get(name, expected_shape=shapes[name])
        if progress is not None:
            progress(name)
        return tensor

    return dict(adapter.hf_to_mcore(get))


def hf_memory_state_dict(state_dict: Dict[str, Tensor], arch: ModelArchitecture,
                         strict: bool = False) -> Dict[str, Tensor]:
    """Full megatron state dict of Hugging Face-named tensors held in memory (shapes checked;
    ``strict``: no tensor the model does not have, beyond a tied ``lm_head.weight`` and RoPE
    buffers, as a transformers ``state_dict()`` holds them)."""
    adapter = get_adapter(arch)
    shapes = adapter.hf_shapes()
    missing = [k for k in shapes if k not in state_dict]
    if missing:
        raise ConfigurationError(f"the state dict lacks tensors of a {arch.model_type} model: {missing[:5]}")
    if strict:
        extra = sorted(k for k in set(state_dict) - set(shapes) - {"lm_head.weight"}
                       if not k.endswith("rotary_emb.inv_freq"))
        if extra:
            raise ConfigurationError(f"the state dict has tensors a {arch.model_type} model does not: {extra[:5]}")
    for name, shape in shapes.items():
        if tuple(state_dict[name].shape) != shape:
            raise ConfigurationError(f"tensor {name!r}: shape {tuple(state_dict[name].shape)} does not match {shape} "
                                     "implied by the config")
    return dict(adapter.hf_to_mcore(lambda name: state_dict[name].detach().cpu()))


def source_architecture(source: ModelSource) -> ModelArchitecture:
    """The architecture of ``source`` without reading any weights (cheap; for validating data
    against the vocabulary before the model is loaded)."""
    if source.tiny:
        return ModelArchitecture.from_hf_config(tiny_config(source.tiny))
    if source.hf_dir:
        return ModelArchitecture.from_hf_dir(source.hf_dir)
    if source.hf_config is not None:
        return ModelArchitecture.from_hf_config(source.hf_config)
    return read_checkpoint_info(source.checkpoint)[1].architecture


def load_model(
    source: ModelSource,
    dtype: torch.dtype = torch.float32,
    device: torch.device = torch.device("cpu"),
    transformer_impl: str = "local",
    pipeline_layers: Optional[Sequence[int]] = None,
    virtual_pipeline_size: int = 1,
) -> Tuple[ModelArchitecture, torch.nn.Module, Optional[dict]]:
    """This rank's model from ``source``; returns (architecture, model, saved optimizer state).
    ``pipeline_layers``: each pipeline stage's layer count (default: an even split);
    ``virtual_pipeline_size`` V > 1: the rank's V chunks (virtual stages ``v * PP + pp_rank``
    of an even split into PP x V)."""
    tp_rank, tp, pp_rank, pp = parallel_layout()
    vpp = virtual_pipeline_size
    split = tuple(pipeline_layers) if pipeline_layers else pp * vpp
    stages = [v * pp + pp_rank for v in range(vpp)]  # this rank's (virtual) stages
    optimizer_state = None
    if source.tiny:
        arch = ModelArchitecture.from_hf_config(tiny_config(source.tiny))
        return arch, build_model(arch, dtype, device, transformer_impl, pipeline_layers, vpp), None
    if source.hf_dir or source.hf_config is not None:
        if source.hf_dir:
            arch = ModelArchitecture.from_hf_dir(source.hf_dir)
            full = hf_full_state_dict(source.hf_dir, arch)
        else:
            arch = ModelArchitecture.from_hf_config(source.hf_config)
            full = hf_memory_state_dict(source.hf_state_dict, arch)
        sharded = shard_state_dict(full, arch, tp, split)
        shards = [sharded[(tp_rank, s)] for s in stages]
    else:
        shards = []
        for s in stages:
            info, shard, state = load_rank_state(source.checkpoint, tp_rank, tp, s, split, virtual_pipeline_size=vpp)
            shards.append(shard)
            optimizer_state = optimizer_state if optimizer_state is not None else state
        arch = info.architecture
    model = build_model(arch, dtype, device, transformer_impl, pipeline_layers, vpp)
    for chunk, shard in zip(model_chunks(model), shards):
        load_state_into(chunk, shard)
    return arch, model, optimizer_state
