#!/usr/bin/env python
"""The project's update step against other prefix-sharing trainers and the floor (issue 13).

    python benchmarks/bench_peers.py [--workloads grpo-512x8x512,stepwise-8x256] [--repeats 5]
                                     [--out-dir runs/bench_peers] [--profile all|none|NAME,...]
    python benchmarks/bench_peers.py --quick          # tiny sizes, 1 repeat (the smoke test)

Every contender runs in this one process on the same weights (one random Hugging Face Llama,
h256 / i512 / 4 layers / 8 heads / 4 KV heads / vocab 2048, fp32, loaded into megatron_psrl
from the same state dict), with the same threads, on the same batch, repeats interleaved; the
reported time is the median of ``--repeats`` after one warm-up (which is also the gradient
check). Timed: packing + forward + backward of the whole batch (no optimizer). The loss of
every contender is the project's ``token-mean`` policy loss at ratio 1, i.e.
``-(1/N) * sum over trained tokens of weight * advantage * log p(token)`` (N = trained tokens),
so all contenders compute the same gradient:

- ``psrl``: megatron_psrl's step (tree build + plan + tree packing + blockwise tree attention);
- ``psrl-no-sharing``: the same with ``--no-prefix-sharing`` (samples packed back to back);
- ``floor``: the least computation that yields the gradient with stock Hugging Face code:
  step-wise chains (every sample a prefix of the longest): one causal forward + backward over
  the chain, every sample's log-probs read off it; GRPO groups (one prompt, equal-length
  responses): the prompt once with ``use_cache=True`` and its K/V reused by one batched forward
  over the responses, backward through both. Other shapes (trees, mixed): "n/a", and the
  FLOP-ideal estimate (``psrl-no-sharing`` time / ideal speedup) is shown instead, marked ``est.``;
- ``hf-per-sample``: Hugging Face, one forward + backward per sample (the gradient reference);
- ``prefix-grouper``: PyPI ``prefix-grouper`` (``PrefixGrouper`` + its transformers attention
  hook); one group per set of samples with a common prefix (the prefix is the group's longest
  common prefix), i.e. one shared prefix per group (nested sharing such as step-wise is beyond it);
- ``trl-tree``: TRL's tree packing (``trl.experimental.async_grpo.packing.TreeRow``, the trie and
  its ``pack()`` layout, unchanged);
- ``areal-dta``: AReaL-DTA's ``DTAEngine.backward`` with its ``TokenTrie`` order and its default
  block size 2048, from the source folder named by ``AREAL_DTA_SRC`` (the ``feat/dta`` branch of
  inclusionAI/AReaL; never vendored).

Attention kernels: Prefix Grouper's default kernel (flash-attn 2 with a padding mask) and TRL's
(flash-attn 3 varlen over gathered K/V paths) need CUDA. On CPU they get a stand-in with the same
contract (same inputs, same causal alignment, bottom-right) built on torch's CPU flash-attention
kernel (``scaled_dot_product_attention`` with a boolean mask), the kernel Hugging Face's
``sdpa`` uses on CPU too; the packing, layouts and index arithmetic are the packages' own.

Gradient check: every contender's gradients of all parameters against ``hf-per-sample`` (fp32):
per tensor, ``max|g - g_ref| <= rtol * max|g_ref|`` with ``rtol`` 1e-4 (``--grad-rtol``); a
contender that fails is reported FAILED and not timed. A contender whose warm-up alone takes
longer than ``--slow-seconds`` is timed by that run only (column ``runs`` = 1). A contender whose
single forward would exceed ``--max-forward-tokens`` tokens (memory) is skipped with the reason.

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
import importlib
import json
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

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from exact_workloads import grpo_exact, stepwise_exact  # noqa: E402
from step_bench import Bench  # noqa: E402

from megatron_psrl.checkpoint import ModelSource  # noqa: E402
from megatron_psrl.checkpoint.state_dict import canonical_name  # noqa: E402
from megatron_psrl.data import make_mixed, make_tree_rollouts  # noqa: E402
from megatron_psrl.data.samples import SampleBatch  # noqa: E402
from megatron_psrl.engine.optimizer import OptimizerSettings, build_optimizer  # noqa: E402
from megatron_psrl.engine.runners import make_runner  # noqa: E402
from megatron_psrl.kvcache import plan_memory  # noqa: E402
from megatron_psrl.model.adapters import get_adapter  # noqa: E402
from megatron_psrl.model.tiny import tiny_config  # noqa: E402
from megatron_psrl.tree import build_prefix_tree  # noqa: E402
from megatron_psrl.tree.planner import plan_step  # noqa: E402

# The model of issue 13 (tiny-llama's h256 / i512 / 4 layers, with 8 heads of 32, 4 KV heads, vocab 2048).
PEER_MODEL = dict(tiny_config("tiny-llama"), num_attention_heads=8, num_key_value_heads=4, head_dim=32,
                  vocab_size=2048)
CONTENDERS = ["psrl", "psrl-no-sharing", "floor", "hf-per-sample", "prefix-grouper", "trl-tree", "areal-dta"]
PEERS = ["hf-per-sample", "prefix-grouper", "trl-tree", "areal-dta"]
"""Other trainers' ways of computing the step (``psrl / best-peer`` is taken over these)."""
DTA_BLOCK_SIZE = 2048  # AReaL's default ``dta_block_size``


