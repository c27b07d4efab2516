"""Every error names what is wrong and where: one line, exit status 2, no traceback (a bug keeps
its traceback and exits 1)."""

import json
import os
import shutil

import pytest
import torch
from helpers.faults import SMALL, error_line, one_by_one, tool, train, without_checksums
from helpers.hf_reference import make_hf_checkpoint
from safetensors.torch import load_file, save_file

from megatron_psrl.checkpoint.convert import hf_to_mcore
from megatron_psrl.checkpoint.layout import TRACKER
from megatron_psrl.cli import call_cli
from megatron_psrl.model import tiny_config
from megatron_psrl.training.arguments import MIN_MICRO_BATCH_TOKENS

CONFIG = dict(tiny_config("debug-llama"), max_position_embeddings=64)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return make_hf_checkpoint(CONFIG, seed=0, directory=str(tmp_path_factory.mktemp("hf")))


@pytest.fixture
def ckpt(hf_dir, tmp_path):
    out = tmp_path / "ckpt"
    hf_to_mcore(hf_dir, str(out), tp=2, progress=False, ckpt_format="legacy")  # per-rank files to damage
    return out


@pytest.fixture
def data(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"id": i, "tokens": [1, 2, 3, 4 + i], "advantage": 1.0}) + "\n"
                            for i in range(3)))
    return path


def _rank_file(ckpt):
    return ckpt / "release" / "mp_rank_01" / "model_optim_rng.pt"


