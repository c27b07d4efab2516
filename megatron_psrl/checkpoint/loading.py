"""Load models from where their weights are: this rank's model from a HF folder, a megatron_psrl
checkpoint of either format (:mod:`dist_format`, :mod:`legacy_format`) or a tiny config
(:func:`load_model`), and whole state dicts of HF folders, in-memory HF models and checkpoints."""

from __future__ import annotations

import dataclasses
import logging
import re
from dataclasses import dataclass
from typing import Dict, Optional, Sequence, Tuple

import torch

from megatron_psrl.checkpoint import dist_format, legacy_format
from megatron_psrl.checkpoint.hf_io import HFCheckpointReader
from megatron_psrl.checkpoint.layout import CheckpointInfo, checkpoint_format, iteration_format, read_checkpoint_info
from megatron_psrl.checkpoint.passthrough import passthrough_names
from megatron_psrl.checkpoint.sharding import shard_state_dict, tp_shard
from megatron_psrl.checkpoint.state_dict import load_state_into
from megatron_psrl.errors import CheckpointError, ConfigurationError
from megatron_psrl.model.adapters import get_adapter, unfuse_experts
from megatron_psrl.model.architecture import ModelArchitecture
from megatron_psrl.model.builder import build_model, expert_parallel_layout, parallel_layout
from megatron_psrl.model.gpt import model_chunks
from megatron_psrl.model.moe import local_experts
from megatron_psrl.model.stages import PipelineSplit, stage_counts, virtual_stages
from megatron_psrl.model.tiny import tiny_config

Tensor = torch.Tensor
logger = logging.getLogger("megatron_psrl")


@dataclass
class ModelSource:
    """Where the weights come from: exactly one of the three."""

    hf_dir: Optional[str] = None
    """A Hugging Face save_pretrained folder (converted in memory)."""

    checkpoint: Optional[str] = None
    """A megatron_psrl checkpoint directory, torch_dist or legacy format (any TP/PP layout)."""

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


def hf_full_state_dict(hf_dir: str, arch: Optional[ModelArchitecture] = None, progress=None,
                       strict: bool = False, non_finite: str = "ignore") -> Dict[str, Tensor]:
    """Full (unsharded) megatron state dict of a HF folder.

    Every tensor is checked against the shape config.json implies before it is used (a wrong
    one names the file and the tensor). ``strict`` also refuses tensors the layout does not
    know (the converter: a round trip must not drop anything). ``non_finite``: what a tensor
    holding NaN or inf does: ``"refuse"`` (a :class:`CheckpointError` naming the file and the
    tensor), ``"warn"`` (one warning line naming them; converted as is) or ``"ignore"`` (not
    checked). ``progress(hf_name)`` is called for every HF tensor read."""
    arch = arch or ModelArchitecture.from_hf_dir(hf_dir)
    reader = HFCheckpointReader(hf_dir)
    adapter = get_adapter(arch)
    shapes = adapter.hf_shapes()
    missing = [k for k in shapes if k not in reader.weight_map]
    if missing:
        raise CheckpointError(hf_dir, f"missing tensors for a {arch.model_type} model: {missing[:5]}")
    if strict:
        extra = sorted(set(reader.weight_map) - set(shapes) - {"lm_head.weight"}
                       - set(passthrough_names(reader.weight_map, adapter.hf_passthrough_prefixes)))
        extra = [k for k in extra if not k.endswith("rotary_emb.inv_freq")]
        if extra:
            raise CheckpointError(hf_dir, f"unexpected tensors (not a plain {arch.model_type} model?): {extra[:5]}")

    if non_finite not in ("ignore", "refuse", "warn"):
        raise ValueError(f"non_finite must be 'ignore', 'refuse' or 'warn', got {non_finite!r}")

    def get(name: str) -> Tensor:
        tensor = reader.get(name, expected_shape=shapes[name])
        if non_finite != "ignore":
            check_finite(tensor, reader.path_of(name), name, refuse=non_finite == "refuse")
        if progress is not None:
            progress(name)
        return tensor

    return dict(adapter.hf_to_mcore(get))


