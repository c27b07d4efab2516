"""The last layer only for the rows whose log-prob is computed (issue 23, item 3).

The model's last layer computes queries, core attention, output projection and MLP only for
the rows the loss head reads (``TreeAttentionMetadata.output_rows``); every row's K/V are still
keys. Checked here: a query-subset attention plan gives exactly the selected rows of the full
plan's output, with every backend, values and gradients; training steps and log-prob passes
with the skip on and off equal the per-sample Hugging Face reference (fp32, the tolerances of
tests/training/test_exactness.py), under mechanism 1, mechanism 2 (kept and recomputed prefix
graphs), megatron's activation recomputation and on an MoE model; and the skipped rows really
do not reach the last layer's attention output projection or MLP.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers.batches import random_tree_batch, random_tree_records
from helpers.families import make_family_checkpoint
from helpers.hf_reference import (
    assert_grads_close,
    hf_grads_to_mcore,
    load_hf_model,
    make_hf_checkpoint,
    per_sample_logprobs,
    per_sample_loss_and_grads,
)

from megatron_psrl import ActorConfig, OptimizerSettings, PolicyActor
from megatron_psrl.attention.backends import blockwise_tree_attention, dense_tree_attention
from megatron_psrl.attention.plan import AttentionPlan, tree_plan
from megatron_psrl.checkpoint import ModelSource, load_model
from megatron_psrl.data.loader import samples_from_dicts
from megatron_psrl.data.synthetic import make_grpo
from megatron_psrl.distributed.setup import initialize_parallel
from megatron_psrl.engine.logprobs import compute_logprobs
from megatron_psrl.engine.step import StepRunner
from megatron_psrl.kvcache import BlockKVCache, KVGeometry
from megatron_psrl.model import tiny_config
from megatron_psrl.model.adapters import get_adapter, unfuse_experts
from megatron_psrl.model.gpt import PsrlTransformerLayer
from megatron_psrl.model.moe import moe_layers
from megatron_psrl.rl.loss import LossConfig
from megatron_psrl.schedule.config import PlannerConfig
from megatron_psrl.schedule.memory import activation_bytes_per_token, plan_memory
from megatron_psrl.schedule.planner import plan_step
from megatron_psrl.tree import build_prefix_tree

CONFIG = dict(tiny_config("debug-llama"), vocab_size=256)
LOSS = LossConfig(clip_eps=0.2, kl_coef=0.05, entropy_coef=0.01, loss_agg="seq-mean-token-mean")


# ------------------------------------------------------------------------------- attention
def _random_plan(rng: np.random.Generator) -> AttentionPlan:
    """A depth-first pack of 2..8 segments, some roots under a cached (external) prefix."""
    g = int(rng.integers(2, 9))
    lengths = rng.integers(1, 7, g)
    parents, path = [], []
    for s in range(g):
        d = int(rng.integers(0, len(path) + 1))
        parents.append(path[d - 1] if d > 0 else -1)
        path = path[:d] + [s]
    ends = np.cumsum(lengths)
    starts = ends - lengths
    subtree_end = ends.copy()
    for s in range(g - 1, -1, -1):
        if parents[s] >= 0:
            subtree_end[parents[s]] = max(subtree_end[parents[s]], subtree_end[s])
    roots = [s for s in range(g) if parents[s] < 0]
    ext = [(int(starts[r]), int(subtree_end[r]), 0) for r in roots if rng.random() < 0.6]
    return tree_plan(starts, ends, parents, ext, [int(rng.integers(1, 6))] if ext else [])


def _varlen_emulation(q, k, v, plan: AttentionPlan, external, scale):
    """flash-attn varlen / TE thd over ``plan.gathered_keys()`` (bottom-right causal), on CPU."""
    key_index, cu_q, cu_k = plan.gathered_keys()
    idx = torch.from_numpy(key_index)
    kg = torch.cat([k] + [e[0] for e in external]).index_select(0, idx)
    vg = torch.cat([v] + [e[1] for e in external]).index_select(0, idx)
    outs = []
    for g in range(len(cu_q) - 1):
        qs, ks, vs = q[cu_q[g]:cu_q[g + 1]], kg[cu_k[g]:cu_k[g + 1]], vg[cu_k[g]:cu_k[g + 1]]
        mask = torch.ones(len(qs), len(ks), dtype=torch.bool).tril(len(ks) - len(qs))
        o = F.scaled_dot_product_attention(qs.transpose(0, 1), ks.transpose(0, 1), vs.transpose(0, 1),
                                           attn_mask=mask, scale=scale, enable_gqa=True)
        outs.append(o.transpose(0, 1))
    return torch.cat(outs) if outs else q.new_zeros(q.shape)


BACKENDS = {
    "torch-aten": lambda q, k, v, p, e, s: blockwise_tree_attention(q, k, v, p, e, s, impl="aten"),
    "torch-math": lambda q, k, v, p, e, s: blockwise_tree_attention(q, k, v, p, e, s, impl="math"),
    "dense": dense_tree_attention,
    "varlen": _varlen_emulation,
}


@pytest.mark.parametrize("backend", sorted(BACKENDS))
@pytest.mark.parametrize("seed", range(4))
def test_query_subset_plan_is_the_full_plans_rows(backend, seed):
    """``select_queries(rows)``: outputs = the full plan's rows, and the gradients of q, k, v and
    the external K/V = the full plan's with a zero output gradient on the other rows (fp64)."""
    rng = np.random.default_rng(seed)
    run = BACKENDS[backend]
    for _ in range(6):
        plan = _random_plan(rng)
        t = plan.num_tokens
        rows = np.flatnonzero(rng.random(t) < rng.uniform(0.1, 0.9))
        if len(rows) == 0:
            rows = np.array([t - 1])
        sub = plan.select_queries(rows)
        assert sub.num_tokens == len(rows) and sub.num_pack_keys == t
        np.testing.assert_array_equal(sub.dense_mask(), plan.dense_mask()[rows])
        gen = torch.Generator().manual_seed(seed)

        def leaf(*shape):
            return torch.randn(*shape, generator=gen, dtype=torch.float64).requires_grad_(True)

        q, k, v = leaf(t, 4, 8), leaf(t, 2, 8), leaf(t, 2, 8)
        external = [(leaf(n, 2, 8), leaf(n, 2, 8)) for n in plan.external_lengths]
        leaves = [q, k, v] + [x for pair in external for x in pair]
        dout = torch.randn(len(rows), 4, 8, generator=gen, dtype=torch.float64)
        full = run(q, k, v, plan, external, 0.3)
        want = torch.autograd.grad((full[torch.from_numpy(rows)] * dout).sum(), leaves)
        got_out = run(q.index_select(0, torch.from_numpy(rows)), k, v, sub, external, 0.3)
        torch.testing.assert_close(got_out, full[torch.from_numpy(rows)].detach(), rtol=1e-9, atol=1e-10)
        got = torch.autograd.grad((got_out * dout).sum(), leaves)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10)


