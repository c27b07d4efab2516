"""Construction of the global prefix tree (:class:`PrefixTree`) of an update batch.

The algorithm (docs/prefix-tree.md has the derivation):

1. Sort the samples lexicographically by token ids (Python's sort on ``bytes`` keys of
   big-endian uint32 tokens: byte order equals token order, and a prefix sorts before its
   extensions). Equal samples keep their input order. With router replay (samples carrying
   ``routed_experts``) a position's key is ``(token id, route id)`` (:func:`token_keys`), so
   samples share a prefix only where their tokens *and* their routes agree.
2. Longest common prefix (LCP) of every pair of neighbours in that order, with numpy.
3. One stack pass over the sorted samples builds the radix tree: the stack is the path of the
   previous sample; sample ``i`` pops the nodes deeper than ``lcp[i]``, splits the node that
   straddles ``lcp[i]``, and pushes one new node for its own tokens ``[lcp[i], len)``. Every
   node is created by the first sample (in sorted order) through it, and the samples through
   a node form a contiguous range of sorted ranks ``[first, last]``.
4. Preorder with children in ascending first-token order is exactly the order of nodes by
   (creator rank, depth), because lexicographic order of the samples is a depth-first walk.
   All per-node, per-token and per-claim arrays then follow with numpy (repeat/cumsum/
   searchsorted); there is no Python loop over tokens, only over samples (steps 1 and 3).
"""

from __future__ import annotations

import numpy as np

from megatron_psrl.data.samples import SampleBatch
from megatron_psrl.tree.keys import token_keys
from megatron_psrl.tree.prefix_tree import PrefixTree

LCP_CHUNK_TOKENS = 1 << 20
"""Neighbour comparisons are done in chunks of about this many token pairs, which bounds the
temporary index arrays of step 2 (memory) and keeps them in cache (speed)."""

GALLOP_FIRST_WINDOW = 16
"""Tokens compared per neighbour pair in the first galloping round (doubling afterwards)."""


def build_prefix_tree(batch: SampleBatch) -> PrefixTree:
    """The global prefix tree over all samples of ``batch`` (every field as documented in
    :class:`PrefixTree`). Duplicates, samples that are prefixes of others, samples that share
    nothing and empty loss masks are all ordinary input."""
    num_samples = batch.num_samples
    lengths = batch.lengths
    if num_samples == 0:
        return _empty_tree(batch)
    if lengths.min() < 1:
        bad = int(np.argmin(lengths))
        raise ValueError(f"{batch.describe_sample(bad)}: a sample needs at least one token")
    if batch.tokens.size and batch.tokens.min() < 0:
        raise ValueError("token ids must be non-negative to define the child order")

    keys = token_keys(batch)  # the tokens themselves without routes
    order = _sort_samples(batch, keys)
    sorted_lengths = lengths[order]
    lcp = _neighbour_lcp(batch, order, sorted_lengths, keys)
    rec_start, rec_end, rec_first, rec_last, rec_parent, end_record = _radix_records(
        lcp, sorted_lengths
    )

    # ---- nodes in preorder = records ordered by (creator rank, start depth)
    preorder = np.lexsort((rec_start, rec_first))
    num_nodes = preorder.shape[0]
    node_of_record = np.empty(num_nodes, dtype=np.int64)
    node_of_record[preorder] = np.arange(num_nodes)
    node_depth = rec_start[preorder]
    node_len = rec_end[preorder] - node_depth
    node_first = rec_first[preorder]
    node_last = rec_last[preorder]
    parent_record = rec_parent[preorder]
    node_parent = np.where(parent_record >= 0, node_of_record[np.maximum(parent_record, 0)], -1)
    node_offset = np.zeros(num_nodes + 1, dtype=np.int64)
    np.cumsum(node_len, out=node_offset[1:])
    node_num_samples = node_last - node_first + 1
    # The subtree of m holds exactly the nodes created by ranks first[m]..last[m] (at depth
    # > depth[m]); in preorder they run up to the first node created after rank last[m].
    node_subtree_end = np.searchsorted(node_first, node_last, side="right").astype(np.int64)

    sample_node = np.empty(num_samples, dtype=np.int32)
    sample_node[order] = node_of_record[end_record]

    offsets = batch.offsets
    num_tree_tokens = int(node_offset[-1])

    # ---- tree tokens: each node's tokens are read from its creator sample
    node_src = offsets[order[node_first]] + node_depth
    tree_tokens = batch.tokens[_concat_ranges(node_src, node_len, num_tree_tokens)]

    sample_token_index = _sample_token_index(
        offsets, order, node_first, node_num_samples, node_depth, node_len, node_offset,
        batch.num_tokens,
    )
    claim_token, claim_sample, claim_flat, claim_offsets = _claims(
        batch, sample_token_index, num_tree_tokens
    )

    return PrefixTree(
        batch=batch,
        tokens=tree_tokens,
        node_offset=node_offset,
        node_parent=node_parent.astype(np.int32),
        node_depth=node_depth.astype(np.int64),
        node_subtree_end=node_subtree_end,
        node_num_samples=node_num_samples.astype(np.int64),
        sample_node=sample_node,
        sample_token_index=sample_token_index,
        claim_token=claim_token,
        claim_sample=claim_sample,
        claim_flat=claim_flat,
        claim_offsets=claim_offsets,
    )