def check_finite(tensor: Tensor, path: str, name: str, refuse: bool = True) -> None:
    """A tensor holding NaN or inf: a :class:`CheckpointError` naming ``path`` and ``name``
    (``refuse``), else one warning line naming them. A model with such a weight produces NaN
    log-probs from the first step, far from the file that caused them."""
    if not tensor.is_floating_point():
        return
    bad = int((~torch.isfinite(tensor)).sum())
    if not bad:
        return
    nans = int(torch.isnan(tensor).sum())
    what = f"{bad} non-finite values ({nans} NaN, {bad - nans} inf) in {tensor.numel()}"
    if refuse:
        raise CheckpointError(path, f"{what}; refusing to convert it (--allow-non-finite converts it as is)",
                              tensor=name)
    logger.warning("%s: tensor %r: %s; converted as is (--allow-non-finite)", path, name, what)


@dataclass(frozen=True)
class _StageReads:
    """What one rank reads of a HF folder for one (virtual) pipeline stage: the stage's layers,
    the embedding where the stage holds it, the final norm and output layer on the last stage,
    and of the routed experts only expert-parallel rank ``ep_rank``'s. Every other tensor is a
    meta tensor of its shape (no memory), dropped after conversion."""

    arch: ModelArchitecture
    offset: int
    """Global index of the stage's first layer."""
    count: int
    """Layers of the stage."""
    stages: int
    """(Virtual) pipeline stages in all."""
    stage: int
    """This stage's index."""
    ep_rank: int
    """This rank's index in its expert-parallel group."""
    ep: int
    """Expert-parallel size."""

    @classmethod
    def of(cls, arch: ModelArchitecture, stage: int, split: PipelineSplit, ep_rank: int, ep: int) -> "_StageReads":
        counts = stage_counts(arch, split)
        return cls(arch, sum(counts[:stage]), counts[stage], len(counts), stage, ep_rank, ep)

    @property
    def first(self) -> bool:
        return self.stage == 0

    @property
    def last(self) -> bool:
        return self.stage == self.stages - 1

    @property
    def embedding_here(self) -> bool:
        """The first stage's input embedding, or megatron's copy of tied embeddings on the last."""
        return self.first or (self.last and self.arch.tie_word_embeddings)

    def local_arch(self, **widths) -> ModelArchitecture:
        """The architecture of the stage's layers alone, whose adapter names them from 0
        (``widths``: a tensor-parallel rank's head counts and FFN width)."""
        a, lo, hi = self.arch, self.offset, self.offset + self.count
        local_types = list(a.layer_types[lo:hi]) if a.layer_types else None
        dense = [i - lo for i in a.dense_mlp_layers if lo <= i < hi]  # numbered as the stage's layers
        return dataclasses.replace(a, num_layers=self.count, layer_types=local_types, dense_mlp_layers=dense,
                                   **widths)

    def layer_tensor(self, name: str) -> Optional[Tuple[str, str]]:
        """``(global name, suffix after the layer index)`` of a stage-local layer tensor's HF
        name; None for a tensor outside the decoder layers."""
        m = re.match(r"^(.*?layers\.)(\d+)\.(.*)$", name)
        if m is None:
            return None
        return f"{m.group(1)}{int(m.group(2)) + self.offset}.{m.group(3)}", m.group(3)

    def skips_expert(self, suffix: str) -> bool:
        """A routed expert of another expert-parallel rank."""
        expert = re.match(r"^(?:mlp|block_sparse_moe)\.experts\.(\d+)\.", suffix)
        if expert is None:
            return False
        first, stop = self.expert_rows
        return not first <= int(expert.group(1)) < stop

    @property
    def expert_rows(self) -> Tuple[int, int]:
        """``[first, stop)``: the global indices of this expert-parallel rank's routed experts."""
        per_rank = self.arch.num_experts // self.ep
        return self.ep_rank * per_rank, (self.ep_rank + 1) * per_rank

    def holds_outside(self, name: str, embedding: str) -> bool:
        """Whether the stage holds the non-layer tensor ``name``: the input embedding (HF name
        ``embedding``) where :attr:`embedding_here`, the final norm and output layer on the last."""
        return self.embedding_here if name == embedding else self.last

    def finish(self, shard: Dict[str, Tensor]) -> Dict[str, Tensor]:
        """This expert-parallel rank's experts renumbered from 0; on the last of several stages,
        the tied embedding under megatron's name for its copy."""
        if self.arch.is_moe:
            shard = local_experts(shard, self.arch, self.ep_rank, self.ep)
        if self.last and self.arch.tie_word_embeddings and self.stages > 1:
            shard["output_layer.weight"] = shard.pop("embedding.word_embeddings.weight")
        return shard