def test_select_queries_refuses_unsorted_rows():
    plan = tree_plan([0, 3], [3, 5], [-1, 0])
    with pytest.raises(ValueError, match="ascending"):
        plan.select_queries(np.array([2, 1]))
    with pytest.raises(ValueError, match="not a query subset"):
        plan.select_queries(np.array([1, 2])).select_queries(np.array([0]))


# ------------------------------------------------------------------------------- the model
@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return make_hf_checkpoint(CONFIG, seed=0, directory=str(tmp_path_factory.mktemp("hf")))


@pytest.fixture(scope="module")
def hf_model(hf_dir):
    return load_hf_model(hf_dir)


@pytest.fixture(scope="module")
def psrl_model(hf_dir):
    initialize_parallel(1, 1, seed=0, device="cpu")
    arch, model, _ = load_model(ModelSource(hf_dir=hf_dir), dtype=torch.float32)
    return arch, model


def _train(arch, model, batch, budget: int, kv_budget, skip: bool):
    """One step's loss and gradients through StepRunner (mechanism 2 when ``budget`` is small;
    ``kv_budget="tight"``: every prefix graph is dropped and recomputed)."""
    tree = build_prefix_tree(batch)
    plan = plan_step(tree, PlannerConfig(micro_batch_tokens=budget, sharing="tree"))
    geom = KVGeometry(num_layers=arch.num_layers, num_groups=arch.num_kv_heads, head_dim=arch.head_dim,
                      dtype=torch.float32, device=torch.device("cpu"))
    rank = plan.ranks[0]
    memory = None
    kv = 1 << 30
    if rank.sources:
        if kv_budget == "tight":
            kv = plan_memory(rank, geom, 1 << 40, 0).peak_bytes
        memory = plan_memory(rank, geom, kv, activation_bytes_per_token(arch, 1, 4))
    model.zero_grad(set_to_none=True)
    runner = StepRunner(model, arch.vocab_size, torch.device("cpu"), kv_cache=BlockKVCache(geom, kv))
    runner.last_layer_row_skip = skip
    out = runner.train(plan, 0, LOSS, memory)
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    return out, grads, plan, memory