# ---------------------------------------------------------------------- workloads
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
    peer = False

    def unavailable(self) -> Optional[str]:
        """Why this contender cannot run at all (None when it can)."""
        return None

    def prepare(self, work: Work) -> Optional[str]:
        """Untimed set-up for ``work``; returns why it does not apply (None when it does)."""
        return None

    def zero_grad(self) -> None:
        self.model.zero_grad(set_to_none=True)

    def run(self, work: Work) -> None:
        raise NotImplementedError

    def grads(self) -> Dict[str, torch.Tensor]:
        """Gradients by Hugging Face parameter name."""
        return {n: (p.grad if p.grad is not None else torch.zeros_like(p)).detach().clone()
                for n, p in self.model.named_parameters()}


class PsrlContender(Contender):
    def __init__(self, bench: "PeerBench", variant: str, name: str):
        self.bench, self.variant, self.name = bench, variant, name
        self.model = bench.model

    def run(self, work: Work) -> None:
        self.bench.step(work.batch, self.variant)

    def grads(self) -> Dict[str, torch.Tensor]:
        return self.bench.grads_hf_named()


class HFContender(Contender):
    attn = "sdpa"

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
    name, peer = "hf-per-sample", True

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
    name = "floor"

    def prepare(self, work: Work) -> Optional[str]:
        seqs = work.seqs
        longest = max(range(len(seqs)), key=lambda i: len(seqs[i]))
        if all(_lcp(seqs[i], seqs[longest]) == len(seqs[i]) for i in range(len(seqs))):
            self.kind, self.chain = "chain", longest
            return self._too_big(len(seqs[longest]))
        groups = prefix_groups(seqs)
        if len(groups) == 1:
            members, p = groups[0]
            lens = {len(seqs[i]) for i in members}
            if len(lens) == 1 and p > 0 and all(_lcp(seqs[members[0]], seqs[i]) >= p for i in members):
                self.kind, self.prompt_len = "grpo", p
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
    name, peer = "prefix-grouper", True
    attn = "prefix_grouper_attention"

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
    name, peer = "trl-tree", True
    attn = TREE_STANDIN

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
    name, peer = "areal-dta", True

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

        self.engine.backward(model=self.model, token_trie=trie, loss_fn=loss_fn, block_size=DTA_BLOCK_SIZE)


# ---------------------------------------------------------------------- the project
class PeerBench(Bench):
    """step_bench's Bench on the in-memory model of ``hf_config`` / ``state_dict``."""

    def __init__(self, hf_config: dict, state_dict: Dict[str, torch.Tensor], micro_batch_tokens: int,
                 device: torch.device):
        super().__init__(ModelSource(hf_config=hf_config, hf_state_dict=state_dict), micro_batch_tokens, device)
        self.hf_names = list(state_dict)

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

        # one optimizer step, timed separately (second step: the first allocates its state); weights restored
        saved = {n: p.detach().clone() for n, p in self.model.named_parameters()}
        opt = build_optimizer(self.model, OptimizerSettings(), self.device)
        try:
            opt.step()
            self.step(batch, "shared")
            t = time.perf_counter()
            opt.step()
            opt_s = time.perf_counter() - t
        finally:
            with torch.no_grad():
                for n, p in self.model.named_parameters():
                    p.copy_(saved[n])
            self.model.zero_grad(set_to_none=True)
            del opt

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