def _open_checked(hf_dir: str, arch: ModelArchitecture) -> Tuple[HFCheckpointReader, Dict[str, tuple]]:
    """The folder's reader and the HF shapes of ``arch``; a missing tensor names the folder."""
    reader = HFCheckpointReader(hf_dir)
    shapes = get_adapter(arch).hf_shapes()
    missing = [k for k in shapes if k not in reader.weight_map]
    if missing:
        raise CheckpointError(hf_dir, f"missing tensors for a {arch.model_type} model: {missing[:5]}")
    return reader, shapes


def _layer_slice(reader, full_name: str, suffix: str, shape, heads: Tuple[int, int], groups: Tuple[int, int],
                 block: Tuple[int, int], shared: Tuple[int, int]) -> Tensor:
    """One tensor-parallel rank's part of a layer tensor: its query (``heads``), key/value
    (``groups``), FFN (``block``) or shared-expert (``shared``) rows, or columns of the output
    projections; norms, routers and whole experts are replicated."""
    if suffix.startswith("self_attn.q_proj."):
        return reader.get_slice(full_name, 0, *heads, shape)
    if suffix.startswith(("self_attn.k_proj.", "self_attn.v_proj.")):
        return reader.get_slice(full_name, 0, *groups, shape)
    if suffix == "self_attn.o_proj.weight":
        return reader.get_slice(full_name, 1, *heads, shape)
    if suffix in ("mlp.gate_proj.weight", "mlp.up_proj.weight"):
        return reader.get_slice(full_name, 0, *block, shape)
    if suffix == "mlp.down_proj.weight":
        return reader.get_slice(full_name, 1, *block, shape)
    # the shared expert (Qwen2-MoE ``shared_expert``; GLM-4.5 / DeepSeek-V3 ``shared_experts``)
    if suffix in ("mlp.shared_expert.gate_proj.weight", "mlp.shared_expert.up_proj.weight",
                  "mlp.shared_experts.gate_proj.weight", "mlp.shared_experts.up_proj.weight"):
        return reader.get_slice(full_name, 0, *shared, shape)
    if suffix in ("mlp.shared_expert.down_proj.weight", "mlp.shared_experts.down_proj.weight"):
        return reader.get_slice(full_name, 1, *shared, shape)
    return reader.get(full_name, shape)


def hf_rank_state_dict(hf_dir: str, arch: ModelArchitecture, tp_rank: int, tp: int, stage: int,
                       split: PipelineSplit, ep_rank: int = 0, ep: int = 1) -> Dict[str, Tensor]:
    """One rank's shard of a HF folder (tensor-parallel rank ``tp_rank``, (virtual) pipeline
    stage ``stage`` of ``split``), reading only what that rank holds: its stage's layers, of the
    routed experts only expert-parallel rank ``ep_rank``'s of ``ep`` (renumbered from 0,
    :func:`~megatron_psrl.model.moe.local_experts`), and, where the adapter's layouts allow it,
    only the rank's rows or columns of each tensor (safetensors ``get_slice``). The result
    equals ``shard_state_dict(hf_full_state_dict(...))[(tp_rank, stage)]`` bit for bit.

    Host memory while loading: about the shard where the adapter reads slices
    (:func:`_rank_slices`); otherwise the shard plus the full tensors of the layer being
    converted (:func:`_stage_cut`; of fused experts, only the rank's rows)."""
    if arch.num_kv_heads % tp:
        raise ConfigurationError(f"tensor parallel size {tp} must divide the {arch.num_kv_heads} key/value heads")
    reads = _StageReads.of(arch, stage, split, ep_rank, ep)
    reader, shapes = _open_checked(hf_dir, arch)
    if get_adapter(arch).reads_rank_slices:
        shard = _rank_slices(reader, shapes, reads, tp_rank, tp)
    else:
        shard = _stage_cut(reader, shapes, reads, tp_rank, tp)
    return reads.finish(shard)