@pytest.mark.parametrize("budget,kv_budget", [(4096, None), (24, None), (24, "tight")],
                         ids=["mechanism1", "mechanism2-kept", "mechanism2-recomputed"])
def test_training_step_equals_reference_with_and_without_skip(psrl_model, hf_model, budget, kv_budget):
    arch, model = psrl_model
    batch = random_tree_batch(seed=7)
    ref_loss, ref_hf = per_sample_loss_and_grads(hf_model, batch, 0.2, 0.05, 0.01, "seq-mean-token-mean")
    ref = hf_grads_to_mcore(ref_hf, arch)
    results = {}
    for skip in (True, False):
        out, grads, plan, memory = _train(arch, model, batch, budget, kv_budget, skip)
        assert out.loss == pytest.approx(ref_loss, rel=1e-5, abs=1e-7)
        assert_grads_close(grads, ref, rtol=1e-5)
        results[skip] = (out, grads)
    if budget < 100:
        assert plan.ranks[0].sources, "the budget must force mechanism 2"
        assert (results[True][0].tokens_recomputed > 0) == (kv_budget == "tight")
    on, off = results[True][0], results[False][0]
    np.testing.assert_allclose(on.logprobs.arrays()[1], off.logprobs.arrays()[1], rtol=0, atol=1e-5)
    assert on.loss == pytest.approx(off.loss, rel=1e-6)


@pytest.mark.parametrize("budget", [4096, 16])
def test_logprobs_equal_reference_with_and_without_skip(psrl_model, hf_model, budget, monkeypatch):
    """The forward-only pass (every row with a next token is read; the rows without one are
    skipped) against the reference, skip on and off."""
    arch, model = psrl_model
    batch = random_tree_batch(seed=21)
    ref = per_sample_logprobs(hf_model, batch)
    original = StepRunner.__init__
    for skip in (True, False):
        def init(self, *args, _skip=skip, **kwargs):  # compute_logprobs builds its own runner
            original(self, *args, **kwargs)
            self.last_layer_row_skip = _skip

        monkeypatch.setattr(StepRunner, "__init__", init)
        ours = compute_logprobs(model, arch, batch, micro_batch_tokens=budget)
        for a, b in zip(ours, ref):
            np.testing.assert_allclose(a, b, atol=1e-4)


def _rows_into(module: torch.nn.Module, counts: list):
    return module.register_forward_hook(lambda mod, args, out: counts.append(int(args[0].shape[0])))


def test_skipped_rows_do_not_reach_the_last_layers_projection_and_mlp(psrl_model):
    """Hooks count the rows that reach the last layer's QKV projection (all), its output
    projection and MLP (only the loss head's rows with the skip; all without), and an earlier
    layer's MLP (all, always)."""
    arch, model = psrl_model
    layers = model.decoder.layers
    assert isinstance(layers[-1], PsrlTransformerLayer)
    # GRPO groups with long prompts: most rows (the prompts') carry no claim
    batch = make_grpo(num_prompts=2, group_size=3, prompt_len=(40, 60), response_len=(4, 8), vocab_size=256,
                      with_logprobs=True)
    counts = {name: [] for name in ("qkv", "proj", "mlp", "first_mlp")}
    handles = [_rows_into(layers[-1].self_attention.linear_qkv, counts["qkv"]),
               _rows_into(layers[-1].self_attention.linear_proj, counts["proj"]),
               _rows_into(layers[-1].mlp, counts["mlp"]), _rows_into(layers[0].mlp, counts["first_mlp"])]
    try:
        for skip in (True, False):
            for c in counts.values():
                c.clear()
            out, _, plan, _ = _train(arch, model, batch, 4096, None, skip)
            rank = plan.ranks[0]
            packs = [rank.pack(plan.index, i) for i in range(len(rank.micro_batches))]
            tokens = [p.num_tokens for p in packs]
            offsets = plan.tree.claim_offsets
            claimed = [len(np.unique(p.logit_rows[offsets[p.logit_targets + 1] > offsets[p.logit_targets]]))
                       for p in packs]
            assert counts["qkv"] == tokens and counts["first_mlp"] == tokens
            expected = claimed if skip else tokens
            assert counts["proj"] == expected and counts["mlp"] == expected
            if skip:
                assert sum(claimed) < sum(tokens) / 2, "most rows of these packs carry no claim"
    finally:
        for h in handles:
            h.remove()


