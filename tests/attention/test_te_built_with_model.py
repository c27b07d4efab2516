"""A model built for the ``te`` attention backend holds Transformer Engine's attention (and its
``_extra_state``) from its constructor, so a torch_dist checkpoint saved before the first step
loads into a model that has taken one (megatron_psrl/attention/core_attention.py).

Transformer Engine is not installed here and runs on CUDA only: a stand-in with TE's state-dict
contract (no parameters, an ``_extra_state`` tensor under ``_te.attention.``; its attention the
torch backend's math) takes the place of ``TETreeAttention`` where the core attention builds it,
and the CUDA checks are answered yes."""

import pytest
import torch

from megatron_psrl.attention import TreeAttentionMetadata, causal_plan, core_attention
from megatron_psrl.attention.backends import blockwise_tree_attention
from megatron_psrl.checkpoint import ModelSource, load_model
from megatron_psrl.checkpoint.dist_format import load_model_weights, model_sharded_state_dict, save_state
from megatron_psrl.distributed.setup import initialize_parallel

T = 16
TE_STATE = "decoder.layers.{}.self_attention.core_attention._te.attention._extra_state"


class _TEDotProductAttention(torch.nn.Module):
    """Transformer Engine's DotProductAttention as a state dict sees it: no parameters and an
    ``_extra_state`` (TE's FP8 metadata, serialised into a uint8 tensor; empty without FP8)."""

    def __init__(self):
        super().__init__()
        self.loaded = None

    def get_extra_state(self):
        return torch.empty(0, dtype=torch.uint8)

    def set_extra_state(self, state):
        self.loaded = state


class _StandInTETreeAttention(torch.nn.Module):
    """``TETreeAttention``'s constructor and forward; the torch backend's math inside."""

    built = []

    def __init__(self, num_heads, num_groups, head_dim, scale, layer_number):
        super().__init__()
        self.attention = _TEDotProductAttention()
        self.heads = (num_heads, num_groups, head_dim, layer_number)
        _StandInTETreeAttention.built.append(self.heads)

    def forward(self, q, k, v, plan, external=(), scale=None):
        return blockwise_tree_attention(q, k, v, plan, external, scale)


@pytest.fixture
def te_stand_in(monkeypatch):
    monkeypatch.setattr(core_attention, "TETreeAttention", _StandInTETreeAttention)
    monkeypatch.setattr(core_attention, "te_builds_with_model", lambda: True)  # as on CUDA
    monkeypatch.setattr(core_attention, "require_cuda", lambda backend, tensor: None)
    _StandInTETreeAttention.built.clear()
    initialize_parallel(1, 1, seed=0, device="cpu")


def _step(model, vocab):
    ids = torch.randint(0, vocab, (T,), generator=torch.Generator().manual_seed(0))
    logits = model(ids, torch.arange(T), TreeAttentionMetadata(plan=causal_plan([T]), backend="te"))
    logits.float().square().mean().backward()


def test_a_checkpoint_saved_before_the_first_step_loads_after_one(te_stand_in, tmp_path):
    arch, fresh, _ = load_model(ModelSource(tiny="debug-llama"), attention_backend="te")
    keys_before = set(fresh.state_dict())
    assert {TE_STATE.format(i) for i in range(arch.num_layers)} <= keys_before
    heads = (arch.num_attention_heads, arch.num_kv_heads, arch.head_dim)
    assert _StandInTETreeAttention.built == [(*heads, i + 1) for i in range(arch.num_layers)]
    sharded_before = set(model_sharded_state_dict(fresh)["model"])
    (tmp_path / "before").mkdir()
    save_state(str(tmp_path / "before"), model_sharded_state_dict(fresh), torch.device("cpu"))

    _, stepped, _ = load_model(ModelSource(tiny="debug-llama"), attention_backend="te")
    _step(stepped, arch.vocab_size)
    assert len(_StandInTETreeAttention.built) == 2 * arch.num_layers  # none built lazily in the step
    assert set(stepped.state_dict()) == keys_before
    assert set(model_sharded_state_dict(stepped)["model"]) == sharded_before
    load_model_weights(str(tmp_path / "before"), stepped)  # strict: every key, none missing
    fresh_state = fresh.state_dict()
    assert all(torch.equal(v, fresh_state[k]) for k, v in stepped.state_dict().items() if torch.is_tensor(v)
               and not k.endswith("_extra_state"))
    assert stepped.decoder.layers[0].self_attention.core_attention._te.attention.loaded is not None


def test_a_model_built_for_another_backend_grows_te_state_at_its_first_te_forward(te_stand_in):
    """What the engine avoids by building the model for its backend: the model's state dict
    changes under it at the first ``te`` forward."""
    arch, model, _ = load_model(ModelSource(tiny="debug-llama"))
    assert TE_STATE.format(0) not in model.state_dict()
    _step(model, arch.vocab_size)
    assert TE_STATE.format(0) in model.state_dict()


def test_a_checkpoint_saved_without_te_loads_into_a_model_built_with_it(te_stand_in, tmp_path):
    """A torch_dist checkpoint of megatron's local layers (no ``_extra_state``: CPU training)
    loads into a model built for ``te``: every weight, and TE's extra state left as built."""
    core_attention.te_builds_with_model = lambda: False  # (the saving run: local layers)
    arch, local, _ = load_model(ModelSource(tiny="debug-llama"))
    save_state(str(tmp_path), model_sharded_state_dict(local), torch.device("cpu"))
    core_attention.te_builds_with_model = lambda: True
    _, with_te, _ = load_model(ModelSource(tiny="debug-llama"), attention_backend="te")
    assert TE_STATE.format(0) in with_te.state_dict()
    for p in with_te.parameters():
        p.data.add_(1.0)  # (so that loading shows)
    load_model_weights(str(tmp_path), with_te)
    saved = local.state_dict()
    assert all(torch.equal(v, saved[k]) for k, v in with_te.state_dict().items() if not k.endswith("_extra_state"))
    assert with_te.decoder.layers[0].self_attention.core_attention._te.attention.loaded is None