_VOCAB_HF = ("model.embed_tokens.weight", "lm_head.weight")
"""The HF names of the input embedding and the output layer (a plain ``...ForCausalLM``)."""


def _stage_cut(reader: HFCheckpointReader, shapes: Dict[str, tuple], reads: _StageReads, tp_rank: int,
               tp: int) -> Dict[str, Tensor]:
    """The stage's tensors read whole and converted by the family's adapter on the stage's
    layers, each cut to this tensor-parallel rank's shard as it comes out (for layouts that are
    not per-group slices of the HF tensors: a gated query, Gated DeltaNet's fused projections).
    Of tensors that hold every routed expert (gpt-oss's fused experts, the adapter's
    ``hf_fused_expert_tensors``) only this expert-parallel rank's rows are read (safetensors
    ``get_slice``), and the adapter converts those experts alone. The embedding's name is the
    adapter's (a multimodal wrapper prefixes it)."""
    arch = reads.arch
    embedding = next((n for n in shapes if n.endswith("embed_tokens.weight")), _VOCAB_HF[0])
    adapter = get_adapter(reads.local_arch())
    fused = adapter.hf_fused_expert_tensors
    if fused:
        adapter.expert_rows = reads.expert_rows

    def get(name: str) -> Tensor:
        layer = reads.layer_tensor(name)
        if layer is None:
            here = reads.holds_outside(name, embedding)
            return reader.get(name, shapes[name]) if here else torch.empty(shapes[name], device="meta")
        full_name, suffix = layer
        if reads.skips_expert(suffix):
            return torch.empty(shapes[full_name], device="meta")
        if suffix in fused:  # [E, ...]: this rank's experts' rows
            return reader.get_slice(full_name, 0, *reads.expert_rows, shapes[full_name])
        return reader.get(full_name, shapes[full_name])

    shard = {}
    for name, tensor in adapter.hf_to_mcore(get):
        if not tensor.is_meta:
            shard[name] = tp_shard(name, tensor, arch, tp, tp_rank)
    return shard