# ---------------------------------------------------------------------- steps 1-3
def _sort_samples(batch: SampleBatch, keys: np.ndarray) -> np.ndarray:
    """Sample indices in lexicographic order of their token keys (stable for duplicates)."""
    width = keys.dtype.itemsize  # 4 (token ids) or 8 (tokens with routes)
    data = memoryview(keys.astype(">u4" if width == 4 else ">u8")).cast("B")
    byte_offsets = (batch.offsets * width).tolist()
    keys = [data[a:b].tobytes() for a, b in zip(byte_offsets[:-1], byte_offsets[1:])]
    order = sorted(range(len(keys)), key=keys.__getitem__)
    return np.asarray(order, dtype=np.int64)


def _neighbour_lcp(batch: SampleBatch, order: np.ndarray, sorted_lengths: np.ndarray,
                   keys: np.ndarray) -> np.ndarray:
    """int64 ``[S]``: ``lcp[i]`` = longest common prefix of sorted samples i-1 and i
    (``lcp[0] = 0``).

    Pairs are processed in chunks of about :data:`LCP_CHUNK_TOKENS` comparable tokens. Inside
    a chunk the comparison gallops: every still-matching pair compares a window of tokens that
    doubles each round, so a pair costs O(its LCP) (plus one small window), not O(its length):
    neighbours from different prompts stop after the first window.
    """
    num_samples = order.shape[0]
    lcp = np.zeros(num_samples, dtype=np.int64)
    if num_samples < 2:
        return lcp
    starts = batch.offsets[order]
    left_all, right_all = starts[:-1], starts[1:]
    compare_len_all = np.minimum(sorted_lengths[:-1], sorted_lengths[1:])
    ends = np.cumsum(compare_len_all)
    tokens = keys
    pair = 0
    while pair < num_samples - 1:
        base = ends[pair - 1] if pair else 0
        stop = max(int(np.searchsorted(ends, base + LCP_CHUNK_TOKENS, side="right")), pair + 1)
        lcp[pair + 1 : stop + 1] = _gallop_lcp(
            tokens, left_all[pair:stop], right_all[pair:stop], compare_len_all[pair:stop]
        )
        pair = stop
    return lcp


