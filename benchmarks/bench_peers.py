#!/usr/bin/env python
"""The project's update step against other prefix-sharing trainers and the floor, built to
survive a noisy machine (issues 13 and 23).

    python benchmarks/bench_peers.py [--workloads grpo-512x8x512,stepwise-8x256] [--repeats 7]
                                     [--out-dir runs/bench_peers] [--profile none|all|NAME,...]
                                     [--guard all|none|NAME,...] [--baseline-profile NAME]
    python benchmarks/bench_peers.py --quick          # tiny sizes, 3 repeats (the smoke test)
    python benchmarks/bench_peers.py --memory-breakdown --memory-curve [--contenders ...]
                                     # the step's peak by holder, and the time-memory curve
                                     # (benchmarks/memory_curve.py; bench_peers_memory.md + one PNG
                                     # per workload in --out-dir)

Every contender runs in this one process on the same weights (one random Hugging Face Llama,
h256 / i512 / 4 layers / 8 heads / 4 KV heads / vocab 2048, fp32, loaded into megatron_psrl
from the same state dict), with the same threads, on the same batch. Per workload: one warm-up
per contender (its gradient check), one untimed run per contender under the same peak-memory
measure (``megatron_psrl.engine.memory.PeakMemory``, ``ops`` mode: the C heap's bytes in use
read after every torch operation, above the run's start), then ``--repeats`` timed rounds in
which the contenders take turns (A B C ... A B C ...), so load from other processes hits them
alike. Reported: the median, the min-max range and the IQR of the rounds, wall and process-CPU
clocks. Timed: packing + forward + backward of the whole batch (no optimizer). The loss of
every contender is the project's ``token-mean`` policy loss at ratio 1, i.e.
``-(1/N) * sum over trained tokens of weight * advantage * log p(token)`` (N = trained tokens),
so all contenders compute the same gradient:

- ``psrl``: ``PolicyActor.forward_backward`` at the defaults (micro-batch budget 4096 tokens,
  KV budget 1 GiB): tree build + plan + tree packing + blockwise tree attention;
- ``psrl-one-pack``: the same with a budget that holds the whole tree (one micro-batch);
- ``psrl-no-sharing``: the same as ``psrl`` with ``prefix_sharing="none"`` (samples packed back
  to back, every prefix recomputed);
- ``floor-psrl``: the least work with the fastest layers available: the project's own layers
  over the unique tokens in one causal pass (a step-wise chain = its longest sample, every
  sample's trained tokens claimed on it; one segment, so one causal attention call per layer).
  Other shapes have no single causal pass ("n/a"; on a GRPO group the least work with these
  layers is ``psrl-one-pack``'s);
- ``floor-hf``: the same least work with stock Hugging Face code: a chain in one causal pass;
  a GRPO group (one prompt, equal-length responses) as the prompt once with ``use_cache=True``
  and one batched forward over the responses on its K/V, backward through both;
- the floor used for ``vs floor`` is the faster measured floor; on trees and mixed batches
  (no floor) the FLOP-ideal estimate (``psrl-no-sharing`` time / ideal speedup), marked ``est.``;
- ``hf-per-sample``: Hugging Face, one forward + backward per sample (the gradient reference);
- ``prefix-grouper``: PyPI ``prefix-grouper`` (``PrefixGrouper`` + its transformers attention
  hook); one group per set of samples with a common prefix (the prefix is the group's longest
  common prefix), i.e. one shared prefix per group (nested sharing such as step-wise is beyond it);
- ``trl-tree``: TRL's tree packing (``trl.experimental.async_grpo.packing.TreeRow``, the trie and
  its ``pack()`` layout, unchanged);
- ``areal-dta-whole`` / ``areal-dta-mb``: AReaL-DTA's ``DTAEngine.backward`` with its
  ``TokenTrie`` order, blocks of the whole sequence (``block_size=-1``) / of the project's
  micro-batch budget (4096), from the source folder named by ``AREAL_DTA_SRC`` (the
  ``feat/dta`` branch of inclusionAI/AReaL; never vendored). AReaL's default block (2048) is
  ``--dta-blocks whole,4096,2048``.

Every contender's kernel choices are printed beside it. Attention kernels: Prefix Grouper's
default kernel (flash-attn 2 with a padding mask) and TRL's (flash-attn 3 varlen over gathered
K/V paths) need CUDA. On CPU they get a stand-in with the same contract (same inputs, same
causal alignment, bottom-right) built on torch's CPU flash-attention kernel
(``scaled_dot_product_attention`` with a boolean mask), the kernel Hugging Face's ``sdpa`` uses
on CPU too; the packing, layouts and index arithmetic are the packages' own.

Gradient check: every contender's gradients of all parameters against ``hf-per-sample`` (fp32):
per tensor, ``max|g - g_ref| <= rtol * max|g_ref|`` with ``rtol`` 1e-4 (``--grad-rtol``); a
contender that fails is reported FAILED and not timed. A contender whose warm-up alone takes
longer than ``--slow-seconds`` is timed by that run only (column ``runs`` = 1, no memory run).
A contender whose single forward would exceed ``--max-forward-tokens`` tokens is skipped.

Mechanism 2's guard (``--guard``): the tree split into k = 2, 4, 8 micro-batches with nothing
recomputed (KV budget large, every cached prefix read back) against its one-pack step, the
variants interleaved; the ratio of the medians, and the median of the per-round ratios, is
printed against the target ``--guard-target`` (1.10). Beside them, the largest split's packs as
unrelated sequences, in one pack and one per micro-batch: what splitting costs without
mechanism 2 (micro-batching alone), so the split's ratio reads as micro-batching x mechanism 2.
By default it runs on ``tree`` (k = 8: micro-batches of about 500 tokens, an eighth of the
default budget) and on ``tree-8-roots`` (17,725 tree tokens; k = 8: about 2,400 tokens each,
near the default budget); a guard workload not in ``--workloads`` runs the guard alone.

The baseline's per-token cost (``--baseline-profile NAME``): ``prefix_sharing="none"`` at the
default budget, in one pack and with one sample per micro-batch (one causal pass per
micro-batch), the shared step and Hugging Face's per-sample loop, interleaved; per variant the
ms per computed token, the FLOPs, and one step under ``torch.profiler`` split into attention
kernels, GEMMs and the rest.

The per-phase breakdown of ``psrl`` (``--profile``): tree build, plan, pack, forward by layer part
(timed with forward hooks on the project's modules: attention core, QKV / output projections,
MLP, norms, the rest of the attention block = RoPE and reshapes, embedding), loss head (forward),
backward, one optimizer step (timed separately, weights restored), and the top operators of one
step under ``torch.profiler``.

Results: ``bench_peers.json`` and ``bench_peers.md`` in ``--out-dir``.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import importlib
import logging
import os
import platform
import statistics
import sys
import time
import traceback
import types
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from megatron_psrl.compat import quiet_expected_import_warnings  # noqa: E402

quiet_expected_import_warnings()

import memory_curve  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from exact_workloads import grpo_exact, stepwise_exact  # noqa: E402
from step_bench import Bench, write_results  # noqa: E402

from megatron_psrl.checkpoint import ModelSource  # noqa: E402
from megatron_psrl.checkpoint.state_dict import canonical_name  # noqa: E402
from megatron_psrl.data import make_mixed, make_tree_rollouts, samples_from_dicts  # noqa: E402
from megatron_psrl.data.samples import SampleBatch  # noqa: E402
from megatron_psrl.engine.config import ActorConfig  # noqa: E402
from megatron_psrl.engine.memory import PeakMemory  # noqa: E402
from megatron_psrl.engine.runners import make_runner  # noqa: E402
from megatron_psrl.model.adapters import get_adapter  # noqa: E402
from megatron_psrl.model.tiny import tiny_config  # noqa: E402
from megatron_psrl.rl.actor import PolicyActor  # noqa: E402
from megatron_psrl.rl.loss import LossConfig  # noqa: E402
from megatron_psrl.schedule.memory import plan_memory
from megatron_psrl.schedule.planner import plan_step  # noqa: E402
from megatron_psrl.tree import build_prefix_tree  # noqa: E402

# The model of issue 13 (tiny-llama's h256 / i512 / 4 layers, with 8 heads of 32, 4 KV heads, vocab 2048).
PEER_MODEL = dict(tiny_config("tiny-llama"), num_attention_heads=8, num_key_value_heads=4, head_dim=32,
                  vocab_size=2048)
DEFAULTS = ActorConfig()
DEFAULT_BUDGET = DEFAULTS.micro_batch_tokens  # the project's default micro-batch budget (4096)
ONE_PACK = 1 << 22  # a micro-batch budget that holds any tree here
LARGE_KV = 1 << 36  # a KV budget under which nothing is recomputed
CONTENDERS = ["psrl", "psrl-one-pack", "psrl-no-sharing", "floor-psrl", "floor-hf", "hf-per-sample", "prefix-grouper",
              "trl-tree", "areal-dta-whole", "areal-dta-mb"]
PEER_FAMILIES = ("hf-per-sample", "prefix-grouper", "trl-tree", "areal-dta")
"""Other trainers' ways of computing the step (``psrl / best peer`` is taken over these, every
AReaL-DTA block size included)."""
FLOORS = ("floor-psrl", "floor-hf")
MEMORY_MODE = "ops"  # PeakMemory's CPU mode, the same for every contender


def is_peer(name: str) -> bool:
    return name.startswith(PEER_FAMILIES)


# ---------------------------------------------------------------------- workloads
DEFAULT_WORKLOADS = ["grpo-512x8x512", "stepwise-8x256", "tree", "mixed"]
"""What a run without ``--workloads`` measures (about 10 minutes on 2 busy cores, and about 8 more
for the default guards, most of them ``tree-8-roots``'s); the longer ones are named explicitly."""


def workloads(vocab: int, quick: bool = False) -> Dict[str, Callable[[], SampleBatch]]:
    """Step-wise t x L: sample t = turns 1..t, trained on the last quarter of turn t (its action)."""
    if quick:
        return {
            "grpo-64x4x16": lambda: grpo_exact(64, 4, 16, vocab),
            "stepwise-4x32": lambda: stepwise_exact(4, 32, 8, vocab),
            "tree-small": lambda: make_tree_rollouts(num_roots=1, depth=2, segment_len=(4, 8), prompt_len=(16, 32),
                                                     obs_len=(4, 8), vocab_size=vocab, seed=1),
            "mixed-small": lambda: make_mixed(
                grpo=dict(num_prompts=1, group_size=2, prompt_len=(16, 32), response_len=(4, 8)),
                stepwise=dict(num_trajectories=1, turns=(2, 3), obs_len=(4, 8), action_len=(2, 4), task_len=(8, 16)),
                tree=dict(num_roots=1, branching=2, depth=2, segment_len=(2, 4), prompt_len=(8, 16), obs_len=(2, 4)),
                vocab_size=vocab, seed=1),
        }
    return {
        "grpo-2048x8x128": lambda: grpo_exact(2048, 8, 128, vocab),
        "grpo-512x8x512": lambda: grpo_exact(512, 8, 512, vocab),
        "stepwise-8x256": lambda: stepwise_exact(8, 256, 64, vocab),
        "stepwise-16x256": lambda: stepwise_exact(16, 256, 64, vocab),
        "stepwise-32x256": lambda: stepwise_exact(32, 256, 64, vocab),
        "stepwise-64x128": lambda: stepwise_exact(64, 128, 32, vocab),
        "tree": lambda: make_tree_rollouts(num_roots=2, vocab_size=vocab, seed=1),
        "mixed": lambda: make_mixed(vocab_size=vocab, seed=1),
        # the same generator with 8 roots (17,725 tree tokens): split 2, 4, 8 ways its micro-batches hold
        # 9.3k, 4.9k and 2.4k tokens, about the default budget (4096), where "tree"'s k = 8 holds 500
        "tree-8-roots": lambda: make_tree_rollouts(num_roots=8, vocab_size=vocab, seed=1),
    }


@dataclass
class Work:
    """One workload as every contender sees it."""

    name: str
    batch: SampleBatch
    seqs: List[np.ndarray]                      # int64 tokens per sample
    claims: List[Tuple[np.ndarray, np.ndarray]]  # per sample: (positions j >= 1 with loss, coefficient)
    num_claims: int
    tree_tokens: int = 0
    ideal_speedup: float = 1.0

    @staticmethod
    def of(name: str, batch: SampleBatch) -> "Work":
        seqs, raw = [], []
        for s in range(batch.num_samples):
            sl = batch.sample_slice(s)
            toks = batch.tokens[sl].astype(np.int64)
            mask = batch.loss_mask[sl].astype(bool).copy()
            mask[0] = False  # token 0 has no context
            j = np.flatnonzero(mask).astype(np.int64)
            adv = (batch.advantages[sl] if batch.advantages is not None else np.ones(len(toks)))[j]
            weight = float(batch.weights[s]) if batch.weights is not None else 1.0
            seqs.append(toks)
            raw.append((j, weight * adv.astype(np.float64)))
        n = sum(len(j) for j, _ in raw)
        claims = [(j, (c / max(n, 1)).astype(np.float32)) for j, c in raw]
        return Work(name, batch, seqs, claims, n)

    @staticmethod
    def built(name: str, batch: SampleBatch, cost) -> "Work":
        """:meth:`of`, with the tree's unique tokens and the FLOP-ideal speedup under ``cost``."""
        work = Work.of(name, batch)
        tree = build_prefix_tree(batch)
        work.tree_tokens, work.ideal_speedup = int(tree.num_tree_tokens), float(cost.ideal_speedup(tree))
        return work

    def all_claims(self) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(sample, position, coefficient) of every claim, samples in order."""
        s = np.concatenate([np.full(len(j), i, dtype=np.int64) for i, (j, _) in enumerate(self.claims)])
        j = np.concatenate([j for j, _ in self.claims])
        c = np.concatenate([c for _, c in self.claims])
        return s, j, c


def _lcp(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if len(diff) else n


def prefix_groups(seqs: List[np.ndarray]) -> List[Tuple[List[int], int]]:
    """Samples grouped by a common prefix (connected by a shared first token), with each group's
    shared prefix length: the group's longest common prefix, at most its shortest sample - 1
    (every sample keeps one own token)."""
    by_first: Dict[int, List[int]] = {}
    for i, t in enumerate(seqs):
        by_first.setdefault(int(t[0]), []).append(i)
    groups = []
    for members in by_first.values():
        lcp = min(len(seqs[i]) for i in members) - 1
        for i in members[1:]:
            lcp = min(lcp, _lcp(seqs[members[0]], seqs[i]))
        groups.append((members, max(lcp, 0)))
    return groups


# ---------------------------------------------------------------------- Hugging Face side
def hf_model_from(hf_config: dict, state_dict: Dict[str, torch.Tensor], attn: str = "sdpa"):
    from transformers import AutoConfig, AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**copy.deepcopy(hf_config)), attn_implementation=attn)
    model.load_state_dict(state_dict)
    return model.float().train()


def random_weights(hf_config: dict, seed: int) -> Dict[str, torch.Tensor]:
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**copy.deepcopy(hf_config))).float()
    with torch.no_grad():  # random init leaves the norms at 1: perturb them so their gradients are checked too
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.1 * torch.randn_like(p))
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def head_loss(model, hidden_rows: torch.Tensor, targets: torch.Tensor, coefs: torch.Tensor) -> torch.Tensor:
    """The common loss head: logits of the claimed rows only, ``-(coef * log p(target)).sum()``."""
    logits = model.lm_head(hidden_rows).float()
    logp = torch.log_softmax(logits, -1).gather(1, targets[:, None])[:, 0]
    return -(coefs * logp).sum()


def lower_right_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: Optional[float]) -> torch.Tensor:
    """Causal attention of ``q [H, nq, d]`` over ``k, v [Hkv, nk, d]`` (nq <= nk), queries aligned
    with the last nq keys (flash-attn's ``causal=True``); torch's CPU flash kernel (GQA by
    repeating K/V heads, as Hugging Face's ``repeat_kv``)."""
    rep = q.shape[0] // k.shape[0]
    if rep > 1:
        k, v = k.repeat_interleave(rep, 0), v.repeat_interleave(rep, 0)
    nq, nk = q.shape[1], k.shape[1]
    if nq == nk:
        return F.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=True, scale=scale)[0]
    mask = torch.ones(nq, nk, dtype=torch.bool, device=q.device).tril(nk - nq)
    return F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask[None, None], scale=scale)[0]


def _cache_kwarg() -> str:
    """transformers renamed ``past_key_values`` to ``cache`` (5.x)."""
    import inspect

    from transformers.models.llama.modeling_llama import LlamaModel

    return "cache" if "cache" in inspect.signature(LlamaModel.forward).parameters else "past_key_values"


CACHE_KWARG = _cache_kwarg()
FA2_STANDIN = "psrl_bench_fa2_cpu"
TREE_STANDIN = "psrl_bench_trl_tree_cpu"


def fa2_padding_mask_cpu(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """flash_attention_2's contract with a 2D padding mask (``[b, k_len]``, True = token), on CPU:
    per row, queries = the valid entries of the mask's last q_len columns, keys = its valid
    entries, causal bottom-right. Returns ``([b, q_len, H, d], None)`` like Hugging Face's."""
    b, heads, q_len, d = query.shape
    rows = []
    for i in range(b):
        m = attention_mask[i].bool()
        if bool(m.all()):
            rows.append(lower_right_attention(query[i], key[i], value[i], scaling))
            continue
        kv = m.nonzero()[:, 0]
        qv = m[-q_len:].nonzero()[:, 0]
        out = lower_right_attention(query[i][:, qv], key[i][:, kv], value[i][:, kv], scaling)
        rows.append(query.new_zeros(heads, q_len, d).index_copy(1, qv, out))
    return torch.stack(rows).transpose(1, 2), None


def tree_attention_cpu(module, query, key, value, attention_mask, *, tree_kv_index, tree_cu_seqlens_q,
                       tree_cu_seqlens_k, tree_max_seqlen_q=None, tree_max_seqlen_k=None, scaling=None, **kwargs):
    """TRL's ``tree_attention`` contract on CPU: segment s's queries attend (causal, bottom-right)
    to the K/V rows ``tree_kv_index[cu_k[s]:cu_k[s+1]]`` (its root-to-segment path)."""
    q = query[0]  # [H, N, d]
    k = key[0].index_select(1, tree_kv_index)
    v = value[0].index_select(1, tree_kv_index)
    cq, ck = tree_cu_seqlens_q.tolist(), tree_cu_seqlens_k.tolist()
    outs = [lower_right_attention(q[:, cq[s]:cq[s + 1]], k[:, ck[s]:ck[s + 1]], v[:, ck[s]:ck[s + 1]], scaling)
            for s in range(len(cq) - 1)]
    return torch.cat(outs, 1).transpose(0, 1)[None], None


def register_standins() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(FA2_STANDIN, fa2_padding_mask_cpu)
    AttentionInterface.register(TREE_STANDIN, tree_attention_cpu)
    AttentionMaskInterface.register(TREE_STANDIN, lambda **kwargs: None)  # as TRL registers its own


# ---------------------------------------------------------------------- contenders
class Contender:
    name = ""
    kernels = ""
    """The kernels this contender runs (printed beside its times)."""

    def unavailable(self) -> Optional[str]:
        """Why this contender cannot run at all (None when it can)."""
        return None

    def prepare(self, work: Work) -> Optional[str]:
        """Untimed set-up for ``work``; returns why it does not apply (None when it does)."""
        return None

    def zero_grad(self) -> None:
        self.model.zero_grad(set_to_none=True)

    def before_memory_run(self) -> None:
        """Drop what a previous run left allocated for reuse, so the memory run counts it."""

    def run(self, work: Work) -> None:
        raise NotImplementedError

    def grads(self) -> Dict[str, torch.Tensor]:
        """Gradients by Hugging Face parameter name."""
        return {n: (p.grad if p.grad is not None else torch.zeros_like(p)).detach().clone()
                for n, p in self.model.named_parameters()}


class PsrlContender(Contender):
    """``PolicyActor.forward_backward`` under one configuration (``overrides`` of the actor's)."""

    def __init__(self, bench: "PeerBench", name: str, **overrides):
        self.bench, self.name, self.overrides = bench, name, overrides
        self.model = bench.model
        self.last: dict = {}
        sharing = overrides.get("prefix_sharing", bench.actor.config.prefix_sharing)
        budget = overrides.get("micro_batch_tokens", bench.actor.config.micro_batch_tokens)
        self.kernels = (f"{bench.layers_desc}; {bench.attention_desc}; "
                        f"{'one pack' if budget >= ONE_PACK else f'budget {budget} tokens'}, sharing {sharing}")

    def zero_grad(self) -> None:
        self.bench.actor.zero_grad()

    def before_memory_run(self) -> None:
        self.bench.actor.kv_cache.release_pool()  # kept between steps for reuse

    def run(self, work: Work) -> None:
        self.last = self.bench.forward_backward(work.batch, **self.overrides)

    def grads(self) -> Dict[str, torch.Tensor]:
        return self.bench.grads_hf_named()


def chain_batch(work: Work) -> Optional[SampleBatch]:
    """A step-wise chain as one sample: the longest, trained wherever any sample is, each
    trained token with its claiming sample's weight x advantage (token-mean over the same N).
    None when the batch is not a chain or two samples train the same position."""
    seqs = work.seqs
    longest = max(range(len(seqs)), key=lambda i: len(seqs[i]))
    if not all(_lcp(seqs[i], seqs[longest]) == len(seqs[i]) for i in range(len(seqs))):
        return None
    mask = np.zeros(len(seqs[longest]), dtype=np.int64)
    adv = np.zeros(len(seqs[longest]), dtype=np.float64)
    for j, c in work.claims:
        if mask[j].any():
            return None
        mask[j] = 1
        adv[j] = c.astype(np.float64) * max(work.num_claims, 1)  # c = weight * advantage / N
    return samples_from_dicts([{"id": "chain", "tokens": seqs[longest].tolist(), "loss_mask": mask.tolist(),
                                "advantage": adv.tolist()}], source="chain")


class FloorPsrl(PsrlContender):
    """The project's layers over the unique tokens of a chain in one causal pass."""

    def __init__(self, bench: "PeerBench"):
        super().__init__(bench, "floor-psrl", micro_batch_tokens=ONE_PACK, kv_cache_budget=LARGE_KV)
        self.kernels = (f"{bench.layers_desc}; one segment: one causal CPU flash SDPA call per layer "
                        "(_scaled_dot_product_flash_attention_for_cpu); one pack")

    def prepare(self, work: Work) -> Optional[str]:
        self.batch = chain_batch(work)
        if self.batch is None:
            return "no single causal pass covers this batch (not one chain); on a GRPO group the least work " \
                   "with these layers is psrl-one-pack's"
        return None

    def run(self, work: Work) -> None:
        self.last = self.bench.forward_backward(self.batch, **self.overrides)


class HFContender(Contender):
    attn = "sdpa"
    kernels = "HF Llama (separate q/k/v, gate/up linears), attn sdpa: CPU flash SDPA is_causal; head over trained rows"

    def __init__(self, hf_config: dict, state_dict: Dict[str, torch.Tensor], max_forward_tokens: int):
        self.hf_config, self.state_dict = hf_config, state_dict
        self.max_forward_tokens = max_forward_tokens
        self._model = None

    @property
    def model(self):
        if self._model is None:
            self._model = hf_model_from(self.hf_config, self.state_dict, self.attn)
        return self._model

    def _too_big(self, tokens: int) -> Optional[str]:
        if tokens > self.max_forward_tokens:
            return (f"a single forward of {tokens} tokens exceeds --max-forward-tokens {self.max_forward_tokens} "
                    "(activation memory)")
        return None


class PerSample(HFContender):
    name = "hf-per-sample"

    def run(self, work: Work) -> None:
        m = self.model
        for s, toks in enumerate(work.seqs):
            j, c = work.claims[s]
            if not len(j):
                continue
            ids = torch.from_numpy(toks)[None]
            h = m.model(input_ids=ids, use_cache=False).last_hidden_state[0]
            jt = torch.from_numpy(j)
            head_loss(m, h[jt - 1], ids[0, jt], torch.from_numpy(c)).backward()


class Floor(HFContender):
    name = "floor-hf"

    def prepare(self, work: Work) -> Optional[str]:
        seqs = work.seqs
        longest = max(range(len(seqs)), key=lambda i: len(seqs[i]))
        if all(_lcp(seqs[i], seqs[longest]) == len(seqs[i]) for i in range(len(seqs))):
            self.kind, self.chain = "chain", longest
            self.kernels = "HF Llama sdpa: one causal pass over the chain (CPU flash SDPA is_causal)"
            return self._too_big(len(seqs[longest]))
        groups = prefix_groups(seqs)
        if len(groups) == 1:
            members, p = groups[0]
            lens = {len(seqs[i]) for i in members}
            if len(lens) == 1 and p > 0 and all(_lcp(seqs[members[0]], seqs[i]) >= p for i in members):
                self.kind, self.prompt_len = "grpo", p
                self.kernels = ("HF Llama sdpa: prompt causal with use_cache, responses batched over its expanded "
                                "K/V (CPU flash SDPA with a bool mask)")
                return self._too_big(p + len(members) * (lens.pop() - p))
        return "not one chain nor one prompt with equal-length responses"

    def run(self, work: Work) -> None:
        m = self.model
        s_idx, j, c = work.all_claims()
        if self.kind == "chain":
            ids = torch.from_numpy(work.seqs[self.chain])[None]
            h = m.model(input_ids=ids, use_cache=False).last_hidden_state[0]
            jt = torch.from_numpy(j)
            head_loss(m, h[jt - 1], ids[0, jt], torch.from_numpy(c)).backward()
            return
        from transformers.cache_utils import DynamicCache

        p, g = self.prompt_len, len(work.seqs)
        r = len(work.seqs[0]) - p
        prompt = torch.from_numpy(work.seqs[0][:p])[None]
        out = m.model(input_ids=prompt, use_cache=True)
        cache = DynamicCache()
        for li, layer in enumerate(getattr(out, CACHE_KWARG).layers):
            cache.update(layer.keys.expand(g, -1, -1, -1), layer.values.expand(g, -1, -1, -1), li)
        resp = torch.from_numpy(np.stack([t[p:] for t in work.seqs]))
        pos = torch.arange(p, p + r)[None].expand(g, -1)
        h_r = m.model(input_ids=resp, position_ids=pos, use_cache=True, **{CACHE_KWARG: cache}).last_hidden_state
        hidden = torch.cat([out.last_hidden_state[0], h_r.reshape(g * r, -1)])
        row = np.where(j - 1 < p, j - 1, p + s_idx * r + (j - 1 - p))
        targets = np.array([work.seqs[s][k] for s, k in zip(s_idx, j)], dtype=np.int64)
        head_loss(m, hidden[torch.from_numpy(row)], torch.from_numpy(targets), torch.from_numpy(c)).backward()


class PrefixGrouperContender(HFContender):
    name = "prefix-grouper"
    attn = "prefix_grouper_attention"
    kernels = ("HF Llama + PrefixGrouper hook; its flash-attn 2 padding-mask kernel stood in by CPU flash SDPA "
               "(bool mask) per group row")

    def unavailable(self) -> Optional[str]:
        try:
            import prefix_grouper  # noqa: F401
            from prefix_grouper.utils.register_transformers import register_attention
            from transformers.masking_utils import AttentionMaskInterface
        except ImportError as e:
            return f"package prefix-grouper not installed ({e})"
        register_attention()
        AttentionMaskInterface.register(self.attn, lambda **kwargs: None)  # its hook ignores the model's mask
        return None

    def prepare(self, work: Work) -> Optional[str]:
        self.groups = prefix_groups(work.seqs)
        longest = max(p + sum(len(work.seqs[i]) - p for i in members) for members, p in self.groups)
        return self._too_big(longest)

    def run(self, work: Work) -> None:
        from prefix_grouper import PrefixGrouper

        m, seqs = self.model, work.seqs
        # packing: group info, one row per group = prefix + every suffix, positions continue the prefix
        info, rows, pos, where = [], [], [], {}
        for g, (members, p) in enumerate(self.groups):
            info.append([p] + [len(seqs[i]) - p for i in members])
            row, rpos = [seqs[members[0]][:p]], [np.arange(p)]
            off = p
            for i in members:
                where[i] = (g, p, off)
                row.append(seqs[i][p:])
                rpos.append(np.arange(p, len(seqs[i])))
                off += len(seqs[i]) - p
            rows.append(np.concatenate(row))
            pos.append(np.concatenate(rpos))
        width = max(len(r) for r in rows)
        ids = torch.zeros(len(rows), width, dtype=torch.long)
        position_ids = torch.zeros(len(rows), width, dtype=torch.long)
        for g, (r, q) in enumerate(zip(rows, pos)):
            ids[g, :len(r)] = torch.from_numpy(r)
            position_ids[g, :len(q)] = torch.from_numpy(q)
        grouper = PrefixGrouper(info, device=ids.device, padding_mode="right")
        h = m.model(input_ids=ids, position_ids=position_ids, use_cache=False, prefix_grouper=grouper,
                    prefix_grouper_attn_func=FA2_STANDIN).last_hidden_state
        s_idx, j, c = work.all_claims()
        flat = np.empty(len(j), dtype=np.int64)
        for k, (s, jj) in enumerate(zip(s_idx, j)):
            g, p, off = where[s]
            col = jj - 1 if jj - 1 < p else off + (jj - 1 - p)
            flat[k] = g * width + col
        targets = np.array([seqs[s][k] for s, k in zip(s_idx, j)], dtype=np.int64)
        head_loss(m, h.reshape(-1, h.shape[-1])[torch.from_numpy(flat)], torch.from_numpy(targets),
                  torch.from_numpy(c)).backward()


def load_trl_tree_row():
    """TRL's ``TreeRow`` from ``trl/experimental/async_grpo/packing.py``, loaded as a file: the
    module needs only torch and transformers, while importing it through its package would pull
    the async GRPO trainer's dependencies (accelerate, datasets)."""
    import importlib.util

    spec = importlib.util.find_spec("trl")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("package trl not installed")
    path = os.path.join(list(spec.submodule_search_locations)[0], "experimental", "async_grpo", "packing.py")
    if not os.path.isfile(path):
        raise ImportError(f"this TRL has no {path} (tree packing)")
    mod_spec = importlib.util.spec_from_file_location("_bench_trl_async_grpo_packing", path)
    mod = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(mod)
    return mod.TreeRow


class TrlTreeContender(HFContender):
    name = "trl-tree"
    attn = TREE_STANDIN
    kernels = ("HF Llama + TRL TreeRow pack; its flash-attn 3 varlen kernel stood in by CPU flash SDPA per segment "
               "over the gathered root-path K/V")

    def unavailable(self) -> Optional[str]:
        try:
            self.TreeRow = load_trl_tree_row()
        except Exception as e:  # noqa: BLE001 - reported as the skip reason
            return f"TRL's tree packing (trl/experimental/async_grpo/packing.py, TreeRow) not available: {e}"
        return None

    def prepare(self, work: Work) -> Optional[str]:
        row = self.TreeRow()
        for s in self._samples(work):
            row.add(s)
        return self._too_big(len(row.tokens))

    @staticmethod
    def _samples(work: Work) -> List[dict]:
        out = []
        for s, toks in enumerate(work.seqs):
            mask = np.zeros(len(toks), dtype=np.int64)
            mask[work.claims[s][0]] = 1
            out.append({"input_ids": torch.from_numpy(toks), "completion_mask": torch.from_numpy(mask),
                        "old_log_probs": torch.zeros(len(toks)), "advantage": 0.0, "group_id": 0})
        return out

    def run(self, work: Work) -> None:
        m = self.model
        row = self.TreeRow()
        for s in self._samples(work):
            row.add(s)
        pk = row.pack()
        # its targets come sample by sample, position by position: the order of work.all_claims()
        _, _, c = work.all_claims()
        assert len(pk["token_index"]) == len(c), "TRL's targets do not match the trained tokens"
        q_max, k_max = pk["tree_max_seqlens"].tolist()
        h = m.model(input_ids=pk["input_ids"][None], position_ids=pk["position_ids"][None], use_cache=False,
                    tree_kv_index=pk["tree_kv_index"], tree_cu_seqlens_q=pk["tree_cu_seqlens_q"],
                    tree_cu_seqlens_k=pk["tree_cu_seqlens_k"], tree_max_seqlen_q=q_max,
                    tree_max_seqlen_k=k_max).last_hidden_state[0]
        ti = pk["token_index"]
        head_loss(m, h[ti], pk["shift_labels"][ti], torch.from_numpy(c)).backward()


def load_areal_dta(src: str):
    """``(DTAEngine, TokenTrie)`` from an AReaL source folder without importing the AReaL package
    (its ``__init__`` pulls its whole runtime): the packages on the way are bare namespaces over
    the folder, and two modules DTA reaches only for a logger and an NPU check are shims."""
    def namespace(name: str, sub: str) -> None:
        if name not in sys.modules:
            mod = types.ModuleType(name)
            mod.__path__ = [os.path.join(src, sub)]
            sys.modules[name] = mod

    for name in ("areal", "areal.utils", "areal.utils.functional", "areal.infra", "areal.experimental",
                 "areal.experimental.dta"):
        namespace(name, name.replace(".", os.sep))
    log = types.ModuleType("areal.utils.logging")
    log.getLogger = lambda name=None, *a, **k: logging.getLogger(f"areal.{name}")
    sys.modules.setdefault("areal.utils.logging", log)
    plat = types.ModuleType("areal.infra.platforms")
    plat.is_npu_available = False
    sys.modules.setdefault("areal.infra.platforms", plat)
    functional = sys.modules["areal.utils.functional"]
    if not hasattr(functional, "gather_logprobs_entropy"):  # the package __init__'s re-exports DTA uses
        vp = importlib.import_module("areal.utils.functional.vocab_parallel")
        functional.gather_logprobs, functional.gather_logprobs_entropy = vp.gather_logprobs, vp.gather_logprobs_entropy
    engine = importlib.import_module("areal.experimental.dta.dta_engine")
    trie = importlib.import_module("areal.experimental.dta.token_trie")
    return engine.DTAEngine, trie.TokenTrie


class ArealDtaContender(HFContender):
    """AReaL-DTA at one block size: -1 = whole sequences (no block limit), else tokens."""

    def __init__(self, hf_config: dict, state_dict: Dict[str, torch.Tensor], max_forward_tokens: int,
                 block_size: int = -1, name: str = "areal-dta-whole"):
        super().__init__(hf_config, state_dict, max_forward_tokens)
        self.block_size, self.name = block_size, name
        self.kernels = (f"HF Llama sdpa (CPU flash SDPA) under DTAEngine: KV-cached pops in TokenTrie order, block "
                        f"{'whole sequence' if block_size < 0 else block_size}")

    def unavailable(self) -> Optional[str]:
        src = os.environ.get("AREAL_DTA_SRC")
        if not src:
            return "AREAL_DTA_SRC not set (a folder with the feat/dta branch of inclusionAI/AReaL)"
        if not os.path.isfile(os.path.join(src, "areal", "experimental", "dta", "dta_engine.py")):
            return f"AREAL_DTA_SRC={src} has no areal/experimental/dta/dta_engine.py"
        try:
            self.DTAEngine, self.TokenTrie = load_areal_dta(src)
        except Exception as e:  # noqa: BLE001 - reported as the skip reason
            return f"AReaL-DTA does not import from {src}: {type(e).__name__}: {e}"
        return None

    def prepare(self, work: Work) -> Optional[str]:
        self.engine = self.DTAEngine(model_config=self.model.config, device=torch.device("cpu"), dtype=torch.float32,
                                     max_seq_len=max(len(t) for t in work.seqs))
        return None

    def run(self, work: Work) -> None:
        trie = self.TokenTrie([torch.from_numpy(t) for t in work.seqs], [{"sample": i} for i in range(len(work.seqs))],
                              sorted=False)
        trie.backward_permute()
        claims = [(torch.from_numpy(j), torch.from_numpy(c)) for j, c in work.claims]

        def loss_fn(logprobs, entropy, attachment):  # logprobs[i] = log p(token i+1)
            j, c = claims[attachment["sample"]]
            return -(c * logprobs[j - 1]).sum()

        self.engine.backward(model=self.model, token_trie=trie, loss_fn=loss_fn, block_size=self.block_size)


# ---------------------------------------------------------------------- the project
class PeerBench(Bench):
    """The project's side: one ``PolicyActor`` on the in-memory model of ``hf_config`` /
    ``state_dict`` (step_bench's Bench over its engine, for the profiles). Its configurations
    (default budget, one pack, no sharing, the guard's splits) are the actor's ``ActorConfig``
    with a few fields replaced between calls: one model, one set of weights, no rebuild."""

    def __init__(self, hf_config: dict, state_dict: Dict[str, torch.Tensor], micro_batch_tokens: int,
                 device: torch.device):
        config = ActorConfig(device=device.type, seed=0, micro_batch_tokens=micro_batch_tokens,
                             attention_backend="torch", loss=LossConfig(loss_agg="token-mean"))
        # the cache's own limit is set at build: the largest budget any configuration here plans with
        self.actor = PolicyActor(ModelSource(hf_config=hf_config, hf_state_dict=state_dict),
                                 dataclasses.replace(config, kv_cache_budget=LARGE_KV), for_training=False)
        self.base_config = config
        self.engine = self.actor.engine
        self.arch, self.model, self.cache = self.engine.arch, self.engine.model, self.engine.kv_cache
        self.device = device
        self.cost = self.engine.flop_model
        self.loss = config.loss
        self.budget = micro_batch_tokens
        self.geometry = self.engine.geometry
        self.runners = {"torch": self.engine.runner,
                        "dense": make_runner(self.model, self.arch.vocab_size, device, "dense", self.cache)}
        self.hf_names = list(state_dict)
        self.hf_config, self.state_dict = hf_config, state_dict
        self.layers_desc = f"megatron-core {self.actor.transformer_impl} layers (fused QKV, fused gate/up)"
        self.attention_desc = (f"attention backend {self.actor.backend_name}: blockwise tree attention, CPU flash SDPA "
                               "(_scaled_dot_product_flash_attention_for_cpu) per segment (causal) and per ancestor "
                               "block (unmasked), lse merge; head: trained rows, fused log-softmax")

    def configure(self, **overrides) -> ActorConfig:
        cfg = dataclasses.replace(self.base_config, **overrides)
        self.actor.config = self.engine.config = cfg
        return cfg

    def forward_backward(self, batch: SampleBatch, **overrides) -> dict:
        """One ``PolicyActor.forward_backward`` under ``overrides``; its metrics."""
        self.configure(**overrides)
        try:
            return self.actor.forward_backward(batch, return_logprobs=False).metrics
        finally:
            self.configure()

    def micro_batches(self, batch: SampleBatch, **overrides) -> int:
        """How many micro-batches the actor plans for ``batch`` under ``overrides``."""
        self.configure(**overrides)
        try:
            _, plan, _, _ = self.actor.plan(batch)
            return len(plan.ranks[0].micro_batches)
        finally:
            self.configure()

    def grads_mcore(self) -> Dict[str, torch.Tensor]:
        out = {}
        for n, p in self.model.named_parameters():
            g = getattr(p, "main_grad", None) if p.grad is None else p.grad
            out[canonical_name(n)] = (g if g is not None else torch.zeros_like(p)).detach().float().clone()
        return out

    def grads_hf_named(self) -> Dict[str, torch.Tensor]:
        """The project's gradients under Hugging Face names (the adapter's inverse on these linear maps)."""
        g = self.grads_mcore()
        return dict(get_adapter(self.arch).mcore_to_hf(g))

    # -------------------------------------------------------------- per-phase breakdown
    def profile(self, batch: SampleBatch, top_ops: int = 12) -> dict:
        """One shared step split into phases (direct timers), forward by layer part (hooks),
        one optimizer step, and the top operators under torch.profiler."""
        self.model.zero_grad(set_to_none=True)
        phases: Dict[str, float] = {}

        def add(key: str, dt: float) -> None:
            phases[key] = phases.get(key, 0.0) + dt

        def timed(fn, key):
            def wrapper(*a, **k):
                t = time.perf_counter()
                try:
                    return fn(*a, **k)
                finally:
                    add(key, time.perf_counter() - t)
            return wrapper

        parts = _layer_part_hooks(self.model)
        t0 = time.perf_counter()
        t = time.perf_counter()
        tree = build_prefix_tree(batch)
        add("tree build", time.perf_counter() - t)
        t = time.perf_counter()
        plan = plan_step(tree, self.engine.planner_config("tree"))
        rank = plan.ranks[0]
        memory = plan_memory(rank, self.geometry, 4 << 30, self.engine.act_bytes) if rank.sources else None
        add("plan", time.perf_counter() - t)
        # A runner of its own: its stages are wrapped with timers below (the bench's stays as it is).
        runner = make_runner(self.model, self.arch.vocab_size, self.device, "torch", self.cache)
        try:
            rank.pack = timed(rank.pack, "pack")
        except (AttributeError, TypeError):  # a frozen plan: pack timed inside "other"
            pass
        runner._stage_forward = timed(runner._stage_forward, "forward (model, to the final norm)")
        runner._loss_head = timed(runner._loss_head, "loss head (forward)")
        runner._stage_backward = timed(runner._stage_backward, "backward (whole model)")
        parts.reset()
        runner.train(plan, 0, self.loss, memory)
        total = time.perf_counter() - t0
        parts.remove()
        accounted = sum(phases.values())
        phases["other (step bookkeeping, claim coefficients)"] = max(total - accounted, 0.0)
        forward_parts = parts.summary(phases.get("forward (model, to the final norm)", 0.0))

        # one optimizer step, timed separately (the second: the first allocates its state), on an actor of its
        # own: building an optimizer wraps its model for gradient reduction (backward hooks that move every
        # gradient into a main_grad buffer), which would change every later step of the bench's model
        trainer = PolicyActor(ModelSource(hf_config=self.hf_config, hf_state_dict=self.state_dict),
                              dataclasses.replace(self.base_config, kv_cache_budget=LARGE_KV))
        trainer.forward_backward(batch, return_logprobs=False)
        trainer.optimizer_step()
        trainer.forward_backward(batch, return_logprobs=False)
        t = time.perf_counter()
        trainer.optimizer_step()
        opt_s = time.perf_counter() - t
        del trainer

        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            self.step(batch, "shared")
        ops = [{"op": e.key, "self_s": e.self_cpu_time_total / 1e6, "calls": e.count}
               for e in sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:top_ops]]
        self.model.zero_grad(set_to_none=True)
        return {"step_s": total, "phases": phases, "forward_parts": forward_parts, "optimizer_step_s": opt_s,
                "top_ops": ops}


class _LayerParts:
    """Forward time of the project's modules by kind, from forward pre/post hooks."""

    KINDS = {"core_attention": "attention core", "linear_qkv": "QKV projection", "linear_proj": "output projection",
             "mlp": "MLP", "input_layernorm": "norms", "pre_mlp_layernorm": "norms", "final_layernorm": "norms",
             "self_attention": "_attention block", "embedding": "embedding"}

    def __init__(self):
        self.times: Dict[str, float] = {}
        self.handles = []
        self.starts: Dict[int, float] = {}

    def reset(self) -> None:
        self.times.clear()

    def remove(self) -> None:
        for h in self.handles:
            h.remove()

    def summary(self, forward_total: float) -> Dict[str, float]:
        t = dict(self.times)
        block = t.pop("_attention block", 0.0)
        inner = sum(t.get(k, 0.0) for k in ("attention core", "QKV projection", "output projection"))
        t["attention block rest (RoPE, reshapes)"] = max(block - inner, 0.0)
        t["rest of forward (residuals, layer glue)"] = max(forward_total - sum(t.values()), 0.0)
        return t


def _layer_part_hooks(model) -> _LayerParts:
    parts = _LayerParts()
    for name, mod in model.named_modules():
        kind = parts.KINDS.get(name.rsplit(".", 1)[-1])
        if kind is None:
            continue

        def pre(m, args, key=id(mod)):
            parts.starts[key] = time.perf_counter()

        def post(m, args, out, key=id(mod), kind=kind):
            parts.times[kind] = parts.times.get(kind, 0.0) + time.perf_counter() - parts.starts.pop(key)

        parts.handles += [mod.register_forward_pre_hook(pre), mod.register_forward_hook(post)]
    return parts


# ---------------------------------------------------------------------- measurement
def grad_check(grads: Dict[str, torch.Tensor], ref: Dict[str, torch.Tensor], rtol: float) -> Tuple[bool, float, str]:
    """(ok, worst max|g - ref| / max|ref| over tensors, its tensor)."""
    worst, worst_name = 0.0, ""
    ok = True
    for name, r in ref.items():
        g = grads.get(name)
        if g is None:
            return False, float("inf"), f"{name} missing"
        r = r.float()
        err = (g.float() - r).abs().max().item()
        scale = r.abs().max().item()
        rel = err / scale if scale > 0 else (0.0 if err == 0 else float("inf"))
        if rel > worst:
            worst, worst_name = rel, name
        ok &= err <= rtol * scale + 1e-12
    return ok, worst, worst_name


def spread(times: List[float]) -> Dict[str, Optional[float]]:
    """Median, min, max, quartiles (``statistics.quantiles``, inclusive) and their relative widths."""
    if not times:
        return {"median": None, "min": None, "max": None, "q1": None, "q3": None, "range_pct": None, "iqr_pct": None}
    med = statistics.median(times)
    q1, q3 = (statistics.quantiles(times, n=4, method="inclusive")[::2] if len(times) > 1 else (times[0], times[0]))
    return {"median": med, "min": min(times), "max": max(times), "q1": q1, "q3": q3,
            "range_pct": 100 * (max(times) - min(times)) / med if med else None,
            "iqr_pct": 100 * (q3 - q1) / med if med else None}


@dataclass
class Result:
    name: str
    status: str = "ok"            # ok | FAILED | skipped | error
    reason: str = ""
    kernels: str = ""
    times: List[float] = field(default_factory=list)
    cpu_times: List[float] = field(default_factory=list)
    grad_rel_err: Optional[float] = None
    grad_worst: str = ""
    peak_bytes: Optional[int] = None
    clock: str = "wall"

    @property
    def clocked_times(self) -> List[float]:
        """The rounds' times on ``clock`` (``--clock``): what ``median`` and a row's ``spread_s`` read."""
        return self.cpu_times if self.clock == "cpu" else self.times

    @property
    def median(self) -> Optional[float]:
        t = self.clocked_times
        return statistics.median(t) if t else None

    @property
    def median_wall(self) -> Optional[float]:
        return statistics.median(self.times) if self.times else None

    @property
    def median_cpu(self) -> Optional[float]:
        return statistics.median(self.cpu_times) if self.cpu_times else None


def _clock(c: Contender, work: Work) -> Tuple[float, float]:
    """(wall seconds, process CPU seconds) of one step of ``c``."""
    c.zero_grad()
    t, cpu = time.perf_counter(), time.process_time()
    c.run(work)
    return time.perf_counter() - t, time.process_time() - cpu


def _peak(c: Contender, work: Work) -> int:
    """Peak heap bytes of one untimed step of ``c`` above its start (the same measure for all),
    measured once per workload: memory_curve's at-peer rows plan under the very peak the peer's
    row reports."""
    peaks = c.__dict__.setdefault("_peaks", {})
    if work.name not in peaks:
        c.zero_grad()
        c.before_memory_run()
        with PeakMemory(torch.device("cpu"), mode=MEMORY_MODE) as mem:
            c.run(work)
        peaks[work.name] = int(mem.peak_bytes - mem.start_bytes)
    return peaks[work.name]


def bench_workload(work: Work, contenders: List[Contender], bench: PeerBench, args, log
                   ) -> Tuple[Dict[str, Result], List[str]]:
    """Warm-up + gradient check, one memory run each, then ``args.repeats`` interleaved rounds;
    returns the results and the order in which the timed steps ran."""
    results: Dict[str, Result] = {}
    ref = None
    first: Dict[str, Tuple[float, float]] = {}
    for c in contenders:  # hf-per-sample first: the reference
        r = results[c.name] = Result(c.name, clock=args.clock)
        c.ready = False  # (warmed up and checked: a later contender may measure it, memory_curve's at-peer rows)
        why = getattr(c, "_unavailable", None)
        if why is None:
            try:
                why = c.prepare(work)
            except Exception as e:  # noqa: BLE001 - a contender that breaks is reported, not fatal
                r.status, r.reason = "error", f"prepare: {type(e).__name__}: {e}"
                log(f"  {c.name}: ERROR in prepare: {r.reason}")
                continue
        r.kernels = c.kernels
        if why:
            r.status, r.reason = "skipped", why
            log(f"  {c.name}: skipped: {why}")
            continue
        try:
            first[c.name] = _clock(c, work)  # warm-up = the gradient check
            grads = c.grads()
        except Exception as e:  # noqa: BLE001
            r.status, r.reason = "error", f"{type(e).__name__}: {e}"
            log(f"  {c.name}: ERROR: {r.reason}")
            if args.verbose:
                traceback.print_exc()
            continue
        if c.name == "hf-per-sample":
            ref = grads
        if ref is None:
            r.status, r.reason = "error", "no reference gradients (hf-per-sample failed)"
            continue
        ok, rel, worst = grad_check(grads, ref, args.grad_rtol)
        r.grad_rel_err, r.grad_worst = rel, worst
        if not ok:
            r.status, r.reason = "FAILED", f"gradient max rel err {rel:.2e} on {worst} (> {args.grad_rtol:g})"
        log(f"  {c.name}: warm-up {first[c.name][0]:.3f}s (CPU {first[c.name][1]:.3f}s), grad rel err {rel:.1e} "
            f"({'ok' if ok else 'FAILED'})")
        c.ready = ok
        del grads
        c.zero_grad()
    live = [c for c in contenders if results[c.name].status == "ok"]
    for c in live:
        if first[c.name][0] > args.slow_seconds:
            results[c.name].times.append(first[c.name][0])
            results[c.name].cpu_times.append(first[c.name][1])
            results[c.name].reason = f"timed by its warm-up only (> {args.slow_seconds:g} s); memory not measured"
    timed = [c for c in live if not results[c.name].times]
    for c in timed:  # untimed: the same peak-memory measure for every contender
        results[c.name].peak_bytes = _peak(c, work)
    order: List[str] = []
    for rep in range(args.repeats):  # interleaved: A B C ... A B C ..., so drift hits every contender alike
        for c in timed:
            wall, cpu = _clock(c, work)
            results[c.name].times.append(wall)
            results[c.name].cpu_times.append(cpu)
            order.append(c.name)
    for c in live:
        c.zero_grad()
    return results, order


def summarise(work: Work, results: Dict[str, Result], order: List[str]) -> dict:
    med = {n: r.median for n, r in results.items() if r.status == "ok" and r.median is not None}
    peers = {n: t for n, t in med.items() if is_peer(n)}
    best_peer = min(peers, key=peers.get) if peers else None
    floors = {n: med[n] for n in FLOORS if n in med}
    floor_name = min(floors, key=floors.get) if floors else None
    floor = floors.get(floor_name)
    floor_est = med["psrl-no-sharing"] / work.ideal_speedup if "psrl-no-sharing" in med else None
    floor_used, floor_kind = (floor, floor_name) if floor is not None else (floor_est, "est.")
    rows = []
    for n, r in results.items():
        t = med.get(n)
        rows.append({
            "contender": n, "status": r.status, "reason": r.reason, "kernels": r.kernels, "median_s": t,
            "runs": len(r.times), "median_wall_s": r.median_wall, "median_cpu_s": r.median_cpu,
            "spread_wall": spread(r.times), "spread_cpu": spread(r.cpu_times),
            "spread_s": spread(r.clocked_times),  # the rounds' range on median_s's clock
            "peak_mb": None if r.peak_bytes is None else r.peak_bytes / 2**20,
            "vs_best_peer": t / peers[best_peer] if t is not None and best_peer else None,
            "vs_floor": t / floor_used if t is not None and floor_used else None,
            "grad_rel_err": r.grad_rel_err, "grad_worst_tensor": r.grad_worst, "times_s": r.times,
            "cpu_times_s": r.cpu_times,
        })
    psrl = med.get("psrl")
    return {
        "workload": work.name, "samples": work.batch.num_samples, "tokens": int(work.batch.num_tokens),
        "tree_tokens": work.tree_tokens, "trained_tokens": work.num_claims, "ideal_speedup": work.ideal_speedup,
        "best_peer": best_peer, "psrl_over_best_peer": psrl / peers[best_peer] if psrl and best_peer else None,
        "floor_s": floor, "floor_name": floor_name, "floor_estimate_s": floor_est, "floor_kind": floor_kind,
        "psrl_over_floor": psrl / floor_used if psrl and floor_used else None,
        "timed_order": order, "rows": rows,
    }


# ---------------------------------------------------------------------- mechanism 2's guard
GUARD_SPLITS = (2, 4, 8)
DEFAULT_GUARDS = "tree,tree-8-roots"
"""The guard's default workloads: the default ``tree`` (4,007 tree tokens: k = 8 splits it into
micro-batches of about 500 tokens, an eighth of the default budget, where the fixed cost of a
pass through the layers shows) and ``tree-8-roots`` (17,725: k = 8 gives about 2,400 tokens per
micro-batch, near the default budget). A guard workload that ``--workloads`` does not select
runs the guard alone, without the contenders."""


def split_budget(bench: PeerBench, batch: SampleBatch, tree_tokens: int, k: int) -> Tuple[int, int]:
    """A micro-batch budget under which the actor plans ``k`` micro-batches for ``batch`` (or
    the nearest count found), and that count."""
    best = None
    base = -(-tree_tokens // k)
    for f in (1.0, 1.02, 1.05, 0.98, 0.95, 1.1, 0.9, 1.2, 0.85, 1.3, 0.8, 0.7, 0.6, 1.5):
        budget = max(int(base * f), 16)
        n = bench.micro_batches(batch, micro_batch_tokens=budget, kv_cache_budget=LARGE_KV)
        if n == k:
            return budget, n
        if best is None or abs(n - k) < abs(best[1] - k):
            best = (budget, n)
    return best


def independent_parts(bench: PeerBench, batch: SampleBatch, budget: int, seed: int = 0) -> SampleBatch:
    """Unrelated sequences as long as the micro-batches the actor plans for ``batch`` under
    ``budget`` (the last quarter of each trained): the same pack sizes with nothing shared
    between them, so splitting them into micro-batches costs what micro-batching itself costs
    (each pass through the layers, megatron's and ours), without mechanism 2's reads and
    injected gradients."""
    bench.configure(micro_batch_tokens=budget, kv_cache_budget=LARGE_KV)
    try:
        _, plan, _, _ = bench.actor.plan(batch)
    finally:
        bench.configure()
    rng = np.random.default_rng(seed)
    records = []
    for i, mb in enumerate(plan.ranks[0].micro_batches):
        n = len(mb.tokens)
        trained = max(1, n // 4)
        records.append({"id": f"part{i}", "tokens": rng.integers(0, bench.arch.vocab_size, n).tolist(),
                        "loss_mask": [0] * (n - trained) + [1] * trained, "advantage": 1.0})
    return samples_from_dicts(records, source="independent-parts")


def guard(work: Work, bench: PeerBench, args, log) -> dict:
    """The tree in one pack against it split into k micro-batches, nothing recomputed, interleaved;
    beside them, the largest split's packs as unrelated sequences, in one pack and one per
    micro-batch: what the split costs without mechanism 2 (micro-batching alone)."""
    variants = {"one pack": (work.batch, dict(micro_batch_tokens=ONE_PACK, kv_cache_budget=LARGE_KV))}
    for k in GUARD_SPLITS:
        budget, n = split_budget(bench, work.batch, work.tree_tokens, k)
        variants[f"k={k}"] = (work.batch, dict(micro_batch_tokens=budget, kv_cache_budget=LARGE_KV))
    k_max = f"k={GUARD_SPLITS[-1]}"
    parts = independent_parts(bench, work.batch, variants[k_max][1]["micro_batch_tokens"], args.seed)
    variants["unrelated, one pack"] = (parts, dict(micro_batch_tokens=ONE_PACK, kv_cache_budget=LARGE_KV))
    variants[f"unrelated, {k_max}"] = (parts, dict(micro_batch_tokens=int(parts.lengths.max()),
                                                    kv_cache_budget=LARGE_KV))
    info, times = {}, {v: [] for v in variants}
    for v, (batch, cfg) in variants.items():  # warm-up: the plan's shape
        m = bench.forward_backward(batch, **cfg)
        info[v] = {"micro_batch_tokens": cfg["micro_batch_tokens"], "micro_batches": m["micro_batches"],
                   "tokens_computed": m["tokens_computed"], "tokens_recomputed": m["tokens_recomputed"],
                   "batch": "tree" if batch is work.batch else "unrelated parts"}
    for _ in range(args.repeats):
        for v, (batch, cfg) in variants.items():
            bench.actor.zero_grad()
            t = time.perf_counter()
            bench.forward_backward(batch, **cfg)
            times[v].append(time.perf_counter() - t)
    bench.actor.zero_grad()
    rows = []
    for v in variants:
        one = times["one pack" if info[v]["batch"] == "tree" else "unrelated, one pack"]
        s = spread(times[v])
        paired = [a / b for a, b in zip(times[v], one)]
        rows.append({"variant": v, **info[v], "spread": s, "times_s": times[v],
                     "ratio_of_medians": s["median"] / statistics.median(one),
                     "median_paired_ratio": statistics.median(paired), "paired_ratios": paired})
    splits = [r for r in rows if r["batch"] == "tree" and r["variant"] != "one pack"]
    worst = max((r["ratio_of_medians"] for r in splits), default=None)
    worst_paired = max((r["median_paired_ratio"] for r in splits), default=None)
    by_name = {r["variant"]: r for r in rows}
    alone = by_name[f"unrelated, {k_max}"]["median_paired_ratio"]
    out = {"workload": work.name, "tree_tokens": work.tree_tokens, "target": args.guard_target, "rows": rows,
           "worst_ratio": worst, "worst_paired_ratio": worst_paired,
           "passed": worst_paired is not None and worst_paired <= args.guard_target,
           "largest_split": k_max, "micro_batching_ratio": alone,
           "mechanism2_ratio": by_name[k_max]["median_paired_ratio"] / alone}
    log("  guard: " + ", ".join(f"{r['variant']} ({r['micro_batches']} mb, {r['tokens_recomputed']} recomputed) "
                                f"{r['spread']['median']:.3f}s x{r['ratio_of_medians']:.2f} "
                                f"(paired x{r['median_paired_ratio']:.2f})" for r in rows))
    log(f"  guard: {k_max}: micro-batching alone x{alone:.2f}, mechanism 2 beyond it x{out['mechanism2_ratio']:.2f}")
    return out


# ---------------------------------------------------------------------- the baseline's per-token cost
BASELINE_VARIANTS = {
    "none @ default budget": ("actor", dict(prefix_sharing="none")),
    "none, one pack": ("actor", dict(prefix_sharing="none", micro_batch_tokens=ONE_PACK)),
    "none, one sample per micro-batch": ("per-sample", {}),
    "tree @ default budget (psrl)": ("actor", {}),
    "hf-per-sample": ("hf", {}),
}


def _op_split(prof) -> Dict[str, float]:
    """Self CPU seconds of one profiled step: attention kernels, GEMMs, the rest."""
    out = {"attention kernels": 0.0, "GEMMs": 0.0, "rest": 0.0}
    for e in prof.key_averages():
        s = e.self_cpu_time_total / 1e6
        k = e.key
        if "flash_attention" in k or "scaled_dot_product" in k or "efficient_attention" in k:
            out["attention kernels"] += s
        elif k in ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::matmul", "aten::linear"):
            out["GEMMs"] += s
        else:
            out["rest"] += s
    return out


def baseline_profile(work: Work, bench: PeerBench, per_sample: Contender, args, log) -> dict:
    """``prefix_sharing="none"`` three ways, the shared step and HF's per-sample loop: ms per
    computed token, FLOPs and the attention / GEMM / rest split of one profiled step."""
    from torch.profiler import ProfilerActivity, profile

    from megatron_psrl.tree.key_pairs import batch_key_pairs, tree_key_pairs

    tree = build_prefix_tree(work.batch)
    lens = np.diff(work.batch.offsets)
    base_pairs = int(batch_key_pairs(work.batch))
    tree_pairs = int(tree_key_pairs(tree))

    def step(kind, cfg):
        if kind == "actor":
            return bench.forward_backward(work.batch, **cfg)
        if kind == "per-sample":
            r = bench.step(work.batch, "per-sample")
            return {"tokens_computed": r["tokens_computed"], "tokens_recomputed": r["tokens_recomputed"],
                    "micro_batches": r["micro_batches"]}
        per_sample.run(work)
        return {"tokens_computed": int(work.batch.num_tokens), "tokens_recomputed": 0, "micro_batches": len(lens)}

    def zero():
        bench.actor.zero_grad()
        per_sample.zero_grad()

    info, times = {}, {v: [] for v in BASELINE_VARIANTS}
    for v, (kind, cfg) in BASELINE_VARIANTS.items():
        zero()
        info[v] = step(kind, cfg)
    for _ in range(args.baseline_repeats):
        for v, (kind, cfg) in BASELINE_VARIANTS.items():
            zero()
            t = time.perf_counter()
            step(kind, cfg)
            times[v].append(time.perf_counter() - t)
    rows = []
    for v, (kind, cfg) in BASELINE_VARIANTS.items():
        zero()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            t = time.perf_counter()
            step(kind, cfg)
            prof_s = time.perf_counter() - t
        split = _op_split(prof)
        shared = v.startswith("tree")
        toks = int(info[v]["tokens_computed"])
        pairs = tree_pairs if shared else base_pairs
        flops = bench.cost.cost(toks, pairs, work.num_claims)
        s = spread(times[v])
        rows.append({"variant": v, **{k: int(info[v][k]) for k in ("tokens_computed", "tokens_recomputed",
                                                                   "micro_batches")},
                     "key_pairs": pairs, "flops": flops, "spread": s, "times_s": times[v],
                     "ms_per_token": 1e3 * s["median"] / toks, "ms_per_gflop": 1e3 * s["median"] / (flops / 1e9),
                     "profiled_step_s": prof_s, "op_split_s": split,
                     "attention_ms_per_mpair": 1e3 * split["attention kernels"] / (pairs / 1e6),
                     "gemm_ms_per_ktoken": 1e3 * split["GEMMs"] / (toks / 1e3),
                     "rest_ms_per_ktoken": 1e3 * split["rest"] / (toks / 1e3)})
        log(f"  {v}: {s['median']:.3f}s [{s['min']:.3f}-{s['max']:.3f}] {rows[-1]['ms_per_token']:.3f} ms/token, "
            f"profile attention {split['attention kernels']:.2f}s GEMM {split['GEMMs']:.2f}s rest {split['rest']:.2f}s")
    zero()
    return {"workload": work.name, "tokens": int(work.batch.num_tokens), "tree_tokens": int(tree.num_tree_tokens),
            "samples": int(work.batch.num_samples), "baseline_key_pairs": base_pairs, "tree_key_pairs": tree_pairs,
            "ideal_speedup": work.ideal_speedup, "rows": rows}


# ---------------------------------------------------------------------- report
def _f(x, fmt):
    return "-" if x is None else format(x, fmt)


def _range(s: dict) -> str:
    return "-" if s["min"] is None else f"{s['min']:.3f}-{s['max']:.3f}"


def markdown(out: dict) -> str:
    summaries, profiles, meta = out["workloads"], out["profiles"], out["meta"]
    lines = [
        f"Model: Llama h{meta['hidden']} / i{meta['intermediate']} / {meta['layers']} layers / {meta['heads']} heads / "
        f"{meta['kv_heads']} KV heads / vocab {meta['vocab']}, fp32, {meta['threads']} threads, {meta['device']}; "
        f"load average {meta['load_average']} at the start. {meta['repeats']} timed rounds per workload after one "
        "warm-up (packing + forward + backward, no optimizer), contenders interleaved within each round "
        "(A B C ... A B C ...); median and min-max of the rounds (IQR in the JSON). Peak MB: heap bytes in use above "
        f"the step's start, PeakMemory `{MEMORY_MODE}` mode, one separate untimed run per contender. Gradients of "
        f"every parameter checked against hf-per-sample (per tensor max|g - g_ref| <= {meta['grad_rtol']:g} * "
        "max|g_ref|). `vs best peer` = time / the fastest passing peer's (hf-per-sample, prefix-grouper, trl-tree, "
        "areal-dta-*); `vs floor` = time / the faster measured floor (floor-psrl, floor-hf), or the FLOP-ideal "
        f"estimate marked est. Ratios use the {meta['clock']} clock (`--clock`).",
        "",
    ]
    for c, why in meta["unavailable"].items():
        lines.append(f"- `{c}` not run: {why}")
    lines.append("")
    lines += summary_table(summaries, meta)
    for s in summaries:
        floor = (f"floor {_f(s['floor_s'], '.3f')} s ({s['floor_name']})" if s["floor_s"] is not None
                 else f"floor n/a, FLOP-ideal estimate {_f(s['floor_estimate_s'], '.3f')} s (est.)")
        rounds = s["timed_order"]
        k = len(set(rounds)) or 1
        lines += [
            f"### {s['workload']}",
            "",
            f"{s['samples']} samples, {s['tokens']} tokens, {s['tree_tokens']} tree tokens, {s['trained_tokens']} "
            f"trained; ideal speedup {s['ideal_speedup']:.2f}x; {floor}. **psrl / best peer "
            f"({s['best_peer'] or '-'}) = {_f(s['psrl_over_best_peer'], '.2f')}, psrl / floor = "
            f"{_f(s['psrl_over_floor'], '.2f')}{' (est.)' if s['floor_kind'] == 'est.' else ''}**",
            "",
            f"Timed order, round 1 of {len(rounds) // k}: {' '.join(rounds[:k])}",
            "",
            "| contender | median s | min-max s | spread | median CPU s | peak MB | runs | vs best peer | vs floor | "
            "gradient check | note |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in s["rows"]:
            if r["status"] == "skipped" and r["contender"] in meta["unavailable"]:
                continue
            sp = r["spread_s"]
            check = "-" if r["grad_rel_err"] is None else \
                f"{'ok' if r['status'] != 'FAILED' else 'FAILED'} ({r['grad_rel_err']:.1e})"
            note = (r["status"] if r["status"] != "ok" else "") + (": " if r["reason"] and r["status"] != "ok" else "") \
                + r["reason"]
            lines.append(f"| {r['contender']} | {_f(r['median_s'], '.3f')} | {_range(sp)} | "
                         f"{_f(sp['range_pct'], '.0f')}{'%' if sp['range_pct'] is not None else ''} | "
                         f"{_f(r['median_cpu_s'], '.3f')} | {_f(r['peak_mb'], '.0f')} | {r['runs']} | "
                         f"{_f(r['vs_best_peer'], '.2f')} | {_f(r['vs_floor'], '.2f')} | {check} | {note} |")
        lines += ["", "| contender | kernels |", "|---|---|"]
        lines += [f"| {r['contender']} | {r['kernels'] or '-'} |" for r in s["rows"]
                  if not (r["status"] == "skipped" and r["contender"] in meta["unavailable"])]
        lines.append("")
        g = out["guards"].get(s["workload"])
        if g:
            lines += guard_md(g)
        p = profiles.get(s["workload"])
        if p:
            lines += _profile_md(p)
    shown = {s["workload"] for s in summaries}
    for name, g in out["guards"].items():
        if name not in shown:  # a guard-only workload
            lines += [f"### {name} (mechanism 2's guard only)", ""] + guard_md(g)
    if out.get("baseline"):
        lines += baseline_md(out["baseline"])
    return "\n".join(lines) + "\n"


def guard_md(g: dict) -> List[str]:
    out = [f"Mechanism 2's guard on {g['workload']} ({g['tree_tokens']} tree tokens; KV budget large, nothing "
           f"recomputed; variants interleaved): worst ratio {_f(g['worst_ratio'], '.2f')} (medians), "
           f"{_f(g['worst_paired_ratio'], '.2f')} (median of per-round ratios); target <= {g['target']:.2f}: "
           f"**{'met' if g['passed'] else 'NOT met'}**", "",
           "| split | budget | micro-batches | recomputed | median s | min-max s | / one pack (medians) | "
           "/ one pack (median per round) |", "|---|---|---|---|---|---|---|---|"]
    for r in g["rows"]:
        budget = "one pack" if r["micro_batch_tokens"] >= ONE_PACK else str(r["micro_batch_tokens"])
        out.append(f"| {r['variant']} | {budget} | {r['micro_batches']} | {r['tokens_recomputed']} | "
                   f"{r['spread']['median']:.3f} | {_range(r['spread'])} | {r['ratio_of_medians']:.2f} | "
                   f"{r['median_paired_ratio']:.2f} |")
    if "micro_batching_ratio" in g:
        k = g["largest_split"]
        out += ["", f"At {k} (median per round): micro-batching alone (the {k} packs as unrelated sequences, one "
                    f"per micro-batch, over the same sequences in one pack) x{g['micro_batching_ratio']:.2f}; the "
                    f"tree's {k} over that, i.e. what mechanism 2 adds: x{g['mechanism2_ratio']:.2f}."]
    return out + [""]


def baseline_md(b: dict) -> List[str]:
    out = [f"### The baseline's per-token cost on {b['workload']}", "",
           f"{b['samples']} samples, {b['tokens']} tokens ({b['baseline_key_pairs']} key pairs without sharing), "
           f"{b['tree_tokens']} tree tokens ({b['tree_key_pairs']} key pairs); ideal speedup "
           f"{b['ideal_speedup']:.2f}x. Interleaved rounds; one more step of each under torch.profiler (self CPU).",
           "", "| variant | micro-batches | tokens computed | median s | min-max s | ms / token | ms / GFLOP | "
           "attention s | GEMM s | rest s | attention ms / M pairs | GEMM ms / k tokens | rest ms / k tokens |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in b["rows"]:
        sp = r["op_split_s"]
        out.append(f"| {r['variant']} | {r['micro_batches']} | {r['tokens_computed']} | {r['spread']['median']:.3f} | "
                   f"{_range(r['spread'])} | {r['ms_per_token']:.3f} | {r['ms_per_gflop']:.2f} | "
                   f"{sp['attention kernels']:.3f} | {sp['GEMMs']:.3f} | {sp['rest']:.3f} | "
                   f"{r['attention_ms_per_mpair']:.2f} | {r['gemm_ms_per_ktoken']:.2f} | {r['rest_ms_per_ktoken']:.2f} |")
    return out + [""]


def summary_table(summaries: List[dict], meta: dict) -> List[str]:
    """One row per workload: every contender's median [min-max] ({clock} clock) and psrl's two ratios."""
    names = [n for n in CONTENDERS if n not in meta["unavailable"]]
    out = [f"Median step seconds ({meta['clock']} clock) [min-max of the rounds] and peak MB; FAILED = gradients "
           "differ from the reference; skip = not applicable or over the memory cap (reason in the workload's table).",
           "", "| workload | " + " | ".join(names) + " | psrl / best peer | psrl / floor |",
           "|---|" + "---|" * (len(names) + 2)]
    for s in summaries:
        rows = {r["contender"]: r for r in s["rows"]}
        cells = []
        for n in names:
            r = rows.get(n)
            if r is None or r["status"] == "skipped":
                cells.append("skip" if r is not None else "-")
            elif r["status"] != "ok":
                cells.append(r["status"])
            else:
                sp = r["spread_s"]
                star = "*" if r["runs"] == 1 and meta["repeats"] > 1 else ""
                cells.append(f"{r['median_s']:.3f}{star} [{_range(sp)}], {_f(r['peak_mb'], '.0f')} MB")
        est = " (est.)" if s["floor_kind"] == "est." and s["psrl_over_floor"] is not None else ""
        out.append(f"| {s['workload']} | " + " | ".join(cells) + f" | {_f(s['psrl_over_best_peer'], '.2f')} "
                   f"({s['best_peer'] or '-'}) | {_f(s['psrl_over_floor'], '.2f')}{est} |")
    return out + ["", "\\* timed by its warm-up only (slower than --slow-seconds).", ""]


def _profile_md(p: dict) -> List[str]:
    out = [f"psrl per-phase breakdown (one profiled step, {p['step_s']:.3f} s; optimizer step timed separately):",
           "", "| phase | s | share |", "|---|---|---|"]
    for k, v in p["phases"].items():
        out.append(f"| {k} | {v:.4f} | {100 * v / p['step_s']:.0f}% |")
    out.append(f"| optimizer step (separate) | {p['optimizer_step_s']:.4f} | - |")
    out += ["", "| forward part | s |", "|---|---|"]
    for k, v in sorted(p["forward_parts"].items(), key=lambda kv: -kv[1]):
        out.append(f"| {k} | {v:.4f} |")
    out += ["", "| top op (torch.profiler, self CPU) | s | calls |", "|---|---|---|"]
    for o in p["top_ops"]:
        out.append(f"| `{o['op']}` | {o['self_s']:.4f} | {o['calls']} |")
    return out + [""]


def _quiet() -> None:
    """AReaL-DTA passes ``past_key_values`` (renamed ``cache`` in transformers 5): not our warning to print."""
    import warnings

    from transformers.utils import logging as hf_logging

    warnings.filterwarnings("ignore", message=".*past_key_values.*")
    hf_logging.set_verbosity_error()
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")


def _dta_blocks(spec: str) -> Dict[str, int]:
    """``whole,4096`` -> {areal-dta-whole: -1, areal-dta-mb: 4096}; other sizes areal-dta-<n>."""
    out = {}
    for b in spec.split(","):
        b = b.strip()
        if b == "whole":
            out["areal-dta-whole"] = -1
        elif b:
            out["areal-dta-mb" if int(b) == DEFAULT_BUDGET else f"areal-dta-{int(b)}"] = int(b)
    return out


def _select(spec: str, names: List[str]) -> List[str]:
    return list(names) if spec == "all" else [] if spec == "none" else [n for n in spec.split(",") if n in names]


def run(args, log=print) -> dict:
    _quiet()
    torch.set_num_threads(args.threads)
    device = torch.device("cpu")
    hf_config = dict(PEER_MODEL)
    state = random_weights(hf_config, args.seed)
    bench = PeerBench(hf_config, state, DEFAULT_BUDGET, device)
    register_standins()
    hf = lambda cls: cls(hf_config, state, args.max_forward_tokens)  # noqa: E731
    all_c: Dict[str, Contender] = {
        "psrl": PsrlContender(bench, "psrl"),
        "psrl-one-pack": PsrlContender(bench, "psrl-one-pack", micro_batch_tokens=ONE_PACK),
        "psrl-no-sharing": PsrlContender(bench, "psrl-no-sharing", prefix_sharing="none"),
        "floor-psrl": FloorPsrl(bench), "floor-hf": hf(Floor), "hf-per-sample": hf(PerSample),
        "prefix-grouper": hf(PrefixGrouperContender), "trl-tree": hf(TrlTreeContender),
    }
    for name, block in _dta_blocks(args.dta_blocks).items():
        all_c[name] = ArealDtaContender(hf_config, state, args.max_forward_tokens, block, name)
    if args.memory_curve or args.memory_breakdown:
        return run_memory(args, bench, all_c, hf_config, state, log)
    chosen = [n for n in (args.contenders.split(",") if args.contenders else all_c)]
    unknown = [n for n in chosen if n not in all_c]
    if unknown:
        raise SystemExit(f"unknown contenders {unknown}; choose from {', '.join(all_c)}")
    if "hf-per-sample" not in chosen:
        chosen.insert(0, "hf-per-sample")  # the gradient reference always runs
    chosen.sort(key=lambda n: n != "hf-per-sample")
    unavailable = {}
    contenders = []
    for n in chosen:
        c = all_c[n]
        c._unavailable = c.unavailable()
        if c._unavailable:
            unavailable[n] = c._unavailable
            log(f"{n}: not run: {c._unavailable}")
        contenders.append(c)
    names = workloads(bench.arch.vocab_size, args.quick)
    selected = args.workloads.split(",") if args.workloads else (list(names) if args.quick else DEFAULT_WORKLOADS)
    unknown = [w for w in selected if w not in names]
    if unknown:
        raise SystemExit(f"unknown workloads {unknown}; choose from {', '.join(names)}")
    want_profile = set(_select(args.profile, selected))
    want_guard = set(_select(args.guard, selected))
    guard_only = [] if args.guard in ("all", "none") else \
        [n for n in args.guard.split(",") if n and n not in selected]
    unknown = [w for w in guard_only if w not in names]
    if unknown:
        raise SystemExit(f"unknown guard workloads {unknown}; choose from {', '.join(names)}")
    summaries, profiles, guards = [], {}, {}
    CONTENDERS[:] = [n for n in CONTENDERS if n in all_c] + [n for n in all_c if n not in CONTENDERS]
    meta = {"hidden": hf_config["hidden_size"], "intermediate": hf_config["intermediate_size"],
            "layers": hf_config["num_hidden_layers"], "heads": hf_config["num_attention_heads"],
            "kv_heads": hf_config["num_key_value_heads"], "vocab": hf_config["vocab_size"],
            "threads": torch.get_num_threads(), "device": "cpu", "micro_batch_tokens": DEFAULT_BUDGET,
            "kv_cache_budget": DEFAULTS.kv_cache_budget, "repeats": args.repeats, "clock": args.clock,
            "grad_rtol": args.grad_rtol, "slow_seconds": args.slow_seconds, "memory_mode": MEMORY_MODE,
            "max_forward_tokens": args.max_forward_tokens, "quick": args.quick, "unavailable": unavailable,
            "load_average": " / ".join(f"{x:.1f}" for x in os.getloadavg()), "psrl_kernels": bench.actor.describe_kernels(),
            "torch": torch.__version__, "platform": platform.platform(), "versions": _versions()}
    log(bench.actor.describe_kernels())
    out = {"meta": meta, "workloads": summaries, "profiles": profiles, "guards": guards, "baseline": None}
    for name in selected:
        work = Work.built(name, names[name](), bench.cost)
        log(f"{name}: {work.batch.num_samples} samples, {work.batch.num_tokens} tokens, {work.tree_tokens} tree "
            f"tokens, ideal {work.ideal_speedup:.2f}x")
        results, order = bench_workload(work, contenders, bench, args, log)
        s = summarise(work, results, order)
        summaries.append(s)
        for r in s["rows"]:
            if r["median_s"] is not None:
                sp = r["spread_s"]
                log(f"  {r['contender']:>16}: {r['median_s']:.3f} s [{_range(sp)}]  peak {_f(r['peak_mb'], '.0f')} MB  "
                    f"vs best peer {_f(r['vs_best_peer'], '.2f')}  vs floor {_f(r['vs_floor'], '.2f')}")
        if name in want_guard:
            guards[name] = guard(work, bench, args, log)
        if name in want_profile:
            profiles[name] = bench.profile(work.batch)
            log("  psrl profile: " + ", ".join(f"{k} {v:.3f}s" for k, v in profiles[name]["phases"].items())
                + f", optimizer step {profiles[name]['optimizer_step_s']:.3f}s")
        write(args.out_dir, out)  # after every workload: a long run that is stopped keeps what it measured
    for name in guard_only:  # the guard alone, no contenders
        work = Work.built(name, names[name](), bench.cost)
        log(f"{name} (guard only): {work.batch.num_samples} samples, {work.batch.num_tokens} tokens, "
            f"{work.tree_tokens} tree tokens")
        guards[name] = guard(work, bench, args, log)
        write(args.out_dir, out)
    if args.baseline_profile:
        if args.baseline_profile not in names:
            raise SystemExit(f"unknown workload {args.baseline_profile}; choose from {', '.join(names)}")
        work = Work.built(args.baseline_profile, names[args.baseline_profile](), bench.cost)
        log(f"baseline profile on {work.name}")
        out["baseline"] = baseline_profile(work, bench, all_c["hf-per-sample"], args, log)
        write(args.out_dir, out)
    return out


def run_memory(args, bench: PeerBench, all_c: Dict[str, Contender], hf_config: dict, state, log) -> dict:
    """``--memory-breakdown`` (the step's peak at the defaults by holder, beside the memory
    plan's prediction) and ``--memory-curve`` (the project's budgets against every peer's
    settings), on the selected workloads (default: the default four)."""
    names = workloads(bench.arch.vocab_size, args.quick)
    selected = args.workloads.split(",") if args.workloads else (list(names) if args.quick else DEFAULT_WORKLOADS)
    out = {"meta": {"repeats": args.repeats, "threads": torch.get_num_threads(), "versions": _versions(),
                    "load_average": " / ".join(f"{x:.1f}" for x in os.getloadavg()), "memory_mode": MEMORY_MODE,
                    "dta_blocks": memory_curve.CURVE_DTA_BLOCKS, "clock": args.clock},
           "breakdown": [], "curves": []}
    os.makedirs(args.out_dir, exist_ok=True)
    contenders: List[Contender] = []
    if args.memory_curve:
        dta = [ArealDtaContender(hf_config, state, args.max_forward_tokens, block, name)
               for name, block in _dta_blocks(memory_curve.CURVE_DTA_BLOCKS).items()]
        peers = [all_c[n] for n in memory_curve.CURVE_PEERS] + dta
        contenders = ([peers[0]] + memory_curve.curve_contenders(bench, PsrlContender) + peers[1:]
                      + memory_curve.at_peer_contenders(bench, PsrlContender, peers, _peak))
        if args.contenders:  # a subset (the gradient reference always runs)
            keep = set(args.contenders.split(",")) | {"hf-per-sample"}
            contenders = [c for c in contenders if c.name in keep]
        for c in contenders:
            c._unavailable = c.unavailable()
        for c in dta:
            memory_curve.skip_same_blocks(c)
    for name in selected if args.memory_breakdown else []:  # first: cheap, and every workload's
        work = Work.built(name, names[name](), bench.cost)
        out["breakdown"].append(memory_curve.breakdown(bench, work))
        m = out["breakdown"][-1]["measured"]
        log(f"{name} breakdown: peak {m['peak_bytes'] / 2**20:.1f} MB at {m['phase']} mb {m['micro_batch']}")
        write_memory(args.out_dir, out)
    for name in selected if args.memory_curve else []:
        work = Work.built(name, names[name](), bench.cost)
        log(f"{name}: {work.batch.num_samples} samples, {work.batch.num_tokens} tokens, {work.tree_tokens} tree tokens")
        results, order = bench_workload(work, contenders, bench, args, log)
        s = summarise(work, results, order)
        for r in s["rows"]:
            c = next(c for c in contenders if c.name == r["contender"])
            if getattr(c, "choice", None) and r["status"] == "ok":  # (an at-peer row: the plan it chose)
                r.update(c.choice, micro_batches=len(c.memory.last.details["plan"].ranks[0].micro_batches))
            elif isinstance(c, PsrlContender) and r["status"] == "ok":
                r["micro_batches"] = bench.micro_batches(work.batch, **c.overrides)
            if r["median_s"] is not None:
                log(f"  {r['contender']:>16}: {r['median_s']:.3f} s  peak {_f(r['peak_mb'], '.0f')} MB")
        s["png"] = memory_curve.plot(s, os.path.join(args.out_dir, f"memory_curve_{name}.png"), args.clock)
        out["curves"].append(s)
        write_memory(args.out_dir, out)
    return out


def write_memory(out_dir: str, out: dict) -> str:
    meta = out["meta"]
    lines = ["# bench_peers: memory", "",
             f"{meta['threads']} threads, load average {meta['load_average']}, {meta['repeats']} interleaved rounds; "
             f"peak = C-heap bytes in use above the step's start, PeakMemory `{meta['memory_mode']}` mode.", ""]
    if out["breakdown"]:
        lines += ["## The step's peak at the defaults, by holder (MB)", ""] + memory_curve.breakdown_md(out["breakdown"])
    for s in out["curves"]:
        png = os.path.basename(s["png"]) if s.get("png") else None
        lines += memory_curve.curve_md(s, png, meta.get("clock", "wall"))
        lines += memory_curve.at_peer_md(s, meta.get("clock", "wall"))
    md = "\n".join(lines)
    write_results(out_dir, "bench_peers_memory", out, md)
    return md


def write(out_dir: str, out: dict) -> str:
    md = markdown(out)
    write_results(out_dir, "bench_peers", out, md)
    return md


def _versions() -> Dict[str, str]:
    out = {}
    for pkg in ("transformers", "prefix_grouper", "trl"):
        try:
            from importlib.metadata import version

            out[pkg] = version(pkg.replace("_", "-"))
        except Exception:  # noqa: BLE001
            pass
    if os.environ.get("AREAL_DTA_SRC"):
        out["areal_dta_src"] = os.environ["AREAL_DTA_SRC"]
    return out


def main(argv=None) -> int:
    out, args = _main(argv)
    summaries = out.get("workloads", out.get("curves", []))
    failed = [(s["workload"], r["contender"]) for s in summaries for r in s["rows"]
              if r["status"] in ("FAILED", "error") and r["contender"] in ("psrl", "psrl-no-sharing", "hf-per-sample")]
    return 1 if failed else 0


def main_result(argv=None) -> dict:
    """The run's result (what ``bench_peers.json`` holds), for other benchmarks."""
    return _main(argv)[0]


def _main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workloads", default=None,
                   help=f"comma-separated subset (default: {','.join(DEFAULT_WORKLOADS)}; --quick: all quick ones)")
    p.add_argument("--contenders", default=None, help=f"comma-separated subset of {','.join(CONTENDERS)}")
    p.add_argument("--repeats", type=int, default=None, help="timed rounds (default 7; --quick 3)")
    p.add_argument("--quick", action="store_true", help="tiny workloads, 3 rounds, no profile (smoke test)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dta-blocks", default=f"whole,{DEFAULT_BUDGET}",
                   help="AReaL-DTA block sizes, one contender each: 'whole' (block_size=-1) or tokens")
    p.add_argument("--grad-rtol", type=float, default=1e-4)
    p.add_argument("--clock", default="wall", choices=["wall", "cpu"],
                   help="which median the ratios use (process CPU time is steadier on a shared machine)")
    p.add_argument("--slow-seconds", type=float, default=None,
                   help="a contender whose warm-up takes longer is timed by that run only (default 30; --quick: never)")
    p.add_argument("--max-forward-tokens", type=int, default=65536,
                   help="skip a Hugging Face contender whose single forward holds more tokens")
    p.add_argument("--profile", default=None, help="psrl per-phase breakdown: all, none (default), or workload names")
    p.add_argument("--guard", default=None,
                   help="mechanism 2's guard (k = 2, 4, 8 vs one pack): all (the selected workloads), none, or "
                        "workload names; a name not in --workloads runs the guard alone "
                        f"(default: {DEFAULT_GUARDS}, or every quick workload with --quick)")
    p.add_argument("--guard-target", type=float, default=1.10)
    p.add_argument("--baseline-profile", default=None, metavar="WORKLOAD",
                   help="the no-sharing baseline's per-token cost, profiled on this workload")
    p.add_argument("--baseline-repeats", type=int, default=3)
    p.add_argument("--memory-breakdown", action="store_true",
                   help="the step's peak at the defaults broken down by holder, beside the memory plan's prediction")
    p.add_argument("--memory-curve", action="store_true",
                   help="the project at micro-batch budgets 512..32768, KV budget at its floor and with "
                        "recomputation, against every peer's settings: a table and a PNG per workload")
    p.add_argument("--out-dir", default="runs/bench_peers")
    p.add_argument("--verbose", action="store_true")
    args = p.parse_args(argv)
    if args.repeats is None:
        args.repeats = 3 if args.quick else 7
    if args.slow_seconds is None:  # (the memory curve needs every point's peak: no warm-up-only timing)
        args.slow_seconds = float("inf") if args.quick or args.memory_curve else 30.0
    if args.profile is None:
        args.profile = "none"
    if args.guard is None:
        args.guard = "all" if args.quick else DEFAULT_GUARDS
    out = run(args)
    md = write_memory(args.out_dir, out) if "curves" in out else write(args.out_dir, out)
    print()
    print(md)
    return out, args


if __name__ == "__main__":
    sys.exit(main())
