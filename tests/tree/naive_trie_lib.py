"""Test helpers for the prefix tree: a naive per-token trie, batch builders and hypothesis
strategies of random and adversarial batches. Imported by tests/tree/test_*.py (conftest.py
puts this directory on sys.path)."""

from __future__ import annotations

from collections import Counter
from typing import Dict, List, Sequence, Tuple

import numpy as np
import pytest
from hypothesis import strategies as st

from megatron_psrl.data.samples import SampleBatch
from megatron_psrl.schedule.cost import CostModel
from megatron_psrl.tree import build_prefix_tree, check_tree, node_level, node_num_children, tree_stats


# ---------------------------------------------------------------------- the naive trie
class NaiveTrie:
    """One node per distinct token path; children ordered by token; built sample by sample."""

    def __init__(self, samples: Sequence[Sequence[int]]) -> None:
        self.children: List[Dict[int, int]] = [{}]  # node 0 is the virtual root
        self.token: List[int] = [-1]
        self.parent: List[int] = [-1]
        self.depth: List[int] = [-1]
        self.passing: List[List[int]] = [[]]  # samples whose path contains the node
        self.ending: List[List[int]] = [[]]  # samples that end at the node
        self.sample_nodes: List[List[int]] = []
        for s, tokens in enumerate(samples):
            node, path = 0, []
            for p, tok in enumerate(tokens):
                nxt = self.children[node].get(tok)
                if nxt is None:
                    nxt = len(self.token)
                    self.children[node][tok] = nxt
                    self.children.append({})
                    self.token.append(tok)
                    self.parent.append(node)
                    self.depth.append(p)
                    self.passing.append([])
                    self.ending.append([])
                self.passing[nxt].append(s)
                node = nxt
                path.append(node)
            self.ending[node].append(s)
            self.sample_nodes.append(path)
        # Preorder (children by ascending token), without the virtual root.
        self.preorder: List[int] = []
        self.subtree_end: Dict[int, int] = {}  # node -> preorder index after its subtree
        stack: List[Tuple[int, bool]] = [(0, False)]
        while stack:
            node, done = stack.pop()
            if done:
                self.subtree_end[node] = len(self.preorder)
                continue
            if node:
                self.preorder.append(node)
            stack.append((node, True))
            for tok in sorted(self.children[node], reverse=True):
                stack.append((self.children[node][tok], False))
        self.rank = {node: i for i, node in enumerate(self.preorder)}

    def starts_compressed_node(self, node: int) -> bool:
        """A token starts a radix node after a branch, after a sample end, or at the top."""
        par = self.parent[node]
        return par == 0 or len(self.children[par]) > 1 or bool(self.ending[par])


def make_batch(samples, loss_masks=None, advantages=None) -> SampleBatch:
    lengths = [len(s) for s in samples]
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    tokens = np.asarray([t for s in samples for t in s], dtype=np.int64).astype(np.int32)
    if loss_masks is None:
        loss_masks = [[False] + [True] * (n - 1) for n in lengths]
    mask = np.asarray([m for ms in loss_masks for m in ms], dtype=bool)
    adv = None
    if advantages is not None:
        adv = np.asarray([a for ad in advantages for a in ad], dtype=np.float32)
    return SampleBatch(ids=list(range(len(samples))), offsets=offsets, tokens=tokens,
                       loss_mask=mask, advantages=adv)


