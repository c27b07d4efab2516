"""pretrain_agent_rl.py with the debug-size MoE models: prefix sharing trains exactly what the
per-sample baseline trains, and --log-json carries every MoE layer's expert load."""

import json

import pytest

from megatron_psrl.model.tiny import MOE_CONFIGS, tiny_config
from megatron_psrl.training.arguments import MOE_MODEL_NAMES, parse_args
from megatron_psrl.training.trainer import format_record, main

DATA = ["--data", "stepwise", "--synthetic-tokens", "3000", "--micro-batch-tokens", "512", "--quiet", "--seed", "3"]


def _records(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def test_every_moe_config_is_a_model_choice():
    assert MOE_MODEL_NAMES == tuple(sorted(MOE_CONFIGS))
    assert parse_args(["--model", "debug-qwen3-moe"]).model == "debug-qwen3-moe"


@pytest.mark.parametrize("model", ["debug-qwen3-moe", "debug-qwen2-moe", "debug-mixtral", "debug-gpt-oss"])
def test_sharing_and_baseline_agree(tmp_path, model):
    """Two iterations with tree packing and cached prefixes (512-token micro-batches) against
    --no-prefix-sharing: the same loss and gradient norm, fewer tokens computed."""
    logs = {}
    for mode in (["--prefix-sharing", "tree"], ["--no-prefix-sharing", "--micro-batch-tokens", "4096"]):
        path = tmp_path / f"{mode[0]}.jsonl"
        main(["--model", model, "--train-iters", "2", "--log-json", str(path)] + DATA + mode)
        logs[mode[0]] = _records(path)
    shared, base = logs["--prefix-sharing"], logs["--no-prefix-sharing"]
    for a, b in zip(shared, base):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5, abs=1e-7)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)
    assert shared[0]["tokens_computed"] < base[0]["tokens_computed"]
    assert shared[0]["kv_hit_rate"] > 0  # trajectories exceed 512 tokens: mechanism 2 is used


def test_log_json_carries_the_expert_load(tmp_path):
    """Per MoE layer ``[max, mean]`` tokens per expert over the step: the first layer routes
    every computed token once (top-k: k copies over E experts), whatever the micro-batches,
    cached prefixes and dropped graphs; the last layer routes only the rows the loss head reads."""
    config = tiny_config("debug-qwen3-moe")
    experts, k = config["num_experts"], config["num_experts_per_tok"]
    path = tmp_path / "log.jsonl"
    records = main(["--model", "debug-qwen3-moe", "--train-iters", "2", "--log-json", str(path)] + DATA
                   + ["--micro-batch-tokens", "256", "--kv-cache-budget", "6MB"])
    for rec, logged in zip(records, _records(path)):
        load = logged["moe_expert_load"]
        assert len(load) == config["num_hidden_layers"]
        first = load[0][1] * experts / k
        assert first == logged["tokens_computed"] - logged["tokens_recomputed"]
        assert 0 < load[-1][1] <= load[0][1]
        for busiest, mean in load:
            assert mean <= busiest <= mean * experts / k  # no expert sees a token twice
        assert "expert load max/mean" in format_record(rec, 2)


def test_glm4_moe_trains_with_the_expert_bias_update(tmp_path):
    """``--model debug-glm4-moe`` (a dense first layer, then grouped sigmoid routing) with
    ``--moe-router-enable-expert-bias``: the expert load is logged per MoE layer (two of its
    three layers), each routing every computed token once (the bias update needs every row,
    so the last layer computes them all too)."""
    config = tiny_config("debug-glm4-moe")
    experts, k = config["n_routed_experts"], config["num_experts_per_tok"]
    path = tmp_path / "log.jsonl"
    main(["--model", "debug-glm4-moe", "--train-iters", "1", "--log-json", str(path), "--moe-router-enable-expert-bias"]
         + DATA + ["--synthetic-tokens", "1500"])
    (logged,) = _records(path)
    load = logged["moe_expert_load"]
    assert len(load) == 2
    for _, mean in load:
        assert mean * experts / k == logged["tokens_computed"] - logged["tokens_recomputed"]
    assert logged["loss"] == logged["loss"] and logged["kv_hit_rate"] > 0  # (finite; mechanism 2 used)
