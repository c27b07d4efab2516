"""The invariants of a step plan (:func:`check_plan`):

- every tree token is owned (computed as a trained row) exactly once over all ranks, and every
  log-prob target (a token with a predecessor), so every loss claim, is computed exactly once;
- every micro-batch fits the token budget and sees exactly its ancestors: in the micro-batch,
  in the cached sources it reads, or in the peer chains of its exchange step;
- every cached source is computed (or received) by its producer before any reader runs forward,
  and every reader's backward runs before the producer's (the readers' dK/dV are accumulated
  in the KV cache and injected into the producer's backward);
- every rank's schedule runs each micro-batch's forward and backward exactly once, forwards in
  micro-batch order;
- inside a cross-rank group every rank runs the same schedule, and every exchange matches on
  both sides: what one rank sends the other receives (same chains, same lengths, put to the
  use the receiver's plan names), and replica gradients go back to the source they copy;
- a prefix head sent between ranks (:class:`HeadSend`, a tree split between exchange
  groups) is computed once, by its home rank, into one exported source; every source imported
  from it lies inside the head of the copy that reads it, and on every rank the forwards of
  exported heads come before any import, the backwards of imports before any exported head's
  (so no rank waits for another that waits for it).

Whether the KV cache holds the plan is the memory plan's business: ``plan_memory`` raises
:class:`~megatron_psrl.kvcache.CacheBudgetError` when no decision fits ``--kv-cache-budget``.

The planners check every plan they make when the environment variable ``PSRL_CHECK_PLANS``
is ``1`` (the test suite sets it): :func:`maybe_check_plan`.
"""

from __future__ import annotations

import os
from typing import Dict, List

import numpy as np

from megatron_psrl.kvcache.prefix_state import GRADS
from megatron_psrl.schedule.plan import PlanInvariantError, RankPlan, StepPlan
from megatron_psrl.tree.index import TreeIndex

# ---------------------------------------------------------------------- invariants
CHECK_PLANS_ENV = "PSRL_CHECK_PLANS"
"""Environment variable: ``1`` makes the planners check every plan they make (:func:`check_plan`)."""

FORWARD_OPS = ("forward", "forward_backward")
BACKWARD_OPS = ("backward", "forward_backward")


def plan_checks_enabled() -> bool:
    """Whether the planners check their plans (``PSRL_CHECK_PLANS=1``, read at every call)."""
    return os.environ.get(CHECK_PLANS_ENV) == "1"


def maybe_check_plan(plan: StepPlan) -> StepPlan:
    """:func:`check_plan` when :func:`plan_checks_enabled`; returns the plan."""
    if plan_checks_enabled() and plan.planned_groups is None:
        check_plan(plan)
    return plan


def check_plan(plan: StepPlan) -> None:
    """Verify the plan's invariants (the module docstring lists them); vectorised per micro-batch.

    Raises :class:`PlanInvariantError` naming the first invariant broken, with the rank,
    micro-batch, source or tree token concerned."""
    index = plan.index
    budget = int(plan.config.micro_batch_tokens)
    num_ranks = int(plan.config.data_parallel_size)
    _require(index.tree is plan.tree, "the plan's token index is not over the plan's tree")
    _require(len(plan.ranks) == num_ranks, f"{len(plan.ranks)} rank plans for {num_ranks} data-parallel ranks")
    grouped = sorted(r for group in plan.groups for r in group)
    _require(grouped == list(range(num_ranks)), f"the groups {plan.groups} do not partition the {num_ranks} ranks")
    owned: List[np.ndarray] = []
    targets: List[np.ndarray] = []
    for r, rank_plan in enumerate(plan.ranks):
        _check_rank(index, rank_plan, budget, f"rank {r}", owned, targets)
    for group in plan.groups:
        _check_group(plan, group)
    _check_transfers(plan)
    _check_coverage(plan, owned, targets)


def _require(ok, message: str) -> None:
    if not ok:
        raise PlanInvariantError(message)


def _contains(sorted_tokens: np.ndarray, values: np.ndarray) -> np.ndarray:
    """bool per value: it is in ``sorted_tokens`` (ascending, not empty); faster than ``np.isin``."""
    pos = np.minimum(np.searchsorted(sorted_tokens, values), len(sorted_tokens) - 1)
    return sorted_tokens[pos] == values


def _in_pack_predecessor(index: TreeIndex, tokens: np.ndarray) -> np.ndarray:
    """bool per token of a sorted token set: its predecessor is in the set."""
    pred = index.pred[tokens]
    return (pred >= 0) & _contains(tokens, pred)