def test_recomputation_is_exact_with_the_skip(hf_dir, hf_model):
    """megatron's full and selective recomputation with cached prefixes (their dK/dV injected
    inside the graph): the PolicyActor path, skip on and off, equals the reference."""
    records = random_tree_records(seed=5, num_roots=2)
    batch = samples_from_dicts(records, source="records")
    ref_loss, ref_hf = per_sample_loss_and_grads(hf_model, batch, 0.2, 0.05, 0.01, "seq-mean-token-mean")
    for recompute in (dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
                      dict(recompute_granularity="selective")):
        for skip in (True, False):
            actor = PolicyActor(hf_dir, ActorConfig(device="cpu", micro_batch_tokens=24, loss=LOSS,
                                                    last_layer_row_skip=skip, optimizer=OptimizerSettings(
                                                        optimizer="sgd", lr=1.0, clip_grad=0.0), **recompute))
            assert actor.runner.last_layer_row_skip is skip
            result = actor.forward_backward(records)
            actor.engine.optimizer.reduce_gradients()
            grads = {n: p.main_grad.detach().clone() for n, p in actor.model.named_parameters()}
            assert result.loss == pytest.approx(ref_loss, rel=1e-5)
            assert_grads_close(grads, hf_grads_to_mcore(ref_hf, actor.arch), rtol=1e-5)


def test_moe_routes_only_the_kept_rows_and_stays_exact(tmp_path):
    """Qwen3-MoE (megatron's MoELayer, dropless top-k): with the skip the last layer's router
    sees only the loss head's rows, and log-probs, loss and every gradient (router and experts
    included) equal the per-sample reference with the skip on and off."""
    hf_dir = make_family_checkpoint(tiny_config("debug-qwen3-moe"), str(tmp_path / "hf-moe"))
    hf_model = load_hf_model(hf_dir)
    records = random_tree_records(seed=5, num_roots=2)
    batch = samples_from_dicts(records, source="records")
    ref_lp = per_sample_logprobs(hf_model, batch)
    ref_loss, ref_grads = per_sample_loss_and_grads(hf_model, batch, 0.2, 0.05, 0.01, "seq-mean-token-mean")
    routed = {}
    for skip in (True, False):
        actor = PolicyActor(hf_dir, ActorConfig(device="cpu", micro_batch_tokens=32, loss=LOSS, last_layer_row_skip=skip,
                                                optimizer=OptimizerSettings(optimizer="sgd", lr=1.0, clip_grad=0.0)))
        router = moe_layers(actor.model)[-1].router
        rows = []
        handle = router.register_forward_hook(lambda mod, args, out: rows.append(args[0].numel() // args[0].shape[-1]))
        for a, b in zip(actor.compute_logprobs(records), ref_lp):
            np.testing.assert_allclose(a, b, rtol=0, atol=1e-5)
        rows.clear()
        result = actor.forward_backward(records)
        handle.remove()
        routed[skip] = sum(rows)
        actor.engine.optimizer.reduce_gradients()
        grads = {n: p.main_grad.detach().clone() for n, p in actor.model.named_parameters()}
        assert result.loss == pytest.approx(ref_loss, rel=1e-5)
        ref = dict(get_adapter(actor.arch).hf_to_mcore(lambda n: unfuse_experts(ref_grads)[n]))
        assert_grads_close(grads, ref, rtol=1e-5)
        # (no actor.close(): it would end the process groups the module's model uses)
    assert routed[True] < routed[False]


def test_the_command_line_switch_reaches_the_config():
    from megatron_psrl.training.arguments import parse_args
    from megatron_psrl.training.trainer import actor_config_from_args

    base = ["--model", "debug-llama", "--data", "stepwise"]
    assert actor_config_from_args(parse_args(base), "float32").last_layer_row_skip is True
    assert actor_config_from_args(parse_args(base + ["--no-last-layer-row-skip"]), "float32").last_layer_row_skip is False
