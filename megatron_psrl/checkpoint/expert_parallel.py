"""Optimizer state of torch_dist checkpoints that reshards across expert-parallel sizes.

megatron builds one optimizer for a dense model, and for an MoE model with expert
parallelism (EP > 1) a ``ChainedOptimizer`` of two: the dense parameters' and the experts'
(``param.allreduce = False``: their gradients are summed over the expert-data-parallel group).
Its ``sharded_state_dict`` then prefixes every tensor with the sub-optimizer's index
(``chained_0.optimizer.state.exp_avg.<param>``, ``chained_1.``...) unless
``chained_optim_avoid_prefix`` is set, and its non-sharded state (hyper-parameters, the common
Adam step) is one entry per sub-optimizer. Neither matches an EP = 1 run's single optimizer,
so an EP = 2 checkpoint's optimizer state would not load at EP = 1, nor the reverse.

What makes the two layouts one (as Megatron-LM does with ``chained_optim_avoid_prefix``):

- every optimizer tensor is stored under its parameter's global key alone
  (``optimizer.state.exp_avg.<param>``; :func:`strip_chained_prefixes`): the parameters of the
  sub-optimizers are disjoint, so the keys are unique, and the model's sharded state dict
  already places each expert at its global index (megatron's expert axis offsets);
- a checkpoint written before, with the prefixes, is read by finding each request's key
  under whichever prefix stores it (:func:`match_stored_keys`);
- the non-sharded state is recast into the structure of the loading optimizer
  (:func:`recast_common`): the saved parameter groups are matched by megatron's group key
  (weight-decay and learning-rate multipliers, ``is_expert_parallel``, decoupled lr), with
  ``is_expert_parallel`` allowed to differ (the same parameters, now in the other optimizer),
  and the common step (equal in every sub-optimizer) goes to each.
"""

from __future__ import annotations

import copy
import re
from typing import Any, Dict, Iterable, List, Optional

from megatron_psrl.errors import CheckpointError

_CHAINED = re.compile(r"^chained_\d+\.")
_GROUP_KEYS = ("wd_mult", "lr_mult", "is_expert_parallel", "is_decoupled_lr")
"""megatron's parameter-group identifier (``param_group_identifier_keys``)."""


def _sharded_leaves(state: Any) -> Iterable[Any]:
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedBase

    return (v for v in nested_values(state) if isinstance(v, ShardedBase))


def strip_chained_prefixes(optimizer_state: Any) -> Any:
    """Drop megatron's ``chained_<i>.`` prefix from every sharded key of an optimizer sharded
    state dict, in place (returns it)."""
    for sh in _sharded_leaves(optimizer_state):
        if _CHAINED.match(sh.key):
            sh.key = _CHAINED.sub("", sh.key, count=1)
    return optimizer_state


def match_stored_keys(optimizer_state: Any, stored: Iterable[str]) -> Any:
    """Point every sharded key of an (unprefixed) optimizer request that the checkpoint lacks at
    the ``chained_<i>.``-prefixed key that stores it, when there is one (a checkpoint saved with
    megatron's prefixes); in place, returns it."""
    stored = set(stored)
    prefixed: Dict[str, str] = {}
    for key in stored:
        if _CHAINED.match(key):
            prefixed.setdefault(_CHAINED.sub("", key, count=1), key)
    if not prefixed:
        return optimizer_state
    for sh in _sharded_leaves(optimizer_state):
        if sh.key not in stored and sh.key in prefixed:
            sh.key = prefixed[sh.key]
    return optimizer_state


def sub_states(optimizer_state: Any) -> List[Any]:
    """The per-sub-optimizer states of a (chained) optimizer's state: megatron's chained state is
    ``{0: ..., 1: ...}`` (sharded) or a list (``state_dict``); a single optimizer's is one."""
    if isinstance(optimizer_state, dict) and optimizer_state and all(isinstance(k, int) for k in optimizer_state):
        return [optimizer_state[k] for k in sorted(optimizer_state)]
    if isinstance(optimizer_state, (list, tuple)):
        return list(optimizer_state)
    return [optimizer_state]