def _gallop_lcp(tokens, left, right, compare_len) -> np.ndarray:
    """LCP of ``tokens[left[k]:]`` and ``tokens[right[k]:]`` capped at ``compare_len[k]``."""
    lcp = np.zeros(left.shape[0], dtype=np.int64)
    active = np.flatnonzero(compare_len > 0)
    window = GALLOP_FIRST_WINDOW
    while active.size:
        pos = lcp[active]
        lens = np.minimum(compare_len[active] - pos, window)
        cum = np.zeros(active.shape[0] + 1, dtype=np.int64)
        np.cumsum(lens, out=cum[1:])
        within = np.arange(cum[-1], dtype=np.int64) - np.repeat(cum[:-1] - pos, lens)
        differ = tokens[np.repeat(left[active], lens) + within] != tokens[
            np.repeat(right[active], lens) + within
        ]
        new_lcp = pos + lens  # pairs without a mismatch in the window match all of it
        mismatch = np.flatnonzero(differ)
        if mismatch.size:
            owner = np.searchsorted(cum, mismatch, side="right") - 1
            first = np.flatnonzero(np.r_[True, owner[1:] != owner[:-1]])
            new_lcp[owner[first]] = within[mismatch[first]]
        lcp[active] = new_lcp
        # Still matching and not yet at the end of the shorter sample: next, wider window.
        keep = (new_lcp == pos + lens) & (new_lcp < compare_len[active])
        active = active[keep]
        window *= 2
    return lcp


def _radix_records(lcp: np.ndarray, sorted_lengths: np.ndarray):
    """The stack pass (step 3). Returns per-record numpy arrays (records are nodes in creation
    order) ``start, end, first, last, parent`` and, per sorted rank, the record it ends in.

    A split keeps the record identity on the deeper half (the tail), so the samples that end
    in a split node keep pointing at the right record and its children stay attached; the new
    record is the head, which takes the tail's place on the stack.
    """
    start, end, first, last, parent = [], [], [], [], []
    stack = []
    end_record = []
    lengths = sorted_lengths.tolist()
    for rank, shared in enumerate(lcp.tolist()):
        while stack and start[stack[-1]] >= shared:
            last[stack.pop()] = rank - 1
        if stack:
            top = stack[-1]
            if end[top] > shared:  # the previous path continues past the divergence: split
                head = len(start)
                start.append(start[top])
                end.append(shared)
                first.append(first[top])
                last.append(-1)
                parent.append(parent[top])
                start[top] = shared
                parent[top] = head
                last[top] = rank - 1
                stack[-1] = head
                top = head
        else:
            top = -1
        if lengths[rank] > shared:
            record = len(start)
            start.append(shared)
            end.append(lengths[rank])
            first.append(rank)
            last.append(-1)
            parent.append(top)
            stack.append(record)
            end_record.append(record)
        else:  # an exact duplicate of the previous sample ends where it ends
            end_record.append(stack[-1])
    final_rank = len(lengths) - 1
    for record in stack:
        last[record] = final_rank
    as_array = lambda values: np.asarray(values, dtype=np.int64)  # noqa: E731
    return (as_array(start), as_array(end), as_array(first), as_array(last), as_array(parent),
            as_array(end_record))


# ---------------------------------------------------------------------- per-token arrays
def _concat_ranges(starts: np.ndarray, lengths: np.ndarray, total: int) -> np.ndarray:
    """int64: ``concatenate([arange(a, a + n) for a, n in zip(starts, lengths)])`` for
    lengths >= 1, built in one buffer: ones, a jump at every run start, in-place cumsum."""
    out = np.ones(total, dtype=np.int64)
    if total == 0:
        return out
    run_start = np.zeros(lengths.shape[0], dtype=np.int64)
    np.cumsum(lengths[:-1], out=run_start[1:])
    jumps = np.empty(lengths.shape[0], dtype=np.int64)
    jumps[0] = starts[0]
    jumps[1:] = starts[1:] - (starts[:-1] + lengths[:-1] - 1)
    out[run_start] = jumps
    np.cumsum(out, out=out)
    return out