def _check_rank(index: TreeIndex, rank_plan: RankPlan, budget: int, where: str,
                owned: List[np.ndarray], targets: List[np.ndarray]) -> None:
    """One rank: micro-batches, sources, schedule order, the keys every micro-batch sees.
    Appends every micro-batch's owned tokens and log-prob targets to ``owned`` / ``targets``."""
    mbs, sources = rank_plan.micro_batches, rank_plan.sources
    n, num_tokens = len(mbs), index.tree.num_tree_tokens
    for i, mb in enumerate(mbs):
        at = f"{where} micro-batch {i}"
        tok = mb.tokens
        _require(mb.index == i, f"{at} has index {mb.index}")
        if not mb.computes:
            _check_transfer_micro_batch(rank_plan, i, at, num_tokens)
            continue
        _require(tok.ndim == 1 and 0 < len(tok) <= budget,
                 f"{at} holds {len(tok)} tokens (the budget is 1 to {budget})")
        _require(tok[0] >= 0 and tok[-1] < num_tokens, f"{at} holds tokens outside the tree's {num_tokens}")
        _require(bool((np.diff(tok) > 0).all()), f"{at}: its tokens are not strictly ascending (sorted, no repeats)")
        _require(mb.owned.shape == tok.shape and mb.owned.dtype == bool,
                 f"{at}: owned is not a bool mask of its tokens")
        present = _in_pack_predecessor(index, tok)
        remote = mb.remote_targets
        if len(remote):
            pred = index.pred[remote]
            bad = np.flatnonzero((pred < 0) | ~_contains(tok, pred))
            if len(bad):
                raise PlanInvariantError(f"{at}: the predecessor of its remote target {int(remote[bad[0]])} is not "
                                         "in the micro-batch")
            _require(not _contains(tok, remote).any(), f"{at}: a remote target is in the micro-batch itself")
        owned.append(tok[mb.owned])
        targets.append(tok[mb.owned & present])
        targets.append(remote)
        _require(len(set(mb.reads)) == len(mb.reads) and len(set(mb.produces)) == len(mb.produces),
                 f"{at} lists a source twice (reads {mb.reads}, produces {mb.produces})")
        for s in mb.reads:
            _require(s in sources and i in sources[s].consumers,
                     f"{at} reads source {s}, which does not list it as a consumer")
        for s in mb.produces:
            _require(s in sources and sources[s].producer == i, f"{at} produces source {s}, whose producer is another")
        lasts = [sources[s].last_token for s in mb.reads]
        _require(all(a < b for a, b in zip(lasts, lasts[1:])), f"{at} reads its sources {mb.reads} not outermost first")
    for s, src in sources.items():
        at = f"{where} source {s}"
        _require(src.source_id == s, f"{at} has id {src.source_id}")
        _require(0 <= src.producer < n and s in mbs[src.producer].produces,
                 f"{at}: its producer micro-batch {src.producer} does not list it")
        chain = src.tokens
        _require(len(chain) > 0 and bool((index.pred[chain[1:]] == chain[:-1]).all()),
                 f"{at} is not a chain (every token the successor of the one before)")
        if src.replica_of is None:
            _require(bool(_contains(mbs[src.producer].tokens, chain).all()),
                     f"{at}: its producer micro-batch {src.producer} does not compute its tokens")
        _require((src.imported is not None) == (mbs[src.producer].role == "import"),
                 f"{at}: imported {src.imported}, but its producer micro-batch {src.producer} has role "
                 f"{mbs[src.producer].role!r}")
        if src.exported is not None:
            _require(not src.consumers and src.replica_of is None and src.imported is None,
                     f"{at} is an exported head, read on this rank (or a copy)")
        for c in src.consumers:
            _require(0 <= c < n and s in mbs[c].reads, f"{at}: its consumer {c} does not read it")
    _check_schedule(rank_plan, where)
    for i, mb in enumerate(mbs):
        if mb.computes:
            _check_keys(index, rank_plan, i, f"{where} micro-batch {i}")