@dataclass
class Result:
    name: str
    status: str = "ok"            # ok | FAILED | skipped | error
    reason: str = ""
    times: List[float] = field(default_factory=list)
    cpu_times: List[float] = field(default_factory=list)
    grad_rel_err: Optional[float] = None
    grad_worst: str = ""

    clock: str = "wall"

    @property
    def median(self) -> Optional[float]:
        t = self.cpu_times if self.clock == "cpu" else self.times
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


def bench_workload(work: Work, contenders: List[Contender], bench: PeerBench, args, log) -> Dict[str, Result]:
    results: Dict[str, Result] = {}
    ref = None
    first: Dict[str, float] = {}
    for c in contenders:  # hf-per-sample first: the reference
        r = results[c.name] = Result(c.name, clock=args.clock)
        why = getattr(c, "_unavailable", None)
        if why is None:
            try:
                why = c.prepare(work)
            except Exception as e:  # noqa: BLE001 - a contender that breaks is reported, not fatal
                r.status, r.reason = "error", f"prepare: {type(e).__name__}: {e}"
                log(f"  {c.name}: ERROR in prepare: {r.reason}")
                continue
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
        log(f"  {c.name}: warm-up {first[c.name][0]:.3f}s (CPU {first[c.name][1]:.3f}s), grad rel err {rel:.1e} ({'ok' if ok else 'FAILED'})")
        del grads
        c.zero_grad()
    live = [c for c in contenders if results[c.name].status == "ok"]
    for c in live:
        if first[c.name][0] > args.slow_seconds:
            results[c.name].times.append(first[c.name][0])
            results[c.name].cpu_times.append(first[c.name][1])
            results[c.name].reason = f"timed by its warm-up only (> {args.slow_seconds:g} s)"
    timed = [c for c in live if not results[c.name].times]
    for rep in range(args.repeats):  # interleaved, so drift hits every contender alike
        for c in timed:
            wall, cpu = _clock(c, work)
            results[c.name].times.append(wall)
            results[c.name].cpu_times.append(cpu)
    for c in live:
        c.zero_grad()
    return results


def summarise(work: Work, results: Dict[str, Result]) -> dict:
    med = {n: r.median for n, r in results.items() if r.status == "ok" and r.median is not None}
    peers = {n: t for n, t in med.items() if n in PEERS}
    best_peer = min(peers, key=peers.get) if peers else None
    floor = med.get("floor")
    floor_est = med["psrl-no-sharing"] / work.ideal_speedup if "psrl-no-sharing" in med else None
    floor_used, floor_kind = (floor, "measured") if floor is not None else (floor_est, "est.")
    rows = []
    for n, r in results.items():
        t = med.get(n)
        rows.append({
            "contender": n, "status": r.status, "reason": r.reason, "median_s": t, "runs": len(r.times),
            "median_wall_s": r.median_wall, "median_cpu_s": r.median_cpu,
            "vs_best_peer": t / peers[best_peer] if t is not None and best_peer else None,
            "vs_floor": t / floor_used if t is not None and floor_used else None,
            "grad_rel_err": r.grad_rel_err, "grad_worst_tensor": r.grad_worst, "times_s": r.times,
            "cpu_times_s": r.cpu_times,
        })
    return {
        "workload": work.name, "samples": work.batch.num_samples, "tokens": int(work.batch.num_tokens),
        "tree_tokens": work.tree_tokens, "trained_tokens": work.num_claims, "ideal_speedup": work.ideal_speedup,
        "best_peer": best_peer,
        "psrl_over_best_peer": med["psrl"] / peers[best_peer] if "psrl" in med and best_peer else None,
        "floor_s": floor, "floor_estimate_s": floor_est, "floor_kind": floor_kind,
        "psrl_over_floor": med["psrl"] / floor_used if "psrl" in med and floor_used else None,
        "rows": rows,
    }


def _f(x, fmt):
    return "-" if x is None else format(x, fmt)


