"""megatron-core's ``torch_dist`` checkpoint format (the default): one sharded checkpoint that
loads under any TP / PP / DP / virtual-pipeline layout.

::

    CKPT_DIR/
      latest_checkpointed_iteration.txt      "release" or the iteration number
      iter_0000042/
        psrl_model.json                      architecture, the TP/PP layout it was saved with, ...
        metadata.json                        megatron's: {"sharded_backend": "torch_dist", ...}
        .metadata                            torch.distributed.checkpoint's index of every tensor
        __<rank>_0.distcp                    the tensors each writing rank held (one file per rank)
        common.pt                            what is not sharded: iteration, scheduler, ...

Written with ``megatron.core.dist_checkpointing.save`` of the state dict Megatron-LM saves:
``model`` (``model0``, ``model1``, ... for virtual pipeline chunks) is the model's
``sharded_state_dict()``, so every tensor is stored once under its *global* name and shape
(layers stacked by global layer number, TP shards placed by offset; data-parallel replicas
write nothing); ``optimizer`` holds per-parameter optimizer state with the parameter's sharding
(``optimizer.state.exp_avg.<key>``, ``optimizer.state.fp32_param.<key>``, ...), so it reshards
too; ``opt_param_scheduler``, ``iteration`` and ``checkpoint_version`` are common state;
``rng_state`` is one object per (PP, TP) rank, as Megatron-LM saves it (restored when the
layout matches). Loading asks for this rank's pieces of the current layout and megatron
reads exactly those slices.

The legacy per-rank layout stays readable and writable (:mod:`legacy_format`);
:func:`~megatron_psrl.checkpoint.layout.iteration_format` tells the two apart by megatron's
``metadata.json`` (:data:`~megatron_psrl.checkpoint.layout.MEGATRON_METADATA`).
"""

from __future__ import annotations

import contextlib
import os
import pickle
import random
import re
import warnings
from typing import Any, Dict, Iterator, List, Optional

import numpy as np
import torch

from megatron_psrl.checkpoint import dist_checks
from megatron_psrl.checkpoint.expert_parallel import (
    match_stored_keys,
    recast_common,
    strip_chained_prefixes,
    sub_states,
)
from megatron_psrl.checkpoint.state_dict import canonical_state_dict, load_state_into
from megatron_psrl.errors import CheckpointError, CheckpointWriteError, ConfigurationError

CHECKPOINT_VERSION = 3.0


@contextlib.contextmanager
def quiet_deprecation_warnings() -> Iterator[None]:
    """Silence the FutureWarning torch.distributed.checkpoint gives on every call: its
    ShardedTensor (what megatron builds on) is deprecated in favour of DTensor, megatron's
    choice, nothing to act on."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed\.checkpoint")
        warnings.filterwarnings("ignore", category=FutureWarning, module=r"megatron\.core\.dist_checkpointing")
        yield


def model_sharded_state_dict(model: torch.nn.Module) -> Dict[str, Any]:
    """Megatron-LM's ``model`` entries: one chunk's ``sharded_state_dict()`` under ``model``,
    or ``model0``, ``model1``, ... for virtual pipeline chunks."""
    from megatron_psrl.model.gpt import model_chunks

    chunks = model_chunks(model)
    if len(chunks) == 1:
        return {"model": chunks[0].sharded_state_dict()}
    return {f"model{v}": chunk.sharded_state_dict() for v, chunk in enumerate(chunks)}


def rng_sharded_object():
    """This rank's RNG states as Megatron-LM saves them: a ShardedObject over (PP, TP), one
    copy per data-parallel group."""
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    state = {"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
             "torch_rng_state": torch.get_rng_state(),
             "cuda_rng_state": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
             "rng_tracker_states": tensor_parallel.get_cuda_rng_tracker().get_states()}
    pp, tp = parallel_state.get_pipeline_model_parallel_world_size(), parallel_state.get_tensor_model_parallel_world_size()
    return ShardedObject("rng_state", [state], (pp, tp), (parallel_state.get_pipeline_model_parallel_rank(),
                                                       parallel_state.get_tensor_model_parallel_rank()),
                         replica_id=parallel_state.get_data_parallel_rank(with_context_parallel=True))


def restore_rng(state: Any) -> None:
    from megatron.core import tensor_parallel

    state = state[0] if isinstance(state, list) else state
    random.setstate(state["random_rng_state"])
    np.random.set_state(state["np_rng_state"])
    torch.set_rng_state(state["torch_rng_state"])
    if state.get("cuda_rng_state") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda_rng_state"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["rng_tracker_states"])


def save_state(it_dir: str, sharded_state_dict: Dict[str, Any], device: torch.device) -> None:
    """Every rank: write ``sharded_state_dict`` into the (empty) folder ``it_dir`` with megatron's
    synchronous torch_dist strategy (one file per writing rank). A failure raises
    :class:`CheckpointWriteError` naming ``it_dir`` on every rank (megatron broadcasts it)."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.core import CheckpointingException
    from torch.distributed.checkpoint import CheckpointException

    from megatron_psrl.compat import torch_dist_save_strategy

    try:
        with quiet_deprecation_warnings():
            dist_checkpointing.save(sharded_state_dict, it_dir, sharded_strategy=torch_dist_save_strategy(device))
    except (CheckpointingException, CheckpointException, OSError) as exc:
        named = _named_failure(exc)
        if named is not None:  # a write error naming its file (item 7 of compat on CPU)
            raise CheckpointWriteError(named.path, named.reason) from exc
        reason = " ".join(str(exc).split())[:400]
        raise CheckpointWriteError(it_dir, f"megatron's torch_dist save failed: {reason}") from exc