def _param_groups(sub: Any) -> Optional[list]:
    """The ``param_groups`` list of one sub-optimizer's state (torch's, or under ``optimizer``:
    megatron's mixed-precision and distributed optimizers), or None."""
    if not isinstance(sub, dict):
        return None
    if isinstance(sub.get("param_groups"), list):
        return sub["param_groups"]
    inner = sub.get("optimizer")
    if isinstance(inner, dict) and isinstance(inner.get("param_groups"), list):
        return inner["param_groups"]
    return None


def _group_key(group: dict, flip_expert: bool = False) -> tuple:
    key = tuple(group.get(k, group.get(f"pre_{k}")) for k in _GROUP_KEYS)
    if flip_expert:
        key = key[:2] + (not key[2],) + key[3:]
    return key


def _common_part(request_sub: Any) -> Any:
    """What megatron would store as the non-sharded state of this request (the structure
    :func:`recast_common` fills): its sharded and local-only leaves dropped, with megatron's own
    extraction (a list or dict of nothing else disappears)."""
    from megatron.core.dist_checkpointing.dict_utils import extract_matching_values
    from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject, ShardedBase

    if not isinstance(request_sub, (dict, list)):
        return copy.deepcopy(request_sub)
    _, common = extract_matching_values(request_sub, lambda x: isinstance(x, (ShardedBase, LocalNonpersistentObject)))
    return copy.deepcopy(common)


def _overlay(base: Any, saved: Any) -> Any:
    """``base`` with every leaf ``saved`` has (same path) taken from ``saved``, and what only
    ``saved`` has added (the common step, which a request before any step lacks)."""
    if isinstance(base, dict) and isinstance(saved, dict):
        out = {k: _overlay(v, saved[k]) if k in saved else v for k, v in base.items()}
        out.update({k: copy.deepcopy(v) for k, v in saved.items() if k not in base})
        return out
    if isinstance(base, list) and isinstance(saved, list):
        return [_overlay(b, s) for b, s in zip(base, saved)] if len(base) == len(saved) else base
    if isinstance(base, (dict, list)) or isinstance(saved, (dict, list)):
        return base
    return copy.deepcopy(saved)


def recast_common(saved: Any, request: Any, it_dir: str) -> Any:
    """The checkpoint's non-sharded optimizer state ``saved`` in the structure of the loading
    optimizer's request (its ``sharded_state_dict(is_loading=True)``); ``saved`` itself when the
    structures match (the same number of sub-optimizers)."""
    saved_subs, wanted = sub_states(saved), sub_states(request)
    if len(saved_subs) == len(wanted):
        return saved
    groups = [g for sub in saved_subs for g in (_param_groups(sub) or []) if isinstance(g, dict)]
    by_key = {}
    for g in groups:
        by_key.setdefault(_group_key(g), g)
    out = []
    for sub in wanted:
        want_groups = _param_groups(sub) or []
        matched = []
        for g in want_groups:
            found = by_key.get(_group_key(g)) or by_key.get(_group_key(g, flip_expert=True))
            if found is None:
                raise CheckpointError(it_dir, f"holds no optimizer parameter group like this run's "
                                              f"{dict(zip(_GROUP_KEYS, _group_key(g)))}: its optimizer state cannot "
                                              "be loaded (--no-load-optim starts a fresh one from its weights)")
            found = {k: copy.deepcopy(v) for k, v in found.items() if k != "params"}
            found["is_expert_parallel"] = g.get("is_expert_parallel", found.get("is_expert_parallel"))
            matched.append(found)
        # the template: the saved sub-optimizer holding this one's first group (same step everywhere)
        template = saved_subs[0]
        if want_groups:
            for s in saved_subs:
                keys = {_group_key(x) for x in (_param_groups(s) or []) if isinstance(x, dict)}
                if _group_key(want_groups[0]) in keys:
                    template = s
                    break
        recast = _overlay(_common_part(sub), template)
        target = _param_groups(recast)
        if target is not None:
            target[:] = matched
        out.append(recast)
    return out[0] if len(out) == 1 else dict(enumerate(out))


__all__ = ["match_stored_keys", "recast_common", "strip_chained_prefixes", "sub_states"]