def markdown(summaries: List[dict], profiles: Dict[str, dict], meta: dict) -> str:
    lines = [
        f"Model: Llama h{meta['hidden']} / i{meta['intermediate']} / {meta['layers']} layers / {meta['heads']} heads / "
        f"{meta['kv_heads']} KV heads / vocab {meta['vocab']}, fp32, {meta['threads']} threads, {meta['device']}; "
        f"psrl micro-batch budget {meta['micro_batch_tokens']} tokens. Median of {meta['repeats']} interleaved steps "
        "after one warm-up (packing + forward + backward, no optimizer); gradients of every parameter checked "
        f"against hf-per-sample (per tensor max|g - g_ref| <= {meta['grad_rtol']:g} * max|g_ref|). "
        "`vs best peer` = time / the fastest passing peer's (hf-per-sample, prefix-grouper, trl-tree, areal-dta); "
        "`vs floor` = time / floor (measured, or the FLOP-ideal estimate marked est.). "
        f"Ratios use the {meta['clock']} clock (`--clock`); wall and process-CPU medians both shown.",
        "",
    ]
    for c, why in meta["unavailable"].items():
        lines.append(f"- `{c}` not run: {why}")
    lines.append("")
    lines += summary_table(summaries, meta)
    for s in summaries:
        floor = (f"floor {_f(s['floor_s'], '.3f')} s" if s["floor_s"] is not None
                 else f"floor n/a, FLOP-ideal estimate {_f(s['floor_estimate_s'], '.3f')} s (est.)")
        lines += [
            f"### {s['workload']}",
            "",
            f"{s['samples']} samples, {s['tokens']} tokens, {s['tree_tokens']} tree tokens, {s['trained_tokens']} "
            f"trained; ideal speedup {s['ideal_speedup']:.2f}x; {floor}. **psrl / best peer "
            f"({s['best_peer'] or '-'}) = {_f(s['psrl_over_best_peer'], '.2f')}, psrl / floor = "
            f"{_f(s['psrl_over_floor'], '.2f')}{' (est.)' if s['floor_kind'] == 'est.' else ''}**",
            "",
            "| contender | median wall s | median CPU s | runs | vs best peer | vs floor | gradient check | note |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in s["rows"]:
            if r["status"] in ("skipped",) and r["contender"] in meta["unavailable"]:
                continue
            check = "-" if r["grad_rel_err"] is None else \
                f"{'ok' if r['status'] != 'FAILED' else 'FAILED'} ({r['grad_rel_err']:.1e})"
            lines.append(f"| {r['contender']} | {_f(r['median_wall_s'], '.3f')} | {_f(r['median_cpu_s'], '.3f')} | "
                         f"{r['runs']} | "
                         f"{_f(r['vs_best_peer'], '.2f')} | {_f(r['vs_floor'], '.2f')} | {check} | "
                         f"{r['status'] if r['status'] != 'ok' else ''}{': ' if r['reason'] and r['status'] != 'ok' else ''}"
                         f"{r['reason']} |")
        lines.append("")
        p = profiles.get(s["workload"])
        if p:
            lines += _profile_md(p)
    return "\n".join(lines) + "\n"


def summary_table(summaries: List[dict], meta: dict) -> List[str]:
    """One row per workload: every contender's median ({clock} clock) and psrl's two ratios."""
    names = [n for n in CONTENDERS if n not in meta["unavailable"]]
    out = [f"Median step seconds ({meta['clock']} clock); FAILED = gradients differ from the reference; "
           "skip = not applicable or over the memory cap (reason in the workload's table).", "",
           "| workload | " + " | ".join(names) + " | psrl / best peer | psrl / floor |",
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
                cells.append(f"{r['median_s']:.3f}{'*' if r['runs'] == 1 and meta['repeats'] > 1 else ''}")
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


def run(args, log=print) -> dict:
    _quiet()
    torch.set_num_threads(args.threads)
    device = torch.device("cpu")
    hf_config = dict(PEER_MODEL)
    state = random_weights(hf_config, args.seed)
    bench = PeerBench(hf_config, state, args.micro_batch_tokens, device)
    register_standins()
    hf = lambda cls: cls(hf_config, state, args.max_forward_tokens)  # noqa: E731
    all_c: Dict[str, Contender] = {
        "hf-per-sample": hf(PerSample), "psrl": PsrlContender(bench, "shared", "psrl"),
        "psrl-no-sharing": PsrlContender(bench, "baseline", "psrl-no-sharing"), "floor": hf(Floor),
        "prefix-grouper": hf(PrefixGrouperContender), "trl-tree": hf(TrlTreeContender), "areal-dta": hf(ArealDtaContender),
    }
    chosen = [n for n in (args.contenders.split(",") if args.contenders else all_c)]
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
    selected = args.workloads.split(",") if args.workloads else list(names)
    unknown = [w for w in selected if w not in names]
    if unknown:
        raise SystemExit(f"unknown workloads {unknown}; choose from {', '.join(names)}")
    want_profile = set(names) if args.profile == "all" else set() if args.profile == "none" else \
        set(args.profile.split(","))
    summaries, profiles = [], {}
    meta = {"hidden": hf_config["hidden_size"], "intermediate": hf_config["intermediate_size"],
            "layers": hf_config["num_hidden_layers"], "heads": hf_config["num_attention_heads"],
            "kv_heads": hf_config["num_key_value_heads"], "vocab": hf_config["vocab_size"],
            "threads": torch.get_num_threads(), "device": "cpu", "micro_batch_tokens": args.micro_batch_tokens,
            "repeats": args.repeats, "clock": args.clock, "grad_rtol": args.grad_rtol, "slow_seconds": args.slow_seconds,
            "max_forward_tokens": args.max_forward_tokens, "quick": args.quick, "unavailable": unavailable,
            "torch": torch.__version__, "platform": platform.platform(), "versions": _versions()}
    out = {"meta": meta, "workloads": summaries, "profiles": profiles}
    for name in selected:
        work = Work.of(name, names[name]())
        tree = build_prefix_tree(work.batch)
        work.tree_tokens, work.ideal_speedup = int(tree.num_tree_tokens), float(bench.cost.ideal_speedup(tree))
        log(f"{name}: {work.batch.num_samples} samples, {work.batch.num_tokens} tokens, {work.tree_tokens} tree "
            f"tokens, ideal {work.ideal_speedup:.2f}x")
        results = bench_workload(work, contenders, bench, args, log)
        s = summarise(work, results)
        summaries.append(s)
        for r in s["rows"]:
            if r["median_s"] is not None:
                log(f"  {r['contender']:>16}: {r['median_s']:.3f} s  vs best peer {_f(r['vs_best_peer'], '.2f')}  "
                    f"vs floor {_f(r['vs_floor'], '.2f')}")
        if name in want_profile:
            profiles[name] = bench.profile(work.batch)
            log("  psrl profile: " + ", ".join(f"{k} {v:.3f}s" for k, v in profiles[name]["phases"].items())
                + f", optimizer step {profiles[name]['optimizer_step_s']:.3f}s")
        write(args.out_dir, out)  # after every workload: a long run that is stopped keeps what it measured
    return out


def write(out_dir: str, out: dict) -> str:
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "bench_peers.json"), "w") as f:
        json.dump(out, f, indent=2)
    md = markdown(out["workloads"], out["profiles"], out["meta"])
    with open(os.path.join(out_dir, "bench_peers.md"), "w") as f:
        f.write(md)
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
    failed = [(s["workload"], r["contender"]) for s in out["workloads"] for r in s["rows"]
              if r["status"] in ("FAILED", "error") and r["contender"] in ("psrl", "psrl-no-sharing", "hf-per-sample")]
    return 1 if failed else 0


