"""Routes for router-replay tests, and a Hugging Face MoE model that follows them.

- :func:`prefix_routes`: deterministic routes that are a function of the token prefix, so
  samples sharing a prefix share its routes (as one rollout's would).
- :func:`hf_replayed`: the per-sample reference with replayed routes: while active, every
  router of a Hugging Face MoE model computes its own logits and softmax but takes the given
  expert ids instead of its top-k (``norm_topk_prob`` as HF applies it; Qwen3.5-MoE's router,
  without the field, always renormalises), one sample per forward, in batch order (as the
  reference helpers run the samples). gpt-oss's router (``mlp.router``: a bias, the softmax over
  the chosen experts' logits) takes them alike. A DeepSeek-V3-style MoE (GLM-4.5: sigmoid
  scores, the expert bias and groups for selection only) takes the given ids in place of its
  grouped selection and weighs them as it weighs its own (the unbiased sigmoid scores,
  renormalised, times ``routed_scaling_factor``); its dense layers have no router, so the
  routes' layers are its MoE layers.
"""

from __future__ import annotations

import contextlib

import numpy as np
import torch
import torch.nn.functional as F


def prefix_routes(tokens, layers: int, topk: int, experts: int, seed: int = 0) -> np.ndarray:
    """int64 ``[n, layers, topk]``: at every position and layer, ``topk`` distinct experts drawn
    from a generator seeded by the prefix up to that position."""
    out = np.empty((len(tokens), layers, topk), dtype=np.int64)
    h = seed
    for p, tok in enumerate(tokens):
        h = (h * 1_000_003 + int(tok) + 1) % (1 << 61)
        rng = np.random.default_rng(h)
        out[p] = [rng.permutation(experts)[:topk] for _ in range(layers)]
    return out


@contextlib.contextmanager
def hf_replayed(model, batch, routes: torch.Tensor):
    """``model``'s routers take ``routes`` (int64 ``[N, L, k]`` over ``batch``'s flat tokens; a
    token whose first id is negative keeps HF's own top-k)."""
    state = {"next": 0, "routes": None}

    def pre_hook(module, args, kwargs):
        s = state["next"]
        state["next"] = (s + 1) % batch.num_samples
        ids = args[0] if args else kwargs["input_ids"]
        sl = batch.sample_slice(s)
        assert ids.shape[-1] == sl.stop - sl.start, "the reference runs the samples in order"
        state["routes"] = routes[sl]

    def gate_forward(gate, layer):
        def forward(hidden_states):
            hidden_states = hidden_states.reshape(-1, gate.hidden_dim)
            router_logits = F.linear(hidden_states, gate.weight)  # [n, E]
            router_probs = torch.softmax(router_logits, dtype=torch.float, dim=-1)
            given = state["routes"]
            own = torch.topk(router_probs, gate.top_k, dim=-1).indices
            indices = torch.where((given[:, 0, 0] < 0)[:, None], own, given[:, layer])  # [n, k]
            top = router_probs.gather(1, indices)
            if getattr(gate, "norm_topk_prob", True):  # (Qwen3.5-MoE's router always renormalises)
                top = top / top.sum(dim=-1, keepdim=True)
            return router_logits, top.to(router_logits.dtype), indices
        return forward

    def router_forward(router, layer):  # gpt-oss: softmax over the chosen experts' logits
        def forward(hidden_states):
            router_logits = F.linear(hidden_states, router.weight, router.bias)  # [n, E]
            given = state["routes"]
            own = torch.topk(router_logits, router.top_k, dim=-1).indices
            indices = torch.where((given[:, 0, 0] < 0)[:, None], own, given[:, layer])  # [n, k]
            scores = torch.softmax(router_logits.gather(1, indices), dim=1, dtype=router_logits.dtype)
            return router_logits, scores, indices
        return forward

    def grouped_routing(moe, layer):
        own_routing = moe.route_tokens_to_experts

        def route(router_logits):  # [n, E] fp32
            own, _ = own_routing(router_logits)
            given = state["routes"]
            indices = torch.where((given[:, 0, 0] < 0)[:, None], own, given[:, layer])  # [n, k]
            weights = router_logits.sigmoid().gather(1, indices)
            if moe.norm_topk_prob:
                weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
            return indices, weights * moe.routed_scaling_factor
        return route

    def router_of(mlp):  # gpt-oss's is mlp.router, the others' mlp.gate
        return mlp.router if hasattr(mlp, "router") else mlp.gate

    # (no dense MLP: it has neither)
    moe_mlps = [layer.mlp for layer in model.model.layers if hasattr(layer.mlp, "gate") or hasattr(layer.mlp, "router")]
    handle = model.register_forward_pre_hook(pre_hook, with_kwargs=True)
    for layer, mlp in enumerate(moe_mlps):
        if hasattr(mlp, "route_tokens_to_experts"):
            mlp.route_tokens_to_experts = grouped_routing(mlp, layer)
        elif hasattr(mlp, "router"):
            mlp.router.forward = router_forward(mlp.router, layer)
        else:
            mlp.gate.forward = gate_forward(mlp.gate, layer)
    try:
        yield
    finally:
        handle.remove()
        for mlp in moe_mlps:  # back to the class's
            if "route_tokens_to_experts" in vars(mlp):
                del mlp.route_tokens_to_experts
            else:
                del router_of(mlp).forward