def _damage(path, how):
    if how == "empty":
        path.write_bytes(b"")
    else:  # truncated
        blob = path.read_bytes()
        path.write_bytes(blob[: len(blob) // 3])


@pytest.mark.parametrize("checksums", [True, False], ids=["checksummed", "unverified"])
@pytest.mark.parametrize("how", ["empty", "truncated"])
def test_damaged_rank_file_is_named_by_every_reader(ckpt, data, tmp_path, how, checksums):
    """With the checksum list the damage is a checksum mismatch; without it (a checkpoint from
    before checksums) the legacy reader's own check names it."""
    rank_file = _rank_file(ckpt)
    _damage(rank_file, how)
    if not checksums:
        without_checksums(ckpt / "release")
    runs = one_by_one({
        "--load": lambda: train(["--load", str(ckpt), "--data", str(data), "--train-iters", "1", "--finetune"],
                                tmp_path, here=True),
        "mcore-to-hf": lambda: tool("convert_hf_checkpoint.py", ["mcore-to-hf", "--load", str(ckpt), "--out-dir",
                                                                  str(tmp_path / "hf-out"), "--no-progress"], tmp_path, here=True),
        "compute_logprobs": lambda: tool("compute_logprobs.py", ["--load", str(ckpt), "--data", str(data), "--out",
                                                                 str(tmp_path / "lp.jsonl")], tmp_path, here=True),
    })
    for name, proc in runs.items():
        line = error_line(proc)
        assert str(rank_file) in line, (name, line)
        expected = ("checksum mismatch (corrupt or modified after save)" if checksums
                    else "empty" if how == "empty" else "truncated or corrupt")
        assert expected in line, (name, line)
    assert not (tmp_path / "hf-out").exists() and not (tmp_path / "lp.jsonl").exists()


@pytest.mark.parametrize("content,words", [("", ["expected an iteration number"]),
                                           ("banana", ["banana"]),
                                           ("12", ["iter_0000012", "does not exist"])])
def test_corrupt_tracker_file_is_named(ckpt, tmp_path, content, words):
    (ckpt / TRACKER).write_text(content)
    line = error_line(tool("convert_hf_checkpoint.py", ["mcore-to-hf", "--load", str(ckpt), "--out-dir",
                                                         str(tmp_path / "o"), "--no-progress"], tmp_path, here=True))
    assert TRACKER in line and all(w in line for w in words), line


@pytest.mark.parametrize("checksums", [True, False], ids=["checksummed", "unverified"])
@pytest.mark.parametrize("content,words", [("{not json", ["not valid JSON"]),
                                           ('{"format_version": 1}', ["missing field 'architecture'"]),
                                           ("", ["not valid JSON"])])
def test_corrupt_model_info_is_named(ckpt, data, tmp_path, content, words, checksums):
    info = ckpt / "release" / "psrl_model.json"
    info.write_text(content)
    if not checksums:
        without_checksums(ckpt / "release")
    line = error_line(train(["--load", str(ckpt), "--data", str(data), "--train-iters", "1"], tmp_path, here=True))
    words = ["checksum mismatch"] if checksums else words
    assert str(info) in line and all(w in line for w in words), line


def test_wrong_shape_hf_tensor_names_tensor_and_file(hf_dir, data, tmp_path):
    bad = tmp_path / "bad-hf"
    shutil.copytree(hf_dir, bad)
    tensors = load_file(str(bad / "model.safetensors"))
    name = "model.layers.1.self_attn.k_proj.weight"
    tensors[name] = tensors[name][:-4].contiguous()  # a head short
    save_file(tensors, str(bad / "model.safetensors"), metadata={"format": "pt"})
    for proc in one_by_one({
        "train": lambda: train(["--hf-dir", str(bad), "--data", str(data), "--train-iters", "1"], tmp_path, here=True),
        "hf-to-mcore": lambda: tool("convert_hf_checkpoint.py", ["hf-to-mcore", "--hf-dir", str(bad), "--out-dir",
                                                                  str(tmp_path / "o"), "--no-progress"], tmp_path, here=True),
    }).values():
        line = error_line(proc)
        assert str(bad / "model.safetensors") in line and repr(name) in line, line
        assert "(28, 64)" in line and "(32, 64)" in line and "config.json" in line, line


def test_truncated_safetensors_is_named(hf_dir, data, tmp_path):
    bad = tmp_path / "bad-hf"
    shutil.copytree(hf_dir, bad)
    _damage(bad / "model.safetensors", "truncated")
    line = error_line(tool("compute_logprobs.py", ["--hf-dir", str(bad), "--data", str(data), "--out",
                                                    str(tmp_path / "lp.jsonl")], tmp_path, here=True))
    assert str(bad / "model.safetensors") in line and "truncated or corrupt" in line, line


def test_safetensors_index_may_not_leave_the_folder(hf_dir, tmp_path):
    bad = tmp_path / "bad-hf"
    shutil.copytree(hf_dir, bad)
    names = list(load_file(str(bad / "model.safetensors")))
    outside = tmp_path / "x.safetensors"
    os.rename(bad / "model.safetensors", outside)
    index = {"metadata": {}, "weight_map": {n: "../x.safetensors" for n in names}}
    (bad / "model.safetensors.index.json").write_text(json.dumps(index))
    line = error_line(tool("convert_hf_checkpoint.py", ["hf-to-mcore", "--hf-dir", str(bad), "--out-dir",
                                                         str(tmp_path / "o"), "--no-progress"], tmp_path, here=True))
    assert "model.safetensors.index.json" in line and "../x.safetensors" in line and "inside" in line, line


@pytest.mark.parametrize("value,words", [("sixty-four", ["'hidden_size'", "integer", "sixty-four"]),
                                         (64.5, ["'hidden_size'", "64.5"])])
def test_malformed_config_field_is_named(hf_dir, data, tmp_path, value, words):
    bad = tmp_path / "bad-hf"
    shutil.copytree(hf_dir, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["hidden_size"] = value
    (bad / "config.json").write_text(json.dumps(cfg))
    line = error_line(train(["--hf-dir", str(bad), "--data", str(data), "--train-iters", "1"], tmp_path, here=True))
    assert str(bad / "config.json") in line and all(w in line for w in words), line


@pytest.mark.parametrize("flag", ["--tp", "--pp"])
def test_zero_parallel_size_is_refused_by_the_converter(hf_dir, tmp_path, flag):
    proc = tool("convert_hf_checkpoint.py", ["hf-to-mcore", "--hf-dir", hf_dir, "--out-dir", str(tmp_path / "o"),
                                             flag, "0"], tmp_path, here=True)
    assert proc.returncode == 2 and f"{flag}: must be >= 1" in proc.stderr and "Traceback" not in proc.stderr


def test_micro_batch_tokens_below_the_floor_is_refused(tmp_path):
    proc = train(SMALL[:-4] + ["--micro-batch-tokens", "1"], tmp_path, here=True)
    assert proc.returncode == 2 and f"floor of {MIN_MICRO_BATCH_TOKENS} tokens" in proc.stderr


def test_sample_longer_than_the_model_positions(hf_dir, tmp_path):
    path = tmp_path / "long.jsonl"
    path.write_text(json.dumps({"id": "short", "tokens": [1, 2, 3], "advantage": 1.0}) + "\n"
                    + json.dumps({"id": "long", "tokens": list(range(70)), "advantage": 1.0}) + "\n")
    runs = one_by_one({
        "refused": lambda: train(["--hf-dir", hf_dir, "--data", str(path), "--train-iters", "1"], tmp_path, here=True),
        "allowed": lambda: train(["--hf-dir", hf_dir, "--data", str(path), "--train-iters", "1",
                                  "--allow-rope-extrapolation"], tmp_path, here=True),
    })
    line = error_line(runs["refused"])
    assert "long.jsonl line 2 (sample id 'long'): field 'tokens'" in line and "length 70" in line, line
    assert "max_position_embeddings (64 tokens)" in line and "--allow-rope-extrapolation" in line
    proc = runs["allowed"]
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "1 sample(s) are longer than the model's max_position_embeddings (64)" in proc.stdout


def test_bug_keeps_its_traceback_and_exits_1(capsys):
    def buggy():
        return [][1]

    assert call_cli(buggy) == 1
    err = capsys.readouterr().err
    assert "Traceback" in err and "IndexError" in err


def test_user_error_prints_one_line_and_exits_2(capsys, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)  # no rank prefix

    def missing():
        open("/nonexistent/samples.jsonl")

    assert call_cli(missing) == 2
    assert capsys.readouterr().err == "error: /nonexistent/samples.jsonl: No such file or directory\n"


def test_mcore_checkpoint_of_wrong_model_names_the_tensor(ckpt, data, tmp_path):
    path = _rank_file(ckpt)
    blob = torch.load(path, weights_only=True)
    name = "decoder.layers.0.mlp.linear_fc2.weight"
    blob["model"][name] = blob["model"][name][:, :3].clone()
    torch.save(blob, path)
    without_checksums(ckpt / "release")  # a consistent rewrite: the shape check names it
    line = error_line(tool("compute_logprobs.py", ["--load", str(ckpt), "--data", str(data), "--out",
                                                   str(tmp_path / "lp.jsonl")], tmp_path, here=True))
    assert repr(name) in line and str(path) in line and "(64, 3)" in line, line