def _named_failure(exc: BaseException) -> Optional[CheckpointWriteError]:
    """The writer's error naming its file, from megatron's report of failed writes (which
    carries it as text: the report crosses ranks pickled, without exception causes)."""
    m = re.search(r"cannot write (\S+?\.distcp): ([^\n]+)", str(exc))
    return CheckpointWriteError(m.group(1), m.group(2).strip()) if m else None


def load_state(it_dir: str, sharded_state_dict: Dict[str, Any],
               common: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """Every rank: this rank's pieces of ``sharded_state_dict`` from ``it_dir`` (a collective).
    The folder is checked first (:func:`~megatron_psrl.checkpoint.dist_checks.check_folder`:
    the index, the files' lengths, what is unpickled); a missing, truncated, corrupt or
    mismatching file raises :class:`CheckpointError` naming it (and the tensor), one line.
    ``common``: the non-sharded state to merge the pieces into, instead of ``common.pt``'s
    (read and recast by the caller)."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.core import CheckpointingException
    from torch.distributed.checkpoint import CheckpointException

    index = dist_checks.check_folder(it_dir)
    try:
        with quiet_deprecation_warnings():
            return dist_checkpointing.load(sharded_state_dict, it_dir,
                                           common_strategy=None if common is None else _given_common(common))
    except (CheckpointingException, CheckpointException, OSError, RuntimeError, EOFError, ValueError,
            AssertionError, pickle.UnpicklingError) as exc:
        raise dist_checks.explain_failure(exc, it_dir, index) from None


def _given_common(common: Dict[str, Any]):
    """megatron's common-state load strategy returning ``common`` (a copy) instead of reading
    ``common.pt``."""
    import copy

    from megatron.core.dist_checkpointing.strategies.common import TorchCommonLoadStrategy

    class GivenCommon(TorchCommonLoadStrategy):
        def load_common(self, checkpoint_dir):
            return copy.deepcopy(common)

    return GivenCommon()


def load_common(it_dir: str) -> Dict[str, Any]:
    """The common (non-sharded) state: iteration, scheduler, optimizer layout (rank-local read).
    Read with ``weights_only=True`` (megatron's own reader takes torch's default): nothing but
    tensors and plain containers is unpickled; anything else is refused naming ``common.pt``."""
    path = os.path.join(it_dir, dist_checks.COMMON)
    common = dist_checks.safe_torch_load(path, path)
    if not isinstance(common, dict):
        raise CheckpointError(path, f"expected a dict of megatron's common state, found {type(common).__name__}")
    return common


def load_model_weights(it_dir: str, model: torch.nn.Module) -> None:
    """Every rank: load this rank's shard of every chunk of ``model`` (any saved layout).

    A checkpoint saved under another layer spec (megatron's local layers, no Transformer Engine)
    holds no TE ``_extra_state`` (its FP8 metadata): a model built with TE then keeps its own,
    fresh, and everything else must match exactly."""
    from megatron_psrl.model.gpt import model_chunks

    request = model_sharded_state_dict(model)
    absent = _extra_state_not_stored(it_dir, request)
    loaded = load_state(it_dir, request)
    keys = list(request)
    for key, chunk in zip(keys, model_chunks(model)):
        try:
            result = chunk.load_state_dict(loaded[key], strict=not absent)
        except RuntimeError as exc:
            raise CheckpointError(it_dir, f"does not match the model: {' '.join(str(exc).split())[:300]}") from None
        if absent:  # (strict but for the extra state the checkpoint does not hold)
            wrong = [k for k in result.missing_keys if not k.endswith("_extra_state")] + list(result.unexpected_keys)
            if wrong:
                raise CheckpointError(it_dir, f"does not match the model: missing or unexpected {wrong[:5]}")


def _extra_state_not_stored(it_dir: str, request: Dict[str, Any]) -> List[str]:
    """Remove from ``request`` the ``_extra_state`` entries (Transformer Engine's) that the
    checkpoint's index does not hold; their keys."""
    try:
        stored = set(dist_checks.read_index(it_dir).state_dict_metadata)
    except CheckpointError:
        return []  # (load_state explains what is wrong with the folder)
    absent = []
    for chunk in request.values():
        for name in [k for k, v in chunk.items() if k.endswith("_extra_state")
                     and getattr(v, "unique_key", getattr(v, "key", None)) not in stored]:
            absent.append(name)
            del chunk[name]
    return absent


def save_training_state(it_dir: str, iteration: int, model, optimizer, device: torch.device) -> None:
    """Every rank: the training checkpoint of Megatron-LM's torch_dist layout (module docstring)."""
    model_state = model_sharded_state_dict(model)
    state: Dict[str, Any] = dict(model_state, iteration=iteration, checkpoint_version=CHECKPOINT_VERSION,
                                 rng_state=rng_sharded_object())
    if optimizer is not None:
        # one key per parameter whatever the expert-parallel size (expert_parallel module)
        state["optimizer"] = strip_chained_prefixes(optimizer.sharded_state_dict(model_state))
        state["opt_param_scheduler"] = optimizer.scheduler.state_dict()
    save_state(it_dir, state, device)


def _check_optimizer_kind(it_dir: str, saved_state: Any, current: str, distributed: bool) -> None:
    """Refuse, in one line, optimizer state of another optimizer, or of the distributed
    optimizer into the plain one and back (megatron would fail deep inside the load: on a
    missing ``exp_avg``, ``pre_wd_mult`` or ``optimizer.state.param...`` key). ``distributed``:
    this run's ``--use-distributed-optimizer``."""
    from megatron_psrl.engine.optimizer import saved_optimizer_kind

    subs = sub_states(saved_state)
    saved = saved_optimizer_kind(subs)
    if saved is not None and saved != current:
        raise CheckpointError(it_dir, f"holds {saved} optimizer state and this run uses --optimizer {current}: "
                                      f"pass --optimizer {saved} to train on, or --no-load-optim to start a fresh "
                                      f"{current} state from the checkpoint's weights")
    # megatron's distributed optimizer names how it sharded its state; the plain one does not
    saved_distributed = any(isinstance(sub, dict) and "param_state_sharding_type" in sub for sub in subs)
    if saved_distributed != distributed:
        saved_by = "with" if saved_distributed else "without"
        this = "uses" if distributed else "does not use"
        raise CheckpointError(it_dir, f"holds optimizer state saved {saved_by} --use-distributed-optimizer and this "
                                      f"run {this} it: resume {saved_by} it, or pass --no-load-optim to start a "
                                      f"fresh optimizer state from the checkpoint's weights")


def load_training_state(it_dir: str, model, optimizer, same_layout: bool) -> None:
    """Every rank: the optimizer state (resharded to this layout, expert-parallel size included:
    :mod:`~megatron_psrl.checkpoint.expert_parallel`), the scheduler, and, when the TP/PP layout
    is the saved one, the RNG states. The weights are loaded already."""
    common = load_common(it_dir)
    if "optimizer" not in common and "opt_param_scheduler" not in common:
        raise CheckpointError(it_dir, "holds no optimizer state (saved without an optimizer)")
    _check_optimizer_kind(it_dir, common["optimizer"], optimizer.settings.optimizer,
                          optimizer.settings.use_distributed_optimizer)
    wanted = strip_chained_prefixes(optimizer.sharded_state_dict(model_sharded_state_dict(model), is_loading=True,
                                                                 saved=common["optimizer"]))
    match_stored_keys(wanted, dist_checks.read_index(it_dir).state_dict_metadata)
    recast = recast_common(common["optimizer"], wanted, it_dir)
    request: Dict[str, Any] = {"optimizer": wanted}
    if same_layout:
        request["rng_state"] = rng_sharded_object()
    loaded = load_state(it_dir, request, None if recast is common["optimizer"] else dict(common, optimizer=recast))
    optimizer.load_sharded_state_dict(loaded["optimizer"])
    optimizer.scheduler.load_state_dict(common["opt_param_scheduler"])
    if same_layout:
        restore_rng(loaded["rng_state"])



# ---------------------------------------------------------------------- whole models, one process
@contextlib.contextmanager
def single_process_model_parallel() -> Iterator[None]:
    """TP = PP = 1 in this (only) process, for reading or writing a whole model (the converter,
    :func:`load_full_state_dict`): a torch_dist checkpoint is read and written through a model
    whose ``sharded_state_dict()`` says where every tensor lives. torch's CPU RNG state is kept
    (megatron's RNG tracker is seeded anew)."""
    import torch.distributed as dist

    from megatron_psrl.distributed.setup import initialize_parallel

    if dist.is_initialized() and dist.get_world_size() > 1:
        raise ConfigurationError("reading or writing a whole torch_dist checkpoint runs in one process, not under "
                                 "torchrun (every rank of a job loads its own slices with --load)")
    cpu = torch.get_rng_state()
    try:
        initialize_parallel(1, 1, seed=0, device="cpu")
        yield
    finally:
        torch.set_rng_state(cpu)


def _whole_model(arch, dtype: torch.dtype):
    from megatron_psrl.model.builder import build_model

    # No random initialisation: every tensor is overwritten (a large model builds in seconds).
    return build_model(arch, dtype, torch.device("cpu"), "local", config_overrides={"perform_initialization": False})


def load_full_state_dict(it_dir: str, arch, dtype: torch.dtype) -> Dict[str, torch.Tensor]:
    """The whole model of a torch_dist iteration folder, with megatron-core names and the
    unpadded vocabulary (as :func:`~megatron_psrl.checkpoint.legacy_format.load_full_state_dict`
    returns a legacy one): megatron loads every tensor into a TP = PP = 1 model."""
    with single_process_model_parallel():
        model = _whole_model(arch, dtype)
        load_model_weights(it_dir, model)
        return {k: v.detach() for k, v in canonical_state_dict(model).items()}


def write_model_checkpoint(it_dir: str, arch, full: Dict[str, torch.Tensor], iteration: int) -> None:
    """Write a whole model (megatron-core names, e.g. converted from Hugging Face) into the empty
    folder ``it_dir`` as a torch_dist checkpoint, from this one process; it loads under any
    layout. Host memory: the state dict and a model of the same size."""
    dtype = next(iter(full.values())).dtype
    with single_process_model_parallel():
        model = _whole_model(arch, dtype)
        load_state_into(model, full)
        state = dict(model_sharded_state_dict(model), iteration=iteration, checkpoint_version=CHECKPOINT_VERSION)
        save_state(it_dir, state, torch.device("cpu"))