def _rank_slices(reader: HFCheckpointReader, shapes: Dict[str, tuple], reads: _StageReads, tp_rank: int,
                 tp: int) -> Dict[str, Tensor]:
    """The stage's tensors as this tensor-parallel rank's slices of the files: the family's
    adapter runs on a *local* architecture (this rank's heads, key/value groups, FFN width and
    the stage's layers) with a reader that returns the matching slices; megatron's layouts
    (grouped QKV, [gate; up]) are per group / per row block, so the local result is exactly the
    rank's shard."""
    arch = reads.arch
    ng, hd, rep = arch.num_kv_heads // tp, arch.head_dim, arch.num_attention_heads // arch.num_kv_heads
    ffn = arch.ffn_hidden_size // tp
    shared = (arch.moe_shared_expert_ffn_hidden_size or 0) // tp  # a shared expert splits like the MLP
    vocab_rows = arch.padded_vocab_size(tp) // tp
    local = reads.local_arch(num_attention_heads=ng * rep, num_kv_heads=ng, ffn_hidden_size=ffn,
                             moe_shared_expert_ffn_hidden_size=shared or arch.moe_shared_expert_ffn_hidden_size)
    heads = (tp_rank * ng * rep * hd, (tp_rank + 1) * ng * rep * hd)  # this rank's query rows
    groups = (tp_rank * ng * hd, (tp_rank + 1) * ng * hd)  # its key / value rows
    block = (tp_rank * ffn, (tp_rank + 1) * ffn)  # its FFN rows (gate, up) / columns (down)

    def vocab(name: str) -> Tensor:
        start = tp_rank * vocab_rows
        t = reader.get_slice(name, 0, min(start, arch.vocab_size), min(start + vocab_rows, arch.vocab_size),
                             shapes[name])
        if t.shape[0] < vocab_rows:  # the padded rows of the last rank
            t = torch.cat([t, t.new_zeros(vocab_rows - t.shape[0], *t.shape[1:])], 0)
        return t

    def get(name: str) -> Tensor:
        layer = reads.layer_tensor(name)
        if layer is None:
            if name in _VOCAB_HF:
                return vocab(name) if reads.holds_outside(name, _VOCAB_HF[0]) else \
                    torch.empty(vocab_rows, arch.hidden_size, device="meta")
            return reader.get(name, shapes[name]) if reads.last else torch.empty(shapes[name], device="meta")
        full_name, suffix = layer
        if reads.skips_expert(suffix):
            return torch.empty(shapes[full_name], device="meta")
        return _layer_slice(reader, full_name, suffix, shapes[full_name], heads, groups, block,
                            (tp_rank * shared, (tp_rank + 1) * shared))

    return {name: t for name, t in get_adapter(local).hf_to_mcore(get) if not t.is_meta}


def hf_memory_state_dict(state_dict: Dict[str, Tensor], arch: ModelArchitecture,
                         strict: bool = False) -> Dict[str, Tensor]:
    """Full megatron state dict of Hugging Face-named tensors held in memory (shapes checked;
    ``strict``: no tensor the model does not have, beyond a tied ``lm_head.weight`` and RoPE
    buffers, as a transformers ``state_dict()`` holds them)."""
    adapter = get_adapter(arch)
    shapes = adapter.hf_shapes()
    if arch.is_moe:  # transformers keeps the experts fused in memory
        state_dict = unfuse_experts(state_dict, arch.model_type)
    missing = [k for k in shapes if k not in state_dict]
    if missing:
        raise ConfigurationError(f"the state dict lacks tensors of a {arch.model_type} model: {missing[:5]}")
    if strict:
        carried = set(passthrough_names(state_dict, adapter.hf_passthrough_prefixes))
        extra = sorted(k for k in set(state_dict) - set(shapes) - {"lm_head.weight"} - carried
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
    config_overrides: Optional[Dict[str, object]] = None,
    attention_backend: Optional[str] = None,
) -> Tuple[ModelArchitecture, torch.nn.Module, Optional[dict]]:
    """This rank's model from ``source``; returns (architecture, model, saved optimizer state:
    a legacy checkpoint's, when the layout matches; a torch_dist checkpoint's optimizer state is
    loaded once the optimizer exists, :func:`~megatron_psrl.checkpoint.dist_format.load_training_state`).
    ``pipeline_layers``: each pipeline stage's layer count (default: an even split);
    ``virtual_pipeline_size`` V > 1: the rank's V chunks (virtual stages ``v * PP + pp_rank``
    of an even split into PP x V); ``config_overrides``: TransformerConfig fields (activation
    recomputation); ``attention_backend``: the one the model is built for
    (:func:`~megatron_psrl.model.builder.build_model`)."""
    tp_rank, tp, pp_rank, pp = parallel_layout()
    ep_rank, ep = expert_parallel_layout()
    vpp = virtual_pipeline_size
    split = tuple(pipeline_layers) if pipeline_layers else pp * vpp
    stages = virtual_stages(pp_rank, pp, vpp)
    optimizer_state = None
    if source.tiny:
        arch = ModelArchitecture.from_hf_config(tiny_config(source.tiny))
        return arch, build_model(arch, dtype, device, transformer_impl, pipeline_layers, vpp, config_overrides,
                                 attention_backend), None
    if source.hf_dir:  # only this rank's slices are read
        arch = ModelArchitecture.from_hf_dir(source.hf_dir)
        log_untrained_mtp(arch, source.hf_dir)
        shards = [hf_rank_state_dict(source.hf_dir, arch, tp_rank, tp, s, split, ep_rank, ep) for s in stages]
    elif source.hf_config is not None:
        arch = ModelArchitecture.from_hf_config(source.hf_config)
        sharded = shard_state_dict(hf_memory_state_dict(source.hf_state_dict, arch), arch, tp, split)
        shards = [local_experts(sharded[(tp_rank, s)], arch, ep_rank, ep) if arch.is_moe else sharded[(tp_rank, s)]
                  for s in stages]
    elif checkpoint_format(source.checkpoint) == "torch_dist":  # megatron reads this rank's slices
        it_dir, info = read_checkpoint_info(source.checkpoint)
        model = build_model(info.architecture, dtype, device, transformer_impl, pipeline_layers, vpp,
                            config_overrides, attention_backend)
        dist_format.load_model_weights(it_dir, model)
        return info.architecture, model, None
    else:
        info, shards, optimizer_state = legacy_format.load_stage_states(source.checkpoint, tp_rank, tp, stages,
                                                                        split, vpp)
        arch = info.architecture
        if arch.is_moe:
            shards = [legacy_experts(source.checkpoint, info, shard, ep_rank, ep) for shard in shards]
    model = build_model(arch, dtype, device, transformer_impl, pipeline_layers, vpp, config_overrides,
                        attention_backend)
    for chunk, shard in zip(model_chunks(model), shards):
        load_state_into(chunk, shard)
    return arch, model, optimizer_state


