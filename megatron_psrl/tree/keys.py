"""What the prefix tree compares at every token: the token id, and with router replay the
routes of every MoE layer (samples share a prefix only where both agree). Its own module so
that the tree builder and the tree checks (``prefix_tree.check_tree``) both read it."""

from __future__ import annotations

import numpy as np

from megatron_psrl.data.samples import SampleBatch


def token_keys(batch: SampleBatch) -> np.ndarray:
    """``[N]`` what the tree compares at every token: the token ids (int32, the array itself)
    without routes; with ``routed_experts``, ``token id << 32 | route id`` (uint64), where equal
    route ids mean equal routes in every MoE layer (:func:`route_ids`). Key order is token
    order first, so siblings stay sorted by their first token."""
    if batch.routed_experts is None:
        return batch.tokens
    return (batch.tokens.astype(np.uint64) << np.uint64(32)) | route_ids(batch.routed_experts).astype(np.uint64)


def route_ids(routes: np.ndarray) -> np.ndarray:
    """int64 ``[N]``: dense ids of the rows of ``routes`` ``[N, L, k]``, equal iff the rows are.

    A 64-bit hash of each row's bytes (one vector pass per 8 bytes of a row), made exact by a
    check that every row equals the first row of its hash; a hash collision (never seen; about
    N^2 / 2^65) falls back to sorting the rows themselves."""
    n = routes.shape[0]
    rows = np.ascontiguousarray(routes.reshape(n, -1))
    raw = rows.view(np.uint8).reshape(n, -1)
    pad = (-raw.shape[1]) % 8
    if pad:
        raw = np.concatenate([raw, np.zeros((n, pad), dtype=np.uint8)], axis=1)
    words = np.ascontiguousarray(raw).view(np.uint64)  # [N, W]
    h = np.full(n, 0x9E3779B97F4A7C15, dtype=np.uint64)
    with np.errstate(over="ignore"):
        for w in range(words.shape[1]):  # FNV-style mixing, wrapping in uint64
            h = (h ^ words[:, w]) * np.uint64(0x100000001B3)
            h ^= h >> np.uint64(29)
    _, first, ids = np.unique(h, return_index=True, return_inverse=True)
    ids = ids.reshape(-1).astype(np.int64)
    for a in range(0, n, 1 << 16):  # chunks bound the [rows, W] comparison temporary
        b = min(n, a + (1 << 16))
        if not (words[a:b] == words[first[ids[a:b]]]).all():
            _, ids = np.unique(rows, axis=0, return_inverse=True)
            return ids.reshape(-1).astype(np.int64)
    return ids
