"""--tensorboard-dir and --wandb-project: the --log-json metrics, read back from the files."""

import json
import os
import time

import pytest

from megatron_psrl.training.trainer import main

RUN = ["--model", "debug-llama", "--data", "stepwise", "--synthetic-tokens", "3000", "--micro-batch-tokens", "512",
       "--quiet", "--seed", "3", "--train-iters", "3"]


def _records(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def test_tensorboard_scalars_equal_the_json_log(tmp_path):
    event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    log, tb = tmp_path / "log.jsonl", tmp_path / "tb"
    main(RUN + ["--log-json", str(log), "--tensorboard-dir", str(tb), "--save", str(tmp_path / "ckpt")])
    records = _records(log)
    acc = event_accumulator.EventAccumulator(str(tb), size_guidance={event_accumulator.SCALARS: 0})
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    numeric = {k for k, v in records[0].items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    assert numeric - {"skipped"} <= tags, sorted(numeric - tags)
    # The planner's decisions, the KV cache (trajectories exceed 512 tokens) and the phase timers.
    assert {"plan_imbalance", "kv_hit_rate", "kv_peak_utilisation", "time_tree_s", "time_plan_s",
            "time_forward_backward_s", "time_optimizer_s", "time_checkpoint_s"} <= tags
    for key in ("loss", "grad_norm", "tokens_computed", "kv_hit_rate", "plan_imbalance"):
        events = acc.Scalars(key)
        assert [e.step for e in events] == [r["iter"] for r in records]
        assert [e.value for e in events] == pytest.approx([r[key] for r in records], rel=1e-6)


def test_wandb_offline_run_is_written(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    for var in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_DIR"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    log = tmp_path / "log.jsonl"
    main(RUN + ["--log-json", str(log), "--wandb-project", "psrl-test", "--wandb-exp-name", "ci",
                "--wandb-save-dir", str(tmp_path / "wb")])
    runs = [d for d in os.listdir(tmp_path / "wb" / "wandb") if d.startswith("offline-run-")]
    assert len(runs) == 1, os.listdir(tmp_path / "wb" / "wandb")
    run_dir = tmp_path / "wb" / "wandb" / runs[0]
    logs = [f for f in os.listdir(run_dir) if f.endswith(".wandb")]
    assert len(logs) == 1, os.listdir(run_dir)
    # The run log is protobuf records (no reader ships with wandb's Go core): every metric key
    # appears once per logged iteration, beside the run's config.
    keys = (b"grad_norm", b"plan_imbalance", b"kv_hit_rate", b"time_forward_backward_s")
    deadline = time.time() + 30  # wandb's service process may still be flushing the log file
    while True:
        data = (run_dir / logs[0]).read_bytes()
        if all(data.count(key) >= 3 for key in keys) or time.time() > deadline:
            break
        time.sleep(0.5)
    for key in keys:
        assert data.count(key) >= 3, (key, data.count(key))