def log_untrained_mtp(arch: ModelArchitecture, where: str) -> None:
    """One line saying that ``arch``'s multi-token-prediction layers are not trained (nor
    built: their tensors are carried through conversions unchanged)."""
    if arch.mtp_layers:
        logger.info("%s: %d multi-token-prediction layer(s) not built or trained; conversions carry their tensors "
                    "through unchanged", where, arch.mtp_layers)


def legacy_experts(ckpt_dir: str, info: CheckpointInfo, shard: Dict[str, Tensor], ep_rank: int,
                   ep: int) -> Dict[str, Tensor]:
    """Expert-parallel rank ``ep_rank``'s part of a legacy checkpoint's stage shard, which holds
    every expert by its global index; a shard holding fewer (one rank's experts, written with
    expert parallelism before the legacy format refused it) is refused in one line."""
    held = {}
    for name in shard:
        m = re.match(r"^(decoder\.layers\.\d+)\.mlp\.experts\.local_experts\.(\d+)\.", name)
        if m:
            held.setdefault(m.group(1), set()).add(int(m.group(2)))
    short = {layer: len(ids) for layer, ids in held.items() if len(ids) != info.architecture.num_experts}
    if short:
        layer, count = min(short.items())
        raise CheckpointError(ckpt_dir, f"holds {count} of the model's {info.architecture.num_experts} experts in "
                                        f"{layer} (a legacy checkpoint written with expert parallelism holds one "
                                        f"rank's), and loading it with expert-parallel size {ep} needs them all: "
                                        "save such runs in the torch_dist format (the default)")
    return local_experts(shard, info.architecture, ep_rank, ep)


def load_full_state_dict(ckpt_dir: str, progress=None) -> Tuple[CheckpointInfo, Dict[str, Tensor]]:
    """Merge all shards of the latest iteration into one full (unpadded) state dict (either
    format: a torch_dist checkpoint is read in this one process, see
    :func:`~megatron_psrl.checkpoint.dist_format.load_full_state_dict`)."""
    it_dir, info = read_checkpoint_info(ckpt_dir)
    if iteration_format(it_dir) == "torch_dist":
        return info, dist_format.load_full_state_dict(it_dir, info.architecture, info.torch_dtype)
    return info, legacy_format.load_full_state_dict(it_dir, info, progress)
