"""tools/compute_logprobs.py: the output format of README.md, against the per-sample HF reference."""

import json
import os

import numpy as np
import pytest
from helpers.faults import run, run_here
from helpers.hf_reference import load_hf_model, make_hf_checkpoint, per_sample_logprobs
from helpers.torchrun import REPO_ROOT

from megatron_psrl.data import make_workload, write_samples
from megatron_psrl.model import tiny_config

pytestmark = pytest.mark.slow  # the command line (one run in a subprocess, the others in this process)

TOOL = os.path.join(REPO_ROOT, "tools", "compute_logprobs.py")
CONVERT = os.path.join(REPO_ROOT, "tools", "convert_hf_checkpoint.py")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("lp")
    hf_dir = make_hf_checkpoint(dict(tiny_config("debug-llama"), vocab_size=300), directory=str(root / "hf"))
    batch = make_workload("mixed", vocab_size=300, seed=4)
    data = root / "samples.jsonl"
    write_samples(batch, data)
    ckpt = root / "ckpt"
    proc = run_here(CONVERT, ["hf-to-mcore", "--hf-dir", hf_dir, "--out-dir", str(ckpt), "--tp", "2", "--no-progress"],
                    root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return hf_dir, ckpt, data, per_sample_logprobs(load_hf_model(hf_dir), batch), batch


def _run(args, here=True):
    """The tool on ``args``: in this process, or, ``here=False``, in a process of its own, as
    users start it (``helpers.faults.run``)."""
    return run(TOOL, args, os.getcwd(), here=here)


@pytest.mark.parametrize("source,extra", [("hf", []), ("hf", ["--no-prefix-sharing"]), ("ckpt", ["--micro-batch-tokens", "256"])])
def test_cli_matches_reference(setup, tmp_path, source, extra):
    hf_dir, ckpt, data, ref, batch = setup
    out = tmp_path / "out.jsonl"
    src = ["--hf-dir", hf_dir] if source == "hf" else ["--load", str(ckpt)]
    proc = _run(src + ["--data", str(data), "--out", str(out)] + extra, here=bool(extra or source != "hf"))
    assert proc.returncode == 0, proc.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in rows] == list(batch.ids)
    for row, expected, n in zip(rows, ref, batch.lengths):
        assert len(row["logprobs"]) == n and row["logprobs"][0] == 0.0
        np.testing.assert_allclose(row["logprobs"], expected, atol=1e-4)


def test_bad_data_is_reported_and_nothing_written(setup, tmp_path):
    hf_dir, *_ = setup
    data = tmp_path / "bad.jsonl"
    data.write_text('{"id": 1, "tokens": [1, 2, 3]}\n{"id": 2, "tokens": [1, 999, 3]}\n')
    out = tmp_path / "out.jsonl"
    proc = _run(["--hf-dir", hf_dir, "--data", str(data), "--out", str(out)])
    assert proc.returncode == 2
    assert "bad.jsonl line 2" in proc.stderr and "tokens" in proc.stderr
    assert not out.exists()