def _sample_token_index(
    offsets, order, node_first, node_num_samples, node_depth, node_len, node_offset, num_tokens
) -> np.ndarray:
    """int64 ``[N]``: tree token of every batch token.

    Every (node, sample through it) pair covers ``node_len`` consecutive batch tokens that map
    to the node's consecutive tree tokens. Sorting the pairs by where they start in the batch
    tiles ``[0, N)`` in order, so one ``np.repeat`` produces the whole map. There are
    sum(path lengths) pairs, typically far fewer than tokens.
    """
    num_nodes = node_first.shape[0]
    pair_base = np.zeros(num_nodes + 1, dtype=np.int64)
    np.cumsum(node_num_samples, out=pair_base[1:])
    num_pairs = int(pair_base[-1])
    pair_node = np.repeat(np.arange(num_nodes, dtype=np.int64), node_num_samples)
    pair_rank = np.repeat(node_first - pair_base[:-1], node_num_samples) + np.arange(num_pairs)
    pair_dst = offsets[order[pair_rank]] + node_depth[pair_node]
    pair_node = pair_node[np.argsort(pair_dst)]
    return _concat_ranges(node_offset[pair_node], node_len[pair_node], num_tokens)


def _claims(batch: SampleBatch, sample_token_index: np.ndarray, num_tree_tokens: int):
    """Claim arrays sorted by (tree token, sample) and their CSR offsets.

    Claims are found in batch order (sample-major). A tree token claimed once needs no sort:
    its claim goes to slot ``claim_offsets[token]``. Only tokens claimed by several samples
    (shared actions of tree rollouts, duplicates) are sorted, by the unique key
    ``token * S + sample``; they fill the remaining slots in order.
    """
    num_samples = batch.num_samples
    flat = np.flatnonzero(batch.loss_mask)
    per_sample = np.add.reduceat(batch.loss_mask, batch.offsets[:-1], dtype=np.int64)
    sample = np.repeat(np.arange(num_samples, dtype=np.int32), per_sample)
    token = sample_token_index[flat]
    counts = np.bincount(token, minlength=num_tree_tokens)
    claim_offsets = np.zeros(num_tree_tokens + 1, dtype=np.int64)
    np.cumsum(counts, out=claim_offsets[1:])

    num_claims = flat.shape[0]
    claim_flat = np.empty(num_claims, dtype=np.int64)
    claim_sample = np.empty(num_claims, dtype=np.int32)
    if num_claims == 0 or counts.max() <= 1:
        # Every claimed token has one claim (GRPO, step-wise): a pure scatter.
        slots = claim_offsets[token]
        claim_flat[slots] = flat
        claim_sample[slots] = sample
        claim_token = np.flatnonzero(counts).astype(np.int64)
        return claim_token, claim_sample, claim_flat, claim_offsets

    shared = counts[token] > 1
    single = np.flatnonzero(~shared)
    slots = claim_offsets[token[single]]
    claim_flat[slots] = flat[single]
    claim_sample[slots] = sample[single]
    which = np.flatnonzero(shared)
    which = which[np.argsort(token[which] * num_samples + sample[which])]
    shared_slots = np.flatnonzero(np.repeat(counts > 1, counts))
    claim_flat[shared_slots] = flat[which]
    claim_sample[shared_slots] = sample[which]
    claim_token = np.repeat(np.arange(num_tree_tokens, dtype=np.int64), counts)
    return claim_token, claim_sample, claim_flat, claim_offsets


def _empty_tree(batch: SampleBatch) -> PrefixTree:
    i64 = lambda: np.zeros(0, dtype=np.int64)  # noqa: E731
    return PrefixTree(
        batch=batch,
        tokens=np.zeros(0, dtype=np.int32),
        node_offset=np.zeros(1, dtype=np.int64),
        node_parent=np.zeros(0, dtype=np.int32),
        node_depth=i64(),
        node_subtree_end=i64(),
        node_num_samples=i64(),
        sample_node=np.zeros(0, dtype=np.int32),
        sample_token_index=i64(),
        claim_token=i64(),
        claim_sample=np.zeros(0, dtype=np.int32),
        claim_flat=i64(),
        claim_offsets=np.zeros(1, dtype=np.int64),
    )