def _check_transfer_micro_batch(rank_plan: RankPlan, i: int, at: str, num_tokens: int) -> None:
    """An ``import`` micro-batch receives (owns nothing, reads nothing, computes no log-prob);
    an ``idle`` one is empty."""
    mb = rank_plan.micro_batches[i]
    _require(mb.role in ("import", "idle"), f"{at} has the role {mb.role!r}")
    _require(not mb.reads and not mb.peer_reads and mb.exchange is None and not len(mb.remote_targets),
             f"{at} ({mb.role}) reads, exchanges or computes log-probs")
    _require(not mb.owned.any() and mb.owned.shape == mb.tokens.shape, f"{at} ({mb.role}) owns tokens")
    if mb.role == "idle":
        _require(not len(mb.tokens) and not mb.produces, f"{at} is idle but holds tokens or produces sources")
        return
    tok = mb.tokens
    _require(len(tok) > 0 and bool((np.diff(tok) > 0).all()) and tok[0] >= 0 and tok[-1] < num_tokens,
             f"{at}: its imported tokens are not ascending tree tokens")
    _require(bool(mb.produces), f"{at} imports but produces no source")
    for s in mb.produces:
        src = rank_plan.sources.get(s)
        _require(src is not None and src.imported is not None and bool(_contains(tok, src.tokens).all()),
                 f"{at} produces source {s}, which is not imported into its tokens")


def _check_schedule(rank_plan: RankPlan, where: str) -> None:
    """Each micro-batch forward once and backward once (or ``forward_backward``), forwards in
    order; a source's readers run forward after its producer, and backward before it."""
    n = len(rank_plan.micro_batches)
    fwd: Dict[int, int] = {}
    bwd: Dict[int, int] = {}
    for t, step in enumerate(rank_plan.schedule):
        op, i = step
        _require(op in FORWARD_OPS + BACKWARD_OPS and 0 <= i < n, f"{where}: schedule step {t} is {step!r}")
        if op in FORWARD_OPS:
            _require(i not in fwd, f"{where}: micro-batch {i} runs forward twice (schedule steps {fwd.get(i)}, {t})")
            fwd[i] = t
        if op in BACKWARD_OPS:
            _require(i not in bwd, f"{where}: micro-batch {i} runs backward twice (schedule steps {bwd.get(i)}, {t})")
            _require(i in fwd, f"{where}: micro-batch {i} runs backward (schedule step {t}) before its forward")
            bwd[i] = t
    missing = sorted(set(range(n)) - set(fwd))
    _require(not missing, f"{where}: micro-batches {missing} never run forward")
    missing = sorted(set(range(n)) - set(bwd))
    _require(not missing, f"{where}: micro-batches {missing} never run backward")
    for s, src in rank_plan.sources.items():
        p = src.producer
        for c in src.consumers:
            _require(c > p and fwd[c] > fwd[p],
                     f"{where}: micro-batch {c} reads source {s} (forward at schedule step {fwd[c]}) before its "
                     f"producer micro-batch {p} runs forward (schedule step {fwd[p]})")
            _require(bwd[c] < bwd[p],
                     f"{where}: the backward of micro-batch {p} (schedule step {bwd[p]}) runs before that of "
                     f"micro-batch {c} (schedule step {bwd[c]}), which reads its source {s}: the reader's dK/dV "
                     "would miss the producer's backward")
    order = [i for i, _ in sorted(fwd.items(), key=lambda kv: kv[1])]
    _require(order == list(range(n)),
             f"{where}: the schedule runs forwards in the order {order}, not micro-batch order")


def _check_keys(index: TreeIndex, rank_plan: RankPlan, i: int, at: str) -> None:
    """Every token whose predecessor is not in the micro-batch (a root segment's first token)
    sees exactly its ancestors in the chains it reads (cached sources, then peer chains): the
    chains visible to it cover positions ``0 .. position - 1`` once each."""
    mb = rank_plan.micro_batches[i]
    tok = mb.tokens
    pred = index.pred[tok]
    dangling = tok[(pred >= 0) & ~_in_pack_predecessor(index, tok)]
    if not len(dangling):
        return
    chains = [(rank_plan.sources[s].length, rank_plan.sources[s].last_token) for s in mb.reads]
    chains += [(p.length, p.last_token) for p in mb.peer_reads]
    _require(bool(chains), f"{at}: tree token {int(dangling[0])} (position {int(index.position[dangling[0]])}) has "
                           "no predecessor in the micro-batch and it reads no chains")
    length = np.array([c[0] for c in chains], dtype=np.int64)
    last = np.array([c[1] for c in chains], dtype=np.int64)
    hi = index.position[last]  # positions a chain covers: hi - length + 1 .. hi
    lo = hi - length + 1
    visible = (dangling[None, :] > last[:, None]) & (dangling[None, :] < index.subtree_end[last][:, None])
    position = index.position[dangling]
    seen = (visible * length[:, None]).sum(axis=0)
    bad = np.flatnonzero(seen != position)
    if len(bad):
        x = int(dangling[bad[0]])
        raise PlanInvariantError(f"{at}: tree token {x} (position {int(position[bad[0]])}) sees {int(seen[bad[0]])} "
                                 "ancestor keys in the chains it reads: its predecessors are neither in the "
                                 "micro-batch nor all in its cached sources and peer chains")
    for d in np.flatnonzero(visible.sum(axis=0) > 1):  # several chains: no position covered twice
        rows = np.flatnonzero(visible[:, d])
        rows = rows[np.argsort(hi[rows])]
        _require(bool((lo[rows][1:] > hi[rows][:-1]).all()),
                 f"{at}: tree token {int(dangling[d])} sees overlapping chains (the same ancestor twice)")