def main_result(argv=None) -> dict:
    """The run's result (what ``bench_peers.json`` holds), for other benchmarks."""
    return _main(argv)[0]


def _main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workloads", default=None, help="comma-separated subset (default: all)")
    p.add_argument("--contenders", default=None, help=f"comma-separated subset of {','.join(CONTENDERS)}")
    p.add_argument("--repeats", type=int, default=None, help="timed repeats per contender (default 5; --quick 1)")
    p.add_argument("--quick", action="store_true", help="tiny workloads, 1 repeat (smoke test)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--micro-batch-tokens", type=int, default=32768)
    p.add_argument("--grad-rtol", type=float, default=1e-4)
    p.add_argument("--clock", default="wall", choices=["wall", "cpu"],
                   help="which median the ratios use (process CPU time is steadier on a shared machine)")
    p.add_argument("--slow-seconds", type=float, default=30.0,
                   help="a contender whose warm-up takes longer is timed by that run only")
    p.add_argument("--max-forward-tokens", type=int, default=65536,
                   help="skip a Hugging Face contender whose single forward holds more tokens")
    p.add_argument("--profile", default="all", help="psrl per-phase breakdown: all, none, or workload names")
    p.add_argument("--out-dir", default="runs/bench_peers")
    p.add_argument("--verbose", action="store_true")
    args = p.parse_args(argv)
    if args.repeats is None:
        args.repeats = 1 if args.quick else 5
    out = run(args)
    md = write(args.out_dir, out)
    print()
    print(md)
    return out, args


if __name__ == "__main__":
    sys.exit(main())
