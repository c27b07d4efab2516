"""Serialise a set of tree tokens into one packed micro-batch (mechanism 1 tree packing).

A micro-batch is a set of tree tokens. Because tree tokens are stored in depth-first preorder,
the set sorted by tree index *is* a depth-first serialisation: every token follows its
predecessor and every subtree stays contiguous. From that sorted array everything the model
needs is derived with array operations:

- ``input_ids`` / ``position_ids``: token ids and true positions (depth in the sample);
- segments: maximal chains inside the pack (a new segment starts where a token's predecessor
  is not the previous pack token, or the previous token branches inside the pack);
- the attention plan: each segment causal, each segment's in-pack descendants over its keys,
  and each external source (a prefix cached by an earlier micro-batch) over the pack tokens
  that descend from it (mechanism 2);
- logit rows: for every target token x whose log-prob this micro-batch computes, the pack
  row holding x's predecessor (its hidden state predicts x). Different children of a branch
  point are different targets of the same row.

Tokens can be *owned* (their loss and log-prob are computed here) or context only (duplicated
ancestors of the mechanism-1 split stopgap, computed again but claimed elsewhere).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Tuple

import numpy as np

from megatron_psrl.attention.plan import AttentionPlan, tree_plan
from megatron_psrl.tree.index import TreeIndex, chain_structure


@dataclass
class ExternalSource:
    """A prefix chain whose K/V an earlier micro-batch left in the KV cache."""

    source_id: int
    """Global id of the cached source (the KV cache's key)."""

    length: int
    """Tokens in the source."""

    last_token: int
    """Tree index of its last token: pack tokens descending from it see all of the source."""


@dataclass
class PackedMicroBatch:
    """Everything the model and the loss need for one micro-batch."""

    tree_tokens: np.ndarray
    """int64 ``[t]``: tree token index of every pack token (sorted = depth-first order)."""

    input_ids: np.ndarray
    """int64 ``[t]``: token ids."""

    position_ids: np.ndarray
    """int64 ``[t]``: position of every token in its samples."""

    owned: np.ndarray
    """bool ``[t]``: the token's loss claims and log-prob belong to this micro-batch."""

    plan: AttentionPlan
    """Segments and ancestor blocks for the attention backends."""

    logit_rows: np.ndarray
    """int64 ``[n]``: pack rows whose hidden states produce logits."""

    logit_targets: np.ndarray
    """int64 ``[n]``: the tree token every logit row predicts (its id is the target)."""

    external: List[ExternalSource] = field(default_factory=list)
    """Cached sources this micro-batch reads, in ``plan.external_lengths`` order."""

    @property
    def num_tokens(self) -> int:
        return int(self.tree_tokens.shape[0])

    def key_pairs(self) -> int:
        return self.plan.key_pairs()


def pack_tokens(
    index: TreeIndex,
    tokens: np.ndarray,
    owned: Optional[np.ndarray] = None,
    external: Sequence[ExternalSource] = (),
    remote_targets: Optional[np.ndarray] = None,
) -> PackedMicroBatch:
    """Pack a set of tree tokens.

    Args:
        index: the tree's :class:`TreeIndex`.
        tokens: tree token indices (any order, no duplicates). Every token's predecessor must be
            in ``tokens`` or be the last token of an external source, or the token is at position 0.
        owned: bool mask aligned with the *sorted* tokens; default all owned.
        external: cached sources the pack's root segments descend from.
        remote_targets: tree tokens outside the pack whose predecessor is in the pack and
            whose log-prob this micro-batch computes (first tokens of cached-prefix dependents).
    """
    tree = index.tree
    tok = np.sort(np.asarray(tokens, dtype=np.int64))
    t = len(tok)
    if t == 0:
        raise ValueError("a micro-batch needs at least one token")
    if np.any(tok[1:] == tok[:-1]):
        raise ValueError("a micro-batch cannot hold the same tree token twice")
    owned = np.ones(t, dtype=bool) if owned is None else np.asarray(owned, dtype=bool)

    pred_tree = index.pred[tok]
    pred_pack, continues = chain_structure(index, tok)
    present = pred_pack >= 0
    seg_start = np.flatnonzero(~continues)
    seg_end = np.append(seg_start[1:], t)
    seg_of_token = np.cumsum(~continues) - 1
    start_pred = pred_pack[seg_start]
    seg_parent = np.where(start_pred >= 0, seg_of_token[np.maximum(start_pred, 0)], -1)

    ext_blocks = _external_blocks(index, tok, seg_start[(seg_parent < 0) & (pred_tree[seg_start] >= 0)], external)
    plan = tree_plan(seg_start, seg_end, seg_parent, ext_blocks, [s.length for s in external],
                     positions=index.position[tok],
                     external_positions=[int(index.position[s.last_token]) - s.length + 1 for s in external])

    logit_rows, logit_targets = _logit_rows(index, tok, pred_pack, owned & present, remote_targets)
    return PackedMicroBatch(
        tree_tokens=tok,
        input_ids=tree.tokens[tok].astype(np.int64),
        position_ids=index.position[tok],
        owned=owned,
        plan=plan,
        logit_rows=logit_rows,
        logit_targets=logit_targets,
        external=list(external),
    )


def _external_blocks(index: TreeIndex, tok: np.ndarray, dangling: np.ndarray,
                     external: Sequence[ExternalSource]) -> List[Tuple[int, int, int]]:
    """``(first row, end row, source)`` of the pack rows that see each external source.

    ``dangling``: root segments whose first token is not at position 0; each must descend from
    external sources. Exactness guard: such a segment must see exactly its ancestors, i.e. as
    many external keys as its position (all its ancestors are outside the pack)."""
    ext_blocks = []
    visible = np.zeros(len(tok), dtype=np.int64)  # external keys each pack token sees
    for i, src in enumerate(external):
        lo = np.searchsorted(tok, src.last_token, side="right")
        hi = np.searchsorted(tok, index.subtree_end[src.last_token], side="left")
        if hi > lo:
            ext_blocks.append((int(lo), int(hi), i))
            visible[lo:hi] += src.length
    bad = dangling[visible[dangling] != index.position[tok[dangling]]]
    if len(bad):
        x = int(tok[bad[0]])
        raise ValueError(
            f"tree token {x} (position {int(index.position[x])}) sees {int(visible[bad[0]])} cached "
            "ancestor keys: its predecessors are neither in the micro-batch nor all in cached sources"
        )
    return ext_blocks


def _logit_rows(index: TreeIndex, tok: np.ndarray, pred_pack: np.ndarray, local: np.ndarray,
                remote_targets: Optional[np.ndarray]) -> Tuple[np.ndarray, np.ndarray]:
    """``(logit rows, their targets)`` sorted by target: owned tokens with an in-pack
    predecessor (``local``), plus remote targets."""
    t = len(tok)
    rows = [pred_pack[local]]
    targets = [tok[local]]
    if remote_targets is not None and len(remote_targets):
        remote_targets = np.asarray(remote_targets, dtype=np.int64)
        rp = np.searchsorted(tok, index.pred[remote_targets])
        if np.any(rp >= t) or np.any(tok[np.minimum(rp, t - 1)] != index.pred[remote_targets]):
            raise ValueError("a remote target's predecessor is not in the micro-batch")
        rows.append(rp)
        targets.append(remote_targets)
    logit_rows = np.concatenate(rows)
    logit_targets = np.concatenate(targets)
    order = np.argsort(logit_targets, kind="stable")
    return logit_rows[order], logit_targets[order]
