"""The local layer spec names the decoder's final norm itself (torch's RMSNorm): megatron's
block default is apex's ``FusedLayerNorm`` when apex is installed without Transformer Engine,
which refuses RMSNorm at construction. Here apex's choice is simulated: the block default
becomes a norm that refuses RMSNorm, and the model still builds with torch's norm."""

import torch
from megatron.core.transformer import transformer_block

from megatron_psrl.distributed.setup import initialize_parallel
from megatron_psrl.model import ModelArchitecture, build_model, tiny_config


class ApexLikeNorm(torch.nn.Module):
    """What megatron's FusedLayerNorm does with RMSNorm."""

    def __init__(self, config, hidden_size, eps=1e-5, **kwargs):
        super().__init__()
        assert config.normalization == "LayerNorm", f"({config.normalization}) is not supported in FusedLayerNorm"


def test_the_final_norm_is_torchs_whatever_megatrons_block_default_is(monkeypatch):
    initialize_parallel(1, 1, device="cpu")
    monkeypatch.setattr(transformer_block, "LayerNormImpl", ApexLikeNorm)
    model = build_model(ModelArchitecture.from_hf_config(tiny_config("debug-llama")))
    norm = model.decoder.final_layernorm
    assert not isinstance(norm, ApexLikeNorm) and isinstance(norm, torch.nn.RMSNorm)
