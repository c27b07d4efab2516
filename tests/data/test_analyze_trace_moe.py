"""tools/analyze_trace.py --model qwen3-30b-a3b / qwen3-235b-a22b: the ideal speedup of a
mixture-of-experts model counts the FLOPs of the experts a token is routed to."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from megatron_psrl.engine.engine import cost_model_for
from megatron_psrl.model.architecture import ModelArchitecture
from megatron_psrl.schedule.cost import CostModel

TOOLS = Path(__file__).resolve().parents[2] / "tools"


def _tool(name: str):
    spec = importlib.util.spec_from_file_location(f"psrl_tool_{name}_moe", TOOLS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


analyze = _tool("analyze_trace")
make_trace = _tool("make_synthetic_trace")


def test_moe_shapes_match_transformers_and_the_published_sizes():
    """The shapes are transformers' Qwen3MoeConfig with the published fields set (the defaults
    it lacks: 48 / 94 layers, head_dim 128, norm_topk_prob), and their parameter counts are the
    models' names: 30.5B total / 3.3B active, 235B total / 22B active."""
    from transformers import Qwen3MoeConfig

    sizes = {"qwen3-30b-a3b": (30.5e9, 3.3e9), "qwen3-235b-a22b": (235e9, 22e9)}
    for name, config in analyze.MOE_MODEL_CONFIGS.items():
        hf = Qwen3MoeConfig(**{k: v for k, v in config.items() if k != "model_type"})
        for key in ("vocab_size", "hidden_size", "moe_intermediate_size", "num_hidden_layers",
                    "num_attention_heads", "num_key_value_heads", "head_dim", "num_experts_per_tok"):
            assert getattr(hf, key) == config[key], (name, key)
        arch = ModelArchitecture.from_hf_config(dict(config))
        total = arch.num_parameters()
        active = total - arch.num_layers * (arch.mlp_parameters() - arch.active_mlp_parameters())
        assert total == pytest.approx(sizes[name][0], rel=0.02) and active == pytest.approx(sizes[name][1], rel=0.05)


def test_moe_cost_model_counts_active_experts():
    """The trainer's cost model: a dense SwiGLU as wide as the top-8 experts of 768 and the
    router (8 x 768 + 128 / 3, rounded: 6,187), far below a dense MLP of all 128 experts."""
    cost = analyze.named_cost_model("qwen3-30b-a3b")
    arch = ModelArchitecture.from_hf_config(dict(analyze.MOE_MODEL_CONFIGS["qwen3-30b-a3b"]))
    assert cost == cost_model_for(arch) and cost.name == "qwen3-30b-a3b"
    assert arch.active_ffn_hidden_size() == round((8 * 3 * 2048 * 768 + 128 * 2048) / (3 * 2048))

    def dense(ffn):
        return CostModel.from_dims(hidden_size=2048, num_layers=48, num_heads=32, num_kv_heads=4, head_dim=128,
                                   ffn_hidden_size=ffn, vocab_size=151936)

    assert cost.linear_flops_per_token == dense(6187).linear_flops_per_token
    assert cost.linear_flops_per_token > dense(8 * 768).linear_flops_per_token  # the router's GEMM
    assert cost.linear_flops_per_token < 0.2 * dense(128 * 768).linear_flops_per_token
    assert cost.attention_flops_per_key == dense(1).attention_flops_per_key  # attention is dense
    assert analyze.kv_bytes_per_token("qwen3-235b-a22b") == 2 * 94 * 4 * 128 * 2


@pytest.mark.parametrize("model", ["qwen3-30b-a3b", "qwen3-235b-a22b"])
def test_analyze_trace_with_a_moe_model(tmp_path, capsys, model):
    trace = tmp_path / "grpo.jsonl"
    assert make_trace.main(["--workload", "grpo", "--num-tokens", "20000", "--out", str(trace)]) == 0
    summary_path = tmp_path / "summary.json"
    rc = analyze.main(["--data", str(trace), "--model", model, "--ranks", "2", "--micro-batch-tokens", "2048",
                       "--out-json", str(summary_path)])
    assert rc == 0
    printed = capsys.readouterr().out
    assert f"{model} " in printed and "placement over 2 ranks" in printed
    summary = json.loads(summary_path.read_text())
    by_model = summary["ideal_speedup_by_model"]
    assert summary["stats"]["cost_model"]["name"] == model
    assert summary["stats"]["ideal_speedup"] == pytest.approx(by_model[model])
    assert by_model[model] > 1.5  # GRPO groups share their prompts: the experts' GEMMs as the attention
    assert set(analyze.MOE_MODEL_CONFIGS) <= set(by_model) and "llama3-8b" in by_model