def _check_group(plan: StepPlan, group: List[int]) -> None:
    """A whole-tree rank exchanges nothing; a cross-rank group runs one schedule in lockstep and
    every send has its receive (and every replica's gradients go back to their owner)."""
    ranks = [plan.ranks[r] for r in group]
    if len(group) == 1:
        _check_alone(ranks[0], f"rank {group[0]}")
        return
    names = [f"rank {r}" for r in group]
    steps = len(ranks[0].micro_batches)
    for q, rp in enumerate(ranks):
        _require(rp.cross_rank and rp.group_rank == q,
                 f"{names[q]} is not group rank {q} of the cross-rank group {group}")
        _require(len(rp.micro_batches) == steps and rp.schedule == ranks[0].schedule,
                 f"{names[q]} does not run the same steps and schedule as {names[0]} (the group runs in lockstep)")
    for m in range(steps):
        _check_step_exchange(ranks, names, group, m)
    for r, rp in enumerate(ranks):
        for s, src in rp.sources.items():
            if src.replica_of is not None:
                _check_replica(ranks, r, s, src, f"{names[r]} replica {s}")


def _check_alone(rank_plan: RankPlan, where: str) -> None:
    """A rank planning alone exchanges nothing and holds no replica."""
    _require(not rank_plan.cross_rank, f"{where} is part of a cross-rank plan but alone in its group")
    for i, mb in enumerate(rank_plan.micro_batches):
        _require(mb.exchange is None and not mb.peer_reads,
                 f"{where} micro-batch {i} exchanges with other ranks, but the rank plans alone")
    replicas = [s for s, src in rank_plan.sources.items() if src.replica_of is not None]
    _require(not replicas, f"{where} holds replicas {replicas} of other ranks' sources, but plans alone")


def _check_step_exchange(ranks: List[RankPlan], names: List[str], group: List[int], m: int) -> None:
    """Step ``m`` of a cross-rank group: every rank takes part in the step's collectives, and
    every pair's sends, receives and returned gradients match."""
    g = len(ranks)
    mbs = [rp.micro_batches[m] for rp in ranks]
    ex = [mb.exchange for mb in mbs]
    forward = any(e is not None and any(e.send.values()) for e in ex)
    backward = any(e is not None and any(e.grad_send.values()) for e in ex)
    for q in range(g):
        at = f"{names[q]} step {m}"
        e = ex[q]
        if e is None:
            _require(not forward and not backward,
                     f"{at} takes no part in the step's exchange, which other ranks of {group} run")
            continue
        _require((e.forward_collective, e.backward_collective) == (forward, backward),
                 f"{at}: its exchange says forward/backward collective {e.forward_collective}/"
                 f"{e.backward_collective}, the group's exchanges say {forward}/{backward}")
        for table in (e.send, e.recv, e.grad_send, e.grad_recv):
            _require(all(0 <= k < g and k != q for k in table), f"{at} exchanges with ranks {sorted(table)}")
    used_peers: List[List[int]] = [[] for _ in range(g)]
    for q in range(g):
        for r in range(g):
            if q != r:
                _check_pair(ranks, names, m, q, r, used_peers)
    for r in range(g):
        _require(sorted(used_peers[r]) == list(range(len(mbs[r].peer_reads))),
                 f"{names[r]} step {m}: its {len(mbs[r].peer_reads)} peer reads are received as "
                 f"{sorted(used_peers[r])}")