def assert_matches_naive(batch: SampleBatch) -> None:
    """The full comparison of the tree with the naive trie."""
    tree = build_prefix_tree(batch)
    check_tree(tree)
    samples = [batch.sample_tokens(s).tolist() for s in range(batch.num_samples)]
    naive = NaiveTrie(samples)

    # Tree tokens are the naive nodes in preorder: same count, same tokens, same positions.
    assert tree.num_tree_tokens == len(naive.preorder)
    assert tree.tokens.tolist() == [naive.token[n] for n in naive.preorder]
    assert tree.token_position().tolist() == [naive.depth[n] for n in naive.preorder]

    # Every sample token maps to the tree token of its own naive node.
    expected_index = [naive.rank[n] for path in naive.sample_nodes for n in path]
    assert tree.sample_token_index.tolist() == expected_index
    for s, tokens in enumerate(samples):
        assert tree.sample_tokens(s).tolist() == tokens

    # Compressed nodes: where branches and sample ends split the naive paths.
    starts = [i for i, n in enumerate(naive.preorder) if naive.starts_compressed_node(n)]
    assert tree.node_offset[:-1].tolist() == starts
    start_nodes = [naive.preorder[i] for i in starts]
    node_of_start = {n: m for m, n in enumerate(start_nodes)}
    token_node = tree.token_node()

    def compressed(naive_node: int) -> int:
        return int(token_node[naive.rank[naive_node]])

    for m, n in enumerate(start_nodes):
        par = naive.parent[n]
        assert tree.node_parent[m] == (-1 if par == 0 else compressed(par))
        assert tree.node_depth[m] == naive.depth[n]
        assert tree.node_num_samples[m] == len(naive.passing[n])
        assert tree.node_offset[tree.node_subtree_end[m]] == naive.subtree_end[n]
        assert node_of_start[n] == m
    for s, path in enumerate(naive.sample_nodes):
        assert tree.sample_node[s] == compressed(path[-1])
        assert tree.sample_path(s).tolist() == sorted({compressed(n) for n in path})

    # Claims: the multiset of (naive node, sample, flat index, advantage) is preserved, and
    # the order is (tree token, sample).
    flat_of = np.concatenate([[0], np.cumsum([len(s) for s in samples])])
    naive_claims = Counter()
    for s, path in enumerate(naive.sample_nodes):
        for p, n in enumerate(path):
            f = int(flat_of[s] + p)
            if batch.loss_mask[f]:
                adv = None if batch.advantages is None else float(batch.advantages[f])
                naive_claims[(naive.rank[n], s, f, adv)] += 1
    tree_claims = Counter()
    for t, s, f in zip(tree.claim_token.tolist(), tree.claim_sample.tolist(),
                       tree.claim_flat.tolist()):
        adv = None if batch.advantages is None else float(batch.advantages[f])
        tree_claims[(t, s, f, adv)] += 1
    assert tree_claims == naive_claims
    keys = list(zip(tree.claim_token.tolist(), tree.claim_sample.tolist()))
    assert keys == sorted(keys)
    for t in range(tree.num_tree_tokens):
        lo, hi = tree.claim_offsets[t], tree.claim_offsets[t + 1]
        assert (tree.claim_token[lo:hi] == t).all()

    # Statistics from the naive trie.
    stats = tree_stats(tree, CostModel.named("tiny"))
    children = node_num_children(tree)
    assert stats.tokens_in_tree == len(naive.preorder)
    assert stats.tokens_total == sum(len(s) for s in samples)
    assert stats.num_nodes == len(start_nodes)
    assert stats.num_claims == sum(naive_claims.values())
    assert stats.attention_pairs_unshared == sum(len(s) * (len(s) + 1) // 2 for s in samples)
    assert stats.attention_pairs_shared == sum(naive.depth[n] + 1 for n in naive.preorder)
    assert stats.num_top_level_nodes == len(naive.children[0])
    naive_children = [
        len({compressed(c) for c in naive.children[_last_of_node(naive, n, start_nodes)].values()})
        for n in start_nodes
    ]
    assert children.tolist() == naive_children
    assert stats.max_branching == max(naive_children, default=0)
    levels = [sum(1 for a in _ancestors(naive, n) if a in node_of_start) for n in start_nodes]
    assert node_level(tree).tolist() == levels
    assert stats.max_node_depth == max((naive.depth[n] for n in start_nodes), default=0)
    model = CostModel.named("tiny")
    # logits: one row per claim without sharing; one per claimed tree token with it
    unshared = model.cost(stats.tokens_total, stats.attention_pairs_unshared, sum(naive_claims.values()))
    shared = model.cost(stats.tokens_in_tree, stats.attention_pairs_shared,
                        len({token for token, *_ in naive_claims}))
    assert stats.ideal_speedup == pytest.approx(unshared / shared)


def _ancestors(naive: NaiveTrie, node: int):
    node = naive.parent[node]
    while node > 0:
        yield node
        node = naive.parent[node]


def _last_of_node(naive: NaiveTrie, start: int, start_nodes) -> int:
    """Last naive node of the compressed node starting at ``start``."""
    starts = set(start_nodes)
    node = start
    while len(naive.children[node]) == 1 and not naive.ending[node]:
        (child,) = naive.children[node].values()
        if child in starts:
            break
        node = child
    return node


# ---------------------------------------------------------------------- strategies
# Token values chosen so that byte-order mistakes show: they differ in low and high bytes.
WIDE_TOKENS = [0, 1, 255, 256, 65535, 65536, 2**24, 2**31 - 1]


@st.composite
def batches(draw, max_samples: int = 10, max_len: int = 12, adversarial: bool = False):
    vocab = draw(st.sampled_from([2, 3, 5, 1000, None]))  # None: the wide token set
    token = st.sampled_from(WIDE_TOKENS) if vocab is None else st.integers(0, vocab - 1)
    samples = draw(st.lists(st.lists(token, min_size=1, max_size=max_len),
                            min_size=1, max_size=max_samples))
    if adversarial:
        # Grow the batch from its own samples: duplicates, prefixes, extensions, and siblings
        # that differ in exactly one token.
        for _ in range(draw(st.integers(1, 8))):
            base = samples[draw(st.integers(0, len(samples) - 1))]
            kind = draw(st.sampled_from(["dup", "prefix", "extend", "sibling"]))
            if kind == "dup":
                samples.append(list(base))
            elif kind == "prefix":
                samples.append(base[: draw(st.integers(1, len(base)))])
            elif kind == "extend":
                samples.append(base + draw(st.lists(token, min_size=1, max_size=4)))
            else:
                pos = draw(st.integers(0, len(base) - 1))
                new = draw(token.filter(lambda t, old=base[pos]: t != old))
                samples.append(base[:pos] + [new] + base[pos + 1:])
        order = draw(st.permutations(range(len(samples))))
        samples = [samples[i] for i in order]
    masks = []
    for s in samples:
        mode = draw(st.sampled_from(["random", "empty", "all"]))
        if mode == "empty":
            masks.append([False] * len(s))
        elif mode == "all":
            masks.append([False] + [True] * (len(s) - 1))
        else:
            masks.append([False] + draw(st.lists(st.booleans(), min_size=len(s) - 1,
                                                 max_size=len(s) - 1)))
    advantages = [
        [draw(st.floats(-3, 3, width=32))] * len(s) if draw(st.booleans())
        else draw(st.lists(st.floats(-3, 3, width=32), min_size=len(s), max_size=len(s)))
        for s in samples
    ]
    return make_batch(samples, masks, advantages)