def _check_pair(ranks: List[RankPlan], names: List[str], m: int, q: int, r: int, used_peers: List[List[int]]) -> None:
    """Step ``m``, rank ``q`` -> rank ``r``: the chains sent are the chains received, each put to
    a use the receiver has; the gradients ``r`` returns are those ``q`` expects."""
    mbs = [rp.micro_batches[m] for rp in ranks]
    ex = [mb.exchange for mb in mbs]
    sent = ex[q].send.get(r, []) if ex[q] is not None else []
    got = ex[r].recv.get(q, []) if ex[r] is not None else []
    at = f"step {m}: {names[q]} -> {names[r]}"
    _require([len(c) for c in sent] == [u.length for u in got],
             f"{at}: the sender sends chains of {[len(c) for c in sent]} tokens, the receiver expects "
             f"{[u.length for u in got]}")
    for chain, use in zip(sent, got):
        _require(bool(_contains(mbs[q].tokens, chain).all()), f"{at}: a sent chain is not in the sender's fragment")
        _require(use.peer is not None or use.replica is not None, f"{at}: a chain is received for no use")
        if use.peer is not None:
            peers = mbs[r].peer_reads
            _require(0 <= use.peer < len(peers), f"{at}: a chain goes to peer read {use.peer}, which "
                                                 f"the receiver does not have")
            peer = peers[use.peer]
            _require((peer.src_rank, peer.length, peer.last_token) == (q, len(chain), int(chain[-1])),
                     f"{at}: a chain goes to peer read {use.peer}, which is another chain")
            used_peers[r].append(use.peer)
        if use.replica is not None:
            src = ranks[r].sources.get(use.replica)
            _require(src is not None and src.replica_of is not None and src.replica_of[0] == q
                     and src.producer == m and np.array_equal(src.tokens, chain),
                     f"{at}: a chain goes to replica {use.replica}, which is not a copy of it made at this step")
    back = ex[r].grad_send.get(q, []) if ex[r] is not None else []
    into = ex[q].grad_recv.get(r, []) if ex[q] is not None else []
    _require([ranks[r].sources[s].replica_of if s in ranks[r].sources else None for s in back]
             == [(q, s) for s in into],
             f"step {m}: {names[r]} returns the gradients of replicas {back} to {names[q]}, which "
             f"expects those of its sources {into}")


def _check_replica(ranks: List[RankPlan], r: int, s: int, src, at: str) -> None:
    """Replica ``s`` of group rank ``r`` copies its owner's chain made at the same step, received
    and its gradients returned exactly once."""
    g = len(ranks)
    q, sid = src.replica_of
    owner = ranks[q].sources.get(sid) if 0 <= q < g and q != r else None
    _require(owner is not None and owner.replica_of is None and owner.producer == src.producer
             and np.array_equal(owner.tokens, src.tokens) and GRADS in owner.kinds,
             f"{at} copies source {sid} of group rank {q}, which is not the same chain made at its step")
    e = ranks[r].micro_batches[src.producer].exchange
    received = [u.replica for u in e.recv.get(q, [])] if e is not None else []
    returned = e.grad_send.get(q, []) if e is not None else []
    _require(received.count(s) == 1 and returned.count(s) == 1,
             f"{at} is received {received.count(s)} times and its gradients returned {returned.count(s)} "
             f"times at step {src.producer} (once each)")


def _check_coverage(plan: StepPlan, owned: List[np.ndarray], targets: List[np.ndarray]) -> None:
    """Every loss claim and every log-prob target computed once, every tree token owned once."""
    tree, index = plan.tree, plan.index
    num_tokens = tree.num_tree_tokens
    computed = np.bincount(np.concatenate(targets), minlength=num_tokens) if targets else np.zeros(num_tokens, np.int64)
    claimed = np.diff(tree.claim_offsets) > 0
    bad = np.flatnonzero(claimed & (computed != 1))
    if len(bad):
        t = int(bad[0])
        sample = int(tree.claim_sample[tree.claim_offsets[t]])
        raise PlanInvariantError(f"the loss claims of tree token {t} (sample {sample}, position "
                                 f"{int(index.position[t])}) are computed {int(computed[t])} times, not once"
                                 f"{_where_computed(plan, t)}")
    expected = (index.pred >= 0).astype(np.int64)
    imported = _imported_tokens(plan)
    if len(imported):  # computed by the home copy instead (their claims moved there)
        after = np.flatnonzero(np.isin(index.pred, imported))  # the token after a head: its predecessor is not here
        expected[imported] = 0
        expected[after] = 0
    bad = np.flatnonzero(computed != expected)
    if len(bad):
        t = int(bad[0])
        raise PlanInvariantError(f"the log-prob of tree token {t} (position {int(index.position[t])}) is computed "
                                 f"{int(computed[t])} times, not {int(expected[t])}{_where_computed(plan, t)}")
    count = np.bincount(np.concatenate(owned), minlength=num_tokens) if owned else np.zeros(num_tokens, np.int64)
    count[imported] += 1  # received, not computed
    bad = np.flatnonzero(count != 1)
    if len(bad):
        t = int(bad[0])
        raise PlanInvariantError(f"tree token {t} is owned (computed as a trained row) by {int(count[t])} "
                                 "micro-batches, not one")


def _where_computed(plan: StepPlan, t: int) -> str:
    """``" (rank r micro-batch i, ...)"``: where tree token t's log-prob is computed (for errors)."""
    index = plan.index
    places = []
    for r, rank_plan in enumerate(plan.ranks):
        for i, mb in enumerate(rank_plan.micro_batches):
            local = mb.tokens[mb.owned & _in_pack_predecessor(index, mb.tokens)]
            if t in local or t in mb.remote_targets:
                places.append(f"rank {r} micro-batch {i}")
    return f" ({', '.join(places)})" if places else ""


def _imported_tokens(plan: StepPlan) -> np.ndarray:
    """Tree tokens of the heads that copies other than the home copy import (nobody computes
    them: the home copy's tokens stand for them), each once."""
    entries = {src.imported for r in plan.ranks for src in r.sources.values() if src.imported is not None}
    parts = [plan.head_sends[t].imports[j].tokens() for t, j in sorted(entries)
             if plan.head_sends[t].imports[j].start != plan.head_sends[t].start]
    return np.unique(np.concatenate(parts)) if parts else np.zeros(0, np.int64)


def _check_transfers(plan: StepPlan) -> None:
    """Every transfer's head is exported once, by its home rank; every imported source lies in
    the head of a copy its rank's group holds; and on every rank exported heads run forward
    before any import and backward after every import's backward (no waiting cycle)."""
    g = int(plan.config.exchange_group_size)
    for t, transfer in enumerate(plan.head_sends):
        at = f"transfer {t}"
        _require(0 <= transfer.home_rank < len(plan.ranks), f"{at}: home rank {transfer.home_rank}")
        exported = [s for s in plan.ranks[transfer.home_rank].sources.values() if s.exported == t]
        _require(len(exported) == 1 and np.array_equal(exported[0].tokens, transfer.tokens()),
                 f"{at}: its home rank {transfer.home_rank} exports {len(exported)} sources, not its head")
        for r, rank_plan in enumerate(plan.ranks):
            if r != transfer.home_rank:
                _require(not any(s.exported == t for s in rank_plan.sources.values()),
                         f"{at}: rank {r} exports it, but rank {transfer.home_rank} is its home")
        _require(bool(transfer.imports) and transfer.imports[0].start == transfer.start,
                 f"{at}: its first import is not the home copy")
        for h in transfer.imports:
            _require(0 < h.length <= transfer.length, f"{at}: a copy imports {h.length} of {transfer.length} tokens")
    for r, rank_plan in enumerate(plan.ranks):
        fwd = {i: k for k, (op, i) in enumerate(rank_plan.schedule) if op in FORWARD_OPS}
        bwd = {i: k for k, (op, i) in enumerate(rank_plan.schedule) if op in BACKWARD_OPS}
        imports = {src.producer for src in rank_plan.sources.values() if src.imported is not None}
        exports = {src.producer for src in rank_plan.sources.values() if src.exported is not None}
        for s, src in rank_plan.sources.items():
            if src.imported is None:
                continue
            t, j = src.imported
            _require(0 <= t < len(plan.head_sends) and 0 <= j < len(plan.head_sends[t].imports),
                     f"rank {r} source {s} imports {src.imported}, which is not a transfer")
            head = plan.head_sends[t].imports[j]
            _require(head.group == r // g and r != plan.head_sends[t].home_rank,
                     f"rank {r} source {s} imports the head of a copy of group {head.group}")
            _require(bool(((src.tokens >= head.start) & (src.tokens < head.start + head.length)).all()),
                     f"rank {r} source {s} is imported but lies outside the head it imports")
        for e in exports:
            for i in imports:
                _require(fwd[e] < fwd[i] and bwd[i] < bwd[e],
                         f"rank {r}: the exported head of micro-batch {e} and the import of micro-batch {i} are "
                         "not ordered export forward, import forward, import backward, export backward")
